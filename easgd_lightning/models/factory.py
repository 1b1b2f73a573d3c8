"""Model factories by config name (``model=NAME``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["MODEL_NAMES", "build_model", "mlp"]


def mlp(in_features: int = 64, hidden: int | list[int] = 128, num_classes: int = 10) -> nn.Module:
    """A small multi-layer perceptron (the digits default)."""
    sizes = [hidden] if isinstance(hidden, int) else list(hidden)
    layers: list[nn.Module] = [nn.Flatten()]
    prev = in_features
    for width in sizes:
        layers += [nn.Linear(prev, width), nn.ReLU()]
        prev = width
    layers.append(nn.Linear(prev, num_classes))
    return nn.Sequential(*layers)


def _torchvision(name: str) -> Callable[..., nn.Module]:
    def build(num_classes: int = 1000, **kwargs: Any) -> nn.Module:
        import torchvision

        fn = getattr(torchvision.models, name)
        if name == "googlenet":
            kwargs.setdefault("aux_logits", False)
            kwargs.setdefault("init_weights", True)
        return fn(weights=None, num_classes=num_classes, **kwargs)

    return build


_FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "alexnet": _torchvision("alexnet"),
    "googlenet": _torchvision("googlenet"),
    "resnet50": _torchvision("resnet50"),
    "resnet18": _torchvision("resnet18"),
}

MODEL_NAMES = tuple(sorted(_FACTORIES))


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by name.

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    if name not in _FACTORIES:
        raise ValueError(f"model.name={name!r} is unknown; choose one of {', '.join(MODEL_NAMES)}")
    return _FACTORIES[name](**kwargs)
