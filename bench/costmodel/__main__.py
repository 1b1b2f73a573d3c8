"""``python -m bench.costmodel``: ``--measure`` (the probe and the rows on the emulated
cluster, root; then the fit) or ``--fit INPUTS_JSON`` (the fit and the projection of saved
measurements)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import costmodel
from bench._netem import ClusterUnavailable, cleanup_all
from bench._scenarios import REPO
from bench.costmodel.measure import (
    DEFAULT_ROWS,
    PROBE_RATES_MBIT,
    PROBE_WORKERS,
    ROWS_RATE_MBIT,
    ROWS_WORKERS,
    measure,
)
from bench.costmodel.projection import layouts_with
from bench.costmodel.report import analyse, markdown


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.costmodel", description=costmodel.__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true",
                      help="run the probe and the rows on the emulated cluster (root), then fit")
    mode.add_argument("--fit", type=Path, metavar="INPUTS_JSON",
                      help="fit and project from an existing costmodel_inputs.json")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "costmodel")
    p.add_argument("--probe-workers", default=",".join(str(w) for w in PROBE_WORKERS))
    p.add_argument("--probe-rates", default=",".join(f"{r:g}" for r in PROBE_RATES_MBIT))
    p.add_argument("--probe-repeats", type=int, default=3)
    p.add_argument("--probe-top-ms", type=float, default=40.0,
                   help="largest probe message, in ms of the link at each rate")
    p.add_argument("--probe-loops", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the probe's training-shaped loops (compute + collective)")
    p.add_argument("--layout", action="append", default=[], metavar="LAYOUT.KEY=VALUE",
                   help="replace a projection layout's assumption, e.g. gpu.compute_factor=0.1")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="bench/cluster.py --configs syntax")
    p.add_argument("--rows-workers", default=",".join(str(w) for w in ROWS_WORKERS),
                   help="ranks of the rows' cluster, comma-separated: every row runs at each "
                        "(the first one's limit row, run first, sizes the probe's kernel)")
    p.add_argument("--rows-rate", type=float, default=ROWS_RATE_MBIT)
    p.add_argument("--local-runs", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the limit and the ddp / sync_easgd rows with all their ranks "
                        "on one host (loopback): their cost beyond the limit in training")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each row, limit and local run; its step time is their median")
    p.add_argument("--fork-ranks", action=argparse.BooleanOptionalAction, default=True,
                   help="fork the rows' ranks from a fork server per host (bench/cluster.py "
                        "--fork-ranks): start-up is not in a steady step time, and it is most "
                        "of a fresh run's wall time here")
    p.add_argument("--limit-steps", type=int, default=200,
                   help="steps of the limit row, whose compute every prediction uses: a steady "
                        "window long against the two runs' start-up jitter")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--extra", default="trainer.limit_val_batches=0",
                   help="Hydra overrides for every row (default: no validation passes, which the "
                        "model has no term for: a training step is what it predicts)")
    p.add_argument("--latency-ms", type=float, default=0.1)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="skip the rows that would end past this many seconds of --measure "
                   "(judged by the longest row so far; 0: no budget)")
    p.add_argument("--port", type=int, default=29700)
    p.add_argument("--subnet", default="10.78.0")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; 2 when the emulated network cannot be built here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    args.out = args.out.resolve()
    try:
        layouts = layouts_with(args.layout)
    except ValueError as exc:
        print(f"bench.costmodel: {exc}", file=sys.stderr)
        return 2
    if args.fit is not None:
        inputs = json.loads(args.fit.read_text())
    else:
        try:
            inputs = measure(args)
        except ClusterUnavailable as exc:
            print(f"bench.costmodel: cannot build the emulated cluster: {exc}", file=sys.stderr)
            return 2
        finally:
            cleanup_all()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "costmodel_inputs.json").write_text(json.dumps(inputs, indent=2))
    result = analyse(inputs, args.out, layouts)
    print(markdown(result))
    print(f"[costmodel] wrote {args.out / 'costmodel.json'}, costmodel.md, costmodel_projection.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
