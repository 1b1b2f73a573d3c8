"""SeCoPa planner (hooks/planner.py): the least-squares fit recovers exact lines, and the
plan's decisions equal a reference model written out here from the module docstring's
formulas (brute force over the partition counts), from the same coefficients."""

from __future__ import annotations

import itertools

import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks._exchange import rounds_of, split_partitions
from easgd_lightning.hooks.planner import (
    CostModel,
    Line,
    TensorSpec,
    check_plan_options,
    fit_line,
    make_plan,
    probe_sizes,
)


@pytest.mark.parametrize("a,b", [(0.5, 0.25), (1e-4, 3e-9), (-2.0, 7.0), (0.0, 0.0)])
def test_fit_line_recovers_an_exact_line(a, b):
    xs = [4096.0, 16384.0, 65536.0, 262144.0, 1048576.0]
    fit = fit_line(xs, [a + b * x for x in xs])
    assert fit.a == pytest.approx(a, rel=1e-9, abs=1e-12)
    assert fit.b == pytest.approx(b, rel=1e-9, abs=1e-15)


def test_fit_line_is_the_least_squares_solution_on_noisy_points():
    gen = torch.Generator().manual_seed(0)
    xs = torch.linspace(1, 100, 30, dtype=torch.float64)
    ys = 3.0 + 0.5 * xs + torch.randn(30, generator=gen, dtype=torch.float64)
    fit = fit_line(xs.tolist(), ys.tolist())
    design = torch.stack([torch.ones_like(xs), xs], dim=1)
    ref = torch.linalg.lstsq(design, ys.unsqueeze(1)).solution.squeeze(1)
    assert fit.a == pytest.approx(ref[0].item(), rel=1e-9)
    assert fit.b == pytest.approx(ref[1].item(), rel=1e-9)


def test_fit_line_refuses_degenerate_input():
    with pytest.raises(ValueError, match="two different x"):
        fit_line([2.0, 2.0], [1.0, 3.0])
    with pytest.raises(ValueError, match=">= 2"):
        fit_line([1.0], [1.0])


def _reference_decision(c: CostModel, shape, esize, min_numel, max_partitions, min_part):
    """The plan of one tensor written out independently: every K = 2^i allowed, the
    pipeline formula, strict improvement over dense."""
    n = 1
    for s in shape:
        n *= s
    dense_t = c.send_dense.a + c.send_dense.b * n * esize
    if n < min_numel:
        return (False, 1)
    rows = shape[0] if len(shape) >= 2 else n
    best = None
    for i in range(0, 20):
        k = 2**i
        if k > 1 and (k > max_partitions or k > rows or n / k < min_part):
            break
        m = n / k
        enc = c.encode.a + c.encode.b * m
        pay = c.payload.a + c.payload.b * m
        snd = c.rounds * c.send_payload.a + c.send_payload.b * max(pay, 0.0)
        dec = (c.world if c.aggregation == "allgather" else 1) * (c.decode.a + c.decode.b * m)
        total = enc + snd + dec + (k - 1) * max(enc, snd, dec)
        if best is None or total < best[0]:
            best = (total, k)
    return (True, best[1]) if best[0] < dense_t else (False, 1)


COSTS = [
    # slow link, cheap codec: compress, pipelined
    CostModel(Line(1e-4, 8e-8), Line(1e-4, 8e-8), Line(2e-5, 4e-9), Line(1e-5, 1e-9), Line(8, 0.08), world=4),
    # fast link, costly codec: dense
    CostModel(Line(5e-5, 8e-10), Line(5e-5, 8e-10), Line(3e-4, 5e-8), Line(1e-4, 2e-8), Line(8, 0.08), world=4),
    # latency-heavy collectives: compress but do not split
    CostModel(Line(2e-3, 8e-8), Line(2e-3, 8e-8), Line(1e-6, 1e-9), Line(1e-6, 1e-9), Line(8, 0.02), world=2),
    # all-reduce payloads (decode once, two rounds)
    CostModel(
        Line(1e-4, 8e-9), Line(1e-4, 8e-9), Line(1e-5, 6e-9), Line(1e-5, 6e-9), Line(0, 0.3), world=8,
        aggregation="allreduce", rounds=2,
    ),
]

SHAPES = [(10,), (4096,), (256, 64), (1024, 1024), (4096, 1024), (3, 100000), (64, 3, 3, 3), (2048, 2048)]


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("min_numel,max_partitions,min_part", [(16384, 8, 16384), (0, 16, 1024), (1 << 20, 4, 4096)])
def test_plan_equals_the_reference_model(costs, min_numel, max_partitions, min_part):
    specs = [TensorSpec(f"t{i}", s, 4) for i, s in enumerate(SHAPES)]
    plan = make_plan(costs, specs, min_numel=min_numel, max_partitions=max_partitions, min_partition_numel=min_part)
    for spec in specs:
        d = plan.get(spec.key)
        assert (d.compress, d.partitions) == _reference_decision(
            costs, spec.shape, 4, min_numel, max_partitions, min_part
        ), spec


def test_the_cases_cover_every_kind_of_decision():
    seen = set()
    for costs, (mn, mp, part) in itertools.product(COSTS, [(16384, 8, 16384), (0, 16, 1024)]):
        plan = make_plan(costs, [TensorSpec(f"t{i}", s) for i, s in enumerate(SHAPES)], min_numel=mn,
                         max_partitions=mp, min_partition_numel=part)
        seen |= {(d.compress, d.partitions > 1) for d in plan.decisions.values()}
    assert seen == {(False, False), (True, False), (True, True)}


def test_small_tensors_travel_dense_and_summary_counts():
    plan = make_plan(COSTS[0], [TensorSpec("b", (100,)), TensorSpec("w", (4096, 1024))], min_numel=16384)
    assert not plan.get("b").compress and plan.get("w").compress
    s = plan.summary()
    assert (s["tensors"], s["compressed"], s["dense"]) == (2, 1, 1)
    assert plan.to_dict()["decisions"][1]["key"] == "w"


def test_powersgd_payload_is_its_factors_exactly():
    c = CostModel(Line(0, 1e-8), Line(0, 1e-8), Line(0, 1e-9), Line(0, 1e-9), Line(0, 0.0), world=2,
                  aggregation="allreduce", rounds=2, factor_rank=4)
    assert c.payload_bytes(1024 * 512, (1024, 512), 4, 1) == (1024 + 512) * 4 * 4
    assert c.payload_bytes(1024 * 512, (1024, 512), 4, 4) == (256 + 512) * 4 * 4


def test_probe_sizes_are_increasing_and_distinct():
    for largest in (10, 5000, 65536, 10**7):
        sizes = probe_sizes(largest)
        assert sizes == sorted(set(sizes)) and len(sizes) >= 2 and all(s % 256 == 0 for s in sizes)


def test_plan_options_are_checked_with_the_key_named():
    check_plan_options("secopa", 0, 8)
    with pytest.raises(ValueError, match=r"compression\.plan must be one of \['none', 'secopa'\]"):
        check_plan_options("hipress", 0, 8)
    with pytest.raises(ValueError, match=r"compression\.replan_steps"):
        check_plan_options("secopa", -1, 8)
    with pytest.raises(ValueError, match=r"compression\.max_partitions"):
        build_compressor("topk", plan="secopa", max_partitions=0)
    c = build_compressor("topk", plan="secopa", replan_steps=50)
    assert (c.plan, c.replan_steps, c.max_partitions) == ("secopa", 50, 8)


def test_config_keys_reach_the_built_compressor_and_bad_values_are_one_line():
    """compression.plan / replan_steps / max_partitions are easgd-train's own keys: set on
    the compressor it builds (two_way: on the wrapper, which the hook gets)."""
    import easgd_lightning.cli.train  # noqa: F401  (registers the recipe resolvers)
    from easgd_lightning.cli.build import ConfigError, build_compression
    from easgd_lightning.cli.overrides import compose_checked
    from easgd_lightning.cli.validate import validate_config

    cfg = compose_checked(["compression=topk", "compression.plan=secopa", "compression.replan_steps=7",
                           "compression.two_way=true"])
    validate_config(cfg, hardware=False)
    c = build_compression(cfg)
    assert (type(c).__name__, c.plan, c.replan_steps, c.max_partitions) == ("TwoWayCompressor", "secopa", 7, 8)
    assert build_compression(compose_checked(["compression=topk"])).plan == "none"
    with pytest.raises(ConfigError) as err:
        build_compression(compose_checked(["compression=topk", "compression.max_partitions=0"]))
    assert str(err.value) == "compression.max_partitions must be an integer >= 1, got 0"
    with pytest.raises(ConfigError, match=r"^compression\.plan must be one of \['none', 'secopa'\], got 'x'$"):
        build_compression(compose_checked(["compression=none", "compression.plan=x"]))


@pytest.mark.parametrize("strategy", ["sync_easgd", "local_sgd"])
def test_a_plan_is_refused_before_launch_where_no_ddp_hook_reads_it(strategy):
    """compression.plan=secopa is read by the compressed DDP hook only: the elastic and
    local-SGD exchanges would ignore it silently, so easgd-train stops in one line."""
    import easgd_lightning.cli.train  # noqa: F401  (registers the recipe resolvers)
    from easgd_lightning.cli.overrides import compose_checked
    from easgd_lightning.cli.validate import ConfigError, validate_config

    validate_config(compose_checked(["strategy=ddp", "compression=topk", "compression.plan=secopa"]), hardware=False)
    validate_config(compose_checked([f"strategy={strategy}", "compression=topk"]), hardware=False)
    with pytest.raises(ConfigError) as err:
        validate_config(compose_checked([f"strategy={strategy}", "compression=topk", "compression.plan=secopa"]),
                        hardware=False)
    assert str(err.value) == (f"compression.plan: secopa plans strategy=ddp's compressed gradient buckets only, "
                              f"not strategy={strategy}; there it must be none")


def test_split_partitions_cuts_the_first_dimension_into_views():
    t = torch.arange(24.0).view(6, 4)
    parts = split_partitions(t, 4)
    assert [p.shape[0] for p in parts] == [2, 2, 1, 1]
    assert all(p.data_ptr() >= t.data_ptr() and p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts), t)
    assert len(split_partitions(torch.zeros(3, 5), 8)) == 3
    assert [p.numel() for p in split_partitions(torch.zeros(10), 3)] == [4, 3, 3]


def test_only_codecs_whose_own_aggregate_is_multi_round_are_driven_by_rounds():
    # ACP-SGD subclasses PowerSGD but replaces its aggregate with one collective per step:
    # driving it by PowerSGD's inherited P-then-Q rounds would run the wrong algorithm
    driven = {name: rounds_of(build_compressor(name)) is not None for name in ("powersgd", "fp16", "bf16", "acpsgd", "topk")}
    assert driven == {"powersgd": True, "fp16": True, "bf16": True, "acpsgd": False, "topk": False}


@pytest.mark.parametrize("name,kwargs", [
    ("topk", {}), ("signsgd", {}), ("qsgd", {}), ("fp16", {}), ("powersgd", {}),
    ("acpsgd", {}), ("csc", {"chunk_size": 16}), ("sketch", {}),
])
def test_exchange_rounds_is_the_number_of_collectives_one_aggregate_makes(name, kwargs):
    """The planner charges ``exchange_rounds`` start-up latencies per tensor (T_snd); it must
    be what the codec's aggregate really does in sequence: counted here on a 1-rank
    collective that records every call (csc: scores then chunks, PowerSGD: P then Q)."""
    from tests.helpers import SoloCollective

    calls = []

    class Counting(SoloCollective):
        def all_reduce_sum(self, tensors):
            calls.append("sum")
            return super().all_reduce_sum(tensors)

        def all_reduce_max(self, tensors):
            calls.append("max")
            return super().all_reduce_max(tensors)

        def all_gather(self, tensors):
            calls.append("gather")
            return super().all_gather(tensors)

    comp = build_compressor(name, min_numel=0, **kwargs)
    state = {"key_hash": 0}
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(7))
    comp.aggregate(x, state, Counting())  # first call may warm a factor up
    calls.clear()
    comp.aggregate(x, state, Counting())
    assert len(calls) == comp.exchange_rounds, calls
