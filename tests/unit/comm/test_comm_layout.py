"""The lazy all-reduce rule, the ``comm`` group's checks, and messages in the summary."""

from __future__ import annotations

import pytest

from easgd_lightning.cli.build import ConfigError, build_comm
from easgd_lightning.cli.summary import build_summary
from easgd_lightning.comm.fusion import MIB, fusion_buckets, fusion_threshold
from easgd_lightning.comm.layout import CommLayout, node_ranks
from easgd_lightning.comm.meter import CommMeter


@pytest.mark.parametrize(
    "sizes,threshold,expected",
    [
        ([10, 10, 10, 10], 0, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # unfused: one per tensor
        ([10, 10, 10, 10], 20, [(0, 2), (2, 4)]),  # sent once a buffer holds >= 20
        ([10, 10, 10, 10, 5], 20, [(0, 2), (2, 4), (4, 5)]),  # the rest is the last buffer
        ([50, 1, 1, 30], 20, [(0, 1), (1, 4)]),  # a big tensor closes its buffer alone
        ([10, 10], 10**9, [(0, 2)]),  # under the threshold: one message
        ([], 20, []),
    ],
)
def test_fusion_buckets(sizes, threshold, expected) -> None:
    assert list(fusion_buckets(sizes, threshold)) == expected


def test_fusion_threshold_is_mib() -> None:
    assert fusion_threshold(25) == 25 * MIB and fusion_threshold(0) == 0


@pytest.mark.parametrize(
    "opts,message",
    [
        ({"fusion_mb": -1}, "comm.fusion_mb must be a number of MiB >= 0"),
        ({"fusion_mb": "big"}, "comm.fusion_mb must be a number of MiB >= 0"),
        ({"hierarchy": "tree"}, "comm.hierarchy must be one of ['flat', 'node'], got 'tree'"),
        ({"procs_per_node": 0}, "comm.procs_per_node must be an integer >= 1 or null"),
        ({"allreduce": "tree"}, "comm.allreduce must be one of ['ring', 'switch'], got 'tree'"),
        ({"aggregator": "rank1"}, "comm.aggregator must be one of ['rank0', 'external'], got 'rank1'"),
        ({"allreduce": "switch", "hierarchy": "node"}, "comm.allreduce: switch sums every process's bucket itself"),
        ({"fusion": 1}, "comm.fusion: not a comm option; the options are fusion_mb, hierarchy, procs_per_node, allreduce, aggregator"),
    ],
)
def test_bad_comm_values_are_one_line_config_errors(opts, message) -> None:
    with pytest.raises(ConfigError) as err:
        build_comm({"comm": opts})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_nodes_and_defaults() -> None:
    assert node_ranks(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="comm.procs_per_node: 3 does not divide the 4 processes"):
        CommLayout(hierarchy="node", procs_per_node=3).check_world(4)
    layout = build_comm({})
    assert (layout.fusion_mb, layout.hierarchy, layout.procs_per_node) == (25.0, "flat", None)


def test_messages_per_step_in_the_summary() -> None:
    meter = CommMeter()
    for _ in range(6):
        meter.record("elastic", sent=8)
    meter.record("setup", sent=8)  # control traffic: not a payload message
    meter.record("control", sent=8)
    snap = meter.snapshot()
    assert snap["messages"] == 6 and snap["by_kind"]["elastic"]["calls"] == 6
    report = {"status": "ok", "steps": 3, "wall_time_s": 1.0, "comm": snap}
    summary = build_summary({}, [report, dict(report, steps=2)])
    assert summary["comm"]["messages"] == [6, 6]
    assert summary["comm"]["messages_per_step"] == [2.0, 3.0]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["strategy=sync_easgd", "comm.allreduce=switch"],
         "comm.allreduce: switch sums strategy=ddp's dense gradient buckets only, not strategy=sync_easgd"),
        (["strategy=ddp", "compression=topk", "comm.allreduce=switch"],
         "comm.allreduce=switch sums dense gradients; it needs compression=none, got compression=topk"),
    ],
)
def test_the_switch_is_refused_where_it_cannot_sum(overrides, message) -> None:
    import easgd_lightning.cli.train  # noqa: F401  (registers the recipe resolvers)
    from easgd_lightning.cli.overrides import compose_checked
    from easgd_lightning.cli.validate import validate_config

    validate_config(compose_checked(["strategy=ddp", "comm.allreduce=switch"]), hardware=False)
    with pytest.raises(ConfigError) as err:
        validate_config(compose_checked(overrides), hardware=False)
    assert str(err.value) == message


@pytest.mark.parametrize("numel", [0, 1, 16384, 16385, 131072, 250_003, 10_000_000])
def test_switch_stream_blocks_tile_the_tensor(numel):
    """The switch streams a tensor as contiguous blocks covering it exactly once: at most
    STREAM_BLOCKS of them, each of at least STREAM_NUMEL elements but the last."""
    from easgd_lightning.comm.switch import STREAM_BLOCKS, STREAM_NUMEL, stream_blocks

    blocks = stream_blocks(numel)
    starts, stops = [a for a, _ in blocks], [b for _, b in blocks]
    assert starts == [0, *stops[:-1]][: len(blocks)]
    assert (stops[-1] if blocks else 0) == numel
    assert len(blocks) <= STREAM_BLOCKS
    assert all(b - a >= STREAM_NUMEL for a, b in blocks[:-1])
    assert len(blocks) == (0 if numel == 0 else min(STREAM_BLOCKS, -(-numel // STREAM_NUMEL)))
