"""Model factories and the generic classification LightningModule used by the CLI."""

from easgd_lightning.models.classifier import ClassifierModule
from easgd_lightning.models.factory import MODEL_NAMES, build_model

__all__ = ["ClassifierModule", "build_model", "MODEL_NAMES"]
