"""One rank of the tensor-parallel equivalence check, launched by the tests.

Builds the tiny GPT split over ``WORLD_SIZE`` tensor-parallel ranks (gloo), runs one
forward and backward on a fixed batch and saves the logits, the loss and every
parameter's gradient (this rank's shard) to ``--out/rank{R}.pt``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from easgd_lightning.comm.meter import get_meter
    from easgd_lightning.models.gpt import GPT, GPTConfig, gpt_loss
    from easgd_lightning.parallel.tensor_parallel import TensorParallelContext

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32)
    tp = TensorParallelContext(size=world, rank=rank, group=dist.group.WORLD)
    model = GPT(cfg, tp, base_seed=args.seed)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (3, cfg.seq_len), generator=gen)
    labels = torch.randint(0, 256, (3, cfg.seq_len), generator=gen)
    logits = model(tokens)
    loss = gpt_loss(logits, labels)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    torch.save(
        {
            "logits": logits.detach(),
            "loss": loss.detach(),
            "grads": grads,
            "tokens": tokens,
            "labels": labels,
            "tp_bytes": get_meter().snapshot()["by_kind"].get("tensor_parallel", {}),
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
