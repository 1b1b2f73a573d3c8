"""The ``ft`` config group, checked before any process starts (``easgd-train`` exits 2 with
one line naming the key and what is allowed).

Rule: ``ft=none`` (the default) changes nothing. ``ft=torchft`` supports what it can keep
exact: ``strategy=local_sgd``, ``sync_easgd``, ``ddp`` (dense or any compressor) and ``diloco``
(one fragment), the elastic ones with ``compression=none``, a flat reduction, started by
easgd-train's own launcher, torchrun or SLURM (which one may start what: ft/external.py);
and the parameter-server family (:data:`FT_NATIVE`, Hogwild only with
``strategy.server=dedicated``), whose server re-admits a restarted worker itself (no torchft
Manager, no lighthouse; any compression). Everything else is refused in one line rather
than run without the tolerance it asked for.
"""

from __future__ import annotations

import re
from typing import Any

from easgd_lightning.utils.checks import check_int, check_positive
from easgd_lightning.utils.errors import ConfigError, config_errors

__all__ = ["FT_KEYS", "FT_STRATEGIES", "FT_NATIVE", "check_ft", "lighthouse_address", "rejoins_natively"]

#: keys of ``ft=torchft`` (conf/ft/torchft.yaml)
FT_KEYS = ("name", "lighthouse", "min_replicas", "quorum_timeout_s", "collective_timeout_s", "max_restarts",
           "heartbeat_timeout_s", "join_timeout_s", "replica_id")

#: strategies whose exchange runs as a torchft quorum step
FT_STRATEGIES = ("local_sgd", "sync_easgd", "ddp", "diloco")

#: strategies whose parameter server re-admits a restarted worker itself: under ft=torchft the
#: launcher restarts a dead worker and the server serves it again (strategies/ps/rejoin.py);
#: the Hogwild ones only with strategy.server=dedicated
FT_NATIVE = ("async_easgd", "async_measgd", "async_sgd", "async_msgd", "hogwild_easgd", "hogwild_sgd")

_WHY_NOT = {
    "pipeline_3d": "a pipeline stage cannot be replaced by a peer: every stage holds different layers",
    "easgd_round_robin": "its master serves workers in rank order over the default process group",
    "hogwild_easgd": "Hogwild workers on shared memory (strategy.server=null) have no server to re-admit a "
                     "restarted one; strategy.server=dedicated has",
    "hogwild_sgd": "Hogwild workers on shared memory (strategy.server=null) have no server to re-admit a "
                   "restarted one; strategy.server=dedicated has",
}

_ADDRESS = re.compile(r"^(?:http://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def lighthouse_address(value: str) -> str:
    """``http://host:port`` from ``host:port`` or ``http://host:port``.

    Raises:
        ValueError: not of that form.
    """
    m = _ADDRESS.match(str(value).strip())
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"ft.lighthouse must be host:port (or http://host:port) or null, got {value!r}")
    return f"http://{m.group(1)}:{m.group(2)}"


def rejoins_natively(cfg: Any) -> bool:
    """Whether ``cfg``'s strategy is one whose server re-admits a restarted worker
    (:data:`FT_NATIVE`, with a dedicated server)."""
    st = cfg.strategy
    return st.get("name") in FT_NATIVE and st.get("server", "dedicated") == "dedicated"


def check_ft(cfg: Any, world: int) -> None:
    """Check ``cfg.ft`` for a run of ``world`` workers.

    Raises:
        ConfigError: one line naming the ``ft.`` key (or the option ``ft=torchft`` cannot
            serve) and what is allowed.
    """
    from easgd_lightning.ft import FT_NAMES

    ft = cfg.get("ft") or {}
    name = ft.get("name", "none")
    if name not in FT_NAMES:
        raise ConfigError(f"ft.name={name!r} is unknown; choose one of {', '.join(FT_NAMES)}")
    if name == "none":
        return
    unknown = sorted(set(ft.keys()) - set(FT_KEYS))
    if unknown:
        raise ConfigError(f"ft.{unknown[0]}: unknown key of ft=torchft; its keys are {', '.join(FT_KEYS[1:])}")
    strategy = cfg.strategy.get("name")
    if (cfg.get("checkpoint") or {}).get("resume"):
        raise ConfigError("ft=torchft: checkpoint.resume is not supported (a restarted worker recovers from the "
                          "live run, not from disk); drop checkpoint.resume, or use ft=none")
    if rejoins_natively(cfg):
        _check_common(ft, world - 1, quorum=False)  # the last process is the server
        if ft.get("lighthouse") is not None:
            raise ConfigError(f"ft.lighthouse: strategy={strategy} uses no torchft lighthouse (its parameter server "
                              "re-admits restarted workers itself); leave ft.lighthouse=null")
        return
    if strategy not in FT_STRATEGIES:
        why = _WHY_NOT.get(strategy, "its exchange does not run through the torchft Manager")
        raise ConfigError(f"ft=torchft: strategy={strategy} cannot survive a lost worker ({why}); "
                          f"use strategy={' or strategy='.join(FT_STRATEGIES + FT_NATIVE[:4])}, or ft=none")
    comm = cfg.get("comm") or {}
    compression = cfg.compression.get("name", "none")
    if compression != "none" and strategy != "ddp":
        raise ConfigError(f"ft=torchft: compression={compression} is supported with strategy=ddp only (a joiner "
                          f"contributes nothing to the {strategy} exchange it heals in, which a compressed exchange "
                          "cannot express); use compression=none, strategy=ddp, or ft=none")
    if compression != "none" and cfg.compression.get("plan", "none") != "none":
        raise ConfigError(f"ft=torchft: compression.plan={cfg.compression.get('plan')} is not supported (the plan is "
                          "measured by timed collectives once, not recovered by a joiner); use compression.plan=none, "
                          "or ft=none")
    if strategy == "ddp" and (comm.get("allreduce", "ring") != "ring"):
        raise ConfigError(f"ft=torchft: comm.allreduce={comm.get('allreduce')} is not supported (the gradients go "
                          "through the torchft Manager); use comm.allreduce=ring, or ft=none")
    if strategy == "diloco":
        st = cfg.strategy
        for key, ok, allowed in (("fragments", st.get("fragments", 1) == 1, "1"),
                                 ("fragment_sync_delay", st.get("fragment_sync_delay", 0) == 0, "0"),
                                 ("outer", st.get("outer", "nesterov") in ("nesterov", "average"), "nesterov or average")):
            if not ok:
                raise ConfigError(f"ft=torchft: strategy.{key}={st.get(key)} is not supported with strategy=diloco "
                                  f"(an exchange must be one whole quorum step); use strategy.{key}={allowed}, or ft=none")
    if strategy == "local_sgd" and cfg.strategy.get("cocod", False):
        raise ConfigError("ft=torchft: strategy.cocod=true is not supported (an average in flight across a "
                          "quorum change cannot be committed); use strategy.cocod=false, or ft=none")
    if comm.get("hierarchy", "flat") != "flat":
        raise ConfigError(f"ft=torchft: comm.hierarchy={comm.get('hierarchy')} is not supported (node groups "
                          "do not follow quorum changes); use comm.hierarchy=flat, or ft=none")
    lighthouse = ft.get("lighthouse")
    if lighthouse is not None:
        try:
            lighthouse_address(lighthouse)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    _check_common(ft, world)
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"ft=torchft needs the torchft package ({err}); install it with "
                          "pip install 'easgd-lightning[ft]' (make venv does)") from None


def _check_common(ft: Any, workers: int, quorum: bool = True) -> None:
    """The keys every ``ft=torchft`` run reads (``workers``: how many may be restarted;
    ``quorum``: torchft's quorum decides who takes part, not a parameter server)."""
    from easgd_lightning.utils.errors import ConfigError

    with config_errors():
        mr = check_int("ft.min_replicas", ft.get("min_replicas", 1), 1, workers)  # at most the workers
        check_int("ft.replica_id", ft.get("replica_id"), 0, workers - 1, nullable=True)
        check_int("ft.max_restarts", ft.get("max_restarts", 3), 0)
        for key, default in (("quorum_timeout_s", 60), ("collective_timeout_s", 10), ("heartbeat_timeout_s", 2),
                             ("join_timeout_s", 10)):
            check_positive(f"ft.{key}", ft.get(key, default), unit="seconds")
    heartbeat, quorum_s = ft.get("heartbeat_timeout_s", 2), ft.get("quorum_timeout_s", 60)
    if heartbeat >= quorum_s:
        raise ConfigError(f"ft.heartbeat_timeout_s must be < ft.quorum_timeout_s ({quorum_s}), got {heartbeat!r}")
    if quorum and mr == workers > 1:  # torchft: a joiner is not a participant of the exchange it heals in
        raise ConfigError(f"ft.min_replicas={mr}: with every worker required a restarted worker could never rejoin "
                          f"(it contributes nothing to the exchange it rejoins in); use at most {workers - 1}")

