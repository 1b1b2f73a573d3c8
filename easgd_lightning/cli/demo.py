"""``make demo``: digits, 2 CPU workers, trained with each strategy of ``conf/demo.yaml``.

Runs ``easgd-train`` once per strategy (output streamed, so progress is visible), then
prints the side-by-side table and writes ``report.md`` and the PNG plots next to the runs.
The strategies (ddp, sync_easgd and easgd_round_robin) are the config file's, not this
module's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from easgd_lightning.cli.report import markdown_table, write_report
from easgd_lightning.config_tree import CONF_DIR


def demo_strategies(conf_dir: str | Path = CONF_DIR) -> tuple[str, ...]:
    """The Hydra strategy options the demo trains, in order (``strategies`` of
    ``conf/demo.yaml``)."""
    import yaml

    return tuple(yaml.safe_load((Path(conf_dir) / "demo.yaml").read_text())["strategies"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="easgd-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo", help="directory for the runs and the report")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    strategies = demo_strategies()
    for i, strategy in enumerate(strategies, 1):
        run_dir = out / strategy
        print(f"\n=== [{i}/{len(strategies)}] strategy={strategy}: digits, 2 workers on CPU -> {run_dir}", flush=True)
        if run_dir.is_dir():  # the demo's own previous run: start it afresh
            print(f"(replacing the previous demo run in {run_dir})", flush=True)
            shutil.rmtree(run_dir)
        cmd = [
            sys.executable, "-m", "easgd_lightning.cli.train",
            f"strategy={strategy}", "trainer.devices=2", f"hydra.run.dir={run_dir}",
            f"run_name=demo-{strategy}", "trainer.enable_progress_bar=false", *args.overrides,
        ]
        start = time.perf_counter()
        code = subprocess.call(cmd, env=env)
        print(f"=== strategy={strategy} finished with exit code {code} in {time.perf_counter() - start:.1f}s", flush=True)
    path, table = write_report(out)
    print("\n" + markdown_table(table))
    print(f"\nreport: {path}\nplots:  {out / 'val_acc_vs_time.png'}, {out / 'acc_vs_bytes.png'}, {out / 'comm_share.png'}")
    return 0 if all(r["status"] == "ok" for r in table) and len(table) == len(strategies) else 1


if __name__ == "__main__":
    sys.exit(main())
