"""tp=2 on real gloo processes: the split GPT equals the unsplit one (forward and gradients).

Tolerance: fp32, the split model sums partial products in a different order, so
|split - unsplit| <= 1e-5 (absolute) + 1e-4 (relative); measured differences are ~1e-7.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_tp_worker.py"
ATOL, RTOL = 1e-5, 1e-4


def test_tp2_matches_unsplit_model(tmp_path):
    from easgd_lightning.models.gpt import GPT, GPTConfig, gpt_loss

    launch_ranks(SCRIPT, 2, ["--out", str(tmp_path), "--seed", "1234"], timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=32)
    ref = GPT(cfg, base_seed=1234)  # the independent reference: one process, no split
    logits = ref(ranks[0]["tokens"])
    loss = gpt_loss(logits, ranks[0]["labels"])
    loss.backward()

    for r in ranks:
        torch.testing.assert_close(r["logits"], logits.detach(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(r["loss"], loss.detach(), atol=ATOL, rtol=RTOL)
    split_dims = {"embed.weight": 0, "qkv.weight": 0, "qkv.bias": 0, "fc1.weight": 0,
                  "fc1.bias": 0, "proj.weight": 1, "fc2.weight": 1}
    checked_split = 0
    for name, p in ref.named_parameters():
        g0, g1 = ranks[0]["grads"][name], ranks[1]["grads"][name]
        dim = next((d for suffix, d in split_dims.items() if name.endswith(suffix)), None)
        if dim is None:  # replicated (LayerNorm, position embedding, row-parallel bias)
            torch.testing.assert_close(g0, p.grad, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(g1, p.grad, atol=ATOL, rtol=RTOL)
        else:  # each rank holds its shard of the gradient
            assert g0.shape[dim] * 2 == p.shape[dim]
            torch.testing.assert_close(torch.cat([g0, g1], dim), p.grad, atol=ATOL, rtol=RTOL)
            checked_split += 1
    assert checked_split == 1 + 6 * cfg.n_layer
    # tensor-parallel traffic is metered under its own kind
    assert ranks[0]["tp_bytes"]["bytes_sent"] > 0
