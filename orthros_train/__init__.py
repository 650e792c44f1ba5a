"""orthros-train: the training framework for Orthros phase-aware attention models."""

__version__ = "0.1.0"
