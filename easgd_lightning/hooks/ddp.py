"""Compressor -> torch DDP communication hook, registered on every backend (gloo too).

Lightning's ``DDPStrategy`` only registers comm hooks on CUDA; ``CompressedDDPStrategy``
calls :func:`register_compression_hook` itself, so the hook runs on CPU/gloo as well.
Without a compressor the hook is a metered dense all-reduce of the bucket (divide by the
world size first, as PyTorch's default hook does).
"""

# NOTE: no ``from __future__ import annotations`` here: DDP's register_comm_hook checks
# that the hook's ``bucket`` annotation *is* ``dist.GradBucket``, which string annotations fail.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from easgd_lightning.comm import ops

__all__ = ["DenseHookState", "dense_allreduce_hook", "register_compression_hook"]


class DenseHookState:
    """State of the metered dense hook."""

    __slots__ = ("group", "world_size", "kind", "calls")

    def __init__(self, group: dist.ProcessGroup | None = None, kind: str = "data_parallel"):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.kind = kind
        self.calls = 0


def dense_allreduce_hook(
    state: DenseHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one metered asynchronous all-reduce."""
    state.calls += 1
    buf = bucket.buffer()
    buf.div_(state.world_size)
    fut = ops.all_reduce_async(buf, kind=state.kind, group=state.group)
    return fut.then(lambda f: f.value()[0])


def register_compression_hook(
    model: DistributedDataParallel,
    compressor=None,
    *,
    group: dist.ProcessGroup | None = None,
    **options,
):
    """Register the hook for ``compressor`` (``None``: metered dense) on ``model``.

    Returns the hook state (for statistics and checkpointing).
    """
    if compressor is None:
        state = DenseHookState(group)
        model.register_comm_hook(state, dense_allreduce_hook)
        return state
    raise NotImplementedError("compressed DDP hooks land with the compression issue")
