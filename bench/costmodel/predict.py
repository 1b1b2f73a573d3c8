"""Step time of a (strategy, compression) row from the fitted model: the rows' predictions.

**Step time** of a (strategy, compression) row on p ranks (:func:`step_time`), with t_c the
measured compute per step (the ``limit`` row: same hosts, no communication; CPU sharing of
k computing processes on c cores scales it by max(1, k/c)), t_k the codec time of one
exchange (:func:`measure_exchange_codec`: error feedback, compression, this rank's decode
and the decode of every rank's payload (all-gather) or of the sum (all-reduce), on the
model's own tensors; linear in p between the measured world sizes; same CPU scaling; for
the all-reduce / all-gather family (:data:`LOCAL_STRATEGIES`) the row's own configuration
run with min(p, cores) ranks on one host instead (loopback, no shaped link), less the
limit row run the same way, each outside its exposed communication (the loopback transfers
and the waits inside the collectives, which C and s charge), per worker with a core
(:func:`local_cost`: the codec and the strategy's machinery per step, DDP's reducer, the
elastic update and the other ranks' threads included, which the codec timed alone leaves
out; the same CPU scaling to p, plus the codec's growth to p)), n
the dense message, m the payload a rank sends per exchange and k its messages
(:func:`count_exchange_messages`: the exchange run through the strategies' own collective
on a one-rank group, e.g. PowerSGD: a P and a Q round per matrix plus the small tensors'
dense all-reduce), C = k x ring(p, m/k) (linear payloads) or k x all-gather(p, m/k)
(sparse payloads), s = s(p, the row's loop shape):

- ``ddp``: t_c + t_k + C + s (serial; s + (k - 1) s_r for k blocking all-reduces);
- ``sync_easgd``: the same, C and s per exchange / tau; with ``overlap`` the exchange runs
  behind the next step's compute: t_c + C - h min(t_c, C) + t_k + s (overlapped; h = 1:
  max(t_c, C) + t_k + s);
- ``local_sgd``: t_c + (ring(p, n) + s) / tau;
- ``easgd_round_robin``: t_c + round robin(p, n) / tau;
- ``async_easgd`` (server = one rank, p - 1 workers; W = PS worker(n), S = PS server
  round(p, n)): max((tau - 1) t_c + max(t_c, W), S) / tau with overlap (tau = 1:
  max(t_c, W, S)), max(tau t_c + W, S) / tau without (no loop shape probed: s = 0);
- ``limit``: t_c.

**Held out.** The fit uses only the probe (collectives and loops), the limit rows
(compute), the local runs and the codec measurements (time, messages and bytes of each exchange); every
training row's step time is a prediction, reported against its measured step time
(target: within 15%), at a link rate the probe did not use, on each of the rows' rank
counts (``--rows-workers``, default 2 and 4: one rank per core of this machine, and two
per core), each from the limit row of its own p. A row's step time is its steady state:
the difference of a run and its first steps (``bench/_tables.py``), on the training
clock (summary.json's ``train_time_s``: batches only, not ``fit``'s set-up), the median of
``--repeats`` runs (default 3; their spread printed beside it), as are the limit rows'
and the local runs'. Each held-out row's own meter (communication, exposed and codec time,
messages per step) is printed beside its prediction for diagnosis; none of it enters a
prediction (the local runs' meters do: their step outside the exposed communication).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bench.costmodel.fit import busy_phi, cpu_share
from bench.costmodel.terms import collective_time, emulated_burst_bytes, probe_of, rate_bps

__all__ = [
    "BUSY_SERVER",
    "LOCAL_STRATEGIES",
    "ablation",
    "codec_seconds",
    "dense_bytes",
    "fitted_net",
    "local_cost",
    "loop_shape",
    "predict_rows",
    "row_inputs",
    "row_label",
    "row_options",
    "step_time",
]


def loop_shape(row: dict, aggregation: str) -> str | None:
    """The probe loop a row's exchange has the shape of (None: not probed: the parameter
    server and round robin)."""
    opts = row_options(row)
    coll = "allgather" if aggregation == "allgather" and row["compression"] != "none" else "ring"
    if row["strategy"] in ("ddp", "ddp_compressed", "local_sgd"):
        return f"serial_{coll}"
    if row["strategy"] == "sync_easgd":
        return f"{'overlap' if opts['overlap'] else 'serial'}_{coll}"
    return None


#: strategies whose exchange is a collective of the row's payload every tau steps
_COLLECTIVE_EXCHANGE = ("ddp", "ddp_compressed", "sync_easgd")


def _collective_step(p: int, m: float, t_compute: float, t_codec: float,
                     net: Callable[[str, int, float], float], aggregation: str, calls: float,
                     tau: int, sync_cost: float, hidden: float | None) -> dict:
    """:func:`step_time` of :data:`_COLLECTIVE_EXCHANGE`: ``calls`` all-reduces (or
    all-gathers) of m / calls bytes per exchange, every ``tau`` steps, plus the loop's
    synchronisation cost; ``hidden`` (sync_easgd's overlap; None: blocking): the exchange
    runs behind the next step's compute, h of min(t_c, C) hidden."""
    op = "allgather" if aggregation == "allgather" else "ring"
    comm = calls * net(op, p, m / calls)
    form = f"{op}(p, m)" if calls == 1 else f"{calls:g} x {op}(p, m/{calls:g})"
    comm /= tau
    sync = sync_cost / tau
    extra = " + s" if sync_cost else ""
    if hidden is not None:
        step = t_compute + comm - hidden * min(t_compute, comm) + t_codec + sync
        if hidden == 1.0:
            return {"step_s": step, "comm_s": comm, "formula": f"max(t_c, {form}/tau) + t_k{extra}"}
        return {"step_s": step, "comm_s": comm,
                "formula": f"t_c + {form}/tau - {hidden:.2f} min(t_c, C) + t_k{extra}"}
    return {"step_s": t_compute + t_codec + comm + sync, "comm_s": comm,
            "formula": f"t_c + t_k + {form}" + ("/tau" if tau > 1 else "") + extra}


def _server_step(p: int, n: float, t_compute: float, net: Callable[[str, int, float], float],
                 tau: int, overlap: bool) -> dict:
    """:func:`step_time` of the parameter-server family: a worker's period of tau steps is
    its own exchange W (behind its compute with overlap) or the server's round S of the
    p-1 workers' requests, whichever is longer."""
    server, worker = net("ps_server", p, n), net("ps_worker", p, n)
    if overlap:
        own = (tau - 1) * t_compute + max(t_compute, worker)
        form = "max((tau-1) t_c + max(t_c, W), S)/tau" if tau > 1 else "max(t_c, W, S)"
    else:
        own = tau * t_compute + worker
        form = "max(tau t_c + W, S)/tau"
    step = max(own, server) / tau
    return {"step_s": step, "comm_s": max(worker, server) / tau, "formula": form}


def step_time(
    strategy: str,
    p: int,
    *,
    n: float,
    m: float,
    t_compute: float,
    t_codec: float,
    net: Callable[[str, int, float], float],
    aggregation: str = "allreduce",
    calls: float = 1,
    tau: int = 1,
    overlap: bool = False,
    sync_cost: float = 0.0,
    hidden: float = 1.0,
) -> dict:
    """Predicted seconds per step of one row (the module docstring's formulas).

    Args:
        strategy: the strategy name (``limit`` for no communication).
        p: ranks (for the parameter-server family the server is one of them).
        n: dense message bytes; m: the row's payload bytes per exchange.
        t_compute: compute seconds per step of one worker; t_codec: codec seconds per step.
        net: ``net(collective, p, bytes) -> seconds``.
        aggregation: ``allreduce`` or ``allgather`` (the compressor's).
        calls: messages per exchange (:func:`count_exchange_messages`; e.g. PowerSGD's P
            and Q rounds per tensor), the payload m split among them.
        tau: steps per exchange.
        overlap: whether the exchange runs behind the next step's compute.
        sync_cost: seconds a compute loop around this exchange's collective loses per
            exchange beyond compute and the idle collective (:func:`fit_loops`; 0 where
            not measured), added per exchange for the synchronous all-reduce family.
        hidden: with ``overlap``, the share h of min(t_c, C) the overlap hides
            (:func:`fit_loops`; 1: max(t_c, C), the ideal).

    Returns:
        ``{"step_s", "comm_s", "formula"}``.
    """
    if strategy == "limit":
        return {"step_s": t_compute, "comm_s": 0.0, "formula": "t_c"}
    if strategy in _COLLECTIVE_EXCHANGE:
        return _collective_step(p, m, t_compute, t_codec, net, aggregation, calls, tau, sync_cost,
                                hidden if strategy == "sync_easgd" and overlap else None)
    if strategy == "local_sgd":
        comm = net("ring", p, n) / tau
        return {"step_s": t_compute + comm + sync_cost / tau, "comm_s": comm,
                "formula": "t_c + ring(p, n)/tau" + (" + s/tau" if sync_cost else "")}
    if strategy == "easgd_round_robin":
        comm = net("round_robin", p, n) / tau
        return {"step_s": t_compute + comm, "comm_s": comm, "formula": "t_c + rr(p, n)/tau"}
    if strategy.startswith("async_"):
        return _server_step(p, n, t_compute, net, tau, overlap)
    raise ValueError(f"no cost formula for strategy {strategy!r}")


#: the training-shaped formulas of a server kept busy (phi from ``loop_ps`` where probed)
BUSY_SERVER = ("ps_server", "round_robin")


def fitted_net(model: dict[str, dict], rate_mbit: float,
               busy_overlap: dict[str, dict[str, float]] | None = None) -> Callable[[str, int, float], float]:
    """``net(collective, p, bytes)`` of the emulated cluster at one link rate (alpha
    scaled by the CPU share of p ranks where the fit was made with ``cpus``; the links'
    token-bucket burst B charged where the fit charged it; eta at p where the probe ran p
    (:func:`fit_eta_by_p`); phi of the fitted ``ps``, or
    for a busy server's round (:data:`BUSY_SERVER`) the one measured at p
    (:func:`fit_ps_loop`), at this rate (:func:`busy_phi`))."""
    def net(name: str, p: int, nbytes: float) -> float:
        par = model[probe_of(name)]
        alpha = par["alpha_s"] * (cpu_share(p, par["cpus"]) if par.get("cpus") else 1.0)
        burst = emulated_burst_bytes(rate_mbit) if par.get("burst") else 0.0
        phi = par.get("overlap", 0.0)
        if name in BUSY_SERVER and busy_overlap and str(p) in busy_overlap:
            phi = busy_phi(busy_overlap[str(p)], rate_mbit)
        eta = (par.get("eta_by_p") or {}).get(str(p), par["eta"])
        return collective_time(name, p, nbytes, alpha, eta * rate_bps(rate_mbit), burst, phi)
    return net


_STRATEGY_DEFAULTS = {  # the strategies' config defaults that the cost formulas read
    "sync_easgd": {"tau": 1, "overlap": True},
    "async_easgd": {"tau": 1, "overlap": True},
    "easgd_round_robin": {"tau": 1, "overlap": False},
    "local_sgd": {"tau": 8, "overlap": False},
}


def row_options(row: dict) -> dict:
    """tau and overlap of a row: the strategy's defaults, then the row's overrides."""
    opts = dict(_STRATEGY_DEFAULTS.get(row["strategy"], {"tau": 1, "overlap": False}))
    for item in row.get("overrides") or []:
        key, _, value = item.partition("=")
        if key == "strategy.tau":
            opts["tau"] = int(value)
        elif key == "strategy.overlap":
            opts["overlap"] = value.lower() == "true"
    return opts


def _computing(row: dict, p: int) -> int:
    """Processes that compute during a step (the parameter server does not)."""
    return p - 1 if row["strategy"].startswith("async_") else p


def codec_seconds(exchange: dict, p: int) -> float:
    """Codec seconds of one exchange on p ranks, linear in p between the measured world
    sizes (decoding p payloads: the all-gather's codec grows with p), never below the
    smallest world's."""
    pts = sorted((int(w), float(t)) for w, t in exchange["seconds_by_world"].items())
    (w0, t0), (w1, t1) = pts[0], pts[-1]
    slope = max(0.0, (t1 - t0) / (w1 - w0)) if w1 > w0 else 0.0
    return t0 + slope * (p - w0)


def dense_bytes(inputs: dict) -> float:
    """The dense message: 4 bytes per parameter of the model (float32), else the ddp/none
    row's metered bytes per step (older inputs)."""
    shapes = inputs.get("model_shapes")
    if shapes:
        return 4.0 * sum(math.prod(s) for s in shapes)
    return inputs["dense_bytes"]


def row_inputs(row: dict, inputs: dict) -> dict:
    """The per-row quantities of :func:`step_time`: n, m, t_c, t_k, aggregation, calls.

    With the per-exchange codec measurement (``codec_exchange``: inputs of this
    measurement, not of the row) the codec time is that of the whole exchange on p ranks
    and the messages and payload bytes are counted through the strategies' collective;
    older inputs fall back to the round trip on one tensor, ``calls`` of the compressor
    and the row's metered payload."""
    p, cpus = row["workers"], inputs["cpus"]
    limit = next(r for r in inputs["rows"] if r["strategy"] == "limit" and r.get("workers") == p)
    t_c1 = limit["step_time_s"] / cpu_share(p, cpus)  # one worker with a core of its own
    codec = inputs["codec"].get(row["compression"]) or {}
    exchange = (inputs.get("codec_exchange") or {}).get(row["compression"])
    share = cpu_share(_computing(row, p), cpus)
    n = dense_bytes(inputs)
    round_trip = codec.get("seconds", 0.0)

    def codec1(q: int) -> float:
        """Codec seconds per exchange on q ranks, one worker per core."""
        return codec_seconds(exchange, q) if exchange else round_trip

    local = local_cost(row, inputs)

    def t_k1(q: int) -> float:
        """The exchange's local seconds per step on q ranks, one worker per core: the local
        run's cost beyond the limit (codec and the strategy's machinery) where there is one,
        plus the codec's growth from its rank count to q; else the codec alone."""
        if local is None:
            return codec1(q)
        q_run, cost = local
        return cost + (codec1(q) - codec1(q_run) if exchange else 0.0)

    if exchange:
        m, calls = exchange["bytes"], exchange["messages"]
    else:
        m, calls = row.get("bytes_per_exchange") or n, codec.get("calls", 1)
    if row["compression"] == "none":
        m, calls = n, 1
    return {
        "n": n, "m": m, "t_compute": t_c1 * share, "t_compute_1": t_c1,
        "t_codec": t_k1(p) * share, "t_codec_1": t_k1, "calls": calls,
        "aggregation": codec.get("aggregation", "allreduce"),
    }


#: strategies whose rows also run on one host (``local_rows``): the codec and the
#: strategy's machinery per step, measured in training
LOCAL_STRATEGIES = ("ddp", "sync_easgd")


def local_cost(row: dict, inputs: dict) -> tuple[int, float] | None:
    """``(q, seconds)``: what a step of ``row``'s configuration takes beyond the limit row
    when both run on one host (``inputs["local_rows"]``: q ranks over the host's loopback,
    no shaped link; q the largest run count up to the row's p), per worker with a core of
    its own (divided by the CPU share of q computing ranks): the codec with every local step
    of its exchange, the strategy's machinery (DDP's reducer and bucket copies, the elastic
    update, the hooks' bookkeeping, the collectives' software cost) and what the other
    ranks' threads take from the cores, none of which the codec timed alone sees. Each
    run's step is taken outside its exposed communication (its meter's ``rest_s``): the
    loopback transfers and the waits for the other ranks inside the collectives are what
    the network model's C and the loops' s charge (batch N, 2-rank ddp/powersgd on one
    host: step 9.6 ms, 3.0 ms of it exposed in the collectives, most of it waiting; with
    the whole step the row was predicted 35% high). None where the configuration did not
    run on one host."""
    runs = {(row_label(r), r.get("workers")): _outside_comm(r) for r in inputs.get("local_rows") or []
            if r.get("status") == "ok" and r.get("step_time_s")}
    if row["strategy"] == "limit":
        return None
    for q in sorted({q for _, q in runs if q is not None and q <= row["workers"]}, reverse=True):
        limit, own = runs.get(("limit/none", q)), runs.get((row_label(row), q))
        if limit is not None and own is not None:
            return q, max(0.0, own - limit) / cpu_share(_computing(row, q), inputs["cpus"])
    return None


def _outside_comm(run: dict) -> float:
    """A run's steady step time outside its exposed communication (the whole step for
    inputs measured before the runs kept a meter)."""
    rest = (run.get("meter") or {}).get("rest_s")
    return rest if rest is not None else run["step_time_s"]


def predict_rows(model: dict[str, dict], inputs: dict, loops: dict | None = None) -> list[dict]:
    """Predicted against measured step time of every measured training row (with
    ``loops``, :func:`fit_loops`, the synchronisation cost of the row's loop shape and,
    under ``busy_overlap``, :func:`fit_ps_loop`'s phi of a busy server)."""
    out = []
    for row in inputs["rows"]:
        if row.get("status") != "ok" or row.get("step_time_s") is None:
            continue
        x = row_inputs(row, inputs)
        opts = row_options(row)
        shape = loop_shape(row, x["aggregation"])
        sync = ((loops or {}).get("sync_s", {}).get(shape) or {}).get(str(row["workers"]), 0.0)
        # each blocking round past the first adds the probe's per-round cost: with the
        # codec between the rounds where probed (fit_codec_rounds), else back to back (fit_rounds)
        codec_round = ((loops or {}).get("codec_round_s") or {}).get(str(row["workers"]))
        per_round = codec_round if codec_round is not None else (
            ((loops or {}).get("per_round_s") or {}).get(str(row["workers"]), 0.0))
        rounds_extra = max(0.0, x["calls"] - 1.0) if shape == "serial_ring" else 0.0
        sync += rounds_extra * per_round
        hidden = ((loops or {}).get("hidden", {}).get(shape) or {}).get(str(row["workers"]), 1.0)
        pred = step_time(
            row["strategy"], row["workers"], n=x["n"], m=x["m"], t_compute=x["t_compute"],
            t_codec=x["t_codec"], net=fitted_net(model, row["rate_mbit"], (loops or {}).get("busy_overlap")),
            aggregation=x["aggregation"], calls=x["calls"], sync_cost=sync, hidden=hidden, **opts,
        )
        measured = row["step_time_s"]
        out.append({
            "row": row_label(row), "workers": row["workers"], "rate_mbit": row["rate_mbit"],
            "measured_s": measured, "predicted_s": pred["step_s"], "comm_s": pred["comm_s"],
            "t_compute_s": x["t_compute"], "t_codec_s": x["t_codec"], "payload_bytes": x["m"],
            "messages": x["calls"], "sync_s": sync, "hidden": hidden, "loop_shape": shape,
            "per_round_s": per_round if rounds_extra else 0.0,
            "rel_err": (pred["step_s"] - measured) / measured, "formula": pred["formula"],
            "in_fit": row["strategy"] == "limit", "meter": row.get("meter"),
            "spread": row.get("spread"),
        })
    return out


def ablation(model: dict[str, dict], inputs: dict, loops: dict) -> list[dict]:
    """Each held-out row's error as the model's parts are added in turn: the idle
    collectives with the codec round trip on one tensor, the compressor's nominal calls
    and the row's metered payload (the model before the loops); + the exchange's codec,
    messages and bytes measured on the model's tensors; + the loops' synchronisation cost
    (the full model). What each part explains, row by row."""
    old = {k: v for k, v in inputs.items() if k not in ("codec_exchange", "model_shapes", "local_rows")}
    no_local = {k: v for k, v in inputs.items() if k != "local_rows"}
    variants = {
        "idle": predict_rows(model, old),
        "+ exchange": predict_rows(model, no_local),
        "+ loops": predict_rows(model, no_local, loops),
        "+ local runs": predict_rows(model, inputs, loops),
    }
    out = []
    for k, row in enumerate(variants["idle"]):
        if row["in_fit"]:
            continue
        out.append({"row": f"{row['row']} (p={row['workers']})",
                    **{name: preds[k]["rel_err"] for name, preds in variants.items()}})
    return out


def row_label(row: dict) -> str:
    return ";".join([f"{row['strategy']}/{row['compression']}", *(row.get("overrides") or [])])
