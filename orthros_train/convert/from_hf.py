"""Hugging Face checkpoint of a supported family (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Qwen2-MoE: ``convert/families.py``) -> Orthros checkpoint (``docs/convert.md``, ``docs/moe.md``).

The conversion swaps the attention module and nothing else: every HF tensor keeps its value and
(minus the ``model.`` prefix) its name (the MoE models' routers and experts included); each
layer gains the output stream's query affine ``gamma = 1, beta = 0``. The converted model
therefore reproduces the HF logits exactly on any sequence of at most ``sliding_window``
tokens, and is the starting point of continued pretraining (``model.init_from`` in the recipes).
``sink_tokens`` (a config field, no weights) lets every base query also attend its document's
first tokens, where a pretrained dense model puts much of its attention; it changes nothing
inside the window.

What each family's config says is data (:data:`~orthros_train.convert.families.FAMILIES`); this
module applies it. Everything a config may say that Orthros cannot express is refused by name
(sliding-window or hybrid attention, RoPE variants other than default/linear/llama3/yarn, MLP or
output-projection biases, quantized weights, non-SiLU activations) rather than converted into a
different model.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from orthros_train.convert.checkpoint_io import (
    CONFIG_NAME,
    ConversionError,
    PlannedTensor,
    copy_side_files,
    dtype_name,
    parse_byte_size,
    parse_dtype,
    read_json,
    read_source,
)
from orthros_train.convert.destination import write_destination
from orthros_train.convert.families import (
    FAMILIES,
    LM_HEAD,
    SLIDING_WINDOW_REASON,
    WINDOW_IF_USE_SLIDING_WINDOW,
    WINDOW_ON_EVERY_LAYER,
    FamilyRules,
    supported_families,
)
from orthros_train.errors import UserError, first_line
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.layers import ROPE_REQUIRED_KEYS, ROPE_TYPES, YARN_OPTIONAL_KEYS
from orthros_train.model.orthros import OrthrosForCausalLM

if TYPE_CHECKING:
    from orthros_train.common.safetensors_io import SafetensorsReader

DEFAULT_WINDOW = 128
# Base queries of the prompt's last R tokens (and of generated tokens) that see the whole document:
# what brings a converted model's retrieval beyond the window back with no training
# (docs/conversion_study.md). 0 is the paper's layer.
DEFAULT_GLOBAL_TAIL = 32
SRC_FIX = (
    "the source must be a Hugging Face model directory (config.json + model.safetensors or "
    "model-*.safetensors with model.safetensors.index.json), e.g. "
    "`huggingface-cli download meta-llama/Llama-3.1-8B --local-dir SRC`"
)


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a v4 (``rope_theta`` + ``rope_scaling``) or v5
    (``rope_parameters``) config; rope types Orthros does not implement are refused."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConversionError(f"{key} must be a dict, got {hf[key]!r}")
    params = _resolved_rope(hf)
    if params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type RoPE ({"full_attention": {...}, "sliding_attention": {...}}).
        kinds = sorted(params)
        if kinds != ["full_attention"]:
            raise ConversionError(f"per-layer-type rope_parameters {kinds} are not supported")
        params = params["full_attention"]
    scaling = dict(params) if params else None
    theta = (params or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConversionError(f"rope_theta must be a positive number, got {theta!r}")
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConversionError(f"partial_rotary_factor={partial} is not supported (Orthros rotates the whole head)")
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_TYPES:
        raise ConversionError(
            f"rope_scaling type {kind!r} is not supported; Orthros implements default RoPE, 'linear', "
            f"'llama3' and 'yarn' scaling ({ROPE_TYPES})"
        )
    if kind in ("llama3", "yarn"):
        # transformers fills these in when loading (standardize_rope_params): do the same so the
        # converted model uses the frequencies HF computes for this config.
        if "original_max_position_embeddings" in hf:
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        elif scaling.get("original_max_position_embeddings") is None and "max_position_embeddings" in hf:
            scaling["original_max_position_embeddings"] = hf["max_position_embeddings"]
    if (
        kind == "yarn"
        and scaling.get("factor") is None
        and scaling.get("original_max_position_embeddings")
        and ("max_position_embeddings" in hf)
    ):
        scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    optional = YARN_OPTIONAL_KEYS if kind == "yarn" else ()
    missing = [k for k in ROPE_REQUIRED_KEYS[kind] if scaling.get(k) is None]
    if missing:
        raise ConversionError(f"{kind} rope_scaling is missing {missing}")
    kept = {k: scaling[k] for k in (*ROPE_REQUIRED_KEYS[kind], *optional) if scaling.get(k) is not None}
    return float(theta), {"rope_type": kind, **kept}


def _resolved_rope(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE parameters transformers itself runs for this config.

    Both spellings may sit in one file (a v5 ``rope_parameters`` beside a legacy
    ``rope_scaling``), and transformers' precedence is not the obvious one: ``rope_scaling`` wins
    whole (``convert_rope_params_to_dict``), ``rope_theta`` then comes from the top level or the
    class default. Rather than re-implement that, let the library's config class resolve it, so
    the converted model gets the RoPE the HF model is loaded with.
    """
    config = _transformers_config(hf)
    if config is None:  # no transformers: the file's own fields, v5 spelling first
        params = hf.get("rope_parameters") or hf.get("rope_scaling")
        return dict(params) if params else None
    if hasattr(config, "rope_parameters"):  # transformers 5: one standardized dict
        params = config.rope_parameters
        return dict(params) if params else None
    # transformers 4: rope_theta beside a validated rope_scaling
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}


def _transformers_config(hf: dict[str, Any]) -> Any | None:
    """The config object transformers builds from ``hf`` (its defaults filled in), or None
    without transformers."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return None
    import logging
    import warnings

    config_class = CONFIG_MAPPING[hf["model_type"]]
    hf_logger = logging.getLogger("transformers")
    level = hf_logger.level
    hf_logger.setLevel(logging.ERROR)  # its rope-validation notes are about the source, not ours
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config_class.from_dict(json.loads(json.dumps(hf)))  # a copy: it mutates dicts
    except (TypeError, ValueError, KeyError, *_config_validation_errors()) as err:
        raise ConversionError(f"transformers cannot load this config ({first_line(err)})") from err
    finally:
        hf_logger.setLevel(level)


def _config_validation_errors() -> tuple[type[Exception], ...]:
    """What transformers' config classes raise for a field of the wrong type (transformers 5
    validates fields with huggingface_hub's strict dataclasses: not a ValueError)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _moe_from_hf(hf: dict[str, Any], rules: FamilyRules) -> dict[str, Any]:
    """OrthrosConfig's MoE fields for a config of an MoE family (``rules.moe`` names them and
    their defaults; ConversionError naming the key for what Orthros cannot express)."""
    if "num_experts" in hf and "num_local_experts" in hf and hf["num_experts"] != hf["num_local_experts"]:
        raise ConversionError(
            f"num_experts={hf['num_experts']!r} and num_local_experts={hf['num_local_experts']!r} disagree "
            "(transformers reads them as one field); keep one of them"
        )
    config = _transformers_config(hf)
    out: dict[str, Any] = {}
    for key, default in (rules.moe or {}).items():
        if config is not None:
            value = getattr(config, key)
        else:
            value = hf.get(key, hf.get("num_local_experts", default) if key == "num_experts" else default)
        out[key] = [] if key == "mlp_only_layers" and value is None else value
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConversionError(f"{key}={value!r}: must be a positive integer")
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise ConversionError(
            f"num_experts_per_tok={out['num_experts_per_tok']} exceeds num_experts={out['num_experts']}"
        )
    if rules.shared_expert:
        shared = out["shared_expert_intermediate_size"]
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
            raise ConversionError(
                f"shared_expert_intermediate_size={shared!r}: {rules.architecture} layers always run their shared "
                "expert, so it must be a positive integer"
            )
    layers = out["mlp_only_layers"]
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ConversionError(f"mlp_only_layers={layers!r}: must be a list of layer indices")
    if hf.get("router_jitter_noise"):
        raise ConversionError(
            f"router_jitter_noise={hf['router_jitter_noise']!r} is not supported (Orthros routers are deterministic)"
        )
    out["norm_topk_prob"] = bool(out["norm_topk_prob"])
    return out


def family_of(hf: dict[str, Any]) -> FamilyRules:
    """The :data:`~orthros_train.convert.families.FAMILIES` entry for a config, or a
    ConversionError naming the supported families."""
    model_type = hf.get("model_type")
    rules = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if rules is None:
        raise ConversionError(f"model_type {model_type!r} is not supported; supported: {supported_families()}")
    arch = hf.get("architectures") or [rules.architecture]
    if arch != [rules.architecture]:
        raise ConversionError(f"architectures {arch} is not supported; expected {[rules.architecture]}")
    return rules


def _refuse_what_orthros_cannot_express(hf: dict[str, Any], rules: FamilyRules) -> None:
    """A ConversionError naming the first key of ``hf`` that would make the converted model a
    different model: never convert it into one."""
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ConversionError(
            f"quantized checkpoints ({method}) are not supported; save a dequantized (float) copy first"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"hidden_act {act!r} is not supported (Orthros uses SwiGLU with SiLU)")
    if hf.get("mlp_bias"):
        raise ConversionError("mlp_bias=true is not supported (Orthros MLP projections have no bias)")
    if rules.attention_bias_refusal and hf.get("attention_bias"):
        raise ConversionError(
            f"attention_bias=true is not supported for {rules.model_type} ({rules.attention_bias_refusal})"
        )
    _refuse_sliding_window(hf, rules)
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ConversionError(f"layer_types {sorted(set(layer_types))} are not supported; only full_attention layers")
    if hf.get("attention_chunk_size"):
        raise ConversionError("attention_chunk_size (chunked attention) is not supported")


def _refuse_sliding_window(hf: dict[str, Any], rules: FamilyRules) -> None:
    """Orthros replaces attention with its own base window beside an output stream that attends
    every earlier key; an HF model whose layers were trained with a sliding window never looked
    that far back, so it is refused. How a family's config says so: ``rules.sliding_window``."""
    window = rules.value(hf, "sliding_window")
    if rules.sliding_window == WINDOW_IF_USE_SLIDING_WINDOW:
        if hf.get("use_sliding_window"):
            raise ConversionError(
                f"use_sliding_window=true (sliding_window={window}, max_window_layers="
                f"{hf.get('max_window_layers')}) is not supported: the layers from max_window_layers on attend "
                f"only their last sliding_window keys, and {SLIDING_WINDOW_REASON}; with use_sliding_window=false "
                "(the published configs) sliding_window is unused and the model converts"
            )
        return
    if window is None:
        return
    if rules.sliding_window == WINDOW_ON_EVERY_LAYER:
        max_pos = rules.value(hf, "max_position_embeddings", 131072)
        if _is_count(window) and _is_count(max_pos) and window >= max_pos:
            return  # no position ever falls out of the window: the model is dense
        raise ConversionError(
            f"sliding_window={window!r} is not supported: every {rules.model_type} layer attends only its last "
            f"sliding_window keys, and {SLIDING_WINDOW_REASON}; a sliding_window that is null or >= "
            f"max_position_embeddings ({max_pos!r}) is dense and converts"
        )
    raise ConversionError(
        f"sliding_window={window!r} is not supported: {rules.architecture} has no sliding-window attention, so a "
        f"config that names a window describes a model trained with one, and {SLIDING_WINDOW_REASON}"
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_required_fields(hf: dict[str, Any], model_type: str) -> None:
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ConversionError(
            f"required field(s) {missing} missing: this is not a complete {model_type} config.json"
        )
    bad = [k for k in required if not _is_count(hf[k]) or hf[k] <= 0]
    if bad:
        raise ConversionError(f"{', '.join(f'{k}={hf[k]!r}' for k in bad)}: must be positive integers")


def _model_fields(hf: dict[str, Any], rules: FamilyRules) -> dict[str, Any]:
    """The OrthrosConfig fields of the layers' shapes, norms and biases."""
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=rules.value(hf, "num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        qk_norm=rules.qk_norm,
        attention_bias=rules.qkv_biases(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=rules.value(hf, "max_position_embeddings", 131072),
        initializer_range=hf.get("initializer_range", 0.02),
    )


def _provenance(hf: dict[str, Any]) -> dict[str, Any]:
    """What the converted config keeps of its source under ``extra.hf``."""
    keys = ("model_type", "architectures", "bos_token_id", "eos_token_id", "pad_token_id")
    provenance = {key: hf[key] for key in keys if key in hf}
    src_dtype = hf.get("torch_dtype", hf.get("dtype"))
    if src_dtype is not None:
        provenance["torch_dtype"] = src_dtype
    return provenance


def orthros_config_from_hf(
    hf: dict[str, Any], sliding_window: int = DEFAULT_WINDOW, source: str = CONFIG_NAME, sink_tokens: int = 0,
    global_tail: int | None = None,
) -> OrthrosConfig:
    """Map a ``config.json`` (as a dict) of a family in
    :data:`~orthros_train.convert.families.FAMILIES` to an :class:`OrthrosConfig` with base window
    ``sliding_window``, ``sink_tokens`` base-stream sinks and global tail ``global_tail``; what it
    cannot express is refused in a ConversionError naming ``source`` and the key.

    ``global_tail`` None: ``DEFAULT_GLOBAL_TAIL`` where the window and that tail together are
    shorter than the model's context, else 0 (where they cover every position no base query is
    ever windowed, which the config refuses)."""
    if global_tail is None:
        context = hf.get("max_position_embeddings")
        fits = not isinstance(context, int) or sliding_window + DEFAULT_GLOBAL_TAIL < context
        global_tail = DEFAULT_GLOBAL_TAIL if fits else 0
    try:
        rules = family_of(hf)
        _refuse_what_orthros_cannot_express(hf, rules)
        _check_required_fields(hf, rules.model_type)
        rope_theta, rope_scaling = _rope_from_hf(hf)
        moe = _moe_from_hf(hf, rules) if rules.moe is not None else {}
        fields = _model_fields(hf, rules)
    except ConversionError as err:
        raise ConversionError(f"{source}: {err}") from err
    except KeyError as err:
        raise ConversionError(f"{source}: required field {err.args[0]!r} is missing") from err
    try:
        return OrthrosConfig(
            **fields,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
            sink_tokens=sink_tokens,
            base_global_tail=global_tail,
            attention_type="orthros",
            **moe,
            extra={"hf": _provenance(hf)},
        )
    except (TypeError, ValueError, UserError) as err:  # what OrthrosConfig refuses, e.g. --window 0
        raise ConversionError(f"{source}: {err}") from err


def _count_flag(flag: str, given: object, fix: str) -> int:
    """A flag that counts tokens (``--sink-tokens``, ``--global-tail``) as an int >= 0, or a
    ConversionError that names the flag and ``fix``."""
    value = given
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConversionError(f"{flag} {given!r} is not an integer: {fix}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConversionError(f"{flag} {given!r} is not an integer: {fix}")
    if value < 0:
        raise ConversionError(f"{flag} {value} is negative: {fix}")
    return value


def check_sink_tokens_flag(sink_tokens: object, window: int) -> int:
    """``--sink-tokens`` as an int, or a ConversionError that names the flag and the fix."""
    fix = (
        f"pass an integer from 0 (no sinks: the paper's layer) to {window - 1} (below --window {window}); "
        "4 is the usual choice for a converted model"
    )
    value = _count_flag("--sink-tokens", sink_tokens, fix)
    if value >= window:
        raise ConversionError(
            f"--sink-tokens {value} is not below --window {window} (the sinks are the document's first tokens a "
            f"base query sees beyond its window): {fix}"
        )
    return value


def check_global_tail_flag(global_tail: object) -> int:
    """``--global-tail`` as an int, or a ConversionError that names the flag and the fix."""
    return _count_flag("--global-tail", global_tail, (
        f"pass an integer >= 0 (0: the paper's layer; {DEFAULT_GLOBAL_TAIL}, the default where the window and the tail "
        "are shorter than the model's context, restores retrieval beyond it: docs/convert.md, 'The global tail')"))


def expected_state(config: OrthrosConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an Orthros checkpoint of ``config`` stores (tied head once)."""
    with torch.device("meta"):
        model = OrthrosForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def is_output_affine(name: str) -> bool:
    return name.endswith(("self_attn.gamma", "self_attn.beta"))


@dataclass
class ConversionReport:
    config: OrthrosConfig
    num_tensors: int
    num_bytes: int
    files: list[Path]
    side_files: list[str]
    seconds: float

    @classmethod
    def of_plan(cls, config: OrthrosConfig, plan: list[PlannedTensor], files: list[Path], side_files: list[str],
                start: float) -> ConversionReport:
        """The report of a conversion that wrote ``plan`` into ``files``, started at ``start``
        (``time.perf_counter``)."""
        return cls(config=config, num_tensors=len(plan), num_bytes=sum(t.nbytes for t in plan), files=files,
                   side_files=side_files, seconds=time.perf_counter() - start)

    def summary(self) -> str:
        c = self.config
        return (
            f"wrote {self.num_tensors} tensors ({self.num_bytes / 2**30:.2f} GiB) in {len(self.files)} file(s) "
            f"in {self.seconds:.1f}s: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads}/{c.num_key_value_heads} heads, window {c.sliding_window}"
            + (f", {c.sink_tokens} sink tokens" if c.sink_tokens else "")
            + (f", global tail {c.base_global_tail}" if c.base_global_tail else "")
            + (f"; copied {', '.join(self.side_files)}" if self.side_files else "")
        )


def convert_from_hf(
    src: str | Path,
    dst: str | Path,
    sliding_window: int = DEFAULT_WINDOW,
    dtype: str | None = None,
    max_shard_size: str | int = "4GB",
    overwrite: bool = False,
    sink_tokens: int = 0,
    global_tail: int | None = None,
) -> ConversionReport:
    """Convert the HF checkpoint in ``src`` into an Orthros checkpoint directory ``dst``.

    ``global_tail`` None: from-hf's default (``orthros_config_from_hf``).

    ``dst`` gets ``config.json`` (an :class:`OrthrosConfig`), the weights (``model.safetensors``
    or shards + index) and the source's tokenizer / generation-config files, and loads with
    ``OrthrosForCausalLM.from_pretrained(dst)``. ``dtype`` ``None``/``"auto"`` keeps the source
    dtypes (bf16 for the 8B models). Tensors are streamed one at a time.
    """
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ConversionError(f"source {src} is not a directory: {SRC_FIX}")
    hf = read_json(src / CONFIG_NAME, SRC_FIX)
    sink_tokens = check_sink_tokens_flag(sink_tokens, sliding_window)  # before anything is read or written
    global_tail = None if global_tail is None else check_global_tail_flag(global_tail)
    config = orthros_config_from_hf(hf, sliding_window, source=str(src / CONFIG_NAME), sink_tokens=sink_tokens,
                                    global_tail=global_tail)
    rules = FAMILIES[hf["model_type"]]
    cast = parse_dtype(dtype)
    shard_bytes = parse_byte_size(max_shard_size)  # before anything is created
    expected = expected_state(config)

    with read_source(src, SRC_FIX) as reader:
        source_of = _source_tensors(reader, rules, config, expected, src)
        plan = _plan_tensors(reader, source_of, expected, cast, src)

        def produce(t: PlannedTensor) -> torch.Tensor:
            if t.name.endswith(".gamma"):
                return torch.ones(t.shape, dtype=t.dtype)
            if t.name.endswith(".beta"):
                return torch.zeros(t.shape, dtype=t.dtype)
            return reader[source_of[t.name]].to(t.dtype)

        if cast is not None:
            config.extra["hf"]["torch_dtype"] = dtype_name(cast)

        def finish(folder: Path) -> list[str]:
            side = copy_side_files(src, folder)
            (folder / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
            return side

        # Written aside and swapped in whole: a failure keeps the previous model in dst.
        files, side = write_destination(src, dst, overwrite, plan, produce, shard_bytes, finish, "from-hf")
    return ConversionReport.of_plan(config, plan, files, side, start)


def _source_tensors(
    reader: SafetensorsReader,
    rules: FamilyRules,
    config: OrthrosConfig,
    expected: dict[str, tuple[int, ...]],
    src: Path,
) -> dict[str, str]:
    """Orthros name -> HF name of every stored tensor the converted model takes; a
    ConversionError for tensors the config does not imply or implies but the checkpoint lacks."""
    source_of: dict[str, str] = {}
    unexpected = []
    for hf_name in reader.names:
        name = rules.orthros_name(hf_name)
        if name is None:
            continue
        if name == LM_HEAD and config.tie_word_embeddings:
            continue  # a tied head stored anyway: HF ignores it too
        if name not in expected or is_output_affine(name):
            unexpected.append(hf_name)
        else:
            source_of[name] = hf_name
    if unexpected:
        raise ConversionError(
            f"{src}: tensors that {rules.architecture} with this config does not "
            f"have, so this architecture variant is not supported: {unexpected[:8]}"
            + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        )
    missing = [n for n in expected if n not in source_of and not is_output_affine(n)]
    if missing:
        hint = (
            " (config says tie_word_embeddings=false but the checkpoint has no lm_head.weight)"
            if missing == [LM_HEAD]
            else ""
        )
        raise ConversionError(f"{src}: checkpoint lacks tensors the config implies: {missing[:8]}{hint}")
    return source_of


def _plan_tensors(
    reader: SafetensorsReader,
    source_of: dict[str, str],
    expected: dict[str, tuple[int, ...]],
    cast: torch.dtype | None,
    src: Path,
) -> list[PlannedTensor]:
    """Every tensor of the converted checkpoint, in ``expected``'s order, with its dtype: ``cast``
    or the stored one (a layer's gamma/beta take its q_proj's); a stored shape the config does
    not imply is refused."""
    plan = []
    for name, shape in expected.items():
        if is_output_affine(name):
            q_name = name.rsplit(".", 1)[0] + ".q_proj.weight"
            src_dtype = reader.info(source_of[q_name]).dtype
        else:
            info = reader.info(source_of[name])
            if info.shape != shape:
                raise ConversionError(
                    f"{src}: tensor {info.name} has shape {list(info.shape)}, the config implies "
                    f"{list(shape)} ({info.file.name})"
                )
            src_dtype = info.dtype
        plan.append(PlannedTensor(name, shape, cast or src_dtype))
    return plan
