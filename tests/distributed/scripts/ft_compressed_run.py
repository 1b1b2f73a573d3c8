"""One worker of tests/distributed/test_ft_session.py's compressed case: the compressed DDP
hook's exchange (top-k with residual memory, ``CompressionHookState``) run on an
``FTSession``'s quorum (synchronous, ``ManagedGroup``) as ``FTDDPStrategy`` runs it: the hook
state copied after the step's quorum, the exchange, ``commit_step``, and the copy restored
when the step is not committed.

``python ft_compressed_run.py OUT.json STEPS VICTIM KILL_STEP`` with the launcher's variables
set by the test. Worker VICTIM SIGKILLs itself in step KILL_STEP after the quorum formed and
before the exchange, so its peers' collectives of that step fail. Each step's gradient is
``randn(16)`` seeded by (step, rank). The result file holds, per step, whether it was
committed, the mean, the residual after it and the quorum's members.
"""

from __future__ import annotations

import json
import os
import signal

import torch

NUMEL, RATIO = 16, 0.25


def gradient(step: int, rank: int) -> torch.Tensor:
    """The gradient worker ``rank`` contributes at ``step`` (the test computes the same)."""
    return torch.randn(NUMEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    from easgd_lightning.ft.worker import FTSession
    from easgd_lightning.hooks._exchange import exchange_tensors
    from easgd_lightning.hooks.compressors import TopKCompressor
    from easgd_lightning.hooks.ddp import CompressionHookState
    from tests.distributed.scripts.ft_session_run import worker_args

    (out, steps, victim, kill_step), ctx = worker_args()
    rank = ctx.rank
    hook: CompressionHookState | None = None
    session = FTSession(ctx, lambda: {"hook": hook.snapshot(), "local_steps": 0}, lambda s: hook.restore(s["hook"]),
                        async_quorum=False)
    hook = CompressionHookState(TopKCompressor(ratio=RATIO, exact=True, min_numel=0, memory=True),
                                group=session.group(), warmup_steps=0)
    history = []
    for step in range(1, steps + 1):
        g = gradient(step, rank)
        session.start_step(step)
        before = hook.snapshot()
        if rank == victim and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # in the quorum, before the exchange
        (mean,), _ = exchange_tensors([g], ["w"], hook.compressor, hook.memory, hook.tensor_states,
                                      hook.collective, min_numel=0)
        committed = session.commit_step()
        if not committed:
            hook.restore(before)
        history.append({"step": step, "committed": committed, "mean": mean.tolist(),
                        "residual": hook.memory.residual("w").tolist(), "members": session.members()})
    with open(out, "w") as f:
        json.dump({"history": history, "report": session.report()}, f)
    session.shutdown()


if __name__ == "__main__":
    main()
