"""The single-device Orthros model: reads like the paper, no parallelism inside."""

from orthros_train.model.cache import KVCache
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.orthros import OrthrosForCausalLM, OrthrosOutput

__all__ = ["KVCache", "OrthrosConfig", "OrthrosForCausalLM", "OrthrosOutput"]
