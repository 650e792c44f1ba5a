"""vLLM plugin: makes ``vllm serve EXPORT_DIR`` / ``vllm.LLM(EXPORT_DIR)`` load Orthros exports.

Registered under the ``vllm.general_plugins`` entry point (pyproject.toml), which vLLM runs in
every process it starts (the engine core and its workers included). It registers the model class
lazily (vLLM imports ``orthros_train.serve.model`` when an Orthros checkpoint is loaded), the
``orthros`` config class with transformers' ``AutoConfig``, so the export's ``config.json`` loads
without ``trust_remote_code`` (the export's own remote code is for transformers' ``generate``),
the architecture's config hook (``config.py``: what cannot be served is refused when the engine's
configuration is built), and the model's attention ops as splitting ops of piecewise CUDA graphs.
"""

from __future__ import annotations

MODEL_CLASS = "orthros_train.serve.model:OrthrosForCausalLM"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.config import CompilationConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from orthros_train.convert.remote_code.configuration_orthros import OrthrosConfig
    from orthros_train.serve.config import ARCHITECTURE, ATTENTION_OPS, OrthrosConfigHook
    from orthros_train.serve.refusal import one_line_refusals

    one_line_refusals()  # a refused configuration: its message, not vLLM's traceback (refusal.py)

    AutoConfig.register(OrthrosConfig.model_type, OrthrosConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    # vLLM looks its per-architecture config hooks up in this table (a plain dict) by the
    # architecture name of config.json; it has no registration call for out-of-tree models.
    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, OrthrosConfigHook)
    # vLLM's piecewise CUDA graphs split at the ops of this list (its own attention ops, and the
    # ops models of its tree add): the output attention reads per-step metadata, as they do.
    for op in ATTENTION_OPS:
        if op not in CompilationConfig._attention_ops:
            CompilationConfig._attention_ops.append(op)
