"""Inference: prefill + decode with a KV cache, batched generation (greedy / temperature / top-p)."""

from orthros_train.common.tokenizer import load_tokenizer
from orthros_train.infer.generate import GenerationOutput, as_rows, decode, generate, generate_text, prefill
from orthros_train.infer.loading import PRESETS, config_from_spec, dense_twin, load_model
from orthros_train.infer.sampling import SamplingParams, filter_logits, sample_next

__all__ = [
    "PRESETS",
    "GenerationOutput",
    "SamplingParams",
    "as_rows",
    "config_from_spec",
    "decode",
    "dense_twin",
    "filter_logits",
    "generate",
    "generate_text",
    "load_model",
    "load_tokenizer",
    "prefill",
    "sample_next",
]
