"""The codec measurements of the cost model: the codec time of one exchange on the rows'
model, and the messages and bytes it sends (through the strategies' own collective)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence

__all__ = ["LocalCollective", "count_exchange_messages", "measure_codecs", "measure_exchange_codec", "model_shapes"]


def measure_codecs(names: Sequence[str], numel: int, repeats: int = 5) -> dict:
    """Codec round trip (``bench/compressors.py``'s) on one tensor of the model's size."""
    import torch

    from bench.compressors import bench_one, load_config, matrix_shape
    from easgd_lightning.hooks.compressors import build_compressor

    torch.set_num_threads(1)
    x = torch.randn(matrix_shape(numel))
    out = {}
    for name in names:
        if name == "none":
            continue
        res = bench_one(name, x, warmup=2, repeats=repeats)
        comp = build_compressor(**load_config(name))
        out[name] = {
            "seconds": res["seconds"], "payload_bytes": res["payload_bytes"],
            "aggregation": comp.aggregation, "calls": 2 if name == "powersgd" else 1,
        }
    return out


class LocalCollective:
    """The collectives of one exchange without a network: p ranks that all hand in this
    rank's payload (all-reduce: p times it; all-gather: p copies). With it,
    :func:`measure_exchange_codec` times everything an exchange does but the wire."""

    kind = "costmodel_codec"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def charge_dense(self, nbytes: int, key=None) -> None:
        pass

    def all_reduce_sum(self, tensors):
        return [t * self.world_size for t in tensors]

    def all_reduce_max(self, tensors):
        return [t.clone() for t in tensors]

    def all_gather(self, tensors):
        return [[t.clone() for t in tensors] for _ in range(self.world_size)]


def model_shapes(workload: Sequence[str], in_features: int = 64, num_classes: int = 10) -> list[tuple]:
    """Parameter shapes of the rows' MLP (``model.hidden=...`` of the workload; digits'
    64 inputs and 10 classes), in DDP's gradient order (last layer first)."""
    from easgd_lightning.models.factory import mlp

    hidden: object = 128
    for item in workload:
        key, _, value = item.partition("=")
        if key == "model.hidden":
            hidden = json.loads(value)
    model = mlp(in_features=in_features, hidden=hidden, num_classes=num_classes)
    return [tuple(q.shape) for q in reversed(list(model.parameters()))]


def measure_exchange_codec(name: str, overrides: Sequence[str], shapes: Sequence[tuple], world: int,
                           warmup: int = 3, repeats: int = 7) -> float:
    """Median seconds of one compressed exchange of tensors of ``shapes`` on
    :class:`LocalCollective` (``world`` ranks): error feedback, compression, this rank's
    decode, the decode of every rank's payload (all-gather) or of the sum (all-reduce), the
    small tensors' dense path: the codec work of a training step's exchange, per step."""
    import torch

    from easgd_lightning.hooks import exchange_tensors

    torch.set_num_threads(1)
    comp, memory = _row_compressor(name, overrides)
    states: dict = {}
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    keys = [f"t{i}" for i in range(len(shapes))]
    coll = LocalCollective(world)
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        exchange_tensors(grads, keys, comp, memory, states, coll)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def count_exchange_messages(name: str, overrides: Sequence[str], shapes: Sequence[tuple],
                            fusion_mb: float = 25.0, exchanges: int = 3) -> dict:
    """Messages (collectives, as the meter counts them) and payload bytes a rank sends in
    one compressed exchange of
    tensors of ``shapes``, through the strategies' own collective
    (``ProcessGroupCollective`` with the ``comm.fusion_mb`` lazy all-reduce and the batched
    all-gather) on a one-rank gloo group: the message structure of the exchange (e.g.
    PowerSGD's P and Q rounds per tensor, a fused or a separate dense part), counted in
    its last of ``exchanges`` exchanges (the first all-gather of a tensor takes two)."""
    import tempfile

    import torch
    import torch.distributed as dist

    from easgd_lightning.comm.meter import get_meter
    from easgd_lightning.hooks import exchange_tensors
    from easgd_lightning.hooks.collective import ProcessGroupCollective

    kind = "costmodel_count"
    comp, memory = _row_compressor(name, overrides)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    keys = [f"t{i}" for i in range(len(shapes))]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            coll = ProcessGroupCollective(kind=kind, fusion_bytes=int(fusion_mb * 2**20))
            states: dict = {}
            for _ in range(exchanges - 1):
                exchange_tensors(grads, keys, comp, memory, states, coll)
            totals = get_meter().by_kind[kind]
            calls, sent = totals.calls, totals.bytes_sent
            exchange_tensors(grads, keys, comp, memory, states, coll)
            return {"messages": float(totals.calls - calls), "bytes": float(totals.bytes_sent - sent)}
        finally:
            dist.destroy_process_group()


def _row_compressor(name: str, overrides: Sequence[str]):
    """The row's compressor (its yaml plus the row's ``compression.*`` overrides) and its
    error-feedback memory."""
    import yaml

    from bench.compressors import load_config
    from easgd_lightning.hooks.compressors import build_compressor
    from easgd_lightning.hooks.memory import make_memory

    cfg = load_config(name)
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("compression."):
            cfg[key.split(".", 1)[1]] = yaml.safe_load(value)
    comp = build_compressor(**cfg)
    return comp, make_memory(comp)
