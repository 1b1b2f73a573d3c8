"""One rank of the fused multi-round exchange checks (``rounds_segments``: sgc, adaptive).

Usage: fused_rounds_run.py OUT SCENARIO[,SCENARIO...]   (sgc | adaptive)

Each scenario runs the per-tensor exchange (side a) and the fused exchange (side b) on the
same inputs for several steps and records, per step, whether the means, the residuals and
each tensor's own codec state are bitwise equal; at ``RESUME`` the fused side restarts from
the per-tensor side's checkpointed states (per-tensor states, joined on first use).
"""

import math

import torch

from easgd_lightning.comm.meter import get_meter
from easgd_lightning.hooks import build_compressor, make_memory
from easgd_lightning.hooks._exchange import exchange_tensors, key_hash
from easgd_lightning.hooks._fused import layout_for, start_exchange_flat
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.utils.checkpoint import from_plain, to_plain
from tests.helpers import run_rank_scenarios

#: dense (< 100 entries) and compressed tensors interleaved; 150 entries: a sample of its own
#: size under sgc's sample_size 256 (a second row length)
SHAPES = [(10,), (40, 30), (30,), (20, 60), (700,), (5,), (150,)]
SIZES = [math.prod(s) for s in SHAPES]
KEYS = [f"t{j}" for j in range(len(SHAPES))]
BIG = [j for j, n in enumerate(SIZES) if n >= 100]
STEPS, RESUME = 7, 4
SGC_FIELDS = ("step", "skipped", "allowed", "aggregations", "last_similarity", "last_aggregated")


def _inputs(rank: int, step: int, noise) -> torch.Tensor:
    """Every tensor a part common to the ranks plus noise of its own per rank (``noise[j]``
    at this step: the similarity of tensor j falls as it grows)."""
    common = torch.Generator().manual_seed(1000 + step)
    own = torch.Generator().manual_seed(10 * rank + step)
    parts = [torch.randn(n, generator=common) + noise(j, step) * torch.randn(n, generator=own)
             for j, n in enumerate(SIZES)]
    return torch.cat(parts)


def _run(name, comp_a, comp_b, rank, noise, fields, before_step=None) -> dict:
    mem_a, mem_b = make_memory(comp_a), make_memory(comp_b)
    states_a, states_b = {}, {}
    coll_a = ProcessGroupCollective(kind=f"rounds_a_{name}")
    coll_b = ProcessGroupCollective(kind=f"rounds_b_{name}")
    rec = {"mean_equal": [], "residual_equal": [], "own_equal": [], "own": [], "scale": [], "local_equal": [],
           "calls": []}
    for step in range(STEPS):
        if before_step is not None:
            before_step(step, comp_a, comp_b)
        if step == RESUME:  # the fused side resumes from the per-tensor side's checkpoint
            states_b = from_plain(to_plain(states_a, "states"))
            mem_b.load_state_dict(mem_a.state_dict())
            comp_b.load_state_dict(comp_a.state_dict())
        flat = _inputs(rank, step, noise)
        pieces = [p.view(s) for p, s in zip(torch.split(flat.clone(), SIZES), SHAPES)]
        mine_a: list = []
        means_a, _ = exchange_tensors(pieces, KEYS, comp_a, mem_a, states_a, coll_a, locals_out=mine_a)
        layout = layout_for(states_b, SHAPES, KEYS, 100)
        out = torch.full_like(flat, float("nan"))  # every entry must be written
        calls = get_meter().by_kind[coll_b.kind].calls
        mean_b, mine_b, _ = start_exchange_flat(flat.clone(), layout, comp_b, mem_b, states_b, coll_b,
                                                want_local=True, out=out).finish()
        rec["calls"].append(get_meter().by_kind[coll_b.kind].calls - calls)
        rec["mean_equal"].append(torch.equal(torch.cat([m.reshape(-1) for m in means_a]), mean_b))
        rec["local_equal"].append(torch.equal(torch.cat([m.reshape(-1) for m in mine_a]), mine_b))
        res = [(mem_a.residual(KEYS[j]), mem_b.residual(KEYS[j])) for j in BIG]
        rec["residual_equal"].append(all((a is None and b is None) or torch.equal(a, b) for a, b in res))
        group = next(v for k, v in states_b.items() if k.startswith("fused:"))
        per_a = [{f: states_a[KEYS[j]].get(f) for f in fields} for j in BIG]
        per_b = [{f: st.get(f) for f in fields} for st in group.get("segment_states", [group] * len(BIG))]
        rec["own_equal"].append(per_a == per_b)
        rec["own"].append(per_b)
        rec["scale"].append(float(mean_b.abs().max()))
    return rec


def scenario_sgc(rank: int, world: int) -> dict:
    """Tensor 1 agrees across ranks (skips, up to max_skip), tensor 3 only at step 5 (else
    aggregates), tensors 4 and 6 on some steps only (their decisions change); at step 5
    every tensor skips (no second all-reduce)."""
    levels = {1: [0.05] * STEPS, 3: [2.0] * 5 + [0.05, 2.0], 4: [0.05, 2.0, 0.05, 0.05, 2.0, 0.05, 0.05],
              6: [2.0, 0.05, 0.05, 2.0, 2.0, 0.05, 2.0]}
    noise = lambda j, step: levels.get(j, [1.0] * STEPS)[step]  # noqa: E731
    out = {}
    for name, params in (("sgc", {}), ("sgc_memory", {"memory": True})):
        a, b = (build_compressor("sgc", threshold=0.9, max_skip=2, sample_size=256, min_numel=100, **params)
                for _ in range(2))
        out[name] = _run(name, a, b, rank, noise, SGC_FIELDS)
    return out


def scenario_adaptive(rank: int, world: int) -> dict:
    """A fixed link and compute time: N = 3250 entries, B * T = 2600 gives ratio
    2600 / (2 * 8) / 3250 = 0.05 (sparse); B * T = 1e5 sends dense (2 * 13000 / B <= T).
    Both sides start knowing every tensor's size (a resumed run's state)."""
    numels = {key_hash(KEYS[j]): SIZES[j] for j in BIG}
    dense_steps = (2, 5)

    def before_step(step, comp_a, comp_b):
        for comp in (comp_a, comp_b):
            comp.bandwidth = 1e7 if step in dense_steps else 2.6e5

    out = {}
    for name, params in (("adaptive", {"sample_size": 500}), ("adaptive_exact", {"exact": True}),
                         ("adaptive_nomem", {"memory": False})):
        comps = []
        for _ in range(2):
            comp = build_compressor("adaptive", compute_time=0.01, bandwidth=2.6e5, min_numel=100, **params)
            comp.load_state_dict({"numels": numels})
            comps.append(comp)
        rec = _run(name, *comps, rank, lambda j, step: 1.0, ("ratio",), before_step)
        rec["last_ratio"] = comps[1].last_ratio
        out[name] = rec
    return out


def main() -> None:
    run_rank_scenarios(lambda name, rank, world, _out: globals()[f"scenario_{name}"](rank, world))


if __name__ == "__main__":
    main()
