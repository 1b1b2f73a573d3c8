"""An externally launched rank (torchrun, DeepSpeed's launcher, srun) ends through
``exit_now``: its exit handlers run, the interpreter's finalization does not (a gloo worker
thread freeing a finished work's tensors during finalization aborts the rank, exit -6)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from easgd_lightning.cli.train import exit_status


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (2, 2), (130, 130), ("a message", 1)])
def test_exit_status_is_what_sys_exit_gives(code, status) -> None:
    assert exit_status(code) == status
    assert subprocess.run([sys.executable, "-c", f"import sys; sys.exit({code!r})"],
                          capture_output=True).returncode == status


@pytest.mark.parametrize(("body", "status"), [("pass", 0), ("sys.exit(3)", 3), ("sys.exit('bad')", 1)])
def test_a_rank_process_runs_its_exit_handlers_and_skips_finalization(tmp_path, body, status) -> None:
    script = textwrap.dedent(f"""
        import atexit, sys
        from easgd_lightning.cli.train import _end_rank_process

        class Finalized:
            def __del__(self):  # runs only when the interpreter finalizes its modules
                print("finalized", flush=True)

        kept = Finalized()
        atexit.register(lambda: print("exit handler", flush=True))

        def run():
            print("ran", end=" ", flush=True)
            {body}

        _end_rank_process(run)
        print("returned", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout.split() == ["ran", "exit", "handler"], proc.stdout
    assert ("bad" in proc.stderr) == (status == 1)
