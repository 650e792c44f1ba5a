"""What an Orthros model cannot serve, refused when vLLM builds its configuration.

``plugin.register`` puts ``OrthrosConfigHook`` into vLLM's per-architecture table of config
hooks (``vllm.model_executor.models.config.MODELS_CONFIG_MAP``), which ``VllmConfig`` runs once
when it is built: in the process that starts the engine (the OpenAI server's front end, or the
``LLM`` object's), before any engine process or model exists. So a refused setting stops
``vllm serve`` / ``LLM(...)`` at once with its message, and what only a request can ask for
(prompt logprobs) gets a validator that vLLM runs when it admits each request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.model_executor.models.config import VerifyAndUpdateConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

ARCHITECTURE = "OrthrosForCausalLM"
# Loaded by vLLM from these names (front end and engine), one per model-runner interface.
PROMPT_LOGPROBS_REFUSAL = "orthros_train.serve.prompt_logprobs:RefusePromptLogprobs"
PROMPT_LOGPROBS_REFUSAL_V2 = "orthros_train.serve.prompt_logprobs:RefusePromptLogprobsV2"


class OrthrosServeError(ValueError):
    """A configuration the Orthros vLLM model cannot serve (the message says what to change)."""


def check_serving_config(vllm_config: VllmConfig) -> None:
    """Refuse what two streams on one paged cache cannot do."""
    if vllm_config.speculative_config is not None:
        raise OrthrosServeError(
            "speculative decoding is not supported by Orthros models: a verification step needs an output "
            "token at every draft position, and Orthros serves one per request per step; drop "
            "--speculative-config / speculative_config"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise OrthrosServeError(
            "pipeline parallelism is not supported by Orthros models (the output stream would have to travel "
            "between stages with the base stream); use tensor parallelism (--tensor-parallel-size) instead"
        )
    hf = vllm_config.model_config.hf_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    if hf.num_attention_heads % tp:
        raise OrthrosServeError(
            f"num_attention_heads={hf.num_attention_heads} is not divisible by --tensor-parallel-size {tp}: gamma/beta "
            "and the query heads are split by heads; pick a tensor-parallel size that divides the head count"
        )
    window = hf.base_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise OrthrosServeError(
            f"base_window in config.json must be a positive integer (the base stream's window W), got {window!r}: "
            "re-export the checkpoint with `orthros-convert to-hf`, or set it to the W the model was trained with"
        )


def run_eagerly_off_cpu(vllm_config: VllmConfig) -> None:
    """Eager mode (no torch.compile, no CUDA graphs) on every platform but the CPU.

    The output stream adds a second dynamic size to the step (one row per request, beside one
    per token), which vLLM's CUDA graphs, captured per token count, cannot replay; on CPU vLLM
    compiles without CUDA graphs, and the model compiles there. Same as ``--enforce-eager``.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() and not vllm_config.model_config.enforce_eager:
        logger.info("Orthros model: running eagerly on %s (the output stream's per-request rows cannot be "
                    "replayed by CUDA graphs captured per token count)", current_platform.device_name)
        vllm_config.model_config.enforce_eager = True


def add_prompt_logprobs_refusal(vllm_config: VllmConfig) -> None:
    """Append the request validator that refuses prompt logprobs to the engine's logits processors.

    A custom logits processor's ``validate_params`` is vLLM's per-request admission hook (a bad
    request gets an error, HTTP 400 from the server, and the engine runs on); the processor itself
    changes no logits. Model Runner V2 (GPU) loads only its own interface, so the class follows it.
    """
    model_config = vllm_config.model_config
    refusal = PROMPT_LOGPROBS_REFUSAL_V2 if vllm_config.use_v2_model_runner else PROMPT_LOGPROBS_REFUSAL
    processors: list[Any] = list(model_config.logits_processors or [])
    if refusal not in processors:
        model_config.logits_processors = [*processors, refusal]


class OrthrosConfigHook(VerifyAndUpdateConfig):
    """vLLM's config hook for ``OrthrosForCausalLM`` (run once per engine configuration)."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        check_serving_config(vllm_config)
        run_eagerly_off_cpu(vllm_config)
        add_prompt_logprobs_refusal(vllm_config)
