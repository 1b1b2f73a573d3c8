"""One rank of the count-sketch exactness check (tests/distributed/test_sketch_exact.py).

``python sketch_exact_run.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_* set: 120 exchanges
of k-sparse vectors (k from 2 to 31, n = 16384, ratio = k / n, so top-k keeps exactly the
non-zeros) through the real compressed exchange over gloo; every rank builds every rank's
vector from its seed and records the exact sum, the exchanged sum and whether peeling
left a remainder. Writes OUT_DIR/rank<R>.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.elastic import exchange_sum

N, DRAWS = 16384, 120


def sparse(rank: int, draw: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * draw + rank)
    v = torch.zeros(N, dtype=torch.float64)
    v[torch.randperm(N, generator=g)[:k]] = torch.randn(k, generator=g, dtype=torch.float64)
    return v


def last_core(state: dict) -> int:
    """The largest remainder of the exchange: per tensor, or per segment of the fused one."""
    cores = [0]
    for s in state.values():
        if isinstance(s, dict):
            cores += [int(m.get("last_core", 0)) for m in [s, *s.get("segment_states", [])]]
    return max(cores)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {"exact": [], "got": [], "core": []}
    for draw in range(DRAWS):
        k = 2 + draw % 30
        state: dict = {}
        comp = build_compressor("sketch", ratio=k / N, min_numel=0)
        got = exchange_sum(sparse(rank, draw, k), compressor=comp, state=state, key=f"d{draw}")
        record["got"].append(got.clone())
        record["exact"].append(sum(sparse(r, draw, k) for r in range(world)))
        record["core"].append(last_core(state))
    torch.save(record, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
