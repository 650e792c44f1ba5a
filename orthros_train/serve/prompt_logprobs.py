"""Prompt logprobs from an Orthros model: an output token at every prompt row of the requests that ask.

Only the output stream predicts tokens. A prefill normally puts one output token per request, at
its last prompt row; the other prompt rows run the base stream alone, which has no LM head. A
request that asks for prompt logprobs (``prompt_logprobs``, or the OpenAI API's ``echo`` with
``logprobs``) therefore gets an output token at every row of each of its prefill chunks: the
pretraining layout, for that request only. Its logprobs are then the model's own full-sequence
ones; the other requests of the batch keep one output token each, and since no output token
attends another, nothing of theirs changes. The cost is that request's: its prompt's output rows
in every matmul (twice the token-wise work of its prefill) and causal attention over its whole
prompt (``T^2/2`` pairs per layer instead of ``T*W + T``).

Which requests asked is known to vLLM's model runner, not to the model. The runner tells every
custom logits processor of the engine, before each forward, which requests joined, left or moved
in its persistent batch (``update_state``), by their batch index, which is their order in the
step's ``query_start_loc``. ``PromptLogprobRows`` is such a processor (``config.py`` adds it to
Orthros engines): it keeps the batch indices of the requests with prompt logprobs and publishes
them under the engine's config, where the model (built from the same config object in the same
worker) reads them when it plans the step's output tokens. It changes no logits.

Model Runner V2 (GPU) tells its logits processors about requests only after the forward, so there
the model cannot know them in time: ``RefusePromptLogprobsV2`` refuses such requests when vLLM
admits them (``VLLMValidationError``, HTTP 400 from the server) and says how to get the V1 runner.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as LogitsProcessorV2

if TYPE_CHECKING:
    import torch
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import BatchUpdate

MESSAGE_V2 = (
    "prompt logprobs are not available from an Orthros model under vLLM's Model Runner V2: an Orthros "
    "model needs to know before the forward which requests want them (it then puts an output token at every "
    "prompt position), and V2 tells it only after; start the engine with VLLM_USE_V2_MODEL_RUNNER=0 (the V1 "
    "runner serves them), or drop {param} from the request"
)

# id(VllmConfig) -> the tracker of the engine built from it (a worker has one model runner per config).
_TRACKERS: dict[int, weakref.ReferenceType[PromptLogprobRows]] = {}


def prompt_logprob_rows(config_id: int) -> frozenset[int]:
    """Batch indices of this step's requests with prompt logprobs, for the engine of ``id(vllm_config)``."""
    ref = _TRACKERS.get(config_id)
    tracker = ref() if ref is not None else None
    return frozenset(tracker.requests) if tracker is not None else frozenset()


def _wants_prompt_logprobs(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> bool | None:
    return True if getattr(params, "prompt_logprobs", None) is not None else None


class PromptLogprobRows(LogitsProcessor):
    """For vLLM's V1 model runner (CPU, and GPU where Model Runner V2 is off): tracks which batch
    indices asked for prompt logprobs, for the model to read; the logits pass through unchanged."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.requests: dict[int, bool] = {}
        # The runner may rebuild its batch (and this processor): the newest one is the engine's.
        _TRACKERS[id(vllm_config)] = weakref.ref(self)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        pass  # every request is served; the V1 runner itself refuses prompt_logprob_token_ids

    def is_argmax_invariant(self) -> bool:
        return True  # greedy sampling never calls apply()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, _wants_prompt_logprobs)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def refuse_prompt_logprobs_v2(params: SamplingParams) -> None:
    """Raise ``VLLMValidationError`` if ``params`` asks for the logprobs of prompt tokens (Model Runner V2)."""
    for param in ("prompt_logprobs", "prompt_logprob_token_ids"):
        if getattr(params, param, None) is not None:
            raise VLLMValidationError(MESSAGE_V2.format(param=param), parameter=param, value=getattr(params, param))


class RefusePromptLogprobsV2(LogitsProcessorV2):
    """The refusal for Model Runner V2 (GPU); it declines every request, so apply() has nothing to do."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        refuse_prompt_logprobs_v2(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        return False

    def apply(self, logits: torch.Tensor, ctx: object) -> torch.Tensor:
        return logits
