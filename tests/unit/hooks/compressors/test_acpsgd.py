"""acpsgd (ACP-SGD, ICDCS 2023) against a single-process float64 reference of the
alternating rule, run by two in-process ranks (threads meeting at a barrier)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from easgd_lightning.hooks import build_compressor


class ThreadRanks:
    """``world`` ranks in threads of one process; all_reduce_sum, all_gather and all_to_all
    meet at a barrier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._slots: list = [None] * world
        self.sent_bytes = [0] * world

    def collective(self, rank: int):
        outer = self

        class _C:
            world_size = outer.world

            def __init__(self):
                self.rank = rank

            def all_gather(self, tensors):
                outer.sent_bytes[rank] += sum(t.numel() * t.element_size() for t in tensors)
                outer._slots[rank] = [t.clone() for t in tensors]
                outer._barrier.wait()
                out = [[t.clone() for t in outer._slots[r]] for r in range(outer.world)]
                outer._barrier.wait()
                return out

            def all_to_all(self, sends):
                """sends[j] to rank j; counted: the pieces for the other ranks."""
                outer.sent_bytes[rank] += sum(t.numel() * t.element_size() for j, t in enumerate(sends) if j != rank)
                outer._slots[rank] = [t.clone() for t in sends]
                outer._barrier.wait()
                out = [outer._slots[r][rank].clone() for r in range(outer.world)]
                outer._barrier.wait()
                return out

            def all_reduce_sum(self, tensors):
                outer.sent_bytes[rank] += sum(t.numel() * t.element_size() for t in tensors)
                outer._slots[rank] = [t.clone() for t in tensors]
                outer._barrier.wait()
                out = [sum(outer._slots[r][i] for r in range(outer.world)) for i in range(len(tensors))]
                outer._barrier.wait()
                return out

        return _C()

    def run(self, fn):
        results = [None] * self.world
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(r))) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results


def orth(a):
    q, _ = np.linalg.qr(a)
    return q


def reference_acp(mats_per_step, q0):
    """The rule with error feedback, every rank in one loop: P steps and Q steps alternate."""
    world = len(mats_per_step[0])
    errs = [np.zeros_like(mats_per_step[0][0]) for _ in range(world)]
    q, p = q0, None
    means = []
    for t, mats in enumerate(mats_per_step):
        comp = [m + e for m, e in zip(mats, errs)]
        if t % 2 == 0:
            q = orth(q)
            parts = [c @ q for c in comp]
            p = sum(parts) / world
            locals_ = [pi @ q.T for pi in parts]
            means.append(p @ q.T)
        else:
            p = orth(p)
            parts = [c.T @ p for c in comp]
            q = sum(parts) / world
            locals_ = [p @ qi.T for qi in parts]
            means.append(p @ q.T)
        errs = [c - lo for c, lo in zip(comp, locals_)]
    return means, errs


def test_alternating_rule_against_the_reference_and_half_the_bytes():
    world, steps, shape, rank = 2, 6, (40, 30), 3
    rng = np.random.default_rng(0)
    mats = [[rng.standard_normal(shape) for _ in range(world)] for _ in range(steps)]
    comp = build_compressor("acpsgd", rank=rank, min_numel=0)
    q0 = comp._initial_q(shape[1], rank, {}, torch.zeros(shape, dtype=torch.float64)).numpy()
    ref_means, ref_errs = reference_acp(mats, q0)
    ranks = ThreadRanks(world)

    def worker(r):
        st, err, out = {}, torch.zeros(shape, dtype=torch.float64), []
        coll = ranks.collective(r)
        for t in range(steps):
            x = torch.tensor(mats[t][r]) + err
            mean, local = comp.aggregate(x, st, coll)
            err = x - local
            out.append(mean.clone())
        return out, err

    results = ranks.run(worker)
    for r in range(world):
        means, err = results[r]
        for t in range(steps):
            np.testing.assert_allclose(means[t].numpy(), ref_means[t], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(err.numpy(), ref_errs[r], rtol=1e-9, atol=1e-9)
    # bytes: P steps send n r, Q steps m r; two steps = one PowerSGD step (n + m) r
    per_two_steps = (shape[0] + shape[1]) * rank * 8
    assert ranks.sent_bytes == [steps // 2 * per_two_steps] * world
    psgd_bytes = ThreadRanks(world)

    def powersgd_worker(r):
        st, coll = {}, psgd_bytes.collective(r)
        psgd = build_compressor("powersgd", rank=rank, min_numel=0)
        for t in range(steps):
            psgd.aggregate(torch.tensor(mats[t][r]), st, coll)

    psgd_bytes.run(powersgd_worker)
    assert [2 * b for b in ranks.sent_bytes] == psgd_bytes.sent_bytes


def test_vectors_travel_dense():
    comp = build_compressor("acpsgd")
    ranks = ThreadRanks(2)
    xs = [torch.arange(5.0), torch.ones(5)]
    out = ranks.run(lambda r: comp.aggregate(xs[r], {}, ranks.collective(r)))
    for mean, _local in out:
        torch.testing.assert_close(mean, (xs[0] + xs[1]) / 2)
    torch.testing.assert_close(out[1][1], xs[1])
