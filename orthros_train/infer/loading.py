"""Load what the eval commands run on: a checkpoint directory (+ tokenizer), or a bare config.

A checkpoint is a directory written by ``OrthrosForCausalLM.save_pretrained`` (``config.json`` +
``*.safetensors``), usually with the tokenizer files beside it (``orthros-train`` saves them).
For benchmarks a model can also come from a config alone (random weights): a JSON/YAML file of
``OrthrosConfig`` fields or one of the ``PRESETS`` below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from orthros_train.errors import UserError
from orthros_train.locations import RECIPES_DIR
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.orthros import OrthrosForCausalLM


def _model_group(name: str, **fixed: Any) -> dict[str, Any] | None:
    """The shape a recipe model group states (``recipes/model/<name>.yaml``) as preset fields, so
    the shape is written once. Interpolated keys (the vocabulary follows the data) and what a
    random-weight benchmark does not use (``init_from``; the recipe's training length as
    ``max_position_embeddings``) are left out, ``fixed`` fills them in. None without the recipes."""
    path = RECIPES_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        return None
    raw = yaml.safe_load(path.read_text())
    known = set(OrthrosConfig.__dataclass_fields__) - {"max_position_embeddings"}
    fields = {k: v for k, v in raw.items() if k in known and not (isinstance(v, str) and "${" in v)}
    return {**fields, **fixed}


# Shapes for benchmarks on random weights (parameter counts with tied embeddings).
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.1M: smoke tests
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        sliding_window=32,
        tie_word_embeddings=True,
    ),
    # ~22M: the model of the CPU prefill figures in docs/eval.md (W = 128, the paper's default)
    "20m": dict(
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        sliding_window=128,
        tie_word_embeddings=True,
    ),
}
for _name, _fields in (
    ("3m", _model_group("tiny", vocab_size=4096)),  # ~4M: the tiny_cpu recipe's model (vocab 4096)
    ("1p3b", _model_group("orthros_1p3b")),  # 1.3B Orthros, the pretrain_1p3b recipe's model
):
    if _fields is not None:
        PRESETS[_name] = _fields

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def is_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def not_a_checkpoint_hint(path: str | Path) -> str:
    """Why a folder without config.json is not a checkpoint, and where the model is when it is a
    trainer's step folder (``checkpoints/step_000000003`` keeps the weights in ``model/``)."""
    path = Path(path)
    if (path / "model" / "config.json").is_file():
        return f"{path} is a trainer checkpoint step: its model is {path / 'model'}; pass that folder"
    return f"{path} is not an Orthros checkpoint directory (no config.json)"


def read_checkpoint_config(directory: str | Path) -> dict[str, Any]:
    """A checkpoint's config.json as a dict; an unreadable or malformed one is named."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise UserError(not_a_checkpoint_hint(directory))
    try:
        fields = json.loads(path.read_text())
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 JSON ({err}); restore or re-export the checkpoint") from err
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON ({err}); restore or re-export the checkpoint") from err
    if not isinstance(fields, dict):
        raise UserError(f"{path} holds {type(fields).__name__}, not a JSON object of config fields")
    return fields


def orthros_config(fields: dict[str, Any], where: str | Path) -> OrthrosConfig:
    """``OrthrosConfig.from_dict`` with its refusals (unknown fields, bad values) naming ``where``."""
    try:
        return OrthrosConfig.from_dict(fields)
    except (UserError, TypeError) as err:  # TypeError: a field of the wrong type (a word for a size)
        raise UserError(f"{where}: not an Orthros model config ({err}){_hf_folder_fix(fields)}") from err


def _hf_folder_fix(fields: dict[str, Any]) -> str:
    """The way out when the folder is a Hugging Face model (its config.json has ``model_type``,
    which an Orthros checkpoint's never has): the list of unknown fields alone names no fix."""
    model_type = fields.get("model_type")
    if not isinstance(model_type, str):
        return ""
    if model_type == "orthros":
        return ("; it is a Hugging Face export (what orthros-convert to-hf writes): pass the Orthros checkpoint it "
                "was exported from")
    return (f"; it is a Hugging Face {model_type} model: convert it first (orthros-convert from-hf SRC DST) and "
            "pass DST")


def load_checkpoint(directory: str | Path, **overrides: Any) -> OrthrosForCausalLM:
    """An Orthros checkpoint directory's model; a malformed config.json, a folder of another kind
    (an HF model: its fields are not OrthrosConfig's) or weights of another shape are user errors
    naming the folder, not tracebacks."""
    directory = Path(directory)
    given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    where = f"{directory / 'config.json'} with the overrides {given}" if overrides else directory / "config.json"
    config = orthros_config({**read_checkpoint_config(directory), **overrides}, where)
    if "base_global_tail" in overrides and config.tail_on_dense():
        raise UserError(f"{where}: base_global_tail={config.base_global_tail} on a dense model does nothing (every "
                        "query of a dense model already sees its whole document); drop that override, or add "
                        "attention_type=orthros for the windowed layer")
    model = OrthrosForCausalLM(config)
    try:
        model.load_pretrained_weights(directory)
    except UserError:  # a missing, truncated or corrupt weights file, named with the fix
        raise
    except ValueError as err:  # a tensor of another shape or name: weights of another model
        raise UserError(f"{directory}: the weights do not fit its config.json ({err})") from err
    # NaN/inf weights would make every eval number NaN (or a silent 0% accuracy): refuse them here
    bad = next((n for n, p in model.state_dict().items() if p.is_floating_point() and not bool(p.isfinite().all())),
               None)  # fmt: skip
    if bad is not None:
        raise UserError(f"{directory}: {bad} holds NaN or infinite values: the weights are corrupt or were saved "
                        "from a diverged run; load an earlier checkpoint")  # fmt: skip
    return model


def _config_fields(path: Path) -> dict[str, Any]:
    if path.suffix in (".yaml", ".yml"):
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if isinstance(raw, dict) and "model" in raw and isinstance(raw["model"], dict):
            raw = raw["model"]  # a whole recipe: take its model group
    else:
        raw = json.loads(path.read_text())
    known = set(OrthrosConfig.__dataclass_fields__)
    fields = {k: v for k, v in raw.items() if k in known}
    for key, value in fields.items():
        if isinstance(value, str) and "${" in value:
            raise UserError(f"{path}: {key} is an interpolation ({value}); give it a value with --override {key}=...")
    return fields


def config_from_spec(spec: str, **overrides: Any) -> OrthrosConfig:
    """An ``OrthrosConfig`` from a checkpoint directory, a JSON/YAML file, or a preset name."""
    path = Path(spec)
    if is_checkpoint(path):
        fields = read_checkpoint_config(path)
    elif path.is_file():
        fields = _config_fields(path)
    elif spec in PRESETS:
        fields = dict(PRESETS[spec])
    else:
        raise UserError(
            f"{spec!r} is neither a checkpoint directory, a config file, nor a preset ({', '.join(PRESETS)})"
        )
    return orthros_config({**fields, **overrides}, spec)


def load_model(
    spec: str | Path,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    **overrides: Any,
) -> OrthrosForCausalLM:
    """Checkpoint weights when ``spec`` is a checkpoint directory, else random weights (seeded)."""
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    if is_checkpoint(spec):
        model = load_checkpoint(spec, **overrides)
    else:
        torch.manual_seed(seed)
        model = OrthrosForCausalLM(config_from_spec(str(spec), **overrides))
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval()


def dense_twin(model: OrthrosForCausalLM, attention_type: str = "dense") -> OrthrosForCausalLM:
    """The baseline of the same shape and weights (``dense`` or ``sliding``), same device/dtype."""
    config = OrthrosConfig.from_dict({**model.config.to_dict(), "attention_type": attention_type})
    twin = OrthrosForCausalLM(config)
    twin.load_state_dict(model.state_dict())
    p = next(model.parameters())
    return twin.to(device=p.device, dtype=p.dtype).eval()
