"""Residual / error-feedback memory, separate from the compressors (GRACE's split).

Rule (error feedback; Seide et al. 2014, Karimireddy et al. 2019, Stich et al. 2018):
  p_t = g_t + e_t            (``compensate``)
  send C(p_t);  e_{t+1} = p_t - C(p_t)   (``update``)
so sum_t C(p_t) + e_{T+1} = sum_t g_t: nothing is lost, only delayed. ``NoMemory`` is the
identity (for unbiased or lossless compressors). One residual per key (tensor).
"""

from __future__ import annotations

import torch

__all__ = ["Memory", "ResidualMemory", "NoMemory", "make_memory"]


class Memory:
    """Interface: ``compensate`` before compressing, ``update`` after."""

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor to compress for ``key`` (``tensor`` plus what is owed)."""
        return tensor

    def update(self, key, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Record what ``transmitted`` (the decompressed local contribution) left out."""

    def residual(self, key) -> torch.Tensor | None:
        """What is owed for ``key`` (None: nothing)."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def reset(self) -> None:
        pass


class NoMemory(Memory):
    """No error feedback: the compressor's error is dropped."""


class ResidualMemory(Memory):
    """Keeps e = compensated - transmitted per key and adds it to the next input.

    Args:
        decay: multiplies the stored residual before it is added back (1.0: plain error
            feedback; < 1 damps stale residuals).
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"compression.memory_decay must be in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.residuals: dict = {}

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        res = self.residuals.get(key)
        if res is None or res.shape != tensor.shape:
            return tensor.clone()
        res = res.to(device=tensor.device, dtype=tensor.dtype)
        return tensor + (res if self.decay == 1.0 else self.decay * res)

    def update(self, key, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        self.residuals[key] = (compensated - transmitted.to(compensated.dtype)).detach()

    def residual(self, key) -> torch.Tensor | None:
        """The stored residual for ``key`` (None before the first update)."""
        return self.residuals.get(key)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state.get("decay", self.decay))
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}

    def reset(self) -> None:
        self.residuals.clear()


def make_memory(compressor=None) -> Memory:
    """``ResidualMemory`` when the compressor asks for error feedback, else ``NoMemory``."""
    if compressor is not None and getattr(compressor, "memory", False):
        return ResidualMemory()
    return NoMemory()
