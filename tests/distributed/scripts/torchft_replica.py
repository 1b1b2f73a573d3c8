"""One torchft replica group of one process, for tests/distributed/test_torchft_smoke.py.

``python torchft_replica.py LIGHTHOUSE INDEX STEPS OUT.jsonl``: a private TCPStore (the
replica group's store), a torchft ``ProcessGroupGloo`` and a torchft ``Manager``; then, per
step: ``start_quorum``, an all-reduce (SUM) through the Manager of a tensor holding
``INDEX + 1`` everywhere, ``should_commit``. Each step appends one JSON line to OUT.jsonl
(participants, the sum, committed), flushed, so the test sees progress while it runs.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore


def main() -> None:
    lighthouse, index, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    state = {"w": torch.zeros(4)}
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=lambda sd: state.update(sd),
        state_dict=lambda: dict(state),
        min_replica_size=1,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"r{index:05d}",
        hostname="127.0.0.1",
        init_sync=False,
    )
    with open(out, "a") as f:
        for step in range(steps):
            manager.start_quorum()
            t = torch.full((4,), float(index + 1), dtype=torch.float64)
            manager.allreduce(t, reduce_op=torch.distributed.ReduceOp.SUM).wait()
            participants = manager.num_participants()
            committed = manager.should_commit()
            f.write(json.dumps({"step": step, "participants": participants, "sum": float(t[0]),
                                "committed": committed, "manager_step": manager.current_step(),
                                "t": time.time()}) + "\n")
            f.flush()
            time.sleep(0.1)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
