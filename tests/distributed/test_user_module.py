"""A user-defined LightningModule trains with strategy="sync_easgd" through Lightning's own launcher."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import run_python

SCRIPT = Path(__file__).parent / "scripts" / "user_module_run.py"


def test_user_module_with_sync_easgd_by_name(tmp_path: Path) -> None:
    proc = run_python(SCRIPT, [str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["strategy"] == "SyncEASGDStrategy"
    # after fit both ranks hold the same center, and it is the strategy's center
    assert torch.equal(r0["flat"], r1["flat"])
    assert torch.equal(r0["flat"], r0["center"])
    assert r0["acc"] > 0.85, r0["acc"]


def test_lightning_ddp_name_is_untouched() -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

    import easgd_lightning  # noqa: F401
    import easgd_lightning.strategies as s

    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy
    assert StrategyRegistry["ddp_compressed"]["strategy"] is s.CompressedDDPStrategy
    s.register_strategies(StrategyRegistry)  # idempotent
    trainer = pl.Trainer(strategy="sync_easgd", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, s.SyncEASGDStrategy)
