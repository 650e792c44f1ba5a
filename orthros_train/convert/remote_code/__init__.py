"""The Hugging Face remote code of exported Orthros models, made from the package's own files.

``configuration_orthros.py`` and ``modeling_orthros.py`` (the thin transformers wrapper) are package
modules like any other; ``orthros-convert to-hf`` writes them and every package module they import
into the export, with their imports made relative (``shipping.py``). They import only torch,
transformers and safetensors, so the export loads with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` without orthros_train.
"""

from __future__ import annotations

from orthros_train.convert.remote_code.shipping import exported_name, shipped_modules, write_remote_code


def __getattr__(name: str) -> tuple[str, ...]:
    # REMOTE_CODE_FILES (every file of an export's remote code: what an earlier conversion wrote,
    # destination.py) is computed on first use: finding the modules parses them, which every
    # `import orthros_train.convert...` would otherwise pay.
    if name == "REMOTE_CODE_FILES":
        return tuple(exported_name(m) for m in shipped_modules())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["REMOTE_CODE_FILES", "write_remote_code"]
