"""Residual / error-feedback memory, separate from the compressors (GRACE's split).

Rule (error feedback; Seide et al. 2014, Karimireddy et al. 2019, Stich et al. 2018):
  p_t = g_t + e_t            (``compensate``)
  send C(p_t);  e_{t+1} = p_t - C(p_t)   (``update``)
so sum_t C(p_t) + e_{T+1} = sum_t g_t: nothing is lost, only delayed. ``NoMemory`` is the
identity (for unbiased or lossless compressors). One residual per key (tensor).

``ResidualMemory`` keeps two buffers per key and swaps them: ``compensate`` writes
p = g + e into the spare one (one pass, no allocation after the first step) and offers it
to the compressor (:func:`~easgd_lightning.hooks.compressors.base.offer_residual`);
``update`` turns p into the next residual in place (p -= transmitted), or keeps it as it
is when the compressor already wrote p - C(p) into it. The stored residual does not change
between ``compensate`` and ``update``.

Fused exchanges (:mod:`easgd_lightning.hooks._fused`) compensate a whole flat buffer at once
(``compensate_runs``): one residual for the exchange, under its group key, of the buffer's
size (only the compressed runs are meaningful). ``residual(key)`` of a member tensor is a
view of it, and ``state_dict`` writes it per member tensor, so checkpoints keep their
per-tensor form and a per-tensor residual (an older checkpoint) joins the group on first use.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors._native import add_into
from easgd_lightning.hooks.compressors.base import offer_residual, take_residual_written
from easgd_lightning.utils.checkpoint import register_state_object
from easgd_lightning.utils.checks import check_float

__all__ = ["Memory", "ResidualMemory", "NoMemory", "make_memory"]


class Memory:
    """Interface: ``compensate`` before compressing, ``update`` after."""

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor to compress for ``key`` (``tensor`` plus what is owed)."""
        return tensor

    def compensate_runs(self, key, flat: torch.Tensor, runs, members) -> torch.Tensor:
        """The 1-D buffer to compress for the group ``key`` of a fused exchange: ``flat`` plus
        what is owed, on the (offset, length) ``runs`` (other entries are not to be read);
        ``members`` are the (key, offset, shape) of its tensors."""
        return flat

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


@register_state_object
class NoMemory(Memory):
    """No error feedback: the compressor's error is dropped."""


@register_state_object
class ResidualMemory(Memory):
    """Keeps e = compensated - transmitted per key and adds it to the next input.

    Args:
        decay: multiplies the stored residual before it is added back (1.0: plain error
            feedback; < 1 damps stale residuals).
    """

    def __init__(self, decay: float = 1.0) -> None:
        self.decay = check_float("compression.memory_decay", decay, 0.0, 1.0)
        self.residuals: dict = {}
        self._spare: dict = {}  # key -> buffer the next compensate writes p into
        self._pending: dict = {}  # key -> the p handed out by compensate, until update
        self._members: dict = {}  # group key -> (key, offset, shape) of its tensors
        self._member_of: dict = {}  # tensor key -> (group key, offset, shape)

    def compensate(self, key, tensor: torch.Tensor) -> torch.Tensor:
        res = self.residuals.get(key)
        if res is None or res.shape != tensor.shape:
            p = tensor.detach().clone(memory_format=torch.contiguous_format)
        else:
            p = self._spare.pop(key, None)
            if p is None or p.shape != tensor.shape or p.dtype != tensor.dtype or (
                p.device != tensor.device
            ):
                p = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            res = res.to(device=tensor.device, dtype=tensor.dtype)
            if self.decay == 1.0:
                add_into(p, tensor.detach(), res)
            else:
                torch.mul(res, self.decay, out=p).add_(tensor.detach())
        self._pending[key] = p
        offer_residual(p)
        return p

    def compensate_runs(self, key, flat: torch.Tensor, runs, members) -> torch.Tensor:
        if self._members.get(key) != members:
            self._members[key] = members
            self._member_of.update({m: (key, off, shape) for m, off, shape in members})
        res = self.residuals.get(key)
        if res is None or res.shape != flat.shape:
            res = self._join_members(key, flat, members)
        if res is None:
            p = flat.detach().clone()
        else:
            p = self._spare.pop(key, None)
            if p is None or p.shape != flat.shape or p.dtype != flat.dtype or p.device != flat.device:
                p = torch.empty_like(flat)
            res = res.to(device=flat.device, dtype=flat.dtype)
            for off, n in runs:
                if self.decay == 1.0:
                    add_into(p[off : off + n], flat[off : off + n].detach(), res[off : off + n])
                else:
                    torch.mul(res[off : off + n], self.decay, out=p[off : off + n]).add_(flat[off : off + n].detach())
        self._pending[key] = p
        offer_residual(p)
        return p

    def _join_members(self, key, flat: torch.Tensor, members) -> torch.Tensor | None:
        """The group residual from its members' per-tensor residuals (zeros where a member
        has none; None when none has one); the per-tensor entries are dropped."""
        names = {m for m, _, _ in members}
        for group, others in list(self._members.items()):  # another group holds some: split it
            if group != key and names.intersection(m for m, _, _ in others):
                self._split(group)
        found = [(off, self.residuals.pop(m)) for m, off, _ in members if m in self.residuals]
        for m, _, _ in members:
            self._spare.pop(m, None)
        if not found:
            return None
        res = torch.zeros_like(flat)
        for off, r in found:
            res[off : off + r.numel()] = r.reshape(-1).to(res.dtype)
        self.residuals[key] = res
        return res

    def _split(self, group) -> None:
        """Turn the fused group's residual back into per-tensor residuals (copies)."""
        members = self._members.pop(group)
        res = self.residuals.pop(group, None)
        self._spare.pop(group, None)
        for m, off, shape in members:
            if self._member_of.get(m, (None,))[0] == group:
                del self._member_of[m]
            if res is not None:
                self.residuals[m] = res[off : off + shape.numel()].view(shape).clone()

    def update(self, key, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        written = take_residual_written(compensated)
        if self._pending.get(key) is not compensated:  # not our buffer: the plain rule
            self.residuals[key] = (compensated - transmitted.to(compensated.dtype)).detach()
            return
        del self._pending[key]
        if not written:
            compensated.sub_(transmitted.to(compensated.dtype))
        old = self.residuals.get(key)
        self.residuals[key] = compensated.detach()
        if old is not None and old.shape == compensated.shape:
            self._spare[key] = old

    def residual(self, key) -> torch.Tensor | None:
        """The stored residual for ``key`` (None before the first update); for a member
        tensor of a fused group, a view of the group's residual."""
        res = self.residuals.get(key)
        if res is None and key in self._member_of:
            group, off, shape = self._member_of[key]
            flat = self.residuals.get(group)
            if flat is not None:
                return flat[off : off + shape.numel()].view(shape)
        return res

    def _per_tensor(self) -> dict:
        """Every residual by tensor key: a fused group's split into its members (views)."""
        out = {}
        for key, res in self.residuals.items():
            members = self._members.get(key)
            if members is None:
                out[key] = res
            else:
                out.update({m: res[off : off + shape.numel()].view(shape) for m, off, shape in members})
        return out

    def adopt(self, key, residual: torch.Tensor) -> None:
        """Take ``residual`` (not a copy) as what is owed for ``key``: for a caller that
        keeps the residual in its own state between steps, or starts from zeros. The
        memory owns the tensor from then on: once an ``update`` has replaced it, its
        buffer may be reused for the next compensated tensor."""
        if self.residuals.get(key) is residual:
            return
        self.residuals[key] = residual
        self._spare.pop(key, None)

    def state_dict(self) -> dict:
        """The decay and a copy of every residual (the spare and pending buffers are
        scratch: rebuilt on demand, never checkpointed)."""
        return {"decay": self.decay, "residuals": {k: v.clone() for k, v in self._per_tensor().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (copies of its residuals)."""
        self.decay = float(state.get("decay", self.decay))
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        self._spare.clear()
        self._pending.clear()
        self._members.clear()
        self._member_of.clear()

    def reset(self) -> None:
        self.residuals.clear()
        self._spare.clear()
        self._pending.clear()
        self._members.clear()
        self._member_of.clear()


def make_memory(compressor=None) -> Memory:
    """``ResidualMemory`` when the compressor asks for error feedback, else ``NoMemory``."""
    if compressor is not None and getattr(compressor, "memory", False):
        return ResidualMemory()
    return NoMemory()
