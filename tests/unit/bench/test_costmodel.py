"""bench/costmodel (the package): the alpha-beta fit (exact recovery on synthetic measurements), the
collective formulas against hand-computed values, step-time predictions, the projection,
and ``easgd-report`` adding the projection when a sweep directory holds costmodel.json."""

from __future__ import annotations

import json
import math

import pytest

from bench import costmodel as cm
from easgd_lightning.cli import report
from tests.helpers import assert_valid_png

ALPHA = 2.5e-4  # s per message
ETA = 0.875  # share of the nominal rate
RATES = (50.0, 200.0, 1000.0)


def _bps(rate_mbit: float) -> float:
    return rate_mbit * 1e6 / 8


def _burst(rate_mbit: float) -> float:
    """bench/_netem.py's tbf burst, by hand: 2 ms of the link, at least 2 x (1500 + 100) B."""
    return float(max(3200, int(_bps(rate_mbit) * 0.002)))


def _synthetic_probe(model: dict[str, tuple[float, float]], cpus: int | None = None,
                     burst=None, overlap: float = 0.0) -> list[dict]:
    """Measurements that follow the formulas exactly, for each collective's (alpha, eta);
    with ``cpus``, each latency is slowed by the ranks' share of the cores, as fit(cpus=) assumes;
    with ``burst``, each probe rate's token-bucket burst; ``overlap``: the fan-in's phi."""
    samples = []
    for op, (alpha, eta) in model.items():
        for p in (2, 4, 8):
            for rate in RATES:
                for nbytes in cm.probe_sizes(rate):
                    a = alpha * (cm.cpu_share(p, cpus) if cpus else 1.0)
                    t = cm.collective_time(op, p, nbytes, a, eta * _bps(rate),
                                           burst(rate) if burst else 0.0, overlap)
                    samples.append({"op": op, "p": p, "bytes": nbytes, "rate_mbit": rate, "time_s": t})
    return samples


def test_fit_recovers_known_alpha_and_eta_exactly():
    truth = {op: (ALPHA * (k + 1), ETA - 0.1 * k) for k, op in enumerate(cm.COLLECTIVES)}
    fitted = cm.fit(_synthetic_probe(truth))
    assert set(fitted) == set(cm.COLLECTIVES)
    for op, (alpha, eta) in truth.items():
        assert fitted[op]["alpha_s"] == pytest.approx(alpha, rel=1e-12, abs=0)
        assert fitted[op]["eta"] == pytest.approx(eta, rel=1e-12, abs=0)
        assert fitted[op]["max_rel_err"] < 1e-12
        assert fitted[op]["samples"] == 3 * 3 * 3


def test_fit_recovers_eta_at_each_p_with_alpha_held_and_the_rows_use_it():
    # one alpha, a bandwidth share that rises with p (the emulated ring's): per p, the
    # share is recovered exactly given alpha; predictions at a probed p use it, others
    # (and the projection's layouts) the all-p eta
    alpha, eta_p = 3e-4, {2: 0.85, 4: 1.05, 8: 1.4}
    ka, kbr, times, ps = [], [], [], []
    for p, eta in eta_p.items():
        for rate in RATES:
            for nbytes in cm.probe_sizes(rate):
                a, b = cm.ring_terms(p, nbytes)
                ka.append(a)
                kbr.append(b / _bps(rate))
                times.append(alpha * a + b / (eta * _bps(rate)))
                ps.append(p)
    got = cm.fit_eta_by_p(alpha, ps, ka, kbr, times, eta=1.0)
    assert got == pytest.approx({str(p): v for p, v in eta_p.items()}, rel=1e-12)
    model = {op: {"alpha_s": alpha, "eta": 1.0, "eta_by_p": {str(p): v for p, v in eta_p.items()}}
             for op in cm.COLLECTIVES}
    net = cm.fitted_net(model, 100.0)
    for p, eta in eta_p.items():
        assert net("ring", p, 614_440) == pytest.approx(
            cm.collective_time("ring", p, 614_440, alpha, eta * _bps(100.0)), rel=1e-12)
    assert net("ring", 3, 614_440) == pytest.approx(
        cm.collective_time("ring", 3, 614_440, alpha, _bps(100.0)), rel=1e-12)
    # a probe with one eta: each p's eta is that eta
    fitted = cm.fit(_synthetic_probe({"ring": (alpha, 0.9)}))
    assert fitted["ring"]["eta_by_p"] == pytest.approx({"2": 0.9, "4": 0.9, "8": 0.9}, rel=1e-9)


def test_emulated_burst_is_the_shapers_tbf_burst():
    for rate in (10.0, 50.0, 100.0, 1000.0):
        assert cm.emulated_burst_bytes(rate) == _burst(rate)
    assert cm.emulated_burst_bytes(100.0) == 25_000.0  # 2 ms of 12.5 MB/s


@pytest.mark.parametrize("phi", [0.0, 0.35, 1.0])
def test_fit_recovers_alpha_eta_and_the_reply_overlap_with_the_token_bucket(phi):
    # every probe sample shaped by the rate's token bucket, the fan-in's replies overlapping by phi
    truth = {op: (ALPHA * (k + 1), ETA - 0.1 * k) for k, op in enumerate(cm.COLLECTIVES)}
    fitted = cm.fit(_synthetic_probe(truth, burst=_burst, overlap=phi), burst=_burst)
    for op, (alpha, eta) in truth.items():
        assert fitted[op]["alpha_s"] == pytest.approx(alpha, rel=1e-9, abs=0)
        assert fitted[op]["eta"] == pytest.approx(eta, rel=1e-9, abs=0)
        assert fitted[op]["max_rel_err"] < 1e-9
        assert fitted[op]["burst"] is True
    assert fitted["ps"]["overlap"] == pytest.approx(phi, abs=1e-9)
    # the prediction on the emulated link charges the same bucket and phi: the fan-in at
    # 4 ranks, 100 Mbit/s, n = 614440 B by hand: 8 alpha + (6 - 2 phi)(n - 25000) / beta
    alpha, eta = truth["ps"]
    net = cm.fitted_net(fitted, 100.0)
    want = 8 * alpha + (6 - 2 * phi) * (614_440 - 25_000) / (eta * 12.5e6)
    assert net("ps", 4, 614_440) == pytest.approx(want, rel=1e-9)


def test_fit_overlap_is_clipped_and_zero_where_undetermined():
    # a fan-in faster than full duplex (phi = 1.5 in the data) is clipped to 1
    truth = {"ps": (ALPHA, ETA)}
    assert cm.fit(_synthetic_probe(truth, overlap=1.5))["ps"]["overlap"] == 1.0
    # only 2 ranks: no next request, phi undetermined -> 0 (serial)
    only2 = [s for s in _synthetic_probe(truth, overlap=0.5) if s["p"] == 2]
    got = cm.fit(only2)["ps"]
    assert got["overlap"] == 0.0
    assert got["alpha_s"] == pytest.approx(ALPHA, rel=1e-9)
    assert got["eta"] == pytest.approx(ETA, rel=1e-9)


def test_fit_with_oversubscribed_cores_recovers_the_own_core_alpha():
    # 8 ranks on 2 cores: each hop's latency is alpha x 4; the fit divides it out
    truth = {"ring": (ALPHA, ETA), "allgather": (3 * ALPHA, 0.6)}
    samples = _synthetic_probe(truth)
    for s in samples:
        op, (alpha, eta) = s["op"], truth[s["op"]]
        share = max(1.0, s["p"] / 2)
        k_alpha, k_bytes = cm.COLLECTIVES[op](s["p"], s["bytes"])
        s["time_s"] = k_alpha * alpha * share + k_bytes / (eta * _bps(s["rate_mbit"]))
    fitted = cm.fit(samples, cpus=2)
    for op, (alpha, eta) in truth.items():
        assert fitted[op]["alpha_s"] == pytest.approx(alpha, rel=1e-12)
        assert fitted[op]["eta"] == pytest.approx(eta, rel=1e-12)
    # and the emulated cluster's prediction at 8 ranks puts the factor back
    net = cm.fitted_net(fitted, 200.0)
    want = 14 * ALPHA * 4 + 14 / 8 * 1e5 / (ETA * _bps(200.0))
    assert net("ring", 8, 1e5) == pytest.approx(want, rel=1e-12)


def test_fit_alpha_beta_without_rates_returns_beta():
    # t = 3 alpha + k_bytes / beta with alpha = 1e-3 s, beta = 1.25e7 B/s (100 Mbit/s)
    alpha, beta = 1e-3, 1.25e7
    ka = [2.0, 6.0, 14.0, 6.0]
    kb = [1e3, 1.5e6, 7e5, 3e6]
    t = [a * alpha + b / beta for a, b in zip(ka, kb)]
    got_alpha, got_beta = cm.fit_alpha_beta(ka, kb, t)
    assert got_alpha == pytest.approx(alpha, rel=1e-12)
    assert got_beta == pytest.approx(beta, rel=1e-12)


def test_fit_rejects_samples_that_do_not_determine_both():
    with pytest.raises(ValueError, match="independent"):
        cm.fit_alpha_beta([2.0, 4.0], [1.0, 2.0], [0.1, 0.2])  # collinear
    with pytest.raises(ValueError, match="independent"):
        cm.fit_alpha_beta([2.0], [1.0], [0.1])


@pytest.mark.parametrize(
    ("name", "p", "n", "want"),
    [
        # ring: 2 (p-1) (alpha + n / (p beta)) = 6 (1e-4 + 1e6 / 4e8)
        ("ring", 4, 1e6, 6 * (1e-4 + 2.5e-3)),
        # tree: 2 ceil(log2 p) (alpha + n / beta); p = 5 -> 3 levels
        ("tree", 8, 1e6, 6 * (1e-4 + 1e-2)),
        ("tree", 5, 1e6, 6 * (1e-4 + 1e-2)),
        # all-gather of m = 1e4 per rank: (p-1)(alpha + m / beta), grows with p
        ("allgather", 4, 1e4, 3 * (1e-4 + 1e-4)),
        ("allgather", 16, 1e4, 15 * (1e-4 + 1e-4)),
        # gloo broadcast: the root sends to each: (p-1)(alpha + n / beta)
        ("broadcast", 4, 1e6, 3 * (1e-4 + 1e-2)),
        # PS fan-in, phi = 0 (replies serial): 2p alpha + 2 (p-1) n / beta
        ("ps", 4, 1e6, 8e-4 + 6e-2),
        ("ps", 2, 1e6, 4e-4 + 2e-2),
        # the server's round: 2 (p-1) alpha + 2 (p-1) n / beta; one worker: 4 alpha + 2 n / beta
        ("ps_server", 4, 1e6, 6e-4 + 6e-2),
        ("ps_worker", 4, 1e6, 4e-4 + 2e-2),
        # round robin: (p-1)(alpha + 2 n / beta); one worker: 2 (alpha + n / beta)
        ("round_robin", 4, 1e6, 3e-4 + 6e-2),
        ("round_robin", 2, 1e6, 2e-4 + 2e-2),
        ("ring", 1, 1e6, 0.0),
    ],
)
def test_collective_formulas_by_hand(name, p, n, want):
    assert cm.collective_time(name, p, n, 1e-4, 1e8) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "p", "n", "want"),
    [
        # alpha = 1e-4 s, beta = 1e8 B/s, burst B = 2e5 B, phi = 0.25
        # ring: one burst per call: 6 alpha + (1.5 n - B) / beta
        ("ring", 4, 1e6, 6e-4 + (1.5e6 - 2e5) / 1e8),
        # a message inside the burst costs only its latency
        ("ring", 4, 1e5, 6e-4),
        # tree: one burst per phase: 6 alpha + 2 (3 n - B) / beta
        ("tree", 8, 1e6, 6e-4 + 2 * (3e6 - 2e5) / 1e8),
        # all-gather, broadcast: (p-1) alpha + ((p-1) m - B) / beta
        ("allgather", 4, 1e5, 3e-4 + (3e5 - 2e5) / 1e8),
        ("broadcast", 4, 1e6, 3e-4 + (3e6 - 2e5) / 1e8),
        # PS fan-in: 2p alpha + (2 (p-1) - (p-2) phi)(n - B) / beta = 8 alpha + 5.5 x 8e5 / beta
        ("ps", 4, 1e6, 8e-4 + 5.5 * 8e5 / 1e8),
        # server round: 2 (p-1) alpha + (p-1)(2 - phi)(n - B) / beta = 6 alpha + 5.25 x 8e5 / beta
        ("ps_server", 4, 1e6, 6e-4 + 5.25 * 8e5 / 1e8),
        # one worker's exchange: 4 alpha + 2 (n - B) / beta (phi plays no part)
        ("ps_worker", 4, 1e6, 4e-4 + 1.6e6 / 1e8),
        # round robin: (p-1)(alpha + (2 - phi)(n - B) / beta); p = 2: 2 (alpha + (n - B) / beta)
        ("round_robin", 4, 1e6, 3e-4 + 5.25 * 8e5 / 1e8),
        ("round_robin", 2, 1e6, 2e-4 + 1.6e6 / 1e8),
        # full duplex (phi = 1) is the ideal p n of the fan-in: checked below
    ],
)
def test_collective_formulas_with_burst_and_overlap_by_hand(name, p, n, want):
    got = cm.collective_time(name, p, n, 1e-4, 1e8, burst=2e5, overlap=0.25)
    assert got == pytest.approx(want, rel=1e-12)


def test_full_duplex_fan_in_exposes_only_the_last_reply():
    # phi = 1: the p - 1 requests then one reply: p n bytes; the server's round (p - 1) n
    for p in (2, 4, 8):
        assert cm.collective_terms("ps", p, 1e6, overlap=1.0) == (2 * p, p * 1e6)
        assert cm.collective_terms("ps_server", p, 1e6, overlap=1.0) == (2 * (p - 1), (p - 1) * 1e6)
    # with p >= 3 the server's round bounds a step before the worker's own exchange does
    for p in (3, 4, 8):
        for phi in (0.0, 0.5, 1.0):
            s_a, s_b = cm.collective_terms("ps_server", p, 1e6, overlap=phi)
            w_a, w_b = cm.collective_terms("ps_worker", p, 1e6)
            assert s_a >= w_a and s_b >= w_b


def test_hierarchical_allreduce_by_hand():
    # 16 workers, 4 per node: tree over 4 inside (2 levels, both ways) + ring over 4 nodes
    intra, inter = (1e-6, 1e10), (1e-4, 1e8)
    want = 2 * 2 * (1e-6 + 1e6 / 1e10) + 2 * 3 * (1e-4 + 1e6 / (4 * 1e8))
    assert cm.hierarchical_allreduce_time(16, 4, 1e6, intra, inter) == pytest.approx(want, rel=1e-12)
    # one node: no network part
    assert cm.hierarchical_allreduce_time(4, 8, 1e6, intra, inter) == pytest.approx(
        2 * 2 * (1e-6 + 1e-4), rel=1e-12
    )


def _net(name: str, p: int, nbytes: float) -> float:
    return cm.collective_time(name, p, nbytes, 1e-4, 1e8)


def test_step_time_per_strategy():
    kw = dict(n=1e6, m=1e4, t_compute=0.05, t_codec=0.002, net=_net)
    ring_n = _net("ring", 4, 1e6)
    assert cm.step_time("limit", 4, **kw)["step_s"] == 0.05
    assert cm.step_time("ddp", 4, **{**kw, "m": 1e6})["step_s"] == pytest.approx(0.052 + ring_n)
    gather = cm.step_time("ddp", 4, aggregation="allgather", **kw)
    assert gather["step_s"] == pytest.approx(0.052 + _net("allgather", 4, 1e4))
    two = cm.step_time("ddp", 4, calls=2, **kw)
    assert two["comm_s"] == pytest.approx(2 * _net("ring", 4, 5e3))
    # sync EASGD overlapped: the exchange hides behind compute up to t_c
    sync = cm.step_time("sync_easgd", 4, overlap=True, **{**kw, "m": 1e6})
    assert sync["step_s"] == pytest.approx(max(0.05, ring_n) + 0.002)
    assert cm.step_time("local_sgd", 4, tau=8, **kw)["step_s"] == pytest.approx(0.05 + ring_n / 8)
    rr = cm.step_time("easgd_round_robin", 4, **kw)
    assert rr["step_s"] == pytest.approx(0.05 + _net("round_robin", 4, 1e6))
    # async: the server's round S = 6 alpha + 6 n / beta = 0.0606 s, the worker's own
    # exchange W = 4 alpha + 2 n / beta = 0.0204 s
    s_round, w_own = 6e-4 + 6e-2, 4e-4 + 2e-2
    assert cm.step_time("async_easgd", 4, overlap=True, **kw)["step_s"] == pytest.approx(
        max(0.05, w_own, s_round))
    assert cm.step_time("async_easgd", 4, **kw)["step_s"] == pytest.approx(max(0.05 + w_own, s_round))
    # a fast server (2 workers' round) leaves the worker's own period: t_c + W without overlap
    assert cm.step_time("async_easgd", 2, **kw)["step_s"] == pytest.approx(0.05 + w_own)
    assert cm.step_time("async_easgd", 2, overlap=True, **kw)["step_s"] == pytest.approx(0.05)
    # tau = 4 with overlap: max(3 t_c + max(t_c, W), S) / 4
    assert cm.step_time("async_easgd", 4, overlap=True, tau=4, **kw)["step_s"] == pytest.approx(
        max(3 * 0.05 + max(0.05, w_own), s_round) / 4)
    with pytest.raises(ValueError, match="hogwild"):
        cm.step_time("hogwild_easgd", 4, **kw)


def _synthetic_inputs(model: dict[str, dict]) -> dict:
    """Rows whose measured step times are the model's own predictions (4 ranks, 2 cores)."""
    n, t_c4 = 614_440.0, 0.06
    rows = [
        {"strategy": "limit", "compression": "none", "overrides": [], "step_time_s": t_c4},
        {"strategy": "ddp", "compression": "none", "overrides": []},
        {"strategy": "ddp", "compression": "dgc", "overrides": ["optim.momentum=0"],
         "bytes_per_exchange": 2_000.0},
        {"strategy": "sync_easgd", "compression": "none", "overrides": []},
        {"strategy": "async_easgd", "compression": "none", "overrides": []},
        {"strategy": "easgd_round_robin", "compression": "none", "overrides": []},
    ]
    codec = {"dgc": {"seconds": 0.001, "payload_bytes": 2000, "aggregation": "allgather", "calls": 1}}
    inputs = {"cpus": 2, "dense_bytes": n, "codec": codec, "rows": rows, "probe": []}
    for row in rows:
        row.update(workers=4, rate_mbit=100.0, status="ok")
        row.setdefault("bytes_per_exchange", n)
    for row in rows[1:]:
        x = cm.row_inputs(row, inputs)
        row["step_time_s"] = cm.step_time(
            row["strategy"], 4, n=x["n"], m=x["m"], t_compute=x["t_compute"], t_codec=x["t_codec"],
            net=cm.fitted_net(model, 100.0), aggregation=x["aggregation"], calls=x["calls"],
            **cm.row_options(row),
        )["step_s"]
    return inputs


MODEL = {op: {"alpha_s": 3e-4, "eta": 0.9} for op in cm.COLLECTIVES}


def test_predictions_reproduce_rows_that_follow_the_model():
    inputs = _synthetic_inputs(MODEL)
    preds = cm.predict_rows(MODEL, inputs)
    assert [p["row"] for p in preds][:2] == ["limit/none", "ddp/none"]
    for p in preds:
        assert p["rel_err"] == pytest.approx(0.0, abs=1e-12), p["row"]
    assert [p["in_fit"] for p in preds] == [True] + [False] * 5
    # the async server does not compute: 3 computing processes on 2 cores, not 4
    async_row = next(p for p in preds if p["row"] == "async_easgd/none")
    assert async_row["t_compute_s"] == pytest.approx(0.06 / 2 * 1.5)


def test_projection_curves_table_and_sc17_mark(tmp_path):
    inputs = _synthetic_inputs(MODEL)
    proj = cm.project(MODEL, inputs)
    assert "not a measurement" in proj["note"]
    assert proj["sc17"]["workers"] == 4253 and proj["sc17"]["efficiency"] == 0.915
    assert proj["workers"][0] == 1 and proj["workers"][-1] == 4096
    for layout in ("knl", "gpu"):
        curves = proj["curves"][layout]
        assert "sync_easgd/none (SC17 tree)" in curves and "sync_easgd/none (hierarchical)" in curves
        for label, effs in curves.items():
            assert effs[0] == 1.0, label
            assert all(0 < e <= 1.0 + 1e-12 for e in effs), label
        assert set(proj["table"][layout]["ddp/none"]) == {"64", "512", "4096"}
        # the flat ring's latency term grows with p: efficiency does not rise with scale
        ddp = curves["ddp/none"]
        assert all(b <= a + 1e-12 for a, b in zip(ddp, ddp[1:]))
        # the compressed all-gather grows with p; the tree does not grow linearly
        tree = proj["table"][layout]["sync_easgd/none (SC17 tree)"]
        assert tree["4096"] >= proj["table"][layout]["sync_easgd/none"]["4096"]
    # a 4096-worker ring on the KNL layout by hand: 60 nodes' worth of inter-node hops
    knl = cm.LAYOUTS["knl"]
    t_c = 0.06 / 2 * knl["compute_factor"]
    ring = cm.collective_time("ring", 4096, 614_440.0, 3e-4, 0.9 * knl["inter_mbit"] * 1e6 / 8)
    assert proj["curves"]["knl"]["ddp/none"][-1] == pytest.approx(t_c / (t_c + ring), rel=1e-12)


def test_rows_on_two_rank_counts_each_use_their_own_limit_row(tmp_path):
    # the same rows measured on 2 ranks too, whose limit row is 4x faster per rank than
    # the 4-rank one would give (0.06 / 2): a prediction that took the other p's compute
    # would miss, and the projection takes the rows of the fewest ranks
    inputs = _synthetic_inputs(MODEL)
    two = [{**r, "workers": 2, "step_time_s": None} for r in inputs["rows"]]
    two[0]["step_time_s"] = 0.0075
    inputs["rows"] += two
    for row in two[1:]:
        x = cm.row_inputs(row, inputs)
        assert x["t_compute"] == pytest.approx(0.0075)  # one rank per core: no sharing
        row["step_time_s"] = 1.25 * cm.step_time(
            row["strategy"], 2, n=x["n"], m=x["m"], t_compute=x["t_compute"], t_codec=x["t_codec"],
            net=cm.fitted_net(MODEL, 100.0), aggregation=x["aggregation"], calls=x["calls"],
            **cm.row_options(row),
        )["step_s"]
    preds = cm.predict_rows(MODEL, inputs)
    for p in preds:
        want = 0.0 if p["workers"] == 4 or p["in_fit"] else 1 / 1.25 - 1  # -20%
        assert p["rel_err"] == pytest.approx(want, abs=1e-12), (p["row"], p["workers"])
    proj = cm.project(MODEL, inputs, workers=[1, 4096])
    md = cm.markdown({"fit": {}, "loops": {}, "predictions": preds, "projection": proj,
                      "inputs_summary": {"probe_samples": 0, "probe_workers": [], "probe_rates_mbit": []}})
    assert "Held-out rows within 15% on 2 ranks: 0 of 5." in md
    assert "Held-out rows within 15% on 4 ranks: 5 of 5." in md
    # the projection: one curve per configuration, from the 2-rank rows (their t_c of 7.5 ms)
    assert len(proj["curves"]["knl"]) == 5 + 2
    knl = cm.LAYOUTS["knl"]
    t_c = 0.0075 * knl["compute_factor"]
    ring = cm.collective_time("ring", 4096, 614_440.0, 3e-4, 0.9 * knl["inter_mbit"] * 1e6 / 8)
    assert proj["curves"]["knl"]["ddp/none"][-1] == pytest.approx(t_c / (t_c + ring), rel=1e-12)


def test_local_runs_replace_the_codec_alone_with_the_rows_own_cost_beyond_the_limit():
    inputs = _synthetic_inputs(MODEL)
    inputs["codec_exchange"] = {"dgc": {"seconds_by_world": {"1": 0.001, "4": 0.002}, "bytes": 2000.0,
                                        "messages": 1.0}}
    dgc = next(r for r in inputs["rows"] if r["compression"] == "dgc")
    ddp = next(r for r in inputs["rows"] if r["strategy"] == "ddp" and r["compression"] == "none")
    sync = next(r for r in inputs["rows"] if r["strategy"] == "sync_easgd")
    before = cm.row_inputs(dgc, inputs)
    assert before["t_codec_1"](4) == pytest.approx(0.002)  # the codec timed alone
    run = lambda strategy, compression, overrides, workers, t: {  # noqa: E731
        "strategy": strategy, "compression": compression, "overrides": overrides,
        "workers": workers, "status": "ok", "step_time_s": t}
    # on one host: 4 ranks (the rows' p: 2 per core) for DGC, 1 rank only for dense DDP;
    # runs of more ranks than a row's p never count (8 ranks here)
    inputs["local_rows"] = [run("limit", "none", [], 4, 0.010), run("ddp", "dgc", ["optim.momentum=0"], 4, 0.016),
                            run("limit", "none", [], 1, 0.005), run("ddp", "none", [], 1, 0.0055),
                            run("limit", "none", [], 8, 0.020), run("ddp", "none", [], 8, 0.090)]
    # 6 ms beyond the limit for 4 ranks sharing 2 cores: 3 ms per worker with a core
    assert cm.local_cost(dgc, inputs) == (4, pytest.approx(0.003))
    x = cm.row_inputs(dgc, inputs)
    assert x["t_codec_1"](4) == pytest.approx(0.003)
    assert x["t_codec"] == pytest.approx(0.003 * cm.cpu_share(4, 2))  # back to the 4-rank share
    # the projection's q: the codec's growth from the run's 4 ranks (-1 ms at one rank)
    assert x["t_codec_1"](1) == pytest.approx(0.002)
    # dense DDP from its one-rank run: its machinery alone (0.5 ms); no local run: unchanged
    assert cm.local_cost(ddp, inputs) == (1, pytest.approx(0.0005))
    assert cm.row_inputs(ddp, inputs)["t_codec"] == pytest.approx(0.0005 * cm.cpu_share(4, 2))
    assert cm.local_cost(sync, inputs) is None
    # a 4-rank row with only a 2-rank local run (one rank per core): its per-worker cost,
    # and the codec's growth from 2 to 4 ranks
    inputs["local_rows"] = [run("limit", "none", [], 2, 0.005), run("ddp", "dgc", ["optim.momentum=0"], 2, 0.008)]
    assert cm.local_cost(dgc, inputs) == (2, pytest.approx(0.003))
    grow = cm.codec_seconds(inputs["codec_exchange"]["dgc"], 4) - cm.codec_seconds(inputs["codec_exchange"]["dgc"], 2)
    assert cm.row_inputs(dgc, inputs)["t_codec_1"](4) == pytest.approx(0.003 + grow)
    assert cm.local_cost(inputs["rows"][0], inputs) is None  # the limit itself
    pred = next(p for p in cm.predict_rows(MODEL, inputs) if p["row"] == cm.row_label(dgc))
    assert pred["t_codec_s"] == pytest.approx((0.003 + grow) * cm.cpu_share(4, 2))
    # with the runs' meters: the step outside the exposed communication (loopback transfers
    # and waits for the other rank, which C and s charge): (8 - 2.5) - (5 - 0.1) = 0.6 ms
    inputs["local_rows"][0]["meter"] = {"rest_s": 0.0049, "exposed_s": 0.0001}
    inputs["local_rows"][1]["meter"] = {"rest_s": 0.0055, "exposed_s": 0.0025}
    assert cm.local_cost(dgc, inputs) == (2, pytest.approx(0.0006))


def test_rows_workers_parse_and_errors():
    assert cm.parse_workers("2,4,2") == [2, 4]
    assert cm.parse_workers("4") == [4]
    with pytest.raises(ValueError, match="--rows-workers"):
        cm.parse_workers("1,4")


def test_layout_overrides_and_errors():
    lay = cm.layouts_with(["gpu.compute_factor=0.5", "knl.per_node=4"])
    assert lay["gpu"]["compute_factor"] == 0.5 and lay["knl"]["per_node"] == 4
    assert cm.LAYOUTS["gpu"]["compute_factor"] == 0.1  # the defaults are untouched
    with pytest.raises(ValueError, match="LAYOUT.KEY=VALUE"):
        cm.layouts_with(["tpu.per_node=4"])
    with pytest.raises(ValueError, match="positive number"):
        cm.layouts_with(["knl.per_node=zero"])


def test_report_adds_the_projection_from_costmodel_json(tmp_path):
    # the probe shared 2 cores (inputs["cpus"]) and ran on the token-bucket links: rows and
    # probe follow the same scaled model, with the bucket's burst and phi = 0.4
    truth = {op: {**par, "cpus": 2, "burst": True, "overlap": 0.4} for op, par in MODEL.items()}
    inputs = _synthetic_inputs(truth)
    inputs["probe"] = _synthetic_probe({op: (3e-4, 0.9) for op in cm.COLLECTIVES}, cpus=inputs["cpus"],
                                       burst=_burst, overlap=0.4)
    result = cm.analyse(inputs, tmp_path / "costmodel")
    assert result["fit"]["ring"]["eta"] == pytest.approx(0.9, rel=1e-12)
    assert result["fit"]["ps"]["overlap"] == pytest.approx(0.4, rel=1e-9)
    md = (tmp_path / "costmodel" / "costmodel.md").read_text()
    assert "Held-out rows within 15% on 4 ranks: 5 of 5." in md
    assert_valid_png(tmp_path / "costmodel" / "costmodel_projection.png")
    # a sweep directory holding the file: the report gains the projection section
    path, _ = report.write_report(tmp_path)
    text = path.read_text()
    assert "## Weak-scaling projection (cost model)" in text
    assert "MODEL PROJECTION, not a measurement" in text
    assert "| ddp/none |" in text and "E(4096)" in text
    assert_valid_png(tmp_path / "costmodel_projection.png")
    # and none without it
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "summary.json").write_text(json.dumps({"status": "ok", "strategy": "ddp"}))
    assert "Weak-scaling projection" not in report.write_report(plain)[0].read_text()
    assert math.isfinite(result["projection"]["table"]["knl"]["ddp/none"]["4096"])


# ---------------------------------------------------------------- loops, codec, messages
def _synthetic_loops(probe: list[dict], free: dict[int, float], sync: dict[str, dict[int, float]],
                     hidden: float = 1.0) -> list[dict]:
    """Loop samples that follow the loop model exactly: serial = F + C + s, overlapped =
    F + C - h min(F, C) + s, at the smallest and the largest probe message of each rate."""
    idle = {(s["op"], s["p"], s["bytes"], s["rate_mbit"]): s["time_s"] for s in probe}
    loops = []
    for (op, p, nbytes, rate), c in idle.items():
        if nbytes not in (cm.probe_sizes(rate)[0], cm.probe_sizes(rate)[-1]) or op != "ring":
            continue
        loops.append({"op": "loop_free", "p": p, "bytes": nbytes, "rate_mbit": rate, "time_s": free[p]})
        for shape, by_p in sync.items():
            mode, coll = shape.split("_")
            c = idle[(coll, p, nbytes, rate)]
            base = free[p] + c - (hidden * min(free[p], c) if mode == "overlap" else 0.0)
            loops.append({"op": f"loop_{shape}", "p": p, "bytes": nbytes, "rate_mbit": rate,
                          "time_s": base + by_p[p]})
    return loops


def test_fit_loops_recovers_known_synchronisation_costs():
    probe = _synthetic_probe({"ring": (ALPHA, ETA), "allgather": (2 * ALPHA, 0.6)}, cpus=2)
    free = {2: 0.012, 4: 0.024, 8: 0.048}
    sync = {shape: {p: 1e-3 * (k + 1) * p for p in free} for k, shape in enumerate(cm.LOOP_SHAPES)}
    got = cm.fit_loops(_synthetic_loops(probe, free, sync), probe)
    assert got["samples"] == len(cm.LOOP_SHAPES) * 3 * 3 * 2
    for p, f in free.items():
        assert got["free_s"][str(p)] == pytest.approx(f, rel=1e-12)
    for shape, by_p in sync.items():
        for p, s in by_p.items():
            assert got["sync_s"][shape][str(p)] == pytest.approx(s, rel=1e-9), (shape, p)
            assert all(v == pytest.approx(s, rel=1e-9) for v in got["by_size"][shape][str(p)].values())
    assert all(h == pytest.approx(1.0, abs=1e-9) for h in got["hidden"]["overlap_ring"].values())


def test_fit_loops_reads_the_synchronisation_cost_at_the_smallest_message():
    """At the largest messages a serial loop's excess over F + C is the difference of two
    timings of a long transfer: here 30% of C faster than the idle probe's. s is a wait,
    read where C is a few alpha; a median over both sizes would land between the two."""
    probe = _synthetic_probe({"ring": (ALPHA, ETA), "allgather": (2 * ALPHA, 0.6)}, cpus=2)
    free = {2: 0.012, 4: 0.024, 8: 0.048}
    sync = {"serial_allgather": {p: 0.001 * p for p in free}}
    loops = _synthetic_loops(probe, free, sync)
    idle = {(s["op"], s["p"], s["bytes"], s["rate_mbit"]): s["time_s"] for s in probe}
    for s in loops:
        if s["op"] == "loop_serial_allgather" and s["bytes"] == cm.probe_sizes(s["rate_mbit"])[-1]:
            s["time_s"] -= 0.3 * idle[("allgather", s["p"], s["bytes"], s["rate_mbit"])]
    got = cm.fit_loops(loops, probe)
    for p, s in sync["serial_allgather"].items():
        assert got["sync_s"]["serial_allgather"][str(p)] == pytest.approx(s, rel=1e-9), p
        by_size = got["by_size"]["serial_allgather"][str(p)]
        assert by_size[str(min(int(b) for b in by_size))] == pytest.approx(s, rel=1e-9)
        assert max(by_size.values()) == pytest.approx(s, rel=1e-9) and min(by_size.values()) < 0


@pytest.mark.parametrize("hidden", [0.0, 0.3, 0.85])
def test_fit_loops_recovers_the_hidden_share_of_an_overlap(hidden):
    probe = _synthetic_probe({"ring": (ALPHA, ETA), "allgather": (2 * ALPHA, 0.6)}, cpus=2)
    free = {2: 0.012, 4: 0.024, 8: 0.048}
    sync = {"overlap_ring": {p: 0.004 for p in free}, "overlap_allgather": {p: 0.002 for p in free}}
    got = cm.fit_loops(_synthetic_loops(probe, free, sync, hidden=hidden), probe)
    for shape, by_p in sync.items():
        for p, s in by_p.items():
            assert got["hidden"][shape][str(p)] == pytest.approx(hidden, abs=1e-9), (shape, p)
            assert got["sync_s"][shape][str(p)] == pytest.approx(s, abs=1e-12), (shape, p)
    # and the step time of an overlapped row with it: t_c + C - h min(t_c, C) + t_k + s
    kw = dict(n=1e6, m=1e6, t_compute=0.05, t_codec=0.002, net=_net, overlap=True)
    ring = _net("ring", 4, 1e6)
    got_t = cm.step_time("sync_easgd", 4, hidden=hidden, sync_cost=0.004, **kw)["step_s"]
    assert got_t == pytest.approx(0.05 + ring - hidden * min(0.05, ring) + 0.002 + 0.004)


def test_step_time_adds_the_synchronisation_cost_per_exchange():
    kw = dict(n=1e6, m=1e4, t_compute=0.05, t_codec=0.002, net=_net)
    serial = cm.step_time("ddp", 4, aggregation="allgather", calls=2, sync_cost=0.01, **kw)
    assert serial["step_s"] == pytest.approx(0.052 + 2 * _net("allgather", 4, 5e3) + 0.01)
    ring_n = _net("ring", 4, 1e6)
    ovl = cm.step_time("sync_easgd", 4, overlap=True, sync_cost=0.01, tau=2, **{**kw, "m": 1e6})
    assert ovl["step_s"] == pytest.approx(max(0.05, ring_n / 2) + 0.002 + 0.005)
    local = cm.step_time("local_sgd", 4, tau=8, sync_cost=0.008, **kw)
    assert local["step_s"] == pytest.approx(0.05 + (ring_n + 0.008) / 8)


def test_codec_seconds_grow_linearly_with_the_world_and_never_fall():
    ex = {"seconds_by_world": {"1": 0.001, "4": 0.0025}}
    assert cm.codec_seconds(ex, 4) == pytest.approx(0.0025)
    assert cm.codec_seconds(ex, 4096) == pytest.approx(0.001 + 0.0005 * 4095)
    flat = {"seconds_by_world": {"1": 0.002, "4": 0.0019}}  # timing noise: no negative slope
    assert cm.codec_seconds(flat, 4096) == pytest.approx(0.002)


def test_predictions_with_loops_and_exchange_measurements():
    model = {op: {**par, "cpus": 2} for op, par in MODEL.items()}
    inputs = _synthetic_inputs(model)
    shapes = [(10,), (10, 2048), (2048,), (2048, 64)]
    inputs["model_shapes"] = shapes
    inputs["codec_exchange"] = {"dgc": {"seconds_by_world": {"1": 0.001, "4": 0.0025},
                                        "messages": 2.0, "bytes": 3000.0}}
    loops = {"sync_s": {"serial_ring": {"4": 0.011}, "serial_allgather": {"4": 0.007},
                        "overlap_ring": {"4": 0.013}}}
    preds = {p["row"]: p for p in cm.predict_rows(model, inputs, loops)}
    n = 4.0 * (10 + 20480 + 2048 + 131072)
    net = cm.fitted_net(model, 100.0)
    t_c = 0.06  # 4 ranks on 2 cores
    assert preds["ddp/none"]["predicted_s"] == pytest.approx(t_c + net("ring", 4, n) + 0.011)
    dgc = preds["ddp/dgc;optim.momentum=0"]
    assert dgc["t_codec_s"] == pytest.approx(0.0025 * 2)
    assert dgc["predicted_s"] == pytest.approx(t_c + 0.005 + 2 * net("allgather", 4, 1500.0) + 0.007)
    sync = preds["sync_easgd/none"]
    assert sync["predicted_s"] == pytest.approx(max(t_c, net("ring", 4, n)) + 0.013)
    assert preds["async_easgd/none"]["sync_s"] == 0.0  # no loop shape for the server


def test_count_exchange_messages_follows_the_exchange_structure():
    shapes = [(10,), (10, 2048), (2048,), (2048, 64)]
    # PowerSGD, rank 2: the P round of both matrices of >= 16384 entries, then their Q
    # round, (n + m) r floats per matrix, each round one fused all-reduce that also carries
    # the 1-D tensors' dense part (the lazy all-reduce of e39bcfc: 2 messages, were 5)
    got = cm.count_exchange_messages("powersgd", [], shapes)
    assert got["messages"] == 2
    # (the dense part may carry a few bytes of the compressor's own beside the 1-D tensors)
    assert got["bytes"] == pytest.approx(4 * 2 * (10 + 2048) + 4 * 2 * (2048 + 64) + 4 * (10 + 2048), abs=16)
    # top-k: every payload and the small tensors in one batched all-gather
    assert cm.count_exchange_messages("topk", [], shapes)["messages"] == 1


def test_row_meter_reads_the_steady_state_from_the_two_runs(tmp_path):
    def summary(steps, clock, comm, exposed, codec, msgs):
        return {"steps_per_rank": [steps] * 2, "wall_time_s": clock + 1, "samples_per_s": 10,
                "val_history": [{"step": steps, "time_s": clock}],
                "comm": {"bytes_sent": [steps * 100] * 2, "time_s": [comm] * 2,
                         "exposed_time_s": [exposed] * 2, "messages": [msgs] * 2},
                "extras": [{"compression_stats": {"codec_time_s": codec}}] * 2}
    (tmp_path / "first10").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps(summary(40, 4.0, 2.0, 1.5, 0.4, 40)))
    (tmp_path / "first10" / "summary.json").write_text(json.dumps(summary(10, 1.3, 0.5, 0.4, 0.1, 10)))
    got = cm.row_meter(tmp_path, 10)
    assert got["step_s"] == pytest.approx(2.7 / 30)
    assert got["comm_s"] == pytest.approx(1.5 / 30) and got["exposed_s"] == pytest.approx(1.1 / 30)
    assert got["codec_s"] == pytest.approx(0.3 / 30) and got["messages_per_step"] == pytest.approx(1.0)
    assert got["rest_s"] == pytest.approx(1.6 / 30)
    assert cm.row_meter(tmp_path / "missing", 10) is None


# ---------------------------------------------------------------- per-round synchronisation
def _rounds_loops(probe: list[dict], free: dict[int, float], s0: float, per_round: dict[int, float]) -> list[dict]:
    """Serial ring loops of r = 1, 2, 4 blocking all-reduces per iteration at the smallest
    message of each rate, following T_r = F + r C + s0 + r s_r exactly."""
    idle = {(s["op"], s["p"], s["bytes"], s["rate_mbit"]): s["time_s"] for s in probe}
    loops = []
    for (op, p, nbytes, rate), c in idle.items():
        if op != "ring" or nbytes != cm.probe_sizes(rate)[0]:
            continue
        loops.append({"op": "loop_free", "p": p, "bytes": nbytes, "rate_mbit": rate, "time_s": free[p]})
        for r in (1, 2, 4):
            loops.append({"op": "loop_serial_ring" + (f"_x{r}" if r > 1 else ""), "p": p,
                          "bytes": nbytes, "rate_mbit": rate,
                          "time_s": free[p] + r * c + s0 + r * per_round[p]})
    return loops


@pytest.mark.parametrize("per_round", [{2: 0.0, 4: 0.0, 8: 0.0}, {2: 0.002, 4: 0.005, 8: 0.011}])
def test_fit_loops_recovers_the_per_round_synchronisation_cost(per_round):
    probe = _synthetic_probe({"ring": (ALPHA, ETA)}, cpus=2)
    free = {2: 0.006, 4: 0.011, 8: 0.022}
    got = cm.fit_loops(_rounds_loops(probe, free, 0.003, per_round), probe)
    for p, sr in per_round.items():
        assert got["per_round_s"][str(p)] == pytest.approx(sr, abs=1e-12), p
        assert got["fixed_s"][str(p)] == pytest.approx(0.003, abs=1e-12), p
        assert got["by_rounds"][str(p)]["4"] == pytest.approx(0.003 + 4 * sr, abs=1e-12)
        # the one-round loop's s is what one blocking round costs
        assert got["sync_s"]["serial_ring"][str(p)] == pytest.approx(0.003 + sr, abs=1e-12)


def test_fit_rounds_clips_a_negative_slope_and_needs_two_round_counts():
    probe = _synthetic_probe({"ring": (ALPHA, ETA)}, cpus=2)
    free = {2: 0.006, 4: 0.011, 8: 0.022}
    loops = _rounds_loops(probe, free, 0.01, {2: -0.001, 4: -0.001, 8: -0.001})
    assert cm.fit_loops(loops, probe)["per_round_s"] == {"2": 0.0, "4": 0.0, "8": 0.0}
    only_one = [s for s in loops if not s["op"].startswith("loop_serial_ring_x")]
    assert cm.fit_loops(only_one, probe)["per_round_s"] == {}


def _inputs_with_powersgd(model: dict, messages: float) -> dict:
    """The synthetic rows plus a ddp/powersgd row whose exchange sends ``messages``."""
    inputs = _synthetic_inputs(model)
    inputs["rows"].append({"strategy": "ddp", "compression": "powersgd", "overrides": [],
                           "workers": 4, "rate_mbit": 100.0, "status": "ok", "step_time_s": 0.1})
    inputs["codec"]["powersgd"] = {"seconds": 0.001, "aggregation": "allreduce", "calls": 2}
    inputs["codec_exchange"] = {
        "powersgd": {"seconds_by_world": {"1": 0.001, "4": 0.001}, "messages": messages, "bytes": 40000.0},
        "dgc": {"seconds_by_world": {"1": 0.001, "4": 0.001}, "messages": 2.0, "bytes": 3000.0}}
    return inputs


def test_predictions_charge_each_further_blocking_round():
    model = {op: {**par, "cpus": 2} for op, par in MODEL.items()}
    inputs = _inputs_with_powersgd(model, 5.0)
    loops = {"sync_s": {"serial_ring": {"4": 0.004}, "serial_allgather": {"4": 0.007}},
             "per_round_s": {"4": 0.003}}
    preds = {p["row"]: p for p in cm.predict_rows(model, inputs, loops)}
    net = cm.fitted_net(model, 100.0)
    psgd = preds["ddp/powersgd"]
    assert psgd["sync_s"] == pytest.approx(0.004 + 4 * 0.003)  # s + (k - 1) s_r, k = 5
    assert psgd["predicted_s"] == pytest.approx(0.06 + 0.002 + 5 * net("ring", 4, 8000.0) + 0.016)
    assert preds["ddp/none"]["sync_s"] == pytest.approx(0.004)  # one round: s alone
    # the all-gather shape was not probed in rounds: its s stays per exchange
    assert preds["ddp/dgc;optim.momentum=0"]["sync_s"] == pytest.approx(0.007)


def test_kernel_matmuls_is_at_least_one_product():
    n, mm_s = cm.kernel_matmuls(0.0, repeats=8)
    assert n == 1 and mm_s > 0


def test_fit_ps_loop_recovers_the_busy_servers_overlap_per_p_and_rate_and_predictions_use_it():
    # the ps probe fitted with the fan-in's phi 0.3; a busy server drains a share that
    # depends on p and on the link rate
    alpha, eta, fan_in = 4e-4, 0.9, 0.3
    busy = {4: {50.0: 0.4, 200.0: 0.7, 1000.0: 0.5}, 8: {50.0: 0.35, 200.0: 0.55, 1000.0: 0.3}}
    model = {"ps": {"alpha_s": alpha, "eta": eta, "cpus": 2, "burst": True, "overlap": fan_in}}
    loops = []
    for rate in RATES:
        n = cm.probe_sizes(rate)[-1]
        x = (n - _burst(rate)) / (eta * _bps(rate))  # seconds of one message past the burst
        for p in (2, 4, 8):
            a = alpha * cm.cpu_share(p, 2)
            phi = busy.get(p, {}).get(rate, 0.0)
            loops.append({"op": "loop_free", "p": p, "bytes": n, "rate_mbit": rate, "time_s": 0.01})
            # the server's round, by hand: 2(p-1) alpha + (p-1)(2 - phi) x
            loops.append({"op": "loop_ps", "p": p, "bytes": n, "rate_mbit": rate,
                          "time_s": 2 * (p - 1) * a + (p - 1) * (2 - phi) * x})
    # a worker-bound sample (its own kernel longer than the server's round) says nothing
    loops.append({"op": "loop_free", "p": 4, "bytes": 1024, "rate_mbit": 10.0, "time_s": 5.0})
    loops.append({"op": "loop_ps", "p": 4, "bytes": 1024, "rate_mbit": 10.0, "time_s": 5.1})
    fitted = cm.fit_ps_loop(loops, model)
    assert set(fitted) == {"4", "8"}  # one worker (p = 2) has no next request
    for p, by_rate in busy.items():
        assert set(fitted[str(p)]) == {"50", "200", "1000"}
        for rate, phi in by_rate.items():
            assert fitted[str(p)][f"{rate:g}"] == pytest.approx(phi, abs=1e-9)
    # linear in log(rate) between probed rates: 100 Mbit/s is halfway from 50 to 200
    assert cm.busy_phi(fitted["4"], 100.0) == pytest.approx(0.55, abs=1e-9)
    assert cm.busy_phi(fitted["4"], 20.0) == pytest.approx(0.4) and cm.busy_phi(fitted["4"], 5000.0) == pytest.approx(0.5)
    assert cm.busy_phi(fitted["8"], 200.0) == pytest.approx(0.55)
    # the busy server's phi replaces the fan-in's for the server round and round robin at
    # its p; the fan-in formula itself keeps the fan-in's phi
    full = {op: {**MODEL[op], "cpus": 2} for op in cm.COLLECTIVES}
    full["ps"] = model["ps"]
    net, busy_net = cm.fitted_net(full, 100.0), cm.fitted_net(full, 100.0, fitted)
    y = (614_440 - 25_000) / (eta * 12.5e6)
    a4 = alpha * cm.cpu_share(4, 2)
    assert busy_net("ps_server", 4, 614_440) == pytest.approx(6 * a4 + 3 * (2 - 0.55) * y, rel=1e-12)
    assert net("ps_server", 4, 614_440) == pytest.approx(6 * a4 + 3 * (2 - 0.3) * y, rel=1e-12)
    assert busy_net("round_robin", 4, 614_440) == pytest.approx(3 * a4 + 3 * (2 - 0.55) * y, rel=1e-12)
    assert busy_net("ps", 4, 614_440) == net("ps", 4, 614_440)
    assert busy_net("ps_server", 2, 614_440) == net("ps_server", 2, 614_440)  # not measured at p = 2
    inputs = _synthetic_inputs(full)
    preds = {p["row"]: p for p in cm.predict_rows(full, inputs, {"busy_overlap": fitted})}
    # async_easgd (tau 1, overlap): max(t_c, W, S), S the busy round
    assert preds["async_easgd/none"]["predicted_s"] == pytest.approx(busy_net("ps_server", 4, 614_440))
    assert cm.fit_ps_loop(loops, {}) == {}
    # the same loop at the workload's message ("at": "workload", another phi per rate):
    # only those samples count where there are any
    at_n = {50.0: 0.8, 200.0: 0.6, 1000.0: 0.2}
    for rate, phi in at_n.items():
        x = (614_440 - _burst(rate)) / (eta * _bps(rate))
        a = alpha * cm.cpu_share(4, 2)
        loops.append({"op": "loop_free", "p": 4, "bytes": 614_440, "rate_mbit": rate, "time_s": 0.01,
                      "at": "workload"})
        loops.append({"op": "loop_ps", "p": 4, "bytes": 614_440, "rate_mbit": rate, "at": "workload",
                      "time_s": 6 * a + 3 * (2 - phi) * x})
    workload = cm.fit_ps_loop(loops, model)
    assert set(workload) == {"4"}
    assert workload["4"] == pytest.approx({f"{r:g}": v for r, v in at_n.items()}, abs=1e-9)


def test_fit_codec_rounds_recovers_the_cost_of_a_round_after_the_codec_and_predictions_use_it():
    # kernel F = 20 ms at p = 4; the codec between the rounds is 5 of its 20 products (f = 5 ms);
    # the loop pays s = 3 ms once (serial_ring) and s_c = 9 ms for the second round
    kernel = {"matmuls": 20, "between_matmuls": 5}
    probe, loops = [], []
    for rate in RATES:
        c = 0.002 * 100.0 / rate  # the idle all-reduce of 1 kB at this rate
        probe.append({"op": "ring", "p": 4, "bytes": 1024, "rate_mbit": rate, "time_s": c})
        loops.append({"op": "loop_free", "p": 4, "bytes": 1024, "rate_mbit": rate, "time_s": 0.020})
        loops.append({"op": "loop_serial_ring_codec", "p": 4, "bytes": 1024, "rate_mbit": rate,
                      "time_s": 0.020 + 0.005 + 2 * c + 0.003 + 0.009})
    fitted = cm.fit_codec_rounds(loops, probe, {"4": 0.003}, kernel)
    assert set(fitted) == {"4"} and fitted["4"] == pytest.approx(0.009, abs=1e-12)
    assert cm.fit_codec_rounds(loops, probe, {"4": 0.003}, {"matmuls": 20, "between_matmuls": 0}) == {}
    assert cm.fit_codec_rounds(loops, probe, {"4": 0.05}, kernel) == {"4": 0.0}  # clipped at 0
    # a two-message exchange is charged s + (k - 1) s_c instead of the back-to-back s_r
    model = {op: {**par, "cpus": 2} for op, par in MODEL.items()}
    inputs = _inputs_with_powersgd(model, 2.0)
    loops_fit = {"sync_s": {"serial_ring": {"4": 0.003}}, "per_round_s": {"4": 0.001}, "codec_round_s": fitted}
    preds = {p["row"]: p for p in cm.predict_rows(model, inputs, loops_fit)}
    assert preds["ddp/powersgd"]["sync_s"] == pytest.approx(0.003 + 0.009)
    assert preds["ddp/none"]["sync_s"] == pytest.approx(0.003)  # one round: s alone
