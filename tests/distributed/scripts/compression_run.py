"""One rank of the compression checks (launched torchrun-style by the tests).

Usage: compression_run.py OUT SCENARIO[,SCENARIO...]   (aggregate | ddp | ddp_dgc | elastic | elastic_split | fused)

Every scenario computes an independent reference from the *dense* local contributions
gathered here with plain ``torch.distributed.all_gather`` and writes the comparison to
OUT/rank{r}.json; the test asserts on those files.
"""

import datetime
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from easgd_lightning.comm.meter import get_meter
from easgd_lightning.hooks import (
    build_compressor,
    exchange_sum,
    make_memory,
    register_compression_hook,
)
from easgd_lightning.hooks._exchange import exchange_tensors
from easgd_lightning.hooks._fused import layout_for, start_exchange_flat
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.hooks.elastic import start_exchange_sum
from easgd_lightning.utils.checkpoint import from_plain, to_plain
from tests.helpers import run_rank_scenarios

SHAPE = (64, 48)
N = SHAPE[0] * SHAPE[1]

#: the tensors of the elastic scenarios (one flat difference of them all)
ELASTIC_SHAPES = [(40, 30), (30,), (20, 25)]
ELASTIC_NUMEL = sum(math.prod(s) for s in ELASTIC_SHAPES)

#: name -> (build params, a formula for the bytes this rank sends per exchange)
CASES = {
    "none": ({"min_numel": 0}, lambda c, st: N * 4),
    "fp16": ({"min_numel": 0}, lambda c, st: N * 2),
    "bf16": ({"min_numel": 0}, lambda c, st: N * 2),
    "topk": ({"ratio": 0.05, "min_numel": 0}, lambda c, st: st["last_nnz"] * 8 + 8),
    "randomk": ({"ratio": 0.05, "min_numel": 0}, lambda c, st: math.ceil(0.05 * N) * 4),
    "dgc": (
        {"ratio": 0.01, "warmup_ratio_steps": 2, "min_numel": 0, "clip_norm": 50.0},
        lambda c, st: st["last_nnz"] * 8 + 8,
    ),
    "redsync": ({"ratio": 0.02, "min_numel": 0}, lambda c, st: st["last_nnz"] * 8 + 8),
    "redsync_bisect": (
        {"ratio": 0.02, "method": "bisect", "min_numel": 0},
        lambda c, st: st["last_nnz"] * 8 + 8,
    ),
    "sidco": ({"ratio": 0.02, "min_numel": 0}, lambda c, st: st["last_nnz"] * 8 + 8),
    "sidco_gamma": (
        {"ratio": 0.02, "distribution": "gamma", "stages": 2, "min_numel": 0},
        lambda c, st: st["last_nnz"] * 8 + 8,
    ),
    "sidco_gpareto": (
        {"ratio": 0.02, "distribution": "gpareto", "stages": 2, "min_numel": 0},
        lambda c, st: st["last_nnz"] * 8 + 8,
    ),
    "powersgd": ({"rank": 3, "min_numel": 0}, lambda c, st: (64 + 48) * 3 * 4),
    "qsgd": (
        {"levels": 15, "bucket_size": 512, "min_numel": 0},
        lambda c, st: math.ceil(N * 5 / 8) + 8 + math.ceil(N / 512) * 4 + 8,  # 4 + 1 bits
    ),
    "qsgd_elias": ({"levels": 1, "coding": "elias", "min_numel": 0}, None),  # variable length
    "signsgd": ({"min_numel": 0}, lambda c, st: 4 + 8 + math.ceil(N / 8) + 8),
    "sketch": (
        {"ratio": 0.02, "min_numel": 0},
        lambda c, st: math.ceil(N / 8) + 3 * math.ceil(1.5 * st["last_union"] / 3) * 4,
    ),
    "adaptive": (
        {"bandwidth": 1e7, "compute_time": 0.001, "min_numel": 0},
        lambda c, st: 8 + st["last_nnz"] * 8 + 8,
    ),
    # 3072 entries in 12 chunks of 256: 12 scores + 3 chunks, all-reduced
    "csc": ({"ratio": 0.25, "chunk_size": 256, "min_numel": 0}, lambda c, st: (12 + 3 * 256) * 4),
}


class NoOrCollective(ProcessGroupCollective):
    """The same collective without the bitwise-OR reduction (the max fallback path)."""

    all_reduce_bor = None


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def scenario_aggregate(rank: int, world: int) -> dict:
    results = {}
    cases = dict(CASES)
    cases["sketch_max_fallback"] = CASES["sketch"]
    for case, (params, formula) in cases.items():
        name = case.split("_")[0] if case not in CASES or case.startswith(("redsync_", "sidco_", "qsgd_")) else case
        name = {"sketch_max_fallback": "sketch"}.get(case, name)
        comp = build_compressor(name, **params)
        kind = f"test_{case}"
        coll = (NoOrCollective if case == "sketch_max_fallback" else ProcessGroupCollective)(kind=kind)
        state: dict = {"key_hash": 17}
        errs, sent, expected, dense = [], [], [], []
        for step in range(4):
            g = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(SHAPE, generator=g) * (1 + rank)
            before = get_meter().by_kind[kind].bytes_sent, get_meter().by_kind[kind].dense_bytes
            coll.charge_dense(N * 4)
            mean, local = comp.aggregate(x, state, coll)
            after = get_meter().by_kind[kind].bytes_sent, get_meter().by_kind[kind].dense_bytes
            ref = torch.stack(gather(local)).mean(0)
            scale = float(ref.abs().max()) or 1.0
            errs.append(float((mean - ref).abs().max()) / scale)
            sent.append(after[0] - before[0])
            dense.append(after[1] - before[1])
            if case != "sketch_max_fallback" and formula is not None:
                expected.append(int(formula(comp, state)))
        results[case] = {"rel_err": errs, "sent": sent, "expected": expected, "dense": dense}
    return results


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(20, 300)
        self.fc2 = nn.Linear(300, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _topk_dense(t: torch.Tensor, k: int) -> torch.Tensor:
    flat = t.reshape(-1)
    idx = torch.topk(flat.abs(), k).indices
    out = torch.zeros_like(flat)
    out[idx] = flat[idx]
    return out.view_as(t)


def _batch_with_reference(model: nn.Module, ref_model: nn.Module, rank: int, it: int):
    """This rank's batch of iteration ``it``; ``ref_model`` (a copy of ``model``'s weights)
    holds the dense gradients of that batch."""
    g = torch.Generator().manual_seed(10 * rank + it)
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
    ref_model.load_state_dict(model.state_dict())
    ref_model.zero_grad()
    nn.functional.cross_entropy(ref_model(x), y).backward()
    return x, y


def scenario_ddp(rank: int, world: int) -> dict:
    comp = build_compressor("topk", ratio=0.01, exact=True, min_numel=1000)
    model = Net()
    ddp = DistributedDataParallel(model)
    state = register_compression_hook(ddp, comp, warmup_steps=1)
    ref_model = Net()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    residual = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    out = {"iterations": []}
    meter = get_meter().by_kind["data_parallel"]
    for it in range(4):
        # reference: this rank's dense gradient, compressed by hand, gathered, averaged
        x, y = _batch_with_reference(model, ref_model, rank, it)
        expected = {}
        expected_sent = 0
        for name, p in ref_model.named_parameters():
            if it == 0 or p.numel() < 1000:
                contrib = p.grad
                expected_sent += p.numel() * 4
            else:
                k = math.ceil(0.01 * p.numel())
                comp_in = p.grad + residual[name]
                contrib = _topk_dense(comp_in, k)
                residual[name] = comp_in - contrib
                expected_sent += k * 8
            expected[name] = torch.stack(gather(contrib)).mean(0)
        if it > 0:  # one message of two parts (the dense biases, every weight's entries): two length headers
            expected_sent += 16
        before = meter.bytes_sent, meter.dense_bytes
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        after = meter.bytes_sent, meter.dense_bytes
        err = max(
            float((p.grad - expected[name]).abs().max()) for name, p in model.named_parameters()
        )
        out["iterations"].append(
            {
                "max_err": err,
                "sent": after[0] - before[0],
                "expected_sent": expected_sent,
                "dense": after[1] - before[1],
                "expected_dense": sum(p.numel() * 4 for p in model.parameters()),
            }
        )
        opt.step()
    out["calls"] = state.calls
    out["compressed_calls"] = state.compressed_calls
    out["stats"] = state.compression_stats()
    out["comm_hook"] = str(ddp._get_ddp_logging_data().get("comm_hook", ""))
    return out


def scenario_ddp_dgc(rank: int, world: int) -> dict:
    """DGC in the DDP hook: the weights (>= min_numel) sparsified with momentum correction
    and masking, the biases dense but with DGC's momentum (u <- m u + g, u sent); the
    reference is both rules written out here with an exact top-k (sample_ratio 1)."""
    m, ratio = 0.9, 0.01
    comp = build_compressor("dgc", ratio=ratio, momentum=m, sample_ratio=1.0, min_numel=1000,
                            warmup_ratio_steps=0)
    model = Net()
    ddp = DistributedDataParallel(model)
    register_compression_hook(ddp, comp, warmup_steps=0)
    ref_model = Net()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    u = {n: torch.zeros_like(p).reshape(-1) for n, p in model.named_parameters()}
    v = {n: torch.zeros_like(p).reshape(-1) for n, p in model.named_parameters()}
    errs, bias_scale = [], []
    for it in range(5):
        g = torch.Generator().manual_seed(100 + 10 * rank + it)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
        ref_model.load_state_dict(model.state_dict())
        ref_model.zero_grad()
        nn.functional.cross_entropy(ref_model(x), y).backward()
        expected = {}
        for name, p in ref_model.named_parameters():
            grad = p.grad.reshape(-1)
            u[name] = m * u[name] + grad
            if p.numel() < 1000:
                contrib = u[name].clone()
            else:
                v[name] = v[name] + u[name]
                top = torch.topk(v[name].abs(), math.ceil(ratio * p.numel())).indices
                contrib = torch.zeros_like(v[name])
                contrib[top] = v[name][top]
                v[name][top] = 0
                u[name][top] = 0
            expected[name] = torch.stack(gather(contrib)).mean(0).view_as(p)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        errs.append(max(float((p.grad - expected[n]).abs().max()) for n, p in model.named_parameters()))
        # the dense biases carry momentum: after a few steps u differs from the plain gradient
        bias = dict(ref_model.named_parameters())["fc2.bias"]
        bias_scale.append(float((expected["fc2.bias"] - torch.stack(gather(bias.grad)).mean(0)).abs().max()))
        opt.step()
    return {"err": errs, "momentum_effect": bias_scale}


FUSED_SHAPES = [(10,), (40, 30), (30,), (20, 60), (700,), (5,)]  # dense and compressed interleaved
FUSED_CASES = {
    "topk": ("topk", {"ratio": 0.03, "sample_size": 500, "min_numel": 100}),
    "dgc": ("dgc", {"ratio": 0.02, "warmup_ratio_steps": 2, "min_numel": 100}),
    # clip_norm 6: limit 6 / sqrt(2) = 4.2 clips the compressed tensors (norms ~26-35) and
    # one of the three dense ones (~5.5; not ~3.2 and ~2.2), each by its own norm
    "dgc_clip": ("dgc", {"ratio": 0.02, "warmup_ratio_steps": 2, "min_numel": 100, "clip_norm": 6.0}),
    "dgc_elastic": ("dgc", {"ratio": 0.02, "warmup_ratio_steps": 0, "min_numel": 100}),
    "signsgd": ("signsgd", {"min_numel": 100}),
    "signsgd_nomem": ("signsgd", {"min_numel": 100, "memory": False}),
    "randomk": ("randomk", {"ratio": 0.05, "seed": 3, "min_numel": 100}),
    "randomk_unbiased": ("randomk", {"ratio": 0.05, "seed": 3, "unbiased": True, "memory": False, "min_numel": 100}),
    "fp16": ("fp16", {"min_numel": 100, "memory": True}),
    "bf16": ("bf16", {"min_numel": 100}),
    "qsgd": ("qsgd", {"levels": 7, "bucket_size": 64, "seed": 5, "memory": True, "min_numel": 100}),
    "qsgd8": ("qsgd", {"seed": 5, "min_numel": 100}),
    "qsgd12": ("qsgd", {"levels": 2047, "bucket_size": 64, "seed": 5, "min_numel": 100}),  # int16 levels, 12 bits
    "qsgd_elias": ("qsgd", {"levels": 7, "bucket_size": 64, "coding": "elias", "seed": 5, "min_numel": 100}),
    "sparse_gc": ("sparse_gc", {"ratio": 0.02, "min_numel": 100}),
    "sparse_gc_grad": ("sparse_gc", {"ratio": 0.02, "min_numel": 100}),
    # both of RedSync's searches, each tensor its own (trimmed top-k; bisection from 1000)
    "redsync": ("redsync", {"ratio": 0.02, "bisect_min_numel": 1000, "min_numel": 100}),
    # SIDCo adapting every step: each tensor's stage count and target correction move
    "sidco": ("sidco", {"ratio": 0.02, "adapt_every": 1, "min_numel": 100}),
    # RedSync reusing each tensor's bisected threshold: searched at step 0, reused at 1 and
    # at 2 (the fused side's, carried over from the per-tensor checkpoint)
    "redsync_reuse": ("redsync", {"ratio": 0.02, "method": "bisect", "reuse_steps": 3, "min_numel": 100}),
    # each tensor's own top-k (sampled; exact) and 2-bit code (its median, its two scales)
    "sparseloco": ("sparseloco", {"ratio": 0.05, "sample_size": 500, "min_numel": 100}),
    "sparseloco_exact": ("sparseloco", {"ratio": 0.05, "exact": True, "min_numel": 100}),
    # each matrix its own factors and step (P and Q alternating); the 1-D (700,) travels dense
    "acpsgd": ("acpsgd", {"rank": 2, "min_numel": 100}),
    # the multi-round form: every P in one all-reduce, then every Q; each matrix its warm start
    "powersgd": ("powersgd", {"rank": 2, "min_numel": 100}),
    # each tensor's own chunks, k and choice: every tensor's scores in one all-reduce, then
    # every tensor's chosen chunks in one (the last chunk of each tensor shorter)
    "csc": ("csc", {"ratio": 0.25, "chunk_size": 64, "min_numel": 100}),
    # each tensor's own top-k, seed and width: one OR, one sketch sum (a remainder: one more)
    "sketch": ("sketch", {"ratio": 0.05, "min_numel": 100}),
    # each tensor's own exponent histogram and Huffman code, one message per rank
    "gcomp": ("gcomp", {"mantissa_bits": 7, "min_numel": 100}),
    # both ways: each tensor's shards, every owner's pieces in one inner call; the owner's
    # second residual f per tensor (carried over from the per-tensor checkpoint)
    "two_way_topk": ("topk", {"ratio": 0.05, "sample_size": 500, "min_numel": 100, "two_way": True}),
    "two_way_signsgd": ("signsgd", {"min_numel": 100, "two_way": True}),
    "two_way_qsgd": ("qsgd", {"levels": 7, "bucket_size": 64, "seed": 5, "min_numel": 100, "two_way": True}),
    "two_way_sidco": ("sidco", {"ratio": 0.05, "adapt_every": 1, "min_numel": 100, "two_way": True}),
    # each tensor its own leader's mask, samples and coder: trained after 2 phase-1 steps
    # (the first two), codes at the third (from the per-tensor side's checkpoint)
    "lgc": ("lgc", {"ratio": 0.1, "coder_warmup_steps": 2, "max_error": 100.0, "train_iters": 5, "min_numel": 100}),
    "lgc_ps": ("lgc", {"ratio": 0.1, "coder_warmup_steps": 2, "max_error": 100.0, "train_iters": 5, "style": "ps",
                       "min_numel": 100}),
}

#: the state of its own per tensor of each codec that keeps one (per segment when fused)
OWN_FIELDS = {
    "sidco": ("stages", "scale", "searching", "moved", "prev_ratio", "achieved", "last_threshold"),
    "redsync_reuse": ("thr", "thr_age"),
    "acpsgd": ("step", "p", "q"),
    "powersgd": ("step", "q"),
    "csc": ("chosen", "last_payload_bytes"),
    "sketch": ("step", "last_nnz", "last_union", "last_core"),
    "two_way_topk": ("f",),
    "two_way_signsgd": ("f",),
    "two_way_qsgd": ("f",),
    "two_way_sidco": ("f",),
    "lgc": ("step", "last_phase", "phase1_steps", "ema_error", "coder_weights"),
    "lgc_ps": ("step", "last_phase", "phase1_steps", "ema_error", "coder_weights"),
}


def _own_states(states: dict, keys: list[str], fields) -> list[dict]:
    """Each compressed tensor's own state: per tensor, or its segment's (fused); tensors
    as (nested) lists."""
    group = next((v for k, v in states.items() if k.startswith("fused:")), None)
    big = [key for j, key in enumerate(keys) if math.prod(FUSED_SHAPES[j]) >= 100]
    per = [states[key] for key in big] if group is None else group["segment_states"]
    plain = lambda v: v.tolist() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return [{f: plain(st.get(f)) for f in fields} for st in per]


def _fused_codec(name: str):
    kind, params = FUSED_CASES[name]
    comp = build_compressor(kind, **params)
    if name == "dgc_elastic":
        comp.bind_exchange(None)  # no momentum: v <- v + d
    if name == "sparse_gc_grad":
        comp.bind_training([], None)  # DDP's mode: the global momentum M and the local update
    return comp


def _codec_state(states: dict, memory, keys: list[str], per_tensor_fields=("u", "v")) -> list:
    """Per compressed tensor: its residual and DGC's u, v (group views for the fused path;
    ``per_tensor_fields``: those the codec keeps per tensor)."""
    out = []
    for j, key in enumerate(keys):
        if math.prod(FUSED_SHAPES[j]) < 100:
            continue
        res = memory.residual(key)
        st = states.get(key)
        if st is None:  # fused: the group's flat u, v at this tensor's offset
            group = next(v for k, v in states.items() if k.startswith("fused:"))
            off, n = sum(math.prod(s) for s in FUSED_SHAPES[:j]), math.prod(FUSED_SHAPES[j])
            st = {f: group[f][off : off + n] for f in per_tensor_fields if f in group}
        out.append([None if res is None else res.reshape(-1)] + [st.get(f) for f in per_tensor_fields])
    return out


def _same(a: list, b: list) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def scenario_fused(rank: int, world: int) -> dict:
    """The fused exchange (one codec call, one message) against the per-tensor exchange on
    the same inputs, three steps: means, residuals and DGC's u, v bitwise equal. At the
    third step the fused side starts from the per-tensor side's checkpoint (per-tensor
    states: converted on first use)."""
    keys = [f"t{j}" for j in range(len(FUSED_SHAPES))]
    total = sum(math.prod(s) for s in FUSED_SHAPES)
    out = {}
    for name in FUSED_CASES:
        comp_a, comp_b = _fused_codec(name), _fused_codec(name)
        mem_a, mem_b = make_memory(comp_a), make_memory(comp_b)
        states_a, states_b = {}, {}
        coll_a = ProcessGroupCollective(kind=f"per_tensor_{name}")
        coll_b = ProcessGroupCollective(kind=f"fused_{name}")
        rec = {"mean_equal": [], "state_equal": [], "calls": [], "scale": []}
        for step in range(3):
            if step == 2:  # resume the fused side from the per-tensor side's state
                states_b = from_plain(to_plain(states_a, "states"))
                mem_b.load_state_dict(mem_a.state_dict())
            flat = torch.randn(total, generator=torch.Generator().manual_seed(30 * rank + step))
            pieces = list(torch.split(flat.clone(), [math.prod(s) for s in FUSED_SHAPES]))
            pieces = [p.view(s) for p, s in zip(pieces, FUSED_SHAPES)]
            means_a, _ = exchange_tensors(pieces, keys, comp_a, mem_a, states_a, coll_a)
            calls = get_meter().by_kind[f"fused_{name}"].calls
            layout = layout_for(states_b, FUSED_SHAPES, keys, 100)
            mean_b, _, _ = start_exchange_flat(flat.clone(), layout, comp_b, mem_b, states_b, coll_b).finish()
            rec["calls"].append(get_meter().by_kind[f"fused_{name}"].calls - calls)
            rec["mean_equal"].append(torch.equal(torch.cat([m.reshape(-1) for m in means_a]), mean_b))
            # sparse_gc: v, no momentum u; in gradient mode the global momentum M
            fields = {"sparse_gc": ("v",), "sparse_gc_grad": ("v", "M")}.get(name, ("u", "v"))
            rec["state_equal"].append(_same(_codec_state(states_a, mem_a, keys, fields),
                                            _codec_state(states_b, mem_b, keys, fields)))
            rec["scale"].append(float(mean_b.abs().max()))
            if name in OWN_FIELDS:
                own_b = _own_states(states_b, keys, OWN_FIELDS[name])
                rec.setdefault("own_state_equal", []).append(_own_states(states_a, keys, OWN_FIELDS[name]) == own_b)
                rec.setdefault("own", []).append(own_b)
        rec["checkpoint_keys"] = sorted(mem_b.state_dict().get("residuals", {}))
        group = next(v for k, v in states_b.items() if k.startswith("fused:"))
        rec["group_tensors"] = sorted(k for k, v in group.items() if isinstance(v, torch.Tensor))
        out[name] = rec
    return out


def scenario_elastic(rank: int, world: int) -> dict:
    out = {}
    shapes, total_numel = ELASTIC_SHAPES, ELASTIC_NUMEL
    for name, params in (
        ("topk", {"ratio": 0.05, "min_numel": 100}),
        ("powersgd", {"rank": 2, "min_numel": 100}),
        ("qsgd", {"levels": 7, "min_numel": 100, "memory": True}),
    ):
        comp = build_compressor(name, **params)
        state: dict = {}
        errs, cons = [], []
        owed = torch.zeros(total_numel)
        for step in range(3):
            g = torch.Generator().manual_seed(50 * rank + step)
            diff = torch.randn(total_numel, generator=g)
            total, local = exchange_sum(
                diff.clone(), compressor=comp, state=state, shapes=shapes, return_local=True
            )
            ref = torch.stack(gather(local)).sum(0)
            errs.append(float((total - ref).abs().max()))
            # conservation: what is sent plus what is owed equals what was asked
            mem = state["_memory"]
            res = torch.cat(
                [
                    (mem.residual(f"flat.{i}").reshape(-1) if mem.residual(f"flat.{i}") is not None
                     else torch.zeros(math.prod(s)))
                    for i, s in enumerate(shapes)
                ]
            )
            cons.append(float((local + res - (diff + owed)).abs().max()))
            owed = res
        out[name] = {"err": errs, "conservation": cons}
    return out


def scenario_elastic_split(rank: int, world: int) -> dict:
    """The split (launch / wait) exchange against the one-call exchange, same inputs.

    Two exchanges are in flight at once and a blocking collective runs between launch and
    wait (as training's own traffic would); the sums and the residuals must agree.
    """
    out = {}
    shapes, total_numel = ELASTIC_SHAPES, ELASTIC_NUMEL
    for name, params in (
        ("topk", {"ratio": 0.05, "min_numel": 100}),
        ("randomk", {"ratio": 0.1, "min_numel": 100}),
        ("qsgd", {"levels": 7, "min_numel": 100, "memory": True, "seed": 3}),  # same noise
        ("signsgd", {"min_numel": 100}),
        ("powersgd", {"rank": 2, "min_numel": 100}),  # multi-round: runs whole at launch
    ):
        comp_a, comp_b = build_compressor(name, **params), build_compressor(name, **params)
        state_a, state_b = {}, {}
        errs, res_errs = [], []
        for step in range(3):
            g = torch.Generator().manual_seed(70 * rank + step)
            diffs = [torch.randn(total_numel, generator=g) for _ in range(2)]
            pendings = [
                start_exchange_sum(d.clone(), compressor=comp_b, state=st, shapes=shapes, key=f"k{j}")
                for j, (d, st) in enumerate(zip(diffs, (state_b, state_b)))
            ]
            dist.all_reduce(torch.ones(3))  # unrelated traffic between launch and wait
            split = [p.wait() for p in pendings]
            whole = [
                exchange_sum(d.clone(), compressor=comp_a, state=state_a, shapes=shapes, key=f"k{j}")
                for j, d in enumerate(diffs)
            ]
            errs.append(max(float((a - b).abs().max()) for a, b in zip(whole, split)))
            mem_a, mem_b = state_a["_memory"], state_b["_memory"]
            keys = [f"k{j}.{i}" for j in range(2) for i in range(len(shapes))]
            res_errs.append(max(
                (float((mem_a.residual(k) - mem_b.residual(k)).abs().max())
                 if mem_a.residual(k) is not None else float(mem_b.residual(k) is not None))
                for k in keys
            ))
        out[name] = {"err": errs, "residual_err": res_errs, "scale": float(whole[0].abs().max())}
    return out


def scenario_csc(rank: int, world: int) -> dict:
    """GradientFlow's chunk selection against a reference from the gathered inputs: the
    3 of 12 chunks with the largest L1 norm summed over ranks, their mean sent densely."""
    comp = build_compressor("csc", ratio=0.25, chunk_size=256, min_numel=0)
    coll = ProcessGroupCollective(kind="test_csc_ref")
    out = {"err": [], "chosen": [], "ref_chosen": []}
    for step in range(3):
        g = torch.Generator().manual_seed(7 * rank + 100 * step)
        x = (torch.randn(N, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2.0, N, dtype=torch.float64)
             * (1 + rank))
        state: dict = {}
        mean, local = comp.aggregate(x.view(SHAPE), state, coll)
        xs = gather(x)
        scores = [sum(float(xi[j * 256:(j + 1) * 256].abs().sum()) for xi in xs) for j in range(12)]
        ref_chosen = sorted(sorted(range(12), key=lambda j: -scores[j])[:3])
        ref = torch.zeros(N, dtype=torch.float64)
        for j in ref_chosen:
            ref[j * 256:(j + 1) * 256] = sum(xi[j * 256:(j + 1) * 256] for xi in xs) / world
        out["err"].append(float((mean.reshape(-1) - ref).abs().max()))
        out["local_err"] = float((local.reshape(-1) - torch.where(ref != 0, x, 0.0)).abs().max())
        out["chosen"].append(state["chosen"].tolist())
        out["ref_chosen"].append(ref_chosen)
    return out


class _Bucket:
    """A bucket as DDP hands it to a comm hook (buffer, per-tensor views, last flag), for
    calling the hook outside a backward pass."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._buf = torch.cat([t.reshape(-1) for t in tensors])
        self._views, offset = [], 0
        for t in tensors:
            self._views.append(self._buf[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def buffer(self) -> torch.Tensor:
        return self._buf

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def is_last(self) -> bool:
        return True


def _cast_reference(contribs: list[torch.Tensor], dtype: torch.dtype | None, world: int) -> torch.Tensor:
    """sum over ranks of dtype(g_r / p) in that dtype's arithmetic, as fp32 (dtype None: the
    fp32 mean), from this rank's gathered dense gradients."""
    if dtype is None:
        return torch.stack(contribs).mean(0)
    total = (contribs[0] / world).to(dtype)
    for c in contribs[1:]:
        total = total + (c / world).to(dtype)
    return total.float()


def scenario_ddp_cast(rank: int, world: int) -> dict:
    """bf16 / fp16 through DDP as the overlapped cast hook: (1) in a real DDP backward over
    several buckets (10 kB each), each tensor of >= 1000 elements averaged as the sum of
    the ranks' 16-bit g / p, the others in fp32 (warm-up iteration all fp32), against the
    gathered dense gradients, with the bytes on the wire; (2) the hook called with a
    bucket returns before the peer has even launched its all-reduce (rank 1 launches only
    once rank 0's hook has returned): nothing waits inside the hook."""
    from easgd_lightning.hooks.ddp import CastHookState, cast_allreduce_hook
    from easgd_lightning.hooks.memory import NoMemory

    out: dict = {}
    meter = get_meter().by_kind["data_parallel"]
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model, ref_model = Net(), Net()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = register_compression_hook(ddp, build_compressor(name, min_numel=1000), warmup_steps=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        rec = {"hook": str(ddp._get_ddp_logging_data().get("comm_hook", "")), "err": [], "sent": [], "expected_sent": []}
        for it in range(3):
            x, y = _batch_with_reference(model, ref_model, rank, it)
            expected, sent = {}, 0
            for pname, p in ref_model.named_parameters():
                cast = it > 0 and p.numel() >= 1000
                expected[pname] = _cast_reference(gather(p.grad), dtype if cast else None, world)
                sent += p.numel() * (2 if cast else 4)
            before = meter.bytes_sent
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            rec["sent"].append(meter.bytes_sent - before)
            rec["expected_sent"].append(sent)
            rec["err"].append(max(float((p.grad - expected[n]).abs().max()) for n, p in model.named_parameters()))
            opt.step()
        rec["stats"] = state.compression_stats()
        out[name] = rec
    # (2) the hook does not wait for its all-reduce
    store = dist.distributed_c10d._get_default_store()
    state = CastHookState(build_compressor("fp16", min_numel=0), NoMemory(), warmup_steps=0)
    state._inflight = []  # not inside a backward: no engine callback to queue
    tensors = [torch.randn(300, 20, generator=torch.Generator().manual_seed(rank)), torch.randn(10)]
    bucket = _Bucket(tensors)
    if rank != 0:
        store.wait(["cast_hook_returned"], datetime.timedelta(seconds=60))
    fut = cast_allreduce_hook(state, bucket)
    out["done_at_return"] = fut.done()
    if rank == 0:
        store.set("cast_hook_returned", "1")
    mean = fut.wait()
    ref = _cast_reference(gather(torch.cat([t.reshape(-1) for t in tensors])), torch.float16, world)
    out["direct_err"] = float((mean - ref).abs().max())
    return out


def main() -> None:
    run_rank_scenarios(lambda name, rank, world, _out: globals()[f"scenario_{name}"](rank, world))


if __name__ == "__main__":
    main()
