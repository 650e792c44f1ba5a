"""Requests for prompt logprobs are refused: an Orthros model has no prediction at prompt rows.

Only the output stream predicts tokens, and a prefill puts one output token per request, at its
last prompt row; every other prompt row runs the base stream alone, which has no LM head. So the
log-probabilities of prompt tokens (``prompt_logprobs``, ``prompt_logprob_token_ids``, and the
OpenAI API's ``echo`` with ``logprobs``) do not exist for this model.

vLLM checks each request's sampling parameters, when it admits the request, with the
``validate_params`` of every custom logits processor of the engine (``config.py`` adds these for
Orthros engines): the request fails with a ``VLLMValidationError`` (HTTP 400 from the OpenAI
server) and the engine serves on. The processors themselves leave every logit as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as LogitsProcessorV2

if TYPE_CHECKING:
    import torch
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import BatchUpdate

MESSAGE = (
    "prompt logprobs are not available from an Orthros model: only the last prompt token carries an "
    "output token (the other prompt positions run the sliding-window base stream, which predicts "
    "nothing); drop {param} from the request (sampled-token logprobs, `logprobs`, are available)"
)


def refuse_prompt_logprobs(params: SamplingParams) -> None:
    """Raise ``VLLMValidationError`` if ``params`` asks for the logprobs of prompt tokens."""
    for param in ("prompt_logprobs", "prompt_logprob_token_ids"):
        if getattr(params, param, None) is not None:
            raise VLLMValidationError(MESSAGE.format(param=param), parameter=param, value=getattr(params, param))


class RefusePromptLogprobs(LogitsProcessor):
    """The refusal for vLLM's V1 model runner (CPU, and GPU where Model Runner V2 is off)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        pass  # no state: it only validates requests

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        refuse_prompt_logprobs(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return True  # greedy sampling never calls apply()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class RefusePromptLogprobsV2(LogitsProcessorV2):
    """The refusal for Model Runner V2 (GPU); it declines every request, so apply() has nothing to do."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        refuse_prompt_logprobs(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False

    def apply(self, logits: torch.Tensor, ctx: object) -> torch.Tensor:
        return logits
