"""The entry of an ``easgd-train`` rank that ``python -m bench.cluster --fork-ranks`` forks from its
host's fork server (``_netem.EmulatedCluster.spawn``; ``easgd_lightning/cli/forkserver.py``):
the server has set ``sys.argv`` to the command line (``.../bin/easgd-train ARGS``, as the
console script sees it), the environment and the working directory; this runs the console
script's function."""

from __future__ import annotations


def main(_args: list[str]) -> None:
    from easgd_lightning.cli.train import main as train_main

    train_main()
