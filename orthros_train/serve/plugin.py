"""vLLM plugin: makes ``vllm serve EXPORT_DIR`` / ``vllm.LLM(EXPORT_DIR)`` load Orthros exports.

Registered under the ``vllm.general_plugins`` entry point (pyproject.toml), which vLLM runs in
every process it starts (the engine core and its workers included). It registers the model class
lazily (vLLM imports ``orthros_train.serve.model`` when an Orthros checkpoint is loaded) and the
``orthros`` config class with transformers' ``AutoConfig``, so the export's ``config.json`` loads
without ``trust_remote_code`` (the export's own remote code is for transformers' ``generate``).
"""

from __future__ import annotations

MODEL_CLASS = "orthros_train.serve.model:OrthrosForCausalLM"


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from orthros_train.convert.remote_code.configuration_orthros import OrthrosConfig

    AutoConfig.register(OrthrosConfig.model_type, OrthrosConfig, exist_ok=True)
    if "OrthrosForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("OrthrosForCausalLM", MODEL_CLASS)
