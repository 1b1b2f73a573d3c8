"""Real gloo processes: every compressor's aggregate equals the mean of the gathered dense
contributions; the DDP hook runs on CPU with the expected bytes; the elastic exchange sums
what each rank transmitted and keeps the rest as residual."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "compression_run.py"


def _run(tmp_path: Path, world: int, scenarios: str) -> list[dict]:
    launch_ranks(SCRIPT, world, [str(tmp_path), scenarios], timeout=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("two"), 2, "aggregate,ddp,ddp_dgc,ddp_cast,elastic,elastic_split,csc,fused")


def _check_aggregate(ranks: list[dict]) -> None:
    for rank in ranks:
        agg = rank["aggregate"]
        for case, res in agg.items():
            tol = 2e-3 if case in ("fp16", "bf16") else 1e-5
            if case == "bf16":
                tol = 2e-2
            assert max(res["rel_err"]) < tol, (case, res["rel_err"])
            assert all(d == 64 * 48 * 4 for d in res["dense"]), (case, res["dense"])
            if res["expected"]:
                assert res["sent"] == res["expected"], (case, res["sent"], res["expected"])
        # the max-reduce fallback sends a byte per entry instead of a bit
        assert agg["sketch_max_fallback"]["sent"][0] > agg["sketch"]["sent"][0]


def test_aggregate_matches_gathered_dense_contributions_two_ranks(two_ranks):
    _check_aggregate(two_ranks)


def test_aggregate_matches_gathered_dense_contributions_three_ranks(tmp_path):
    _check_aggregate(_run(tmp_path, 3, "aggregate"))


def test_csc_sends_the_chunks_of_largest_summed_l1_norm(two_ranks):
    for rank in two_ranks:
        res = rank["csc"]
        assert res["chosen"] == res["ref_chosen"]
        assert max(res["err"]) < 1e-12 and res["local_err"] == 0.0


def test_ddp_hook_runs_on_cpu_with_the_payload_bytes(two_ranks):
    for rank in two_ranks:
        ddp = rank["ddp"]
        assert ddp["calls"] > 0 and ddp["compressed_calls"] > 0
        assert "compressed_allreduce_hook" in ddp["comm_hook"]
        for it, rec in enumerate(ddp["iterations"]):
            assert rec["max_err"] < 1e-6, (it, rec)
            assert rec["sent"] == rec["expected_sent"], (it, rec)
            assert rec["dense"] == rec["expected_dense"], (it, rec)
        # warm-up iteration dense, then compressed: 4 * 9310 dense vs 1976 payload bytes
        assert ddp["iterations"][0]["sent"] == ddp["iterations"][0]["dense"]
        assert ddp["iterations"][1]["dense"] / ddp["iterations"][1]["sent"] > 15
        stats = ddp["stats"]
        assert stats["compressor"] == "topk" and stats["compression_ratio"] > 15


def test_ddp_hook_dgc_keeps_momentum_on_dense_tensors(two_ranks):
    """Sparsified weights follow DGC (momentum correction, masking); tensors under
    min_numel travel dense with DGC's momentum (u <- m u + g, u sent), both against a
    reference written in the script."""
    for rank in two_ranks:
        res = rank["ddp_dgc"]
        assert max(res["err"]) < 1e-5, res
        assert max(res["momentum_effect"][1:]) > 1e-3, res  # not the plain gradient


def test_fused_exchange_equals_the_per_tensor_exchange_bitwise(two_ranks):
    """One codec call over the flat buffer and one message per exchange (issue 29), with
    each tensor's own rule: top-k (sampled threshold, residual memory), DGC with momentum
    (dense tensors keep theirs) and DGC on elastic differences give bitwise the means,
    residuals and u, v of the per-tensor exchange, over three steps, the third resumed
    from the per-tensor side's checkpoint; so do EF-signSGD (with and without memory: the
    residual written by the kernel or by the memory), random-k (the seeds drawn in the
    kernel), QSGD (3-, 8- and 12-bit levels and the Elias coding, each tensor's own buckets and noise) and
    fp16 / bf16 (all-reduced; two ranks: a sum of two is the same in any order), and
    DGC with local clipping (each tensor's own norm, the small ones' too), sparse_gc on
    differences and on gradients (DDP's mode: the global momentum M and the
    local update g - sent + M over the compressed runs after the mean), RedSync
    (trimmed top-k and threshold bisection, each tensor's own search) and SIDCo adapting
    every step (each tensor's stage count and target correction, kept per segment and
    carried over from the per-tensor checkpoint), and RedSync reusing each tensor's
    bisected threshold (the reused one carried over from the per-tensor checkpoint too), and
    SparseLoCo (each tensor's own top-k, sampled or exact, and its own 2-bit code), and
    ACP-SGD (each matrix's own factors and step, P and Q alternating, in one all-reduce; a
    1-D tensor dense in it; the residuals written in place), and PowerSGD in the multi-round
    form (every P in one all-reduce, then every Q; each matrix its own warm start), csc (each
    tensor's own chunks and choice; scores, then chunks, one all-reduce each) and sketch
    (each tensor's own top-k, seed and width; one OR, one sketch sum), GComp (each
    tensor's own Huffman code in one message) and two-way compression over top-k,
    EF-signSGD, QSGD and SIDCo (each tensor's shards; every owner's pieces in one inner
    call, one all-to-all, one all-gather; the owners' second residuals per tensor) and LGC,
    ring and ps (each tensor's own leader mask, samples, coder and phase; the masks in one
    all-gather, the codes in one all-reduce)."""
    for rank in two_ranks:
        for name, rec in rank["fused"].items():
            assert all(rec["mean_equal"]) and all(rec["state_equal"]), (name, rec)
            # one all-gather per exchange (the first: +1 round, capacity 0); the all-reduce
            # codecs add the all-reduce of their summed payload
            calls = 2 if name in ("randomk", "randomk_unbiased", "fp16", "bf16", "acpsgd") else 1
            calls = 3 if name in ("powersgd", "csc") else calls  # two rounds and the dense message
            if name == "sketch":  # the OR, the sum, the dense message; a peeling remainder: +1
                assert all(c in (3, 4) for c in rec["calls"][1:]), (name, rec["calls"])
            elif name.startswith("lgc"):  # coding: the masks, the codes, the dense message
                # (the training step before adds each coder's weights' all-reduce)
                assert rec["calls"][2] == 3, (name, rec["calls"])
            elif name.startswith("two_way"):  # the all-to-all and the owners' all-gather
                # (lengths with each), the dense message: one all-to-all, one all-gather
                assert len(set(rec["calls"][1:])) == 1 and rec["calls"][1] <= 5, (name, rec["calls"])
            elif name in ("sidco", "redsync_reuse"):  # its count moves as its stages adapt (a
                # reused threshold: with the data): a message may outgrow the capacity the
                # ranks agreed on (its rest follows in one more round)
                assert all(c in (1, 2) for c in rec["calls"][1:]), (name, rec["calls"])
            else:
                assert rec["calls"][1:] == [calls, calls], (name, rec["calls"])
            assert min(rec["scale"]) > 0.01, (name, rec["scale"])
            memory = name in ("topk", "signsgd", "randomk", "fp16", "qsgd", "redsync", "sidco", "redsync_reuse",
                              "sparseloco", "sparseloco_exact", "acpsgd",
                              "powersgd", "csc", "sketch", "two_way_topk", "two_way_signsgd", "two_way_sidco",
                              "lgc", "lgc_ps")
            residuals = ["t1", "t3", "t4"] if memory else []  # per tensor, as before
            assert rec["checkpoint_keys"] == residuals, (name, rec["checkpoint_keys"])
        sidco = rank["fused"]["sidco"]
        assert all(sidco["own_state_equal"]), sidco  # each tensor's stage count, correction, history
        assert any(st["stages"] != 1 for step in sidco["own"] for st in step), sidco  # the adaptation moved
        reuse = rank["fused"]["redsync_reuse"]
        assert all(reuse["own_state_equal"]), reuse  # each tensor's threshold and its age
        # searched at step 0, then reused: the age counts up, the thresholds stay
        assert [[st["thr_age"] for st in step] for step in reuse["own"]] == [[1, 1, 1], [2, 2, 2], [3, 3, 3]], reuse
        assert reuse["own"][0] == [{**st, "thr_age": 1} for st in reuse["own"][2]], reuse
        acp = rank["fused"]["acpsgd"]
        assert all(acp["own_state_equal"]), acp  # each matrix's step and mean factors
        # steps 1, 2, 3 for the matrices (P, Q, P); the 1-D one travels dense (no step, no factors)
        assert [[st["step"] for st in step] for step in acp["own"]] == [[1, 1, None], [2, 2, None], [3, 3, None]], acp
        own = acp["own"]
        assert own[0][0]["p"] is not None and own[0][0]["q"] is None and own[1][0]["q"] is not None, acp
        assert own[2][2]["p"] is None and own[2][2]["q"] is None, acp
        psgd = rank["fused"]["powersgd"]
        assert all(psgd["own_state_equal"]), psgd  # each matrix's warm-started Q and step
        assert [[st["step"] for st in step] for step in psgd["own"]] == [[1, 1, None], [2, 2, None], [3, 3, None]]
        for name in ("two_way_topk", "two_way_signsgd", "two_way_qsgd", "two_way_sidco"):
            rec = rank["fused"][name]  # each tensor's piece of the owner's second residual
            assert all(rec["own_state_equal"]) and any(any(x != 0 for x in st["f"]) for st in rec["own"][2]), name
        for name in ("lgc", "lgc_ps"):  # each tensor's coder trained after its two top-k steps
            rec = rank["fused"][name]
            assert all(rec["own_state_equal"]), name
            assert [[st["last_phase"] for st in step] for step in rec["own"]] == [[1] * 3, [1] * 3, [2] * 3], name
        csc, sketch = rank["fused"]["csc"], rank["fused"]["sketch"]
        assert all(csc["own_state_equal"]) and all(sketch["own_state_equal"]), (csc, sketch)
        # k = ceil(0.25 x chunks) per tensor: 1200 entries -> 19 chunks -> 5; 700 -> 11 -> 3
        assert [len(st["chosen"]) for st in csc["own"][0]] == [5, 5, 3], csc
        assert [st["step"] for st in sketch["own"][2]] == [3, 3, 3], sketch
        assert all(st["last_union"] >= st["last_nnz"] > 0 for step in sketch["own"] for st in step), sketch
        assert "M" in rank["fused"]["sparse_gc_grad"]["group_tensors"]
        assert "M" not in rank["fused"]["sparse_gc"]["group_tensors"]


def test_ddp_bf16_fp16_run_as_the_overlapped_cast_hook(two_ranks):
    """The dense 16-bit baselines of the benchmarks (issue 29): bf16 / fp16 in DDP run the
    asynchronous cast hook, per bucket, with the sum of the ranks' 16-bit g / p for tensors
    of >= min_numel elements (fp32 for the others and in the warm-up iteration), 2 bytes an
    element on the wire; the hook returns while the peer has not launched its all-reduce
    (rank 0 calls it first and rank 1 only once rank 0's returned: rank 0's future cannot be
    done at its return; rank 1's may be, its peer waits in the all-reduce already -- a race,
    so it is not asserted)."""
    assert two_ranks[0]["ddp_cast"]["done_at_return"] is False
    for rank in two_ranks:
        res = rank["ddp_cast"]
        for name in ("bf16", "fp16"):
            rec = res[name]
            assert "cast_allreduce_hook" in rec["hook"], rec["hook"]
            assert max(rec["err"]) < 1e-6, (name, rec["err"])
            assert rec["sent"] == rec["expected_sent"], (name, rec)
            assert rec["stats"]["compressor"] == name and rec["stats"]["compressed_calls"] > 0
            assert rec["stats"]["compressed_tensors"] == 2 * 2 and rec["stats"]["dense_tensors"] == 2 * 2
        assert res["direct_err"] < 1e-6


def test_elastic_exchange_sums_transmitted_and_keeps_residual(two_ranks):
    for rank in two_ranks:
        for name, res in rank["elastic"].items():
            assert max(res["err"]) < 1e-5, (name, res)
            assert max(res["conservation"]) < 1e-5, (name, res)


def test_split_elastic_exchange_matches_one_call(two_ranks):
    """start_exchange_sum(...).wait() (Sync EASGD's overlap) sums what exchange_sum sums
    and leaves the same residuals, with two exchanges and other traffic in flight."""
    for rank in two_ranks:
        for name, res in rank["elastic_split"].items():
            assert res["scale"] > 0.1, (name, res)  # the sums are not trivially zero
            assert max(res["err"]) < 1e-5, (name, res)
            assert max(res["residual_err"]) < 1e-6, (name, res)
