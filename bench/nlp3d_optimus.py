"""Optimus-CC on the tiny GPT, pp=2 x dp=2 on CPU: tokens/s and bytes per step by kind.

Runs every variant in the same four processes, one after another, from the same seed and
data order (DeepSpeed's PipelineEngine over gloo, easgd_lightning's metered engine), and
prints one markdown table: throughput as a ratio to the uncompressed baseline measured in
the same run, and bytes per optimizer step (summed over the four ranks) for each traffic
kind. Timings on a shared 2-core machine are noisy; the byte counts are exact.

    python -m bench.nlp3d_optimus                # 4 processes, 30 steps per variant
    python -m bench.nlp3d_optimus --steps 60 --out bench/results/nlp3d_optimus.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

VARIANTS: dict[str, dict | None] = {
    "none": None,
    "CB": {"compressed_backprop": True, "lazy_error_propagation": False, "fused_embedding": False,
           "selective_stages": "none"},
    "CB+LEP": {"compressed_backprop": True, "lazy_error_propagation": True,
               "fused_embedding": False, "selective_stages": "none"},
    "CB+LEP epilogue-only": {"compressed_backprop": True, "lazy_error_propagation": True,
                             "epilogue_only": True, "fused_embedding": False,
                             "selective_stages": "none"},
    "FE": {"compressed_backprop": False, "fused_embedding": True, "selective_stages": "none"},
    "SC (auto)": {"compressed_backprop": False, "fused_embedding": False,
                  "selective_stages": "auto"},
    "CB+LEP+FE+SC": {"compressed_backprop": True, "lazy_error_propagation": True,
                     "fused_embedding": True, "selective_stages": "auto"},
}
KINDS = ("pipeline", "data_parallel", "embedding", "tensor_parallel")


def _rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from easgd_lightning.comm.meter import get_meter
    from easgd_lightning.data.text import TextDataModule
    from easgd_lightning.hooks.optimus_cc import OptimusCCConfig
    from easgd_lightning.models.gpt import GPTConfig, build_gpt_pipeline
    from easgd_lightning.parallel.engine import build_pipeline_engine, deepspeed_config

    topo = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=1, num_dp=args.dp)
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=4, d_model=args.d_model)
    dm = TextDataModule(seq_len=args.seq_len, batch_size=args.micro_batch_size, max_bytes=1 << 20)
    dm.setup()
    dp_rank = topo.get_coord(dist.get_rank()).data
    results = {}
    for name, params in VARIANTS.items():
        optimus = None
        if params is not None:
            optimus = OptimusCCConfig.from_mapping({"rank": args.rank, "dp_rank": args.dp_rank, **params})
        module, _ = build_gpt_pipeline(cfg, topo, base_seed=1234)
        engine = build_pipeline_engine(
            module,
            optimizer=torch.optim.AdamW(module.parameters(), lr=3e-3),
            config=deepspeed_config(micro_batch_size=args.micro_batch_size,
                                    micro_batches=args.micro_batches, dp=args.dp),
            optimus=optimus,
        )
        sampler = torch.utils.data.DistributedSampler(dm._train, num_replicas=args.dp,
                                                      rank=dp_rank, shuffle=True, seed=1234)
        it = iter(torch.utils.data.DataLoader(dm._train, batch_size=args.micro_batch_size,
                                              sampler=sampler, drop_last=True))
        engine.train_batch(it)  # warm-up step, not timed or metered
        dist.barrier()
        get_meter().reset()
        start = time.perf_counter()
        losses = [float(engine.train_batch(it)) for _ in range(args.steps)]
        dist.barrier()
        wall = time.perf_counter() - start
        results[name] = {"losses": losses, "wall_s": wall,
                         "by_kind": get_meter().snapshot()["by_kind"]}
    Path(args.out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    world = args.pp * args.dp
    from easgd_lightning.utils.rank_env import clean_env, free_port, rank_env

    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(clean_env(repo=REPO, DS_ACCELERATOR="cpu"), rank, world, port)
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.nlp3d_optimus", *argv, "--rank-worker"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode:
            raise SystemExit(f"rank failed:\n{err[-4000:]}")
    return [json.loads(Path(args.out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def _table(args: argparse.Namespace, ranks: list[dict]) -> str:
    tokens = args.steps * args.micro_batches * args.micro_batch_size * args.dp * args.seq_len
    base_wall = max(r["none"]["wall_s"] for r in ranks)
    base_loss = ranks[0]["none"]["losses"]
    lines = [
        f"pp={args.pp} dp={args.dp}, GPT {args.n_layer} layers d_model={args.d_model}, "
        f"seq {args.seq_len}, {args.micro_batches} micro-batches x {args.micro_batch_size}, "
        f"{args.steps} steps, CB rank {args.rank}, DP PowerSGD rank {args.dp_rank}.",
        "Bytes: sent per optimizer step, summed over all ranks. Loss: mean of the last 5 steps.",
        "",
        "| Optimus-CC | tokens/s | x none | pipeline B/step | data_parallel B/step | "
        "embedding B/step | total B/step | x none bytes | loss (last 5) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_total = None
    for name in VARIANTS:
        wall = max(r[name]["wall_s"] for r in ranks)
        per_kind = {k: sum(r[name]["by_kind"].get(k, {}).get("bytes_sent", 0) for r in ranks)
                    / args.steps for k in KINDS}
        total = sum(per_kind.values())
        base_total = base_total or total
        loss = sum(ranks[0][name]["losses"][-5:]) / 5
        lines.append(
            f"| {name} | {tokens / wall:,.0f} | {base_wall / wall:.2f} | "
            f"{per_kind['pipeline']:,.0f} | {per_kind['data_parallel']:,.0f} | "
            f"{per_kind['embedding']:,.0f} | {total:,.0f} | {total / base_total:.3f} | {loss:.3f} |"
        )
    lines.append("")
    lines.append(f"(uncompressed loss, last 5 steps: {sum(base_loss[-5:]) / 5:.3f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dp-rank", type=int, default=8)
    ap.add_argument("--out", type=str, default="")
    ap.add_argument("--out-dir", type=str, default="")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        _rank_main(args)
        return
    import tempfile

    argv = [a for a in sys.argv[1:] if a != "--rank-worker"]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.out_dir:
            args.out_dir = tmp
            argv += ["--out-dir", tmp]
        table = _table(args, _launch(args, argv))
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
