"""The config keys renamed in 0.2 (one name per concept) keep their old spellings for one
release: on the command line, in a config file, and as strategy keywords, each warned."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from easgd_lightning.cli.overrides import check_command_line, compose_checked
from easgd_lightning.strategies.local_sgd import LocalSGDStrategy
from easgd_lightning.utils.renames import RENAMES, apply_renames


def test_old_command_line_keys_run_under_their_new_names() -> None:
    old = ["strategy=local_sgd", "strategy.period=4", "strategy.period_rule=qsr", "strategy.h_base=2",
           "strategy.gamma=0.1", "strategy.warmup_steps=3", "trainer.threads_per_process=2",
           "trainer.allow_nonfinite_loss=true"]
    with pytest.warns(FutureWarning, match=r"strategy\.period is deprecated, use strategy\.tau"):
        argv = check_command_line(old)
    assert argv == ["strategy=local_sgd", "strategy.tau=4", "strategy.tau_rule=qsr", "strategy.tau_base=2",
                    "strategy.qsr_coefficient=0.1", "strategy.qsr_warmup_steps=3", "threads_per_process=2",
                    "allow_nonfinite_loss=true"]
    with pytest.warns(FutureWarning):
        cfg = compose_checked(old)
    new = compose_checked(argv)
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(new)
    assert (cfg.strategy.tau, cfg.strategy.tau_base, cfg.threads_per_process) == (4, 2, 2)
    assert "period" not in cfg.strategy and "threads_per_process" not in cfg.trainer


def test_overlap_is_renamed_for_local_sgd_only() -> None:
    with pytest.warns(FutureWarning, match="strategy.cocod"):
        assert check_command_line(["strategy=local_sgd", "strategy.overlap=true"])[1] == "strategy.cocod=true"
    # sync_easgd's overlap is the exact overlap, a name of its own: left as it is, no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_command_line(["strategy=sync_easgd", "strategy.overlap=false"])[1] == "strategy.overlap=false"


def test_a_sweep_over_an_old_key_is_renamed() -> None:
    with pytest.warns(FutureWarning):
        argv = check_command_line(["-m", "strategy=local_sgd", "strategy.period=2,4"])
    assert argv == ["-m", "strategy=local_sgd", "strategy.tau=2,4"]


def test_a_config_file_with_old_keys_is_moved_to_the_new_ones() -> None:
    cfg = OmegaConf.create({
        "strategy": {"name": "local_sgd", "tau": 8, "period": 3, "overlap": True, "cocod": False},
        "data": {"name": "imagenet", "train_size": 10, "synthetic_train_size": 64},
        "trainer": {"devices": 2, "threads_per_process": 4},
        "threads_per_process": None,
    })
    OmegaConf.set_struct(cfg, True)
    with pytest.warns(FutureWarning):
        apply_renames(cfg)
    assert OmegaConf.to_container(cfg) == {
        "strategy": {"name": "local_sgd", "tau": 3, "cocod": True},
        "data": {"name": "imagenet", "train_size": 64},
        "trainer": {"devices": 2},
        "threads_per_process": 4,
    }


def test_old_strategy_keywords_still_work_and_both_spellings_are_refused() -> None:
    with pytest.warns(FutureWarning, match="strategy.h_base is deprecated, use strategy.tau_base"):
        s = LocalSGDStrategy(period=4, h_base=2, period_rule="qsr", gamma=0.5)
    assert (s.tau_rule, s.summary_extras()["tau"], s.summary_extras()["tau_base"]) == ("qsr", 4, 2)
    assert s.summary_extras()["qsr_coefficient"] == 0.5
    with pytest.raises(TypeError, match="give only tau"):
        LocalSGDStrategy(period=4, tau=4)


def test_every_new_key_exists_in_the_shipped_config() -> None:
    for rename in RENAMES:
        strategy = [f"strategy={rename.strategy}"] if rename.strategy else []
        compression = [f"compression={rename.compression}"] if rename.compression else []
        data = ["data=imagenet"] if rename.new.startswith("data.") else []
        cfg = compose_checked(strategy + compression + data)
        assert OmegaConf.select(cfg, rename.new, default="missing") != "missing", rename.new
        assert OmegaConf.select(cfg, rename.old, default="missing") == "missing", rename.old


def test_lgc_warmup_steps_is_coder_warmup_steps_everywhere() -> None:
    import warnings

    from easgd_lightning.hooks import build_compressor
    from easgd_lightning.hooks.compressors.lgc import LGCCompressor

    match = r"compression\.warmup_steps is deprecated, use compression\.coder_warmup_steps"
    with pytest.warns(FutureWarning, match=match):
        argv = check_command_line(["compression=lgc", "compression.warmup_steps=7"])
    assert argv == ["compression=lgc", "compression.coder_warmup_steps=7"]
    with pytest.warns(FutureWarning, match=match):
        cfg = compose_checked(["compression=lgc", "compression.warmup_steps=7"])
    assert cfg.compression.coder_warmup_steps == 7 and "warmup_steps" not in cfg.compression
    own = OmegaConf.create({"compression": {"name": "lgc", "coder_warmup_steps": 50, "warmup_steps": 9}})
    with pytest.warns(FutureWarning, match=match):
        apply_renames(own)
    assert OmegaConf.to_container(own) == {"compression": {"name": "lgc", "coder_warmup_steps": 9}}
    with pytest.warns(FutureWarning, match=match):
        assert build_compressor("lgc", warmup_steps=6).coder_warmup_steps == 6
    with pytest.warns(FutureWarning, match=match):
        assert LGCCompressor(warmup_steps=5).coder_warmup_steps == 5
    with pytest.raises(TypeError, match="give only coder_warmup_steps"):
        build_compressor("lgc", warmup_steps=6, coder_warmup_steps=6)
    # only LGC's: another compressor's (or the hook's) warmup_steps is not renamed
    other = OmegaConf.create({"compression": {"name": "topk", "warmup_steps": 3}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_renames(other)
    assert other.compression.warmup_steps == 3
