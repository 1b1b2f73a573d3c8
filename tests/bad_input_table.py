"""Print the bad-input table of issue #14: input, exit status, whether a worker started,
and the line printed (errors from stderr, our warnings from the log, which Hydra prints on
stdout).

    python -m tests.bad_input_table               # the real easgd-train (~7 s per input)
    python -m tests.bad_input_table --in-process  # the checks easgd-train runs, in this process

Through the real CLI every input runs in its own temporary run directory; a worker started
iff ``ranks/`` exists. In process, each input goes through what ``easgd-train`` runs before
it starts anything -- ``compose_checked`` (the command line against the config tree) and
``validate_config`` (the values) -- and a ``ConfigError`` is the CLI's exit 2 with the line
``easgd-train: error: MESSAGE``; no worker can start there.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.helpers import run_cli

_TWO_OPT = "model=gpt_tiny model.builder=tests.unit.cli.test_validation:two_optimizers strategy=sync_easgd"

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
    # issue 31 item 5: silent, late (after the workers started) or a traceback before
    "hydra.run.dir=", "faults.crash_at_step=2", "faults.nan_at_step=abc", "faults.nan_at_step=-3",
    "strategy=async_easgd trainer.devices=3 faults.crash_rank=2 faults.crash_at_step=2",
    "strategy=pipeline_3d model=gpt_tiny data=text trainer.precision=64-true", "-m optim.lr=0.1,-1",
    "faults.slow_ms=abc", "model=gpt_tiny", "model._target_=nonexistent.mod.fn",
    "hydra.run.dir={tmp}/afile", "hydra.run.dir={tmp}/afile/run", "hydra.run.dir=/proc/easgd-run",
    "hydra.run.dir={tmp}/" + "a" * 300, "hydra.run.dir=/tmp/" + "/".join(["d" * 200] * 21),
    # valid: a real Trainer argument (it was refused as unknown)
    "trainer.gradient_clip_algorithm=value trainer.max_epochs=1 trainer.limit_train_batches=2",
    # valid, with a warning: the compressor never engages (every tensor is under min_numel)
    "compression=dgc optim.momentum=0 trainer.max_epochs=1 trainer.limit_train_batches=2",
    # valid: on one node the center is in shared memory, so both processes are workers
    "strategy=hogwild_easgd trainer.devices=2 trainer.max_epochs=1 trainer.limit_train_batches=2",
]


def _args(args: str, tmp: Path) -> list[str]:
    """The input's overrides, ``{tmp}`` the table's directory (holding ``afile``, a file)."""
    (tmp / "afile").write_text("a file\n")
    return args.replace("{tmp}", str(tmp)).split()


def _row(args: str, run: Path) -> tuple[str, int, bool, str]:
    given = _args(args, run.parent)
    flags = [a for a in given if a in ("-m", "--multirun")]  # Hydra's argparse: flags before the overrides
    proc = run_cli([*flags, f"hydra.run.dir={run}", "logger=none", "trainer.enable_progress_bar=false",
                    *(a for a in given if a not in flags)], check=False, timeout=300, fresh=True, cwd=run.parent)
    errors = [ln for ln in proc.stderr.splitlines() if "easgd-train: error:" in ln]
    warnings = [ln.split(" - ", 1)[-1] for ln in proc.stdout.splitlines() if "[WARNING]" in ln]  # Hydra logs to stdout
    said = errors + [f"warning: {w}" for w in warnings]
    return args, proc.returncode, (run / "ranks").exists(), " / ".join(said) or "(no message)"


def _row_in_process(args: str) -> tuple[str, int, bool, str]:
    """Exit 2 and the CLI's line for a ConfigError; otherwise 0 (the run would start) and
    the warnings the checks logged."""
    import logging

    import easgd_lightning.cli.train  # noqa: F401  (registers the recipe resolvers)
    from easgd_lightning.cli.validate import ConfigError, validate_config

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    from easgd_lightning.cli.overrides import check_command_line
    from easgd_lightning.cli.train import check_dir_usable

    argv = _args(args, Path(tempfile.mkdtemp(prefix="easgd-bad-input-")))
    try:
        for arg in argv:  # what main() checks of the run directory before Hydra runs
            if arg.startswith("hydra.run.dir="):
                check_dir_usable("hydra.run.dir", arg.split("=", 1)[1], probe=False)
        composed: list = []
        check_command_line(argv, composed=composed)
        for i, (job, cfg) in enumerate(composed):  # every job of a sweep (main(): before_hydra)
            try:
                validate_config(cfg)
            except ConfigError as err:
                raise ConfigError(f"{err} (sweep job {i}: {' '.join(job)}; no job was started)") from None
    except ConfigError as err:
        return args, 2, False, f"easgd-train: error: {err}"
    finally:
        root.removeHandler(handler)
    return args, 0, False, " / ".join(f"warning: {w}" for w in records) or "(accepted)"


def main() -> None:
    in_process = "--in-process" in sys.argv[1:]
    print("| input | exit | worker started | printed |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, args in enumerate(INPUTS):
            name, code, started, line = _row_in_process(args) if in_process else _row(args, Path(tmp) / str(i))
            name = name if len(name) < 80 else f"{name[:40]}...({len(name)} chars)"
            print(f"| `{name}` | {code} | {'yes' if started else 'no'} | {line.replace('|', '/')} |", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
