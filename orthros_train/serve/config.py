"""What an Orthros model cannot serve, refused when vLLM builds its configuration.

``plugin.register`` puts ``OrthrosConfigHook`` into vLLM's per-architecture table of config
hooks (``vllm.model_executor.models.config.MODELS_CONFIG_MAP``), which ``VllmConfig`` runs once
when it is built: in the process that starts the engine (the OpenAI server's front end, or the
``LLM`` object's), before any engine process or model exists. So a refused setting stops
``vllm serve`` / ``LLM(...)`` at once with its message. It also makes the output attention a
splitting op of vLLM's piecewise CUDA graphs and adds the logits processor through which the model
learns which requests want prompt logprobs, and, with a global tail, the one through which it learns
each request's prompt length (turning prefix caching off: see ``tail_prefix_caching``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from orthros_train.errors import UserError, first_line
from orthros_train.ops.keys import KeyRule
from orthros_train.serve.refusal import OrthrosServeError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

ARCHITECTURE = "OrthrosForCausalLM"
# Loaded by vLLM from these names (front end and engine), one per model-runner interface.
PROMPT_LOGPROBS_ROWS = "orthros_train.serve.prompt_logprobs:PromptLogprobRows"
PROMPT_LOGPROBS_REFUSAL_V2 = "orthros_train.serve.prompt_logprobs:RefusePromptLogprobsV2"
# How the model learns each request's prompt length (the global tail; V1 runner).
PROMPT_LENGTHS = "orthros_train.serve.prompt_lengths:PromptLengths"
# The output stream's attention and the base stream's with sink tokens: splitting ops of vLLM's
# piecewise CUDA graphs, as its own attention is (they read the step's metadata).
OUTPUT_ATTENTION_OP = "orthros::output_attention"
BASE_ATTENTION_OP = "orthros::base_attention"
GLOBAL_ATTENTION_OP = "orthros::global_attention"  # the global tail's base rows over every key
ATTENTION_OPS = (OUTPUT_ATTENTION_OP, BASE_ATTENTION_OP, GLOBAL_ATTENTION_OP)
# Speculative methods whose drafts need only the target's logits at the verified positions, which
# the model gives by putting output tokens there. The others condition the draft on the target's
# hidden states at every scheduled position (EAGLE, EAGLE-3, MTP, DFlash, DSpark, hidden-state
# extraction) or at positions this model does not define (Medusa, MLP speculator, custom classes).
SPECULATIVE_METHODS = ("ngram", "ngram_gpu", "suffix", "draft_model")


def check_serving_config(vllm_config: VllmConfig) -> None:
    """Refuse what two streams on one paged cache cannot do."""
    spec = vllm_config.speculative_config
    if spec is not None and spec.method not in SPECULATIVE_METHODS:
        raise OrthrosServeError(
            f"speculative decoding with method {spec.method!r} is not supported by Orthros models: it conditions "
            "the draft on the target model's hidden states, which an Orthros model defines only where it puts an "
            "output token (giving every prompt position one is the pretraining layout, a quadratic prefill); use "
            f"one of {', '.join(SPECULATIVE_METHODS)} (their drafts need only the verified positions' logits)"
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
    path, raw = export_config(vllm_config.model_config)
    if raw is not None and "base_window" not in raw:
        # The config class defaults the window (128), which would serve a model trained with another
        # W silently wrong; an export always writes it.
        legacy = " (its sliding_window is not read: the window of an Orthros export is base_window)" \
            if "sliding_window" in raw else ""
        raise OrthrosServeError(
            f"{path} has no base_window{legacy}: re-export the checkpoint with `orthros-convert to-hf`, or add "
            '"base_window": W (the base-stream window the model was trained with) to it'
        )
    window = hf.base_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise OrthrosServeError(
            f"base_window in config.json must be a positive integer (the base stream's window W), got {window!r}: "
            "re-export the checkpoint with `orthros-convert to-hf`, or set it to the W the model was trained with"
        )
    sinks = stated(hf, raw, "sink_tokens")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or not 0 <= sinks < window:
        raise OrthrosServeError(
            f"sink_tokens in config.json must be an integer in 0..base_window-1={window - 1} (the base stream's "
            f"attention sinks; absent means 0), got {sinks!r}: re-export the checkpoint with `orthros-convert to-hf`"
        )
    try:  # the one validation of W, S, R (ops/keys.py)
        KeyRule(window, sinks, stated(hf, raw, "base_global_tail"))
    except UserError as e:
        raise OrthrosServeError(f"{path}: {first_line(e)}; fix base_global_tail there or re-export the checkpoint "
                                "with `orthros-convert to-hf`") from None
    if served_global_tail(hf, vllm_config.model_config.max_model_len):
        check_tail_serving(vllm_config)


def stated(hf_config: Any, raw: dict | None, key: str) -> object:
    """``sink_tokens`` / ``base_global_tail`` as the export states it: absent from its config.json (an
    export from before the key existed, whose config class leaves it None) is 0, the layer it was;
    any stated value, ``null`` included, is checked as given."""
    value = getattr(hf_config, key, None)
    if value is None and (raw is None or key not in raw):
        return 0
    return value


def check_tail_serving(vllm_config: VllmConfig) -> None:
    """Refuse what the global tail cannot be served with: the model must know every request's prompt
    length before each forward, which only the V1 runner's logits processors learn in time."""
    tail = vllm_config.model_config.hf_config.base_global_tail
    what = f"an Orthros model with base_global_tail={tail} needs each request's prompt length before the forward"
    if vllm_config.speculative_config is not None:
        raise OrthrosServeError(
            f"speculative decoding is not supported with base_global_tail > 0: {what}, which vLLM tells the model "
            "through a custom logits processor and takes none under speculative decoding; drop the speculative "
            "config, or serve an export with base_global_tail 0"
        )
    if vllm_config.use_v2_model_runner:
        raise OrthrosServeError(
            f"vLLM's Model Runner V2 cannot serve base_global_tail > 0: {what}, and V2 tells logits processors "
            "about requests only after it; start the engine with VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner)"
        )
    if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
        raise OrthrosServeError(
            f"prompt embeddings are not supported with base_global_tail > 0: {what}, and vLLM gives it the prompt's "
            "token ids only; drop --enable-prompt-embeds"
        )


def served_global_tail(hf_config: Any, max_model_len: int) -> int:
    """The global tail the served base stream applies: the export's ``base_global_tail`` (absent: 0),
    or 0 where no request is longer than the window (``max_model_len <= base_window``: every base
    row already sees its whole request, as for ``served_sink_tokens``)."""
    tail = int(getattr(hf_config, "base_global_tail", 0) or 0)
    return tail if max_model_len > int(hf_config.base_window) else 0


def tail_prefix_caching(vllm_config: VllmConfig) -> None:
    """With a global tail, prefix caching is turned off (with a warning).

    A cached block holds K/V computed for the request that wrote it: a token that was among that
    request's last ``R`` prompt tokens or that it generated has K/V from a global base query, and
    the same token read afresh inside a longer prompt has K/V from a windowed one (and the reverse:
    a prompt's own tail found in a block another request wrote windowed). Reusing blocks would make
    a request's answer depend on what the cache held, which a user of prefix caching does not
    expect. vLLM turns prefix caching on by default and hands the hook the same flag whether a user
    asked for it or not, so it is turned off rather than refused (refusing would refuse every
    default engine), and the warning says why.
    """
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        return
    tail = vllm_config.model_config.hf_config.base_global_tail
    logger.warning(
        "Orthros model with base_global_tail=%d: prefix caching is turned off. A cached block holds K/V "
        "computed for another request's prompt tail or answer (global base queries), which a fresh read of "
        "the same tokens computes windowed; each request reads its whole prompt instead (a chat's earlier "
        "turns are read as part of the new prompt: only its last %d tokens are the tail)", tail, tail)
    cache.enable_prefix_caching = False


def add_prompt_lengths(vllm_config: VllmConfig) -> None:
    """Append the logits processor through which the model learns each request's prompt length
    (``prompt_lengths.py``), for an export served with a global tail."""
    model_config = vllm_config.model_config
    processors: list[Any] = list(model_config.logits_processors or [])
    if PROMPT_LENGTHS not in processors:
        model_config.logits_processors = [*processors, PROMPT_LENGTHS]


def served_sink_tokens(hf_config: Any, max_model_len: int) -> int:
    """The sink tokens the served base stream must add: the export's ``sink_tokens`` (absent: 0),
    or 0 where no request is long enough for a window to miss its first tokens (``max_model_len <=
    base_window``), so vLLM's own windowed attention serves it as it serves ``S = 0``."""
    sinks = int(getattr(hf_config, "sink_tokens", 0) or 0)
    return sinks if max_model_len > int(hf_config.base_window) else 0


def export_config(model_config: Any) -> tuple[str, dict | None]:
    """(path, contents) of the export's own config.json, as written (the config object vLLM built
    from it has every default filled in); contents ``None`` where it cannot be read (then the
    config object alone is checked)."""
    import json
    from pathlib import Path

    source = getattr(model_config, "hf_config_path", None) or model_config.model
    path = Path(source) / "config.json"
    if not path.is_file():
        try:
            from transformers.utils import cached_file

            found = cached_file(source, "config.json", revision=getattr(model_config, "revision", None),
                                _raise_exceptions_for_missing_entries=False)
        except Exception:  # a remote source we cannot resolve here: vLLM reports its own errors
            found = None
        if found is None:
            return str(path), None
        path = Path(found)
    try:
        return str(path), json.loads(path.read_text())
    except (OSError, ValueError):
        return str(path), None


def split_graphs_at_output_attention(vllm_config: VllmConfig) -> None:
    """Make the output attention (and the base stream's with sink tokens) splitting ops of vLLM's
    piecewise CUDA graphs.

    vLLM's default splitting ops come from ``CompilationConfig._attention_ops``, which the plugin
    extends (``plugin.register``); a list the user gave gets the op appended here. An empty list
    means one graph without pieces (full graphs only), which needs nothing. Between pieces the
    output attention runs eagerly, reading the step's metadata; inside a captured piece, the rows
    of the output stream are every row of the step (``output_rows``), so a graph keyed by the token
    count replays them.
    """
    ops = vllm_config.compilation_config.splitting_ops
    if ops:
        ops.extend(op for op in ATTENTION_OPS if op not in ops)


def add_prompt_logprobs_rows(vllm_config: VllmConfig) -> None:
    """Append the logits processor that tells the model which requests want prompt logprobs (V1
    runner), or the one that refuses them (Model Runner V2, which tells processors too late).

    A custom logits processor hears of every request joining, leaving or moving in the runner's
    batch before each forward, and its ``validate_params`` is vLLM's per-request admission hook;
    neither processor changes a logit (``prompt_logprobs.py``).
    """
    if vllm_config.speculative_config is not None:
        # vLLM takes no custom logits processor under speculative decoding (its runner refuses to
        # start), so the model cannot learn which requests want prompt logprobs there.
        logger.warning("Orthros model with speculative decoding: prompt logprobs are not available (vLLM takes no "
                       "custom logits processor then, through which the model learns which requests want them); "
                       "a request asking for them gets NaN")
        return
    model_config = vllm_config.model_config
    name = PROMPT_LOGPROBS_REFUSAL_V2 if vllm_config.use_v2_model_runner else PROMPT_LOGPROBS_ROWS
    processors: list[Any] = list(model_config.logits_processors or [])
    if name not in processors:
        model_config.logits_processors = [*processors, name]


class OrthrosConfigHook(VerifyAndUpdateConfig):
    """vLLM's config hook for ``OrthrosForCausalLM`` (run once per engine configuration)."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        check_serving_config(vllm_config)
        split_graphs_at_output_attention(vllm_config)
        add_prompt_logprobs_rows(vllm_config)
        if served_global_tail(vllm_config.model_config.hf_config, vllm_config.model_config.max_model_len):
            tail_prefix_caching(vllm_config)
            add_prompt_lengths(vllm_config)
