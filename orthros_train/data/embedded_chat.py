"""The embedded SFT corpus (``data.source=embedded``, ``data.corpus=chatterbot``), built on first use.

The chatterbot-corpus dialogues are rendered with a chat template into an SFT indexed dataset
in ``cache_dir`` (assistant spans marked, the format ``orthros-data sft`` writes; both use
``orthros_train/data/chat.py``), then read back as packed conversations like any SFT data. The
tokenizer is ``data.tokenizer`` when set (a pretrained checkpoint's), else the BPE of the text
corpus the chat corpus is paired with (``CHAT_CORPORA``: the essays' BPE, so the data matches a
model pretrained with ``tiny_cpu``); one without a chat template gets ``PLAIN_CHAT_TEMPLATE``.

The cache folder is keyed by the tokenizer (its template included) and the corpus files' paths
and contents (``cache.py``); the tokenizer is saved atomically, the dataset's summary is written
last (under a lock), and a cached dataset whose files do not match its summary is refused with
the folder to delete.
"""

from __future__ import annotations

import os

from orthros_train.common.tokenizer import load_tokenizer
from orthros_train.data.cache import corpus_fingerprint, digest, note_inputs, tokenizer_digest
from orthros_train.data.embedded import (
    CHAT_CORPORA,
    chat_conversations,
    corpus_documents,
    corpus_files,
    train_tokenizer,
    with_chat_template,
)
from orthros_train.data.indexed import resolve_prefixes
from orthros_train.data.tokenize import (
    check_cached,
    eod_token_id,
    save_tokenizer_once,
    write_conversations,
)


def chat_tokenizer(cfg):
    """The tokenizer the chat corpus is rendered with (``data.tokenizer`` or the paired BPE)."""
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    else:
        documents = corpus_documents(CHAT_CORPORA[cfg.corpus])
        tokenizer = train_tokenizer(documents, cfg.tokenizer_vocab_size, cfg.cache_dir)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return with_chat_template(tokenizer)


def prepare_embedded_chat(cfg) -> tuple[str, object]:
    """Render the chat corpus into ``cache_dir`` once; returns (output prefix, tokenizer)."""
    tokenizer = chat_tokenizer(cfg)
    files = corpus_files(cfg.corpus)
    # keyed by the corpus files' contents and the tokenizer (its chat template included)
    conversations = chat_conversations(cfg.corpus)
    fingerprint = {"corpus": cfg.corpus, "files": corpus_fingerprint(files), "tokenizer": tokenizer_digest(tokenizer),
                   "conversations": digest(conversations, 64)}  # the parsed dialogues, whatever read them
    root = os.path.join(os.path.expanduser(cfg.cache_dir), "embedded")
    folder = os.path.join(root, f"{cfg.corpus}-sft-{digest(fingerprint)}")
    note_inputs(root, {"corpus": cfg.corpus, "tokenizer": cfg.tokenizer, "vocab": cfg.tokenizer_vocab_size,
                       "paths": [str(p) for p in files]}, fingerprint, folder, "embedded chat corpus")
    tok_dir = save_tokenizer_once(tokenizer, folder)
    output = os.path.join(folder, "conversations")
    source = {"corpus": cfg.corpus, "inputs": [str(p) for p in files], "fingerprint": fingerprint["files"]}
    summary = write_conversations(conversations, tokenizer, tok_dir, output, source)
    check_cached(output, summary, folder)
    return output, tokenizer


def embedded_chat_data(cfg, seq_len: int, micro_batch_size: int, seed: int, dp_rank: int, dp_size: int):
    """Packed SFT batches of the embedded chat corpus (held-out conversations by ``data.split``)."""
    from orthros_train.data.sft import ConversationStore, SFTData

    output, tokenizer = prepare_embedded_chat(cfg)
    eod = eod_token_id(tokenizer)[0]  # what the summary records (EOS), as for orthros-data outputs
    store = ConversationStore(resolve_prefixes(output))
    return SFTData(store, tokenizer, eod, seq_len, micro_batch_size, seed, dp_rank, dp_size,
                   split=cfg.split, overlong=cfg.overlong, loss_average=cfg.loss_average)
