"""Orthros checkpoint -> Hugging Face directory with self-contained remote code.

The export holds ``config.json`` (``model_type: orthros`` with an ``auto_map``), the weights under
HF names (``model.layers.0.self_attn.gamma``, ``lm_head.weight``, ...), the remote code
(``configuration_orthros.py`` / ``modeling_orthros.py`` and the package modules they import, made
from the package's own files: ``remote_code/shipping.py``; torch + transformers only) and the
tokenizer files. It loads without orthros_train installed::

    AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)
    AutoTokenizer.from_pretrained(dst, trust_remote_code=False)  # the tokenizer runs no custom code

and its ``generate`` runs Orthros' prefill (one output token at the last prompt position) and
decode (one base + output pair per step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from orthros_train.common.tokenizer import check_loadable
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
from orthros_train.convert.families import LM_HEAD, hf_name, orthros_name
from orthros_train.convert.from_hf import ConversionReport, expected_state
from orthros_train.convert.remote_code import write_remote_code
from orthros_train.errors import UserError
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.layers import rope_type

if TYPE_CHECKING:
    from orthros_train.common.safetensors_io import SafetensorsReader

SRC_FIX = (
    "the source must be an Orthros checkpoint directory (config.json + *.safetensors) written by "
    "`orthros-convert from-hf`, `OrthrosForCausalLM.save_pretrained` or the trainer"
)
AUTO_MAP = {
    "AutoConfig": "configuration_orthros.OrthrosConfig",
    "AutoModel": "modeling_orthros.OrthrosModel",
    "AutoModelForCausalLM": "modeling_orthros.OrthrosForCausalLM",
}


def hf_config_from_orthros(config: OrthrosConfig, torch_dtype: str) -> dict[str, Any]:
    """The exported ``config.json``: loadable by ``configuration_orthros.OrthrosConfig``."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    kind = rope_type(config.rope_scaling)
    if config.rope_scaling is not None and kind != "default":
        # Every key travels (yarn's optional ones included) so the export computes what we train with.
        rope = {**{k: v for k, v in config.rope_scaling.items() if k != "type"}, **rope, "rope_type": kind}
    provenance = config.extra.get("hf", {}) if isinstance(config.extra, dict) else {}
    hf: dict[str, Any] = {
        "architectures": ["OrthrosForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "model_type": "orthros",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "qk_norm": config.qk_norm,
        "attention_bias": config.attention_bias,
        "base_window": config.sliding_window,
        # written even when 0: an export states which keys each query sees (its remote code refuses a
        # config.json without them rather than default them)
        "sink_tokens": config.sink_tokens,
        "base_global_tail": config.base_global_tail,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": True,
        "torch_dtype": torch_dtype,
    }
    if config.num_experts:
        # lazy: the shipped config module imports transformers, which a plain convert command does not need
        from orthros_train.convert.remote_code.configuration_orthros import MOE_FIELDS

        hf.update({name: getattr(config, name) for name in MOE_FIELDS},
                  mlp_only_layers=list(config.mlp_only_layers), moe_routing=str(config.moe_routing))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if provenance.get(key) is not None:
            hf[key] = provenance[key]
    return hf


def convert_to_hf(
    src: str | Path,
    dst: str | Path,
    dtype: str | None = None,
    tokenizer: str | Path | None = None,
    max_shard_size: str | int = "4GB",
    overwrite: bool = False,
) -> ConversionReport:
    """Export the Orthros checkpoint in ``src`` to a Hugging Face remote-code directory ``dst``.

    ``dtype`` ``None``/``"auto"`` keeps the stored dtypes; ``tokenizer`` names a directory to copy
    tokenizer files from when ``src`` has none (e.g. a trainer checkpoint).
    """
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    config = _orthros_source_config(src)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ConversionError(f"--tokenizer {tokenizer} is not a directory")
    check_loadable(src, tokenizer)  # a corrupt tokenizer.json is refused, not exported
    cast = parse_dtype(dtype)
    shard_bytes = parse_byte_size(max_shard_size)  # before anything is created

    with read_source(src, SRC_FIX) as reader:
        plan = _plan_export(reader, config, cast, src)
        stored = reader.info("embed_tokens.weight").dtype

        def produce(t: PlannedTensor) -> torch.Tensor:
            return reader[orthros_name(t.name)].to(t.dtype)

        def finish(folder: Path) -> list[str]:
            side = _copy_remote_code_and_side_files(src, folder, tokenizer)
            _write_export_config(folder, hf_config_from_orthros(config, dtype_name(cast or stored)))
            return side

        # Written aside and swapped in whole: a failure keeps the previous export in dst.
        files, side = write_destination(src, dst, overwrite, plan, produce, shard_bytes, finish, "to-hf")
    return ConversionReport.of_plan(config, plan, files, side, start)


def _orthros_source_config(src: Path) -> OrthrosConfig:
    """The Orthros config of the checkpoint directory ``src``, or a ConversionError naming what
    ``src`` is instead (not a directory, a trainer checkpoint step, another model)."""
    if not src.is_dir():
        raise ConversionError(f"source {src} is not a directory: {SRC_FIX}")
    if not (src / CONFIG_NAME).is_file() and (src / "model" / CONFIG_NAME).is_file():
        # a trainer's checkpoint step keeps the model in its model/ folder
        raise ConversionError(f"{src} is a trainer checkpoint step: its model is {src / 'model'}; pass that folder")
    raw = read_json(src / CONFIG_NAME, SRC_FIX)
    try:
        config = OrthrosConfig.from_dict(raw)
    except (TypeError, ValueError, UserError) as err:
        raise ConversionError(f"{src / CONFIG_NAME} is not an Orthros config ({err}): {SRC_FIX}") from err
    if config.attention_type != "orthros":
        raise ConversionError(
            f"{src / CONFIG_NAME}: attention_type={config.attention_type!r}; to-hf exports Orthros models "
            "(attention_type='orthros') only"
        )
    return config


def _plan_export(
    reader: SafetensorsReader, config: OrthrosConfig, cast: torch.dtype | None, src: Path
) -> list[PlannedTensor]:
    """Every tensor of the export under its HF name, with ``cast`` or its stored dtype; weights
    that do not match ``config`` (missing, unexpected or of another shape) are refused."""
    expected = expected_state(config)
    names = set(reader.names)
    if config.tie_word_embeddings:
        names.discard(LM_HEAD)  # a tied head stored anyway
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        raise ConversionError(
            f"{src}: the weights do not match {CONFIG_NAME}: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    plan = []
    for name, shape in expected.items():
        info = reader.info(name)
        if info.shape != shape:
            raise ConversionError(
                f"{src}: tensor {name} has shape {list(info.shape)}, {CONFIG_NAME} implies {list(shape)}"
            )
        plan.append(PlannedTensor(hf_name(name), shape, cast or info.dtype))
    return plan


def _copy_remote_code_and_side_files(src: Path, dst: Path, tokenizer: str | Path | None) -> list[str]:
    """The remote code (the package's own model files, ``remote_code/shipping.py``), then the
    tokenizer / generation files of ``src`` and of ``tokenizer`` (those ``src`` lacks); returns the
    side files' names."""
    write_remote_code(dst)
    side = copy_side_files(src, dst)
    if tokenizer is not None:
        side += [n for n in copy_side_files(Path(tokenizer), dst) if n not in side]
    return side


def _write_export_config(dst: Path, hf: dict[str, Any]) -> None:
    """``config.json``, with the token ids a trainer checkpoint's config did not keep taken from a
    copied ``generation_config.json``; a ``generation_config.json`` from the token ids when none
    was copied."""
    generation = dst / "generation_config.json"
    token_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    if generation.is_file():
        known = json.loads(generation.read_text())
        for key in token_keys:
            if key not in hf and known.get(key) is not None:
                hf[key] = known[key]
    (dst / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
    if not generation.is_file():
        gen = {k: hf[k] for k in token_keys if k in hf}
        generation.write_text(json.dumps(gen, indent=2) + "\n")


def export_llama_twin(export: str | Path, dst: str | Path) -> Path:
    """The dense ``LlamaForCausalLM`` directory of an export's weights (gamma/beta dropped), the
    baseline serving benchmarks and tests run beside it: it equals the Orthros model at gamma = 1,
    beta = 0 on sequences inside the window. Tokenizer and generation files are copied along."""
    from orthros_train.common.safetensors_io import SafetensorsReader, save_safetensors

    export, dst = Path(export), Path(dst)
    hf = json.loads((export / "config.json").read_text())
    if hf.get("num_experts"):
        raise UserError(f"{export} has sparse (mixture-of-experts) layers: it has no dense Llama twin")
    dst.mkdir(parents=True, exist_ok=True)
    llama = {
        k: v for k, v in hf.items() if k not in ("auto_map", "qk_norm", "base_window", "sink_tokens", "attention_bias")
    }
    llama.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
                 mlp_bias=False)
    (dst / "config.json").write_text(json.dumps(llama, indent=2))
    with SafetensorsReader(export / "model.safetensors") as weights:
        state = {k: weights[k] for k in weights if not k.endswith((".gamma", ".beta"))}
    save_safetensors(state, dst / "model.safetensors")
    for p in export.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            (dst / p.name).write_bytes(p.read_bytes())
    return dst
