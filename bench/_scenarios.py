"""The emulated-cluster benchmark's vocabulary: rows (``BenchConfig``), targets and the
scenario presets (``SCENARIOS``) that ``python -m bench.cluster --scenario`` runs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


BASELINE = ("ddp", "none")


# The dense baselines (issue 29 section 3): fp32 DDP and DDP with 16-bit gradients on the
# wire (PyTorch's bf16/fp16 compression hooks: every bucket cast whole, min_numel=0, its
# all-reduce overlapped with the rest of backward as DDP's own). Speedups and "x sooner"
# are taken against the best of them in the run (:func:`bench._tables.best_dense`).
DENSE_CODECS = ("none", "bf16", "fp16")
BF16_ROW = "ddp/bf16;compression.min_numel=0"
FP16_ROW = "ddp/fp16;compression.min_numel=0"
DENSE_ROWS = ("ddp/none", BF16_ROW, FP16_ROW)
DENSE_CONFIGS = ",".join(DENSE_ROWS)


#: a target's ``ref`` resolved when the table is made: the best dense row of the run for
#: the target's figure (``bench._tables.best_dense``)
BEST_DENSE = "best dense"


# The "limit" row: the same hosts, workers and workload with no communication at all.
# It runs as local SGD whose averaging period is longer than any run, so every worker
# trains alone; what local SGD still sends happens outside the timed window (the set-up
# broadcast before training starts, one final average after the last step; both are the
# same in the long and the short run of the steady-state subtraction and cancel).
LIMIT = ("limit", "none")


LIMIT_RUN = ("local_sgd", "none", ("strategy.tau=1000000000",))


# DGC is measured at its final sparsity (no warm-up) and, as its config asks, with the
# momentum inside the compressor rather than in the optimizer.
DGC_ROW = "ddp/dgc;compression.warmup_ratio_steps=0;optim.momentum=0"


# AlexNet at 64x64 on synthetic data: ~57M parameters, ~230 MB of fp32 gradients per step.
# 2560 training samples = 20 steps x 32 per worker x 4 workers: the timed steps stay inside
# one epoch (no validation pass inside the timed fit); the final train loss is evaluated
# on 256 of them.
DEFAULT_WORKLOAD = (
    "model=alexnet",
    "data=synthetic",
    "data.image_size=64",
    "data.train_size=2560",
    "data.val_size=128",
    "data.train_eval_size=256",
)


# The digits MLP made wide (64 -> 2048 -> 10, 153k parameters, 614 kB of fp32 per
# exchange): steps of a few tens of milliseconds, so a slow link makes it
# communication-bound at little cost in bench time.
WIDE_MLP_WORKLOAD = ("model.hidden=2048",)


# SC17 (You, Buluc, Demmel): the original EASGD spends 87% of its time communicating.
SC17_BASELINE_SHARE = 0.87


SC17_FIRST_PROBE_MBIT = 1000.0


#: issue 29 section 4: the overlapped Sync EASGD row's speedup over round-robin must reach
#: this share of the bandwidth bound the table prints (``bench._tables.sc17_bound``)
SC17_OF_BOUND = 0.8


@dataclass(frozen=True)
class BenchConfig:
    """One row of the table: a strategy, a compression and overrides for this row only."""

    strategy: str
    compression: str
    overrides: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.strategy, self.compression)

    @property
    def label(self) -> str:
        return f"{self.strategy}/{self.compression}"

    @property
    def slug(self) -> str:
        # Hydra's override grammar forbids '=' inside hydra.run.dir's value.
        tail = "_".join(re.sub(r"[^A-Za-z0-9.-]", "-", o) for o in self.overrides)
        return f"{self.strategy}__{self.compression}" + (f"__{tail}" if tail else "")


def parse_configs(text: str) -> list[BenchConfig]:
    """Parse ``"strategy/compression,strategy/compression;key=value;key=value"``.

    Items are separated by commas; an item may carry Hydra overrides for that row only
    after semicolons (e.g. ``ddp/dgc;compression.warmup_ratio_steps=0``).

    Args:
        text: the ``--configs`` value.

    Returns:
        The configurations in order, exact duplicates removed.

    Raises:
        ValueError: an item is not of the form ``strategy/compression[;key=value...]``.
    """
    configs: list[BenchConfig] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        head, *overrides = (tok.strip() for tok in item.split(";"))
        parts = head.split("/")
        bad = [o for o in overrides if "=" not in o]
        if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9_\-]+", p) for p in parts) or bad:
            raise ValueError(
                f"--configs: '{item}' is not 'strategy/compression[;key=value...]' "
                "(e.g. ddp/none, sync_easgd/topk, ddp/dgc;compression.warmup_ratio_steps=0)"
            )
        config = BenchConfig(parts[0], parts[1], tuple(o for o in overrides if o))
        if config not in configs:
            configs.append(config)
    if not configs:
        raise ValueError("--configs: empty list; give e.g. 'ddp/none,sync_easgd/none'")
    return configs


def one_config(text: str) -> BenchConfig:
    """One ``strategy/compression[;key=value...]`` item as a :class:`BenchConfig`."""
    (config,) = parse_configs(text)
    return config


SHARE_KINDS = ("comm_share", "comm_bound", "of_bound", "loss_gap")

#: how a ``speedup`` target reads for each figure (the ratio is always ref / row)
_FIGURE_WORDS = {
    "time_to_target_s": "time to target speedup over",
    "bytes_to_target": "bytes one worker sent until the target: times fewer than",
    "peak_exchange_bytes": "largest single exchange: times smaller than",
}


@dataclass(frozen=True)
class Target:
    """A ratio a scenario must reach, judged PASS/MISS in the table.

    Kinds: ``efficiency`` (the row's ``efficiency`` against ``bound``), ``comm_share``
    (the row's comm share), ``comm_bound`` (1 - efficiency: the share of the step that
    communication adds over the limit), ``speedup`` (``figure`` of the row ``ref`` divided by the same
    figure of this row: how many times faster this row is), ``of_bound`` (that per-step
    speedup over ``ref`` as a share of the bandwidth bound the table prints, the row's
    ``of_bound`` figure: ``bench._tables.sc17_bound``), ``loss_gap`` (|the row's final loss
    - ``ref``'s| / ``ref``'s). ``ref`` :data:`BEST_DENSE`:
    the best dense row of the run for ``figure``, chosen when the table is made.
    """

    row: str
    kind: str
    op: str
    bound: float
    ref: str | None = None
    figure: str = "step_time_s"
    note: str = ""

    def describe(self, ref: str | None = None) -> str:
        """The target in words; ``ref``: the row a :data:`BEST_DENSE` ref resolved to."""
        ref_words = self.ref if self.ref != BEST_DENSE else (
            f"{ref} ({BEST_DENSE})" if ref else f"the {BEST_DENSE} row"
        )
        what = {
            "efficiency": "efficiency",
            "comm_share": "comm share",
            "comm_bound": "share of the step spent on communication (1 - efficiency)",
            "speedup": f"{_FIGURE_WORDS.get(self.figure, 'per-step speedup over')} {ref_words}",
            "of_bound": f"per-step speedup over {ref_words} as a share of the printed bandwidth bound",
            "loss_gap": f"final loss's relative gap to {ref_words}",
        }[self.kind]
        bound = f"{100 * self.bound:.0f}%" if self.kind in SHARE_KINDS else f"{self.bound:g}"
        if self.kind == "speedup":
            bound += "x"
        return f"{self.row}: {what} {self.op} {bound}" + (f" ({self.note})" if self.note else "")

    def short(self, ref: str | None = None) -> str:
        """The table's label (``ref``: as :meth:`describe`); a speedup names its reference
        row's ``strategy/compression``, the one it resolved to for :data:`BEST_DENSE`."""
        bound = f"{100 * self.bound:.0f}%" if self.kind in SHARE_KINDS else f"{self.bound:g}"
        name = {"efficiency": "eff", "comm_share": "comm", "comm_bound": "1-eff", "speedup": "x",
                "of_bound": "of bound", "loss_gap": "loss gap"}[self.kind]
        if self.kind == "speedup":
            spec = ref if self.ref == BEST_DENSE else self.ref
            return f"{bound}x vs {one_config(spec).label if spec else BEST_DENSE}"
        return f"{name} {self.op} {bound}"


@dataclass(frozen=True)
class Scenario:
    """A preset: hosts, link, workload, rows, run length and the targets it is judged by.

    ``kind`` ``throughput`` measures per-step figures over ``steps`` (steady state after
    ``warmup_steps``) and always adds the limit row; ``tta`` trains each row for
    ``epochs`` and reports the time to ``target_acc``. ``rate_mbit`` None: calibrate the
    rate (sc17). ``only_configs``: run exactly ``configs`` (no ``ddp/none`` or limit row
    added, as ``--only-configs``), for workloads the dense MLP rows do not apply to.
    """

    name: str
    description: str
    workers: int
    rate_mbit: float | None
    workload: tuple[str, ...]
    configs: str
    targets: tuple[Target, ...] = ()
    steps: int = 20
    warmup_steps: int = 2
    extra: tuple[str, ...] = ()
    kind: str = "throughput"
    epochs: int = 0
    target_acc: float = 0.0
    timeout_s: float = 1800.0
    procs_per_host: int = 1
    only_configs: bool = False


SC17_OVERLAPPED = "sync_easgd/none;strategy.overlap=true"


SC17_BLOCKING = "sync_easgd/none;strategy.overlap=false"


TTA_CONFIGS = (
    f"{DENSE_CONFIGS},{DGC_ROW},ddp/powersgd,sync_easgd/none;strategy.tau=4,sync_easgd/topk,"
    "local_sgd/none;strategy.tau_rule=qsr;strategy.tau_base=2;strategy.qsr_coefficient=0.1,"
    "async_easgd/none;strategy.tau=4"
)


# A sharded center (issue 29 section 1, strategy.servers): on the 4 hosts of tta, async_easgd
# with 2 servers (2 workers + 2 servers, each server one half of the center on its own host
# link) beside the single server (3 workers + 1 server).
TTA_SHARDED = "async_easgd/none;strategy.tau=4;strategy.servers=2"
# ... and with the EASGD paper's longer period, tau = 16 (it runs 1, 4, 16 and 64): elastic
# averaging tolerates rare exchanges, and at 100 Mbit/s the exchange is what a step waits on
TTA_SHARDED_16 = "async_easgd/none;strategy.tau=16;strategy.servers=2"
TTA_CONFIGS += f",{TTA_SHARDED},{TTA_SHARDED_16}"


# Step time of async_easgd with 1 server against 4 (issue 29 section 1): 8 single-process
# hosts; strategy.servers=4 is 4 workers + 4 servers, one per host, each pushing a quarter of
# the center over its own link; strategy.servers=1 is 7 workers + 1 server, all through one
# host link. Target: S=4's step >= 1.5x faster (compare samples/s too: the rows train 7 and
# 4 workers; the same 4 workers with one server: --workers 5 --only-configs, README).
SHARDS_ONE = "async_easgd/none;strategy.servers=1"
SHARDS_FOUR = "async_easgd/none;strategy.servers=4"


# Hierarchical reduction (issue 13 section 3): 2 hosts x 2 processes, each dense exchange
# flat (one all-reduce over the 4 ranks) against comm.hierarchy=node (reduce to the host's
# leader over its loopback, leaders all-reduce over the link, broadcast on the host).
HIERARCHY_ROWS = (
    ("ddp/none", "ddp/none;comm.hierarchy=node"),
    ("sync_easgd/none", "sync_easgd/none;comm.hierarchy=node"),
    ("local_sgd/none;strategy.tau=1", "local_sgd/none;strategy.tau=1;comm.hierarchy=node"),
)


# GradientFlow's lazy all-reduce (issue 13 section 1): a model of many small tensors
# (an MLP of 48 hidden layers of 32: 98 tensors of <= 4 kB), one message per tensor
# (comm.fusion_mb=0) against the default 25 MiB buffers (one message per exchange here).
MANY_SMALL_WORKLOAD = ("model.hidden=[" + ",".join(["32"] * 48) + "]",)


FUSION_ROWS = (
    ("sync_easgd/none;comm.fusion_mb=0", "sync_easgd/none"),
    ("local_sgd/none;strategy.tau=1;comm.fusion_mb=0", "local_sgd/none;strategy.tau=1"),
)


# HiPress's SeCoPa planner (issue 13 section 2) against compressing every tensor and
# against compressing none, on an MLP of mixed widths (64 -> 2048 -> 256 -> 32 -> 10:
# weights of 131k, 524k, 8k and 320 entries, biases of 2048 and fewer), where the planner
# has both kinds to tell apart. min_numel=0 in both compressed rows, so the only
# difference between them is the plan. Two codecs: topk (an all-gathered sparse payload)
# and csc (GradientFlow's chunks, all-reduced densely; 1024-entry chunks so that each
# weight has several).
MIXED_WIDTH_WORKLOAD = ("model.hidden=[2048,256,32]",)


def plan_rows(compression: str, *overrides: str) -> tuple[str, str]:
    """(compress everything, the planner's row) of ``ddp/<compression>``, for ``plan``."""
    every = ";".join((f"ddp/{compression}", *overrides, "compression.min_numel=0"))
    return every, f"{every};compression.plan=secopa"


PLAN_CODECS = (("topk",), ("csc", "compression.chunk_size=1024"))


PLAN_ROWS = tuple(plan_rows(*codec) for codec in PLAN_CODECS)


# Optimus-CC's throughput (issue 29 section 5): the tiny GPT of the nlp3d recipe, pp=2 x dp=2
# on 4 single-rank hosts at 100 Mbit/s (stage 0 on hosts 0-1, stage 1 on hosts 2-3: every
# inter-stage send and every data-parallel all-reduce crosses a shaped link), pipeline_3d with
# every Optimus-CC technique against the same recipe uncompressed, same seed and data order.
# Per step and stage pair: 4 micro-batches of (4 x 64 x 128) fp32 activations each way
# (524 kB forward, 524 kB backward, 42 ms each at 100 Mbit/s) and ~0.9 MB of stage gradients
# all-reduced: the links, not the cores, set the step. Issue 5's bound: the compressed run's
# loss after the same steps within 5% of the uncompressed one (tests/distributed/
# test_pipeline_engine.py). The workload is the uncompressed recipe nlp3d/gpt_tiny_pp2 with dp
# taken from the 4 ranks (strategy.dp=null: 2); the compressed row adds what
# nlp3d/gpt_tiny_pp2_dp2_optimus sets beyond optimus_cc's defaults (dp_rank 8, the paper's
# 128 scaled to d_model 128), so both rows are the two recipes.
OPTIMUS_WORKLOAD = ("recipe=nlp3d/gpt_tiny_pp2", "strategy.dp=null", "trainer.limit_val_batches=2")
OPTIMUS_NONE = "pipeline_3d/none"
OPTIMUS_CC = "pipeline_3d/optimus_cc;compression.dp_rank=8"
OPTIMUS_SPEEDUP = 1.5
OPTIMUS_LOSS_GAP = 0.05


def _comm_pairs(
    name: str, description: str, rate_mbit: float, workload: tuple[str, ...], pairs: tuple[tuple[str, str], ...]
) -> Scenario:
    """A 2 hosts x 2 processes preset of (baseline row, row) pairs, each row judged by its
    per-step speedup over its baseline (>= 1x), which prints the ratio."""
    return Scenario(
        name=name,
        description=f"2 hosts x 2 processes, {description}",
        workers=2,
        procs_per_host=2,
        rate_mbit=rate_mbit,
        workload=workload,
        configs=",".join((*DENSE_ROWS, *(spec for pair in pairs for spec in pair))),
        targets=tuple(Target(row, "speedup", ">=", 1.0, ref=ref) for ref, row in pairs),
        steps=60,
        warmup_steps=10,
        timeout_s=300.0,
    )


# The low-bandwidth comparison (issue 26 section 7): DiLoCo and its variants against the
# dense baselines (fp32 and bf16 DDP), PowerSGD, QSR local SGD and Sync EASGD. An MLP of
# five equal hidden layers (64 -> 256 x 5 -> 10: 282k parameters, 1.1 MB of fp32 per
# exchange) so that four fragments of whole tensors are near a quarter each; batches of 16,
# lr halved every 4 epochs (as tta); target 0.93 (on one host, 4 ranks: ddp/none first at
# epoch 10, diloco tau 16 at 12, with 4-bit pseudo-gradients at 10, tau 64 at 12).
LOWBAND_WORKLOAD = ("model.hidden=[256,256,256,256,256]", "data.batch_size=16")
LOWBAND_DILOCO = "diloco/none;strategy.tau=16"
LOWBAND_STREAMING = "diloco/none;strategy.tau=16;strategy.fragments=4;strategy.fragment_sync_delay=1"
LOWBAND_4BIT = "diloco/qsgd;strategy.tau=16;compression.levels=7;compression.min_numel=0"
LOWBAND_CONFIGS = ",".join((
    *DENSE_ROWS, "ddp/powersgd",
    "local_sgd/none;strategy.tau_rule=qsr;strategy.tau_base=2;strategy.qsr_coefficient=0.1",
    "sync_easgd/none;strategy.tau=4",
    LOWBAND_DILOCO, "diloco/none;strategy.tau=64", LOWBAND_STREAMING, LOWBAND_4BIT,
    "diloco/sparseloco;strategy.tau=16;compression.ratio=0.03;compression.min_numel=0",
    "diloco/none;strategy.tau=16;strategy.outer=elastic",
))


def _lowband(name: str, rate_mbit: float, timed: bool, epochs: int) -> Scenario:
    """4 hosts at ``rate_mbit``; targets: DiLoCo with 4-bit pseudo-gradients reaches the
    accuracy with >= 100x fewer bytes than the best dense row (and, ``timed``, >= 3x sooner), and
    streaming with 4 fragments sends <= 1/3 of DiLoCo's largest exchange."""
    targets = [
        Target(LOWBAND_4BIT, "speedup", ">=", 100.0, ref=BEST_DENSE, figure="bytes_to_target"),
        Target(LOWBAND_STREAMING, "speedup", ">=", 3.0, ref=LOWBAND_DILOCO, figure="peak_exchange_bytes"),
    ]
    if timed:
        targets.append(Target(LOWBAND_4BIT, "speedup", ">=", 3.0, ref=BEST_DENSE, figure="time_to_target_s"))
    return Scenario(
        name=name,
        description=f"time to accuracy at low bandwidth: 4 hosts, {rate_mbit:g} Mbit/s, an MLP of five "
        "256-wide layers, DiLoCo and its variants against the dense and compressed baselines",
        workers=4,
        rate_mbit=rate_mbit,
        workload=LOWBAND_WORKLOAD,
        extra=("optim.schedule=step", "optim.step_size_epochs=4", "optim.gamma=0.5"),
        configs=LOWBAND_CONFIGS,
        targets=tuple(targets),
        kind="tta",
        epochs=epochs,
        target_acc=0.93,
        timeout_s=900.0,
    )


SCENARIOS: dict[str, Scenario] = {
    "quick": Scenario(
        name="quick",
        description="2 hosts, 100 Mbit/s, the digits MLP made wide (model.hidden=2048)",
        workers=2,
        rate_mbit=100.0,
        workload=WIDE_MLP_WORKLOAD,
        configs=f"{DENSE_CONFIGS},{DGC_ROW},ddp/powersgd,sync_easgd/none,sync_easgd/topk",
        targets=(
            Target(DGC_ROW, "efficiency", ">=", 0.8),
            Target("sync_easgd/topk", "efficiency", ">=", 0.8),
        ),
        steps=210,
        warmup_steps=10,
        timeout_s=300.0,
    ),
    "default": Scenario(
        name="default",
        description="4 hosts, 1 Gbit/s, AlexNet 64x64 on synthetic data",
        workers=4,
        rate_mbit=1000.0,
        workload=DEFAULT_WORKLOAD,
        configs=f"{DENSE_CONFIGS},{DGC_ROW},ddp/powersgd,sync_easgd/none,sync_easgd/topk",
        targets=(
            Target(DGC_ROW, "efficiency", ">=", 0.8),
            Target("ddp/powersgd", "efficiency", ">=", 0.8),
            Target("sync_easgd/topk", "efficiency", ">=", 0.8),
            Target(DGC_ROW, "speedup", ">=", 2.0, ref=BEST_DENSE),
        ),
        steps=8,
        warmup_steps=2,
        timeout_s=1200.0,
    ),
    "sc17": Scenario(
        name="sc17",
        description=(
            "4 hosts, the wide digits MLP, link rate calibrated so that easgd_round_robin "
            "spends >= 87% of its time communicating (SC17's baseline)"
        ),
        workers=4,
        rate_mbit=None,
        workload=WIDE_MLP_WORKLOAD,
        configs=f"{DENSE_CONFIGS},easgd_round_robin/none,{SC17_BLOCKING},{SC17_OVERLAPPED}",
        targets=(
            Target(
                "easgd_round_robin/none", "comm_bound", ">=", SC17_BASELINE_SHARE,
                note="the calibration: SC17's baseline",
            ),
            Target(SC17_OVERLAPPED, "speedup", ">=", 5.3, ref="easgd_round_robin/none"),
            Target(SC17_OVERLAPPED, "comm_share", "<=", 0.14),
            Target(SC17_OVERLAPPED, "of_bound", ">=", SC17_OF_BOUND, ref="easgd_round_robin/none"),
        ),
        steps=40,
        warmup_steps=10,
        timeout_s=600.0,
    ),
    "hierarchy": _comm_pairs(
        "hierarchy",
        "100 Mbit/s, the wide digits MLP: flat against comm.hierarchy=node for ddp, "
        "sync_easgd and local_sgd (tau 1)",
        100.0,
        WIDE_MLP_WORKLOAD,
        HIERARCHY_ROWS,
    ),
    "fusion": _comm_pairs(
        "fusion",
        "1 Gbit/s, an MLP of 48 small hidden layers: one message per tensor "
        "(comm.fusion_mb=0) against the 25 MiB lazy all-reduce",
        1000.0,
        MANY_SMALL_WORKLOAD,
        FUSION_ROWS,
    ),
    "plan": Scenario(
        name="plan",
        description=(
            "2 hosts, 100 Mbit/s, an MLP of mixed widths (model.hidden=[2048,256,32]): the "
            "SeCoPa planner against compressing every tensor and none, for topk and csc"
        ),
        workers=2,
        rate_mbit=100.0,
        workload=MIXED_WIDTH_WORKLOAD,
        configs=",".join((*DENSE_ROWS, *(row for pair in PLAN_ROWS for row in pair))),
        targets=tuple(
            target
            for every, planned in PLAN_ROWS
            for target in (
                Target(planned, "speedup", ">=", 1.0, ref=every, note="HiPress: the plan is never slower"),
                Target(planned, "speedup", ">=", 1.0, ref=BEST_DENSE),
            )
        ),
        steps=60,
        warmup_steps=10,
        timeout_s=300.0,
    ),
    "tta": Scenario(
        name="tta",
        description=(
            "time to accuracy: 4 hosts, 100 Mbit/s (ddp/none communication-bound), the wide "
            "digits MLP, lr halved every 4 epochs"
        ),
        workers=4,
        rate_mbit=100.0,
        workload=WIDE_MLP_WORKLOAD,
        extra=("optim.schedule=step", "optim.step_size_epochs=4", "optim.gamma=0.5"),
        configs=TTA_CONFIGS,
        targets=tuple(
            Target(spec, "speedup", ">=", 2.0, ref=BEST_DENSE, figure="time_to_target_s")
            for spec in TTA_CONFIGS.split(",")
            if spec not in DENSE_ROWS
        ),
        kind="tta",
        epochs=12,
        target_acc=0.95,
        timeout_s=600.0,
    ),
    "shards": Scenario(
        name="shards",
        description=(
            "8 hosts, 100 Mbit/s, the wide digits MLP: async_easgd with one parameter server "
            "(7 workers) against strategy.servers=4 (4 workers, 4 servers on their own hosts)"
        ),
        workers=8,
        rate_mbit=100.0,
        workload=WIDE_MLP_WORKLOAD,
        configs=f"{DENSE_CONFIGS},{SHARDS_ONE},{SHARDS_FOUR}",
        targets=(Target(SHARDS_FOUR, "speedup", ">=", 1.5, ref=SHARDS_ONE),),
        steps=60,
        warmup_steps=10,
        timeout_s=600.0,
    ),
    "optimus": Scenario(
        name="optimus",
        description=(
            "4 hosts, 100 Mbit/s, the tiny GPT pp=2 x dp=2 (recipes nlp3d/gpt_tiny_pp2 and "
            "gpt_tiny_pp2_dp2_optimus): pipeline_3d with compression=optimus_cc against uncompressed"
        ),
        workers=4,
        rate_mbit=100.0,
        workload=OPTIMUS_WORKLOAD,
        configs=f"{OPTIMUS_NONE},{OPTIMUS_CC}",
        targets=(
            Target(OPTIMUS_CC, "speedup", ">=", OPTIMUS_SPEEDUP, ref=OPTIMUS_NONE,
                   note="Optimus-CC: tokens/s, the same tokens per step"),
            Target(OPTIMUS_CC, "loss_gap", "<=", OPTIMUS_LOSS_GAP, ref=OPTIMUS_NONE,
                   note="issue 5's bound"),
        ),
        steps=30,
        warmup_steps=5,
        timeout_s=600.0,
        only_configs=True,
    ),
    "lowband": _lowband("lowband", 100.0, timed=False, epochs=16),
    # 12 epochs at 10 Mbit/s: ddp/none reaches 0.93 in about 10 and takes ~1.4 s a step
    "lowband10": _lowband("lowband10", 10.0, timed=True, epochs=12),
}
