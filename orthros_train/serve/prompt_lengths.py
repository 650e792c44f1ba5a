"""Each request's prompt length, for the global tail: learnt through a logits processor, as prompt logprobs are.

With ``base_global_tail = R > 0`` the base rows of a request's last ``R`` prompt tokens and of its
generated tokens are global (``tail_rows.py``). vLLM's attention metadata gives a step's rows and
each request's cached length, but not where its prompt ends, and under chunked prefill a chunk
that does not end the prompt still has tail rows when ``R`` exceeds the prompt's last chunk. The
V1 model runner tells every custom logits processor, before each forward, which requests joined
its persistent batch with their prompt token ids, and which left or moved (by batch index, their
order in the step's ``query_start_loc``): ``PromptLengths`` keeps each index's prompt length and
publishes it under the engine's config (``prompt_logprobs.py`` routes prompt-logprob requests the
same way), where the model reads it when it plans the step. A request preempted and resumed joins
again with the same prompt, so its recomputed generated tokens stay global. It changes no logit.

On GPU the lengths are also kept in a device buffer of fixed address (``TailLengths.device``),
written here, before the forward, so a captured CUDA graph that computes the tail rows on the
device reads this step's lengths when it is replayed (its Python does not run again).

The config hook adds this processor only with ``R > 0`` and refuses what it cannot serve there:
speculative decoding (vLLM then takes no custom logits processor), Model Runner V2 (it tells
processors about requests after the forward) and prompt embeddings (no prompt token ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from orthros_train.serve.refusal import OrthrosServeError

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.sample.logits_processor import BatchUpdate


@dataclass
class TailLengths:
    """The prompt lengths of one engine's batch: by batch index on the host, and on the device."""

    lengths: dict[int, int] = field(default_factory=dict)
    device: torch.Tensor | None = None  # [max_num_seqs] int32 on the GPU (None on CPU)

    def host(self, num_requests: int) -> torch.Tensor:
        """``[num_requests]`` int64: the prompt length of every batch index of the step."""
        try:
            return torch.tensor([self.lengths[i] for i in range(num_requests)], dtype=torch.long)
        except KeyError as e:
            raise OrthrosServeError(
                f"no prompt length is known for batch index {e.args[0]}: the model runner did not tell the "
                "Orthros logits processor about this request (serve base_global_tail > 0 with vLLM's V1 runner, "
                "without speculative decoding)"
            ) from None

    def refresh_device(self) -> None:
        if self.device is None or not self.lengths:
            return
        n = max(self.lengths) + 1
        values = torch.tensor([self.lengths.get(i, 0) for i in range(n)], dtype=torch.int32)
        self.device[:n].copy_(values, non_blocking=True)


# id(VllmConfig) -> the lengths of the engine built from it (one model runner per config in a worker).
# Plain entries, not weak ones: a rebuilt processor must keep the buffer a captured graph reads.
_LENGTHS: dict[int, TailLengths] = {}


def tail_lengths(vllm_config: VllmConfig, device: torch.device | None = None) -> TailLengths:
    """The engine's ``TailLengths`` (made on first use; ``device``: where the GPU buffer lives)."""
    state = _LENGTHS.get(id(vllm_config))
    if state is None:
        state = _LENGTHS[id(vllm_config)] = TailLengths()
    if device is not None and torch.device(device).type == "cuda":
        size = max(vllm_config.scheduler_config.max_num_seqs, 1)
        old, want = state.device, torch.device(device)
        # Made once per engine; a config id reused by a later engine (ids are recycled) gets its own.
        if old is None or old.shape[0] < size or want.index not in (None, old.device.index):
            state.device = torch.zeros(size, dtype=torch.int32, device=device)
            state.refresh_device()
    return state


def lengths_of(config_id: int) -> TailLengths | None:
    """The ``TailLengths`` of the engine of ``id(vllm_config)``, if its processor was built."""
    return _LENGTHS.get(config_id)


def _prompt_length(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> int | None:
    return None if prompt_ids is None else len(prompt_ids)


class PromptLengths(LogitsProcessor):
    """For vLLM's V1 model runner: every batch index's prompt length, for the model to read; the
    logits pass through unchanged."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.state = tail_lengths(vllm_config, device)
        # The runner may rebuild its batch (and this processor): its batch starts empty again.
        self.state.lengths.clear()

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        pass  # every request is served

    def is_argmax_invariant(self) -> bool:
        return True  # greedy sampling never calls apply()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self.state.lengths, batch_update, _prompt_length):
            self.state.refresh_device()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
