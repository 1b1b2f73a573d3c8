"""Does two-way compression rescue AdamW where one-way compression of the same ratio fails?

A single-process replay of ``p`` data-parallel workers on digits (the default MLP,
64-128-10, each worker a fixed 1/p of the training set, batch per worker), written
independently of the package's hooks so that it checks the claim, not the code. Per tensor
and step, with C a compressor (top-k at density r, or EF-signSGD's scaled sign
``(||x||_1 / n) sign(x)``):

  dense:    AdamW gets (1/p) sum_i g_i
  one-way:  p_i = g_i + e_i, c_i = C(p_i), e_i <- p_i - c_i; AdamW gets m = (1/p) sum_i c_i
  two-way:  the same m, then per shard j (entries [j n/p, (j+1) n/p)) q_j = m_j + f_j,
            d_j = C(q_j), f_j <- q_j - d_j; AdamW gets the concatenated d_j
            (Zhong et al. 2021's second, owner-side residual; our ``compression.two_way``)

Usage::

    .venv/bin/python bench/two_way_adam_sim.py          # 2 and 4 workers, lr 0.001 / 0.003, 10 epochs
    .venv/bin/python bench/two_way_adam_sim.py --worlds 2 --lrs 0.003,0.01,0.03 --epochs 5 \
        --compressors topk@0.01,topk@0.001,topk@0.0001,sign

Prints one markdown table: final validation accuracy per (world, lr, compressor), dense /
one-way / two-way.
"""

from __future__ import annotations

import argparse
import math

import torch


def topk(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """x with all but its ceil(ratio n) largest-magnitude entries zeroed."""
    out = torch.zeros_like(x)
    idx = x.abs().topk(max(1, math.ceil(ratio * x.numel()))).indices
    out[idx] = x[idx]
    return out


def scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """EF-signSGD's compressor: (||x||_1 / n) sign(x)."""
    return x.abs().mean() * torch.sign(x)


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def run(mode: str, compress, world: int, lr: float, epochs: int, batch: int, seed: int, data) -> float:
    """Final validation accuracy of one run (mode: dense | one | two)."""
    xtr, xva, ytr, yva = data
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    shards = [torch.arange(r, len(xtr), world) for r in range(world)]
    e = [[torch.zeros(q.numel()) for q in params] for _ in range(world)]
    f = [torch.zeros(q.numel()) for q in params]
    for _ in range(epochs):
        perms = [s[torch.randperm(len(s))] for s in shards]
        for it in range(len(shards[0]) // batch):
            grads = []
            for r in range(world):
                b = perms[r][it * batch:(it + 1) * batch]
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(xtr[b]), ytr[b]).backward()
                grads.append([q.grad.reshape(-1).clone() for q in params])
            for t, q in enumerate(params):
                if mode == "dense":
                    agg = sum(g[t] for g in grads) / world
                else:
                    sent = []
                    for r in range(world):
                        p = grads[r][t] + e[r][t]
                        c = compress(p)
                        e[r][t] = p - c
                        sent.append(c)
                    agg = sum(sent) / world
                    if mode == "two":
                        n = agg.numel()
                        for j in range(world):
                            lo, hi = j * n // world, (j + 1) * n // world
                            qj = agg[lo:hi] + f[t][lo:hi]
                            dj = compress(qj)
                            f[t][lo:hi] = qj - dj
                            agg[lo:hi] = dj
                q.grad = agg.reshape(q.shape).clone()
            opt.step()
    with torch.no_grad():
        return (model(xva).argmax(1) == yva).float().mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--lrs", default="0.001,0.003")
    ap.add_argument("--compressors", default="topk@0.01,topk@0.001,sign")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = digits()
    print(f"digits, AdamW, batch {args.batch_size} per worker, {args.epochs} epochs, seed {args.seed}\n")
    print("| workers | lr | compressor | dense | one-way | two-way | two-way - one-way |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for world in map(int, args.worlds.split(",")):
        for lr in map(float, args.lrs.split(",")):
            dense = run("dense", None, world, lr, args.epochs, args.batch_size, args.seed, data)
            for name in args.compressors.split(","):
                if name == "sign":
                    comp = scaled_sign
                else:
                    ratio = float(name.split("@")[1])
                    comp = lambda x, r=ratio: topk(x, r)  # noqa: E731
                one = run("one", comp, world, lr, args.epochs, args.batch_size, args.seed, data)
                two = run("two", comp, world, lr, args.epochs, args.batch_size, args.seed, data)
                print(f"| {world} | {lr:g} | {name} | {dense:.4f} | {one:.4f} | {two:.4f} | {two - one:+.4f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
