"""One rank of a pipeline-engine training run (no Lightning), launched by the tests.

Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK from the environment,
trains the tiny GPT with :class:`OptimusPipelineEngine` for ``--steps`` steps once per
entry of ``--runs`` (a JSON list of ``{"name": ..., "optimus": {...} | null}``; each run
starts from the same seed with a fresh model, engine and meter) and writes
``rank{R}.json`` = ``{name: {losses, meter snapshot, pipeline counters}}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--runs", type=str, default='[{"name": "base", "optimus": null}]')
    ap.add_argument("--out", type=str, required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from easgd_lightning.comm.meter import get_meter
    from easgd_lightning.data.text import TextDataModule
    from easgd_lightning.hooks.optimus_cc import OptimusCCConfig
    from easgd_lightning.models.gpt import GPTConfig, build_gpt_pipeline
    from easgd_lightning.parallel.engine import build_pipeline_engine, deepspeed_config

    topo = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=args.dp)
    cfg = GPTConfig(
        seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model
    )
    dm = TextDataModule(seq_len=args.seq_len, batch_size=args.micro_batch_size, max_bytes=1 << 20)
    dm.setup()
    dp_rank = topo.get_coord(dist.get_rank()).data
    results = {}
    for run in json.loads(args.runs):
        module, _ = build_gpt_pipeline(cfg, topo, base_seed=args.seed)
        optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
        optimus = OptimusCCConfig.from_mapping(run["optimus"]) if run.get("optimus") else None
        engine = build_pipeline_engine(
            module,
            optimizer=optimizer,
            config=deepspeed_config(
                micro_batch_size=args.micro_batch_size, micro_batches=args.micro_batches, dp=args.dp
            ),
            optimus=optimus,
        )
        sampler = torch.utils.data.DistributedSampler(
            dm._train, num_replicas=args.dp, rank=dp_rank, shuffle=True, seed=args.seed
        )
        loader = torch.utils.data.DataLoader(
            dm._train, batch_size=args.micro_batch_size, sampler=sampler, drop_last=True
        )
        dist.barrier()
        get_meter().reset()
        it = iter(loader)
        losses = []
        start = time.perf_counter()
        for _ in range(args.steps):
            losses.append(float(engine.train_batch(it)))
        wall = time.perf_counter() - start
        results[run["name"]] = {
            "rank": dist.get_rank(),
            "stage": engine.stage_id,
            "losses": losses,
            "wall_s": wall,
            "tokens": args.steps * args.micro_batches * args.micro_batch_size * args.dp * args.seq_len,
            "meter": get_meter().snapshot(),
            "pipe_stats": dict(engine.pipe_stats),
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
