"""One rank of the two-way exchange on gloo (launched torchrun-style by the test).

Usage: two_way_run.py OUT N STEPS CASE[,CASE...]   (CASE = topk | redsync | signsgd | exchange)

Each case runs STEPS exchanges of one float64 tensor of N entries through
``TwoWayCompressor.aggregate`` on a :class:`ProcessGroupCollective` (residual memory as the
attach points keep it); rank r's gradients are those of
:func:`tests.unit.hooks.compressors.test_two_way.grads_for`. The rank saves, per case and step, its result,
its state's byte figures, what the meter counted for the case's kind, and the bytes its
all-to-all really moved (measured on the tensors it sent and got back). The case
``exchange`` runs top-k two-way through the attach points' exchange
(:func:`~easgd_lightning.hooks._exchange.exchange_tensors`: residual memory, batched
all-gathers, dense charges) on two tensors, N and SMALL entries.
"""

import os
import sys

import torch
import torch.distributed as dist

from easgd_lightning.comm.meter import get_meter
from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks._exchange import exchange_tensors
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.hooks.memory import ResidualMemory
from tests.unit.hooks.compressors.test_two_way import grads_for

SMALL = 37
CASES = {
    "topk": {"ratio": 0.05, "exact": True},
    "redsync": {"ratio": 0.05},
    "signsgd": {},
}


class RecordingCollective(ProcessGroupCollective):
    """Notes the bytes each all-to-all moved: the pieces for the other ranks, theirs."""

    def all_to_all(self, sends):
        out = super().all_to_all(sends)
        self.moved = (sum(t.numel() * t.element_size() for j, t in enumerate(sends) if j != self.rank),
                      sum(t.numel() * t.element_size() for j, t in enumerate(out) if j != self.rank))
        return out


def run_case(case: str, rank: int, world: int, n: int, steps: int) -> dict:
    comp = build_compressor(case, two_way=True, min_numel=0, **CASES[case])
    kind = f"two_way_{case}"
    coll = RecordingCollective(kind=kind)
    memory, state = ResidualMemory(), {"key_hash": 5}
    grads = grads_for(world, n, steps)[rank]
    rows = []
    for g in grads:
        totals = get_meter().by_kind[kind]
        before = totals.bytes_sent, totals.bytes_recv, totals.dense_bytes
        coll.charge_dense(n * 8, key="w")
        p = memory.compensate("w", g)
        out, local = comp.aggregate(p, state, coll)
        memory.update("w", p, local)
        totals = get_meter().by_kind[kind]
        rows.append({
            "out": out.clone(),
            "up": state["last_up_bytes"], "down": state["last_down_bytes"],
            "a2a_sent": coll.moved[0], "a2a_recv": coll.moved[1],
            "sent": totals.bytes_sent - before[0], "recv": totals.bytes_recv - before[1],
            "dense": totals.dense_bytes - before[2],
        })
    return {"rows": rows, "e": memory.residual("w").clone(), "f": state["f"].clone()}


def run_exchange(rank: int, world: int, n: int, steps: int) -> dict:
    comp = build_compressor("topk", two_way=True, min_numel=0, **CASES["topk"])
    coll = ProcessGroupCollective(kind="two_way_exchange")
    memory, states = ResidualMemory(), {}
    grads = [grads_for(world, size, steps)[rank] for size in (n, SMALL)]
    outs = []
    for t in range(steps):
        means, _ = exchange_tensors([grads[0][t], grads[1][t]], ["a", "b"], comp, memory, states, coll)
        outs.append([m.clone() for m in means])
    return {"outs": outs}


def main() -> None:
    out, n, steps, cases = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result = {case: run_exchange(rank, world, n, steps) if case == "exchange" else run_case(case, rank, world, n, steps)
              for case in cases}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
