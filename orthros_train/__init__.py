"""orthros-train: the training framework for Orthros phase-aware attention models."""

from orthros_train.third_party_warnings import filter_third_party_warnings

__version__ = "0.1.0"

filter_third_party_warnings()
