"""A process group whose members are the quorum a torchft ``Manager`` formed for this step
(``ft=torchft``): :mod:`easgd_lightning.comm.ops` runs a collective on it when its ``group``
is a :class:`ManagedGroup`, so the compressed DDP hook (its all-reduces, variable-length
all-gathers and all-to-alls) runs on the quorum unchanged.

Rule (torchft's own, as ``Manager.allreduce``): the members and their ranks are the step's
quorum (worker-rank order); a collective that fails -- a peer died or stopped inside it,
gloo's ``ft.collective_timeout_s`` -- is reported to the Manager, so the step is not
committed (``should_commit`` is False), and completes with a stand-in of the right shape
instead of raising (an all-reduce: the input as it is; a gather: this rank's own message in
every row; an all-to-all: what this rank sent, back to itself as far as it fits), so the
caller runs to the end of the step; once the Manager holds an error, the step's remaining
collectives are not started (each would only wait for the timeout) and complete with their
stand-ins at once. The values of a step with an error are never used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["ManagedGroup"]

T = TypeVar("T")


class ManagedGroup:
    """The quorum of ``manager`` as a group for :mod:`easgd_lightning.comm.ops`.

    Args:
        manager: the worker's torchft ``Manager`` (its quorum must be synchronous: every
            member of the quorum takes part, as :class:`~easgd_lightning.ft.worker.
            FTSession` configures it for a compressed hook).
        pg: the torchft reconfigurable process group the Manager was built with.
    """

    def __init__(self, manager: Any, pg: Any) -> None:
        self.manager = manager
        self.pg = pg

    def size(self) -> int:
        """Members of this step's quorum."""
        self.manager.wait_quorum()
        return int(self.manager.num_participants())

    def rank(self) -> int:
        """This worker's rank in this step's quorum."""
        self.manager.wait_quorum()
        return int(self.manager.participating_rank())

    def backend(self) -> str:
        """The backend under torchft's wrapper (``gloo``)."""
        return str(self.pg.getBackendName()).removeprefix("torchft-")

    def _run(self, launch: Callable[[], Any], fallback: Callable[[], T]) -> torch.futures.Future:
        """``launch()``'s work as a future that never fails (module doc)."""
        done: torch.futures.Future = torch.futures.Future()
        if self.manager.errored() is None:
            try:
                self.manager.wait_quorum()
                fut = launch().get_future()
            except Exception as err:  # the group is broken or not configured
                self.manager.report_error(err)
            else:
                def guard(f: torch.futures.Future) -> Any:
                    try:
                        return f.value()
                    except Exception as err:
                        self.manager.report_error(err)
                        return fallback()

                return fut.then(guard)
        done.set_result(fallback())
        return done

    def all_reduce(self, tensor: torch.Tensor, op) -> torch.futures.Future:
        """In-place all-reduce of ``tensor``; the future resolves to ``[tensor]``."""
        from torch.distributed.distributed_c10d import AllreduceOptions

        opts = AllreduceOptions()
        opts.reduceOp = op
        return self._run(lambda: self.pg.allreduce([tensor], opts), lambda: [tensor])

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> torch.futures.Future:
        """Every member's ``tensor`` into ``outs`` (one per member, in rank order)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        def fallback() -> list:
            for out in outs:
                out.copy_(tensor)
            return [outs]

        return self._run(lambda: self.pg.allgather([outs], [tensor], AllgatherOptions()), fallback)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                          in_splits: list[int] | None = None) -> torch.futures.Future:
        """``torch.distributed.all_to_all_single`` on the quorum (blocking callers wait)."""
        from torch.distributed.distributed_c10d import AllToAllOptions

        def fallback() -> list:
            n = min(out.numel(), inp.numel())
            out.view(-1)[:n].copy_(inp.view(-1)[:n])
            out.view(-1)[n:].zero_()
            return [out]

        return self._run(lambda: self.pg.alltoall_base(out, inp, out_splits or [], in_splits or [],
                                                       AllToAllOptions()), fallback)
