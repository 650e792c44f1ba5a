"""Attention ops: the plain-torch reference and the kernels checked against it."""

from orthros_train.ops.attention import UNBOUNDED, available_backends, orthros_attention

__all__ = ["UNBOUNDED", "available_backends", "orthros_attention"]
