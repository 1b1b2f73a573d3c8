"""Our strategies under Lightning Fabric (easgd_lightning.fabric): a hand-written loop on 2
gloo ranks in float64 ends with bitwise the parameters the Trainer path ends with, for the
same network, seed, data order and options; the strategies Fabric cannot run are refused
in one line naming why, before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_fabric import Fabric

import easgd_lightning.fabric as ef
from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "fabric_run.py"
CASES = ("ddp_compressed", "sync_easgd_topk", "sync_easgd", "local_sgd", "diloco", "easgd_round_robin")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fabric")
    launch_ranks(SCRIPT, 2, [str(out)])
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", CASES)
def test_fabric_loop_ends_bitwise_where_the_trainer_ends(ranks: list[dict], case: str) -> None:
    for r in ranks:
        trainer, fabric = r[case]["trainer"], r[case]["fabric"]
        assert fabric["steps"] == trainer["steps"] == 10
        assert all(t.dtype == torch.float64 for t in fabric["final"])
        assert all(torch.equal(a, b) for a, b in zip(fabric["final"], trainer["final"])), case
        assert fabric["overlapped"] == trainer["overlapped"]  # sync_easgd: overlapped in both
    # every rank ends on the same model (DDP's, or the center) ...
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][case]["fabric"]["final"], ranks[1][case]["fabric"]["final"]))
    # ... away from the initial point (the comparison is not vacuous)
    moved = max((a - b).abs().max().item() for a, b in zip(ranks[0][case]["fabric"]["final"], ranks[0]["init"]))
    assert moved > 1e-3, case


def test_the_strategy_and_its_options_matter(ranks: list[dict]) -> None:
    """Each case ends elsewhere: the options reached the exchange, not its defaults."""
    finals = {case: torch.cat([p.reshape(-1) for p in ranks[0][case]["fabric"]["final"]]) for case in CASES}
    assert len({tuple(v.tolist()) for v in finals.values()}) == len(CASES)
    assert ranks[0]["sync_easgd"]["fabric"]["strategy"] == "sync_easgd"  # Fabric(strategy="sync_easgd")
    assert ranks[0]["sync_easgd"]["fabric"]["overlapped"] > 0  # tau 1: every exchange overlapped the next step
    stats = ranks[0]["ddp_compressed"]["fabric"]["extras"]["compression_stats"]  # the hook compressed
    assert stats["compressor"] == "topk" and stats["compressed_calls"] > 0 and stats["bytes_sent"] < stats["dense_bytes"]
    local = ranks[0]["local_sgd"]["fabric"]["extras"]
    assert local["taus"] == [8, 8] and local["rounds"] == 2  # the default tau; finish() averaged steps 9-10
    assert ranks[0]["diloco"]["fabric"]["extras"]["outer_syncs"] == [3, 3]  # steps 2, 6, 10 / 4, 8 and finish()


def test_holding_center_swaps_the_center_in_and_the_worker_back(ranks: list[dict]) -> None:
    """sync_easgd: inside holding_center() the module holds the center finish() ends on (the
    exchange in flight completed); after it, each rank's own worker, which is elsewhere."""
    for r in ranks:
        run = r["sync_easgd_topk"]["fabric"]
        assert all(torch.equal(a, b) for a, b in zip(run["held"], run["final"]))
        assert not all(torch.equal(a, b) for a, b in zip(run["worker"], run["final"]))


@pytest.mark.filterwarnings("ignore:The `srun` command is available")  # Fabric's SLURM probe
@pytest.mark.parametrize(
    "name,why",
    [("async_easgd", "parameter server"), ("hogwild_sgd", "shared center"), ("pipeline_3d", "pipeline engine")],
)
def test_strategies_fabric_cannot_run_are_refused_in_one_line(name: str, why: str) -> None:
    with pytest.raises(ValueError) as by_name:
        Fabric(accelerator="cpu", devices=2, strategy=name)
    with pytest.raises(ValueError) as built:
        ef.strategy(name)
    for err in (by_name, built):
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"strategy={name} does not run under Lightning Fabric: ")
        assert why in msg


def test_unknown_names_and_options_are_one_line_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"strategy.name='sync' is unknown; choose one of .*sync_easgd"):
        ef.strategy("sync")
    with pytest.raises(ValueError, match=r"strategy.taus is not an option of sync_easgd"):
        ef.strategy("sync_easgd", taus=4)
    with pytest.raises(ValueError, match=r"compression.ratio"):
        ef.strategy("sync_easgd", compression={"name": "topk", "ratio": 2.0})
