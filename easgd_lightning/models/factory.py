"""Model factories by config name (``model=NAME``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["MODEL_NAMES", "build_model", "model_factory", "mlp", "alexnet", "googlenet", "resnet50", "resnet18"]


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


def _torchvision(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=num_classes, **kwargs)


def alexnet(num_classes: int = 1000, dropout: float = 0.5) -> nn.Module:
    """torchvision's AlexNet (single tower), untrained."""
    return _torchvision("alexnet", num_classes, dropout=dropout)


def googlenet(num_classes: int = 1000, dropout: float = 0.2, transform_input: bool = False,
              aux_logits: bool = False, init_weights: bool = True, dropout_aux: float = 0.7) -> nn.Module:
    """torchvision's GoogLeNet (Inception v1), untrained, without the auxiliary classifiers."""
    return _torchvision("googlenet", num_classes, dropout=dropout, transform_input=transform_input,
                        aux_logits=aux_logits, init_weights=init_weights, dropout_aux=dropout_aux)


def _resnet(name: str) -> Callable[..., nn.Module]:
    def build(num_classes: int = 1000, zero_init_residual: bool = False, groups: int = 1,
              width_per_group: int = 64, replace_stride_with_dilation: list[bool] | None = None) -> nn.Module:
        return _torchvision(name, num_classes, zero_init_residual=zero_init_residual, groups=groups,
                            width_per_group=width_per_group, replace_stride_with_dilation=replace_stride_with_dilation)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"torchvision's {name} (v1.5), untrained."
    return build


resnet50 = _resnet("resnet50")
resnet18 = _resnet("resnet18")

_FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "alexnet": alexnet,
    "googlenet": googlenet,
    "resnet50": resnet50,
    "resnet18": resnet18,
}

MODEL_NAMES = tuple(sorted(_FACTORIES))


def model_factory(name: str) -> Callable[..., nn.Module]:
    """The factory of ``model.name`` (what ``conf/model/NAME.yaml``'s ``_target_`` names).

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    if name not in _FACTORIES:
        raise ValueError(f"model.name={name!r} is unknown; choose one of {', '.join(MODEL_NAMES)}")
    return _FACTORIES[name]


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by name.

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    return model_factory(name)(**kwargs)
