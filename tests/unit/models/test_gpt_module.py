"""The GPT LightningModule outside pipeline_3d: it builds the whole model and trains."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from easgd_lightning.models.gpt import GPT, GPTConfig, GPTLightningModule


def test_plain_strategy_trains_the_unsplit_model(tmp_path):
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (64, 17))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    module = GPTLightningModule(GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=16), lr=1e-2,
                                schedule="cosine", warmup_steps=2, total_steps=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))
    assert isinstance(module.net, GPT) and module.pipe is None
    assert trainer.global_step == 8
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    # linear warm-up then cosine to min_lr (0) at total_steps
    assert trainer.optimizers[0].param_groups[0]["lr"] < 1e-3
