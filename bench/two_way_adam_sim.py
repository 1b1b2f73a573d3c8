"""Does two-way compression rescue AdamW where one-way compression of the same ratio fails?

A single-process replay of ``p`` data-parallel workers on digits (the default MLP,
64-128-10, each worker a fixed 1/p of the training set, batch per worker), written
independently of the package's hooks so that it checks the claim, not the code. Per tensor
and step, with C_d top-k at density d (the ceil(d n) largest magnitudes of what it gets)
and shard j the entries [j n/p, (j+1) n/p):

  dense:    AdamW gets (1/p) sum_i g_i
  one-way:  p_i = g_i + e_i, c_i = C_d(p_i), e_i <- p_i - c_i; AdamW gets (1/p) sum_i c_i
  two-way:  p_i = g_i + e_i, c_i^j = C_d(p_i[shard j]) for every j, e_i <- p_i - concat_j c_i^j;
            owner j: m_j = (1/p) sum_i c_i^j, q_j = m_j + f_j, d_j = C_d(q_j), f_j <- q_j - d_j;
            AdamW gets concat_j d_j  (Zhong et al. 2021 on a ring: a reduce-scatter of
            compressed shards, then an all-gather of the owners' compressed shards; our
            ``compression.two_way``)

Wire bytes per rank with ring collectives, k = d n entries of (value, index) = 2 words:
one-way all-gathers whole payloads, (p - 1) 2k words; two-way sends the other owners'
pieces, about 2k (p - 1)/p, and forwards (p - 1) shards of the all-gather, 2k (p - 1)/p
again: about 4k (p - 1)/p. So one-way at density 2d/p costs two-way's bytes at d (the
"equal wire" column).

Usage::

    .venv/bin/python -m bench.two_way_adam_sim    # 4 and 8 workers, lr 0.003 / 0.01,
                                                  # d 1% / 0.1%, 20 epochs, batch 8, seeds 0, 1

Prints one markdown table: final validation accuracy per (workers, lr, d), the mean over
the seeds, for dense, one-way at d, one-way at 2d/p and two-way at d.
"""

from __future__ import annotations

import argparse
import math

import torch


def topk(x: torch.Tensor, density: float) -> torch.Tensor:
    """x with all but its ceil(density n) largest-magnitude entries zeroed."""
    out = torch.zeros_like(x)
    if x.numel():
        idx = x.abs().topk(max(1, math.ceil(density * x.numel()))).indices
        out[idx] = x[idx]
    return out


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def shard_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of every owner's shard: entries [j n/p, (j+1) n/p)."""
    return [(j * n // world, (j + 1) * n // world) for j in range(world)]


def upload(grads: list[torch.Tensor], e: list[torch.Tensor], density: float, bounds) -> torch.Tensor:
    """(1/p) sum_i of each worker's compressed p_i = g_i + e_i, C_d applied per [a, b) of
    ``bounds``; every e_i becomes p_i minus what it sent."""
    total = torch.zeros_like(grads[0])
    for i, g in enumerate(grads):
        p = g + e[i]
        sent = torch.cat([topk(p[a:b], density) for a, b in bounds])
        e[i] = p - sent
        total += sent
    return total / len(grads)


def send_back(mean: torch.Tensor, f: torch.Tensor, density: float, bounds) -> torch.Tensor:
    """Every owner's d_j = C_d(m_j + f_j), concatenated; f <- q - d, shard by shard."""
    out = torch.empty_like(mean)
    for a, b in bounds:
        q = mean[a:b] + f[a:b]
        out[a:b] = topk(q, density)
        f[a:b] = q - out[a:b]
    return out


def run(mode: str, density: float, world: int, lr: float, epochs: int, batch: int, seed: int, data) -> float:
    """Final validation accuracy of one run (mode: dense | one | two)."""
    xtr, xva, ytr, yva = data
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    parts = [torch.arange(r, len(xtr), world) for r in range(world)]
    e = [[torch.zeros(q.numel()) for _ in range(world)] for q in params]
    f = [torch.zeros(q.numel()) for q in params]
    for _ in range(epochs):
        perms = [s[torch.randperm(len(s))] for s in parts]
        for it in range(len(parts[0]) // batch):
            grads = []
            for r in range(world):
                b = perms[r][it * batch:(it + 1) * batch]
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(xtr[b]), ytr[b]).backward()
                grads.append([q.grad.reshape(-1).clone() for q in params])
            for t, q in enumerate(params):
                mine = [g[t] for g in grads]
                n = q.numel()
                if mode == "dense":
                    agg = sum(mine) / world
                elif mode == "one":
                    agg = upload(mine, e[t], density, [(0, n)])
                else:
                    bounds = shard_bounds(n, world)
                    agg = send_back(upload(mine, e[t], density, bounds), f[t], density, bounds)
                q.grad = agg.reshape(q.shape).clone()
            opt.step()
    with torch.no_grad():
        return (model(xva).argmax(1) == yva).float().mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--lrs", default="0.003,0.01")
    ap.add_argument("--densities", default="0.01,0.001")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = digits()
    seeds = [int(s) for s in args.seeds.split(",")]

    def mean_acc(mode, density, world, lr):
        accs = [run(mode, density, world, lr, args.epochs, args.batch_size, s, data) for s in seeds]
        return sum(accs) / len(accs)

    print(f"digits, AdamW, batch {args.batch_size} per worker, {args.epochs} epochs, "
          f"mean of seeds {args.seeds}\n")
    print("| workers | lr | d | dense | one-way @ d | one-way @ 2d/p (equal wire) | two-way @ d |"
          " two-way - equal-wire one-way |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in map(int, args.worlds.split(",")):
        for lr in map(float, args.lrs.split(",")):
            dense = mean_acc("dense", 1.0, world, lr)
            for d in map(float, args.densities.split(",")):
                one = mean_acc("one", d, world, lr)
                equal = mean_acc("one", 2 * d / world, world, lr)
                two = mean_acc("two", d, world, lr)
                print(f"| {world} | {lr:g} | {d:g} | {dense:.4f} | {one:.4f} | {equal:.4f} (d = {2 * d / world:g})"
                      f" | {two:.4f} | {two - equal:+.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
