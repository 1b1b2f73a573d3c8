"""Model factories and the generic classification LightningModule used by the CLI."""

from easgd_lightning.models.classifier import ClassifierModule
from easgd_lightning.models.factory import MODEL_NAMES, build_model, model_factory

__all__ = ["ClassifierModule", "build_model", "model_factory", "MODEL_NAMES"]
