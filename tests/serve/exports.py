"""Tiny Orthros exports (and their dense Llama twins) for the vLLM tests, built offline in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from orthros_train.convert.to_hf import convert_to_hf, export_llama_twin
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.orthros import OrthrosForCausalLM

# head_dim 32: the smallest head size vLLM's CPU attention kernels take.
TINY: dict[str, Any] = dict(
    vocab_size=384, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=256, sliding_window=16, tie_word_embeddings=False,
    max_position_embeddings=4096, rope_theta=10000.0,
)
TEXT = (
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun and birds sing "
    "long prompts are read once into the cache and answers are short so prefill dominates the time "
) * 8


def make_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A byte-level BPE trained on a few sentences, saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return folder


def make_orthros(root: Path, seed: int = 0, trained_affine: bool = True, **overrides: Any) -> tuple[Path, Path]:
    """(checkpoint dir, to-hf export dir) of a random tiny Orthros model.

    ``trained_affine`` draws gamma/beta away from 1/0 so the output stream differs from the base
    stream (otherwise a bug that swaps them could pass).
    """
    fields = {**TINY, **overrides}
    config = OrthrosConfig(**fields)
    torch.manual_seed(seed)
    model = OrthrosForCausalLM(config)
    model.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        # Matrices larger than the default init: logits far from uniform, no greedy ties.
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.endswith((".gamma", ".beta")):
                p.mul_(3.0)
        if trained_affine:
            for layer in model.layers:
                layer.self_attn.gamma.normal_(1.0, 0.3)
                layer.self_attn.beta.normal_(0.0, 0.3)
    ckpt = root / "orthros"
    model.save_pretrained(ckpt)
    tok = make_tokenizer(root / "tokenizer", min(config.vocab_size, 384))
    export = root / "export"
    convert_to_hf(ckpt, export, tokenizer=tok)
    config_path = export / "config.json"
    hf = json.loads(config_path.read_text())
    hf.setdefault("eos_token_id", 0)
    config_path.write_text(json.dumps(hf, indent=2))
    return ckpt, export


def make_llama_twin(export: Path, dst: Path) -> Path:
    """The export as a plain ``LlamaForCausalLM`` directory (gamma/beta dropped: only equal with 1/0)."""
    return export_llama_twin(export, dst)
