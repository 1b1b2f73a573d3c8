"""One torchft replica (one process) training with torchft's own DiLoCo, the outside oracle
of tests/distributed/test_diloco.py.

``python diloco_torchft_run.py LIGHTHOUSE INDEX MODE INIT.pt OUT.pt``: the worker of rank
INDEX in ``diloco_run.py``'s MODE -- the same float64 module, initial weights (INIT.pt),
data, batches and inner optimizer -- trained for the mode's whole rounds by a plain loop
under ``torchft.local_sgd.DiLoCo`` (a torchft ``Manager`` over ``ProcessGroupGloo``, one
outer ``torch.optim.SGD`` per fragment). Writes torchft's global weights (each fragment's
``original_parameters``) after every synchronisation to OUT.pt.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore

from tests.distributed.local_sgd_script import rank_data
from tests.distributed.scripts import diloco_run as S


class Fragment(nn.Module):
    """A fragment of the model: some of its Parameter objects themselves (not copies)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(params)


def main() -> None:
    lighthouse, index, mode, init_path, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    options, optimizer, lr, _ = S.MODES[mode]
    tau, count = options["tau"], options.get("fragments", 1)
    steps = (S.MODES[mode][3] // tau) * tau  # whole rounds
    model = S.Module(optimizer, lr).double()
    nn.utils.vector_to_parameters(torch.load(init_path).clone(), model.parameters())
    params = list(model.parameters())
    groups = [params] if count == 1 else [params[:1], params[1:]]  # the strategy's cut for 2
    fragments = [Fragment(g) for g in groups]
    inner = model.configure_optimizers()
    outer = [torch.optim.SGD(f.parameters(), lr=options.get("outer_lr", 0.7), momentum=0.9, nesterov=True)
             for f in fragments]
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda sd: None,
        state_dict=lambda: {},
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"oracle{index}",
        hostname="127.0.0.1",
        init_sync=False,
    )
    x, y = rank_data(index, S.N, 5, 3)
    thetas = []
    with DiLoCo(manager, fragments, inner, outer, sync_every=tau, backup_device=torch.device("cpu"),
                pin_memory=False, fragment_sync_delay=options.get("fragment_sync_delay", 0),
                fragment_update_alpha=options.get("fragment_update_alpha", 0.0)) as diloco:
        for t in range(1, steps + 1):
            sl = slice((t - 1) * S.BATCH, t * S.BATCH)
            inner.zero_grad()
            nn.functional.mse_loss(model.net(x[sl]), y[sl]).backward()
            inner.step()  # DiLoCo's hooks prepare / synchronise a fragment after the step
            thetas.append(torch.cat([p.reshape(-1) for f in diloco._fragments
                                     for p in f.original_parameters.values()]).clone())
    torch.save({"thetas": thetas, "participants": manager.num_participants(),
                "manager_step": manager.current_step()}, out)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
