"""Print the bad-input table of issue #14 from the real ``easgd-train``: input, exit status,
whether a worker started, and the line printed (errors from stderr, our warnings from the
log, which Hydra prints on stdout).

    python -m tests.bad_input_table            # from the repository root (~7 s per input)

Every input runs in its own temporary run directory; a worker started iff ``ranks/`` exists.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.helpers import run_cli

_TWO_OPT = "model=gpt_tiny model.builder=tests.unit.test_validation:two_optimizers strategy=sync_easgd"

INPUTS = [
    # accepted silently before
    "+foo=1", "+trainer.max_epocs=3", "strategy=sync_easgd +strategy.tua=4", "optim.lr=0",
    "trainer.max_epochs=abc", "trainer.max_epochs=0", "trainer.precision=16-mixed",
    "checkpoint.every_n_epochs=0", "recipe=bogus",
    # reaching the workers first before
    "optim.lr=-1", "optim.lr=abc", "optim.momentum=-0.5", "model.hidden=-5", "trainer.precision=65-true",
    "trainer.accelerator=gpu", "optim.optimizer=adam", "trainer.accumulate_grad_batches=0",
    "trainer.max_steps=-2", "data.num_workers=-1", "seed=abc", "strategy=pipeline_3d", _TWO_OPT,
    # Hydra-level (exit 1, several lines, before)
    "strategy=bogus", "compression=bogus", "model=bogus", "optim.milestones=[1,2", "strategy=ddp,sync_easgd",
    # valid, with a warning
    "compression=dgc optim.momentum=0 trainer.max_epochs=1 trainer.limit_train_batches=2",
    "strategy=hogwild_easgd trainer.devices=2 trainer.max_epochs=1 trainer.limit_train_batches=2",
]


def _row(args: str, run: Path) -> tuple[str, int, bool, str]:
    proc = run_cli([f"hydra.run.dir={run}", "logger=none", "trainer.enable_progress_bar=false", *args.split()],
                   check=False, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if "easgd-train: error:" in ln]
    warnings = [ln.split(" - ", 1)[-1] for ln in proc.stdout.splitlines() if "[WARNING]" in ln]  # Hydra logs to stdout
    said = errors + [f"warning: {w}" for w in warnings]
    return args, proc.returncode, (run / "ranks").exists(), " / ".join(said) or "(no message)"


def main() -> None:
    print("| input | exit | worker started | printed |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, args in enumerate(INPUTS):
            name, code, started, line = _row(args, Path(tmp) / str(i))
            print(f"| `{name}` | {code} | {'yes' if started else 'no'} | {line.replace('|', '/')} |", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
