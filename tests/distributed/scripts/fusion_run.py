"""One rank of the lazy all-reduce / hierarchical reduction checks (launched torchrun-style).

Usage: fusion_run.py OUT collectives|train FUSION_BYTES

``collectives``: float64 tensors of dyadic values (k / 64, so every sum is exact in any
order and any bit difference is a misplaced element) summed through
``CommLayout.all_reduce_flat`` with no fusion, with buffers of FUSION_BYTES, with one
buffer, and hierarchically (``procs_per_node=2``); then the compressed exchange
(``randomk``, an all-reduce codec) on its per-tensor path with and without fusion, and on
its fused path (one codec call: the small tensors' all-gather and one all-reduce). Saves
results and each call's message count (the meter's calls under the call's kind).

``train``: a model of many small layers trained in float64 by sync_easgd (tau 1) and
local_sgd (tau 2, blocking and CoCoD), unfused (fusion_mb 0) vs fused (FUSION_BYTES) vs,
with 4 ranks, hierarchical (2 nodes x 2), and by ddp (flat vs hierarchical); saves the
final centers (parameters) and the messages of each fit.
"""

import os
import sys

import torch
import torch.distributed as dist

from easgd_lightning.comm import get_meter, reset_meter
from easgd_lightning.comm.fusion import MIB
from easgd_lightning.comm.layout import CommLayout

SIZES = [5, 300, 7, 1000, 3, 64, 2, 50, 40, 1]


def dyadic(rank: int, n: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randint(-4096, 4096, (n,), generator=g).to(torch.float64) / 64


def calls(kind: str) -> int:
    return get_meter().by_kind[kind].calls


def collectives(out: str, fusion_bytes: int, rank: int, world: int) -> None:
    from easgd_lightning.hooks import build_compressor
    from easgd_lightning.hooks.elastic import exchange_sum

    dist.init_process_group("gloo")
    mb = fusion_bytes / MIB
    layouts = {
        "unfused": CommLayout(fusion_mb=0),
        "fused": CommLayout(fusion_mb=mb),
        "one": CommLayout(fusion_mb=25),
        "node": CommLayout(fusion_mb=mb, hierarchy="node", procs_per_node=2),
    }
    res: dict = {"sizes": SIZES}
    data = dyadic(rank, sum(SIZES))
    for name, layout in layouts.items():
        layout.setup()
        flat = data.clone()
        reset_meter()
        layout.all_reduce_flat(flat, SIZES, kind="t")
        res[name] = {"sum": flat, "messages": calls("t")}
        # non-blocking twin, waited for at once: the same sum
        flat2 = data.clone()
        layout.all_reduce_flat_async(flat2, SIZES, kind="t2").wait()
        res[name]["async_equal"] = bool(torch.equal(flat, flat2))
    res["is_leader"] = layouts["node"].node.is_leader
    res["nodes"] = layouts["node"].node.nodes
    layouts["node"].close()
    # compressed: randomk (all-reduce payloads), min_numel 32 (smaller tensors dense)
    shapes = [torch.Size([n]) for n in SIZES]
    for name in ("unfused", "fused", "one_call"):
        comp = build_compressor("randomk", ratio=0.5, min_numel=32)
        if name != "one_call":
            comp.fused_segments = False  # the per-tensor exchange: its sums take the lazy buffers
        state: dict = {}
        sums = []
        for step in range(2):
            reset_meter()
            diff = dyadic(rank, sum(SIZES), salt=step + 1)
            layout = layouts["unfused" if name == "one_call" else name]
            total = exchange_sum(diff, compressor=comp, state=state, kind="c", shapes=shapes, layout=layout)
            sums.append(total.clone())
        res["compressed_" + name] = {"sums": sums, "messages_second": calls("c")}
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def train(out: str, fusion_bytes: int, rank: int, world: int) -> None:
    import pytorch_lightning as pl
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import easgd_lightning  # noqa: F401
    from easgd_lightning.strategies import (
        CompressedDDPStrategy,
        LocalSGDStrategy,
        SyncEASGDStrategy,
    )

    steps, batch = 6, 8

    class Many(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(3)
            self.net = nn.Sequential(*[nn.Linear(6, 6) for _ in range(5)], nn.Linear(6, 1))

        def training_step(self, b, _):
            x, y = b
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(steps * batch, 6, generator=g, dtype=torch.float64)
    y = x.sum(1, keepdim=True).sin()
    layouts = {"unfused": dict(fusion_mb=0), "fused": dict(fusion_mb=fusion_bytes / MIB)}
    if world == 4:
        layouts["node"] = dict(fusion_mb=fusion_bytes / MIB, hierarchy="node", procs_per_node=2)
    res: dict = {}
    for strat in ("sync_easgd", "local_sgd", "local_sgd_cocod", "ddp"):
        for name, opts in layouts.items():
            if strat == "ddp" and name == "unfused":
                continue  # DDP's buckets are DDP's (bucket_cap_mb = fusion_mb): flat vs node only
            model = Many()
            if strat == "ddp":
                s = CompressedDDPStrategy(comm=opts)
            elif strat == "sync_easgd":
                s = SyncEASGDStrategy(tau=1, alpha=0.2, comm=opts)
            else:
                s = LocalSGDStrategy(tau=2, cocod=strat.endswith("cocod"), comm=opts)
            trainer = pl.Trainer(
                accelerator="cpu", devices=world, strategy=s, precision="64-true", max_steps=steps,
                use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )
            reset_meter()
            trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False))
            res[(strat, name)] = {
                "final": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "messages": calls(getattr(s, "comm_kind", "data_parallel")),
                "exchanges": s._rounds if strat.startswith("local_sgd") else steps,
                "tensor_bytes": [p.numel() * 8 for p in model.parameters()],
            }
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    out, mode, fusion_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    {"collectives": collectives, "train": train}[mode](out, fusion_bytes, rank, world)


if __name__ == "__main__":
    main()
