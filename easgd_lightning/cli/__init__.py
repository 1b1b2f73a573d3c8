"""Command-line entry points: ``easgd-train`` (Hydra main) and ``easgd-report``."""
