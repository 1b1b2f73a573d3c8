"""Checks of a ``pp x tp x dp`` layout, run before any process starts (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass

from easgd_lightning.utils.checks import check_int

__all__ = ["Layout", "validate_layout"]


@dataclass(frozen=True)
class Layout:
    """A validated 3D layout: ``pp * tp * dp == world_size``."""

    pp: int
    tp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp


def validate_layout(
    pp: int,
    tp: int,
    dp: int,
    world_size: int,
    n_layers: int | None = None,
    n_heads: int | None = None,
    *,
    d_model: int | None = None,
    micro_batches: int | None = None,
) -> Layout:
    """Check a 3D-parallel layout and return it; raise a one-line ``ValueError`` otherwise.

    Args:
        pp: Pipeline stages (``strategy.pp``).
        tp: Tensor-parallel degree (``strategy.tp``).
        dp: Data-parallel degree (``strategy.dp``).
        world_size: Processes that will run (``trainer.devices * trainer.num_nodes``).
        n_layers: Transformer blocks (``model.n_layer``); each stage needs at least one.
        n_heads: Attention heads (``model.n_head``); ``tp`` must divide it.
        d_model: Hidden width (``model.d_model``); ``tp`` must divide it and the MLP width.
        micro_batches: ``strategy.micro_batches``; must be >= 1.

    Returns:
        The layout.

    Raises:
        ValueError: naming the offending keys and what would fix them.
    """
    pp = check_int("strategy.pp", pp)
    tp = check_int("strategy.tp", tp)
    dp = check_int("strategy.dp", dp)
    world_size = check_int("world size (trainer.devices * trainer.num_nodes)", world_size)
    if pp * tp * dp != world_size:
        raise ValueError(
            f"strategy.pp * strategy.tp * strategy.dp = {pp} * {tp} * {dp} = {pp * tp * dp} "
            f"must equal the world size {world_size} (trainer.devices * trainer.num_nodes)"
        )
    if n_layers is not None and pp > check_int("model.n_layer", n_layers):
        raise ValueError(
            f"strategy.pp ({pp}) is larger than model.n_layer ({n_layers}): every pipeline "
            f"stage needs at least one transformer block"
        )
    if n_heads is not None and check_int("model.n_head", n_heads) % tp != 0:
        raise ValueError(
            f"strategy.tp ({tp}) must divide model.n_head ({n_heads}); allowed tp values: "
            f"{[d for d in range(1, n_heads + 1) if n_heads % d == 0]}"
        )
    if d_model is not None and check_int("model.d_model", d_model) % tp != 0:
        raise ValueError(f"strategy.tp ({tp}) must divide model.d_model ({d_model})")
    if micro_batches is not None:
        check_int("strategy.micro_batches", micro_batches)
    return Layout(pp=pp, tp=tp, dp=dp)
