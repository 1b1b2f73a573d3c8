"""Real gloo processes (2 ranks): the compressors of issue 12 and two-way compression under
``sync_easgd`` and ``local_sgd``, a few steps of a tiny model through ``Trainer.fit``.

Every rank must end with the same center (each rank's module holds it after fit), the
exchanges' dense bytes must be those of the flat buffer, and where it is cheap the figures
are checked against a reference: GComp's lossless mode gives the uncompressed run's center,
ACP-SGD sends one factor per exchange (P, then Q), and DGC under an elastic strategy has no
momentum (its u stays 0, the optimizer keeps its own) and warms up over the Trainer's epochs
counted in optimizer steps. (``sgc`` is refused by both strategies: tests/unit/hooks/compressors/test_sgc.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "elastic_compressors_run.py"
STRATEGIES = ("sync_easgd", "local_sgd")
COMPRESSORS = ("none", "gcomp", "lgc", "sparse_gc", "acpsgd", "two_way", "dgc")
STEPS = 6
EXCHANGES = {"sync_easgd": 6, "local_sgd": 3}  # tau 1 and 2
WEIGHT, BIAS = (32, 16), 32
FLAT_BYTES = (WEIGHT[0] * WEIGHT[1] + BIAS) * 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("elastic_compressors")
    cases = ",".join(f"{s}/{c}" for s in STRATEGIES for c in COMPRESSORS)
    launch_ranks(SCRIPT, 2, [str(out), cases], timeout=400)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", COMPRESSORS)
def test_runs_with_one_center_and_the_exchange_bytes(ranks, strategy: str, name: str) -> None:
    case = f"{strategy}/{name}"
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["steps"] == r1["steps"] == STEPS
    assert torch.equal(r0["center"], r1["center"]), (r0["center"] - r1["center"]).abs().max()
    assert torch.isfinite(r0["center"]).all() and not torch.equal(r0["center"], r0["init"])
    for r in (r0, r1):
        assert r["dense_bytes"] == EXCHANGES[strategy] * FLAT_BYTES, (case, r["dense_bytes"])
        if name == "none":
            assert r["bytes_sent"] == r["dense_bytes"]
        elif name == "lgc":  # its first phase also collects every worker's vectors to train on
            assert r["bytes_sent"] > 0
        else:
            assert 0 < r["bytes_sent"] < r["dense_bytes"], (case, r["bytes_sent"])
        assert r["optimizer_momentum"] == 0.9  # no compressor here takes the optimizer's momentum


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gcomp_lossless_gives_the_uncompressed_center(ranks, strategy: str) -> None:
    """mantissa_bits 23 round-trips float32 exactly; what is left is float32 rounding of a
    different order of operations (local_sgd averages the parameters in place when dense,
    the differences when compressed): a few ulps, where 7 mantissa bits would miss by ~1e-2."""
    for rank in ranks:
        torch.testing.assert_close(rank[f"{strategy}/gcomp"]["center"], rank[f"{strategy}/none"]["center"],
                                   rtol=1e-6, atol=2e-5)


def test_acpsgd_sends_one_factor_per_exchange(ranks) -> None:
    """Exchange 1 all-reduces P (32 x 2), exchange 2 Q (16 x 2), and so on, beside the dense
    bias and a constant per exchange: with P, Q, P, Q, P, Q (sync_easgd, 6 exchanges) and
    P, Q, P (local_sgd, 3) the constants cancel in sync - 2 local = Q - P (PowerSGD, which
    sends both every time, would give 0)."""
    n, m = WEIGHT
    p_bytes, q_bytes = n * 2 * 4, m * 2 * 4
    for rank in ranks:
        sync, local = rank["sync_easgd/acpsgd"]["bytes_sent"], rank["local_sgd/acpsgd"]["bytes_sent"]
        assert sync - 2 * local == q_bytes - p_bytes, (sync, local)
        per_exchange = (local - 2 * p_bytes - q_bytes) / 3 - BIAS * 4
        assert 0 <= per_exchange <= 16 and (sync - 3 * (p_bytes + q_bytes)) / 6 - BIAS * 4 == per_exchange


@pytest.mark.parametrize("strategy,densities", [
    # tau 1: one exchange per step, the warm-up (one epoch = 3 steps) a stage per step
    ("sync_easgd", [0.5, 0.25, 0.125, 0.01, 0.01, 0.01]),
    # tau 2: exchanges after steps 2, 4, 6 (0-based 1, 3, 5); counting exchanges instead
    # would give 0.5, 0.25, 0.125
    ("local_sgd", [None, 0.25, 0.25, 0.01, 0.01, 0.01]),
])
def test_dgc_is_its_sparsifier_alone_with_the_warmup_in_trainer_epochs(ranks, strategy: str, densities) -> None:
    for rank in ranks:
        res = rank[f"{strategy}/dgc"]
        assert res["gradient_mode"] is False and res["u_max"] == 0.0
        assert res["densities"] == densities
