"""Data for the SFT CPU demo: chatterbot-corpus QA pairs for the tiny pretrained model.

    orthros-train --config-name tiny_cpu                     # the tiny pretrained model (once)
    python -m data_tools.sft_demo                            # tokenizer + chat template + SFT shards
    orthros-train --config-name sft_tiny_cpu                 # fine-tune on the QA pairs

The tiny model's tokenizer is a byte-level BPE trained on essays: it has ``<|endoftext|>`` and
no chat template. ``PLAIN_CHAT_TEMPLATE`` is a plain-text template that needs no new tokens
(the model's vocabulary stays as it is)::

    User: <question>\\n
    Assistant: <answer><|endoftext|>User: <next question>\\n
    Assistant:                                   <- generation prompt

An assistant turn ends with the tokenizer's EOS token, which the model learns to emit (it is the
last token of every answer span) and generation stops on. ``prepare`` saves a copy of the
checkpoint's tokenizer with this template set, so everything downstream (``orthros-data sft``,
the trainer, the saved SFT checkpoint) uses ``tokenizer.apply_chat_template`` as with any chat
tokenizer.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

PLAIN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}Assistant: {{ m['content'] }}{{ eos_token }}"
    "{%- else -%}{{ m['role'] | capitalize }}: {{ m['content'] }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Assistant:{%- endif -%}"
)
DEFAULT_CHECKPOINT = "runs/tiny_cpu/checkpoints/final"
DEFAULT_OUTPUT = "runs/sft_tiny_cpu_data"


def chatterbot_conversations(limit: int | None = None) -> list[list[dict]]:
    """The English dialogues of ``chatterbot-corpus`` as alternating user/assistant messages."""
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the demo needs the PyPI package chatterbot-corpus: pip install --no-deps "
                                "'chatterbot-corpus==1.3.3' (or `make install`)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "english"
    out = []
    for path in sorted(folder.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conv in data.get("conversations") or []:
            turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
            if len(turns) < 2:
                continue
            out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)])
            if limit and len(out) >= limit:
                return out
    return out


def chat_tokenizer(source: str, template: str = PLAIN_CHAT_TEMPLATE):
    """The tokenizer saved in ``source`` with ``template`` as its chat template (kept if it has one)."""
    from orthros_train.infer.loading import load_tokenizer

    tok = load_tokenizer(source)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = template
    if tok.eos_token is None:
        raise ValueError(f"{source}: the tokenizer has no EOS token to end assistant turns with")
    return tok


def prepare(checkpoint: str = DEFAULT_CHECKPOINT, output: str = DEFAULT_OUTPUT, limit: int | None = None) -> dict:
    """Write ``output/tokenizer`` (with a chat template), ``output/chatterbot.jsonl`` and the SFT
    shards ``output/chatterbot*`` (``orthros-data sft``); returns the shards' summary."""
    from data_tools.pretokenize import TokenizeOptions, run

    out = Path(output)
    tok_dir = out / "tokenizer"
    tok = chat_tokenizer(checkpoint)
    tok.save_pretrained(str(tok_dir))
    conversations = chatterbot_conversations(limit)
    jsonl = out / "chatterbot.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for msgs in conversations:
            f.write(json.dumps({"messages": msgs}) + "\n")
    prefix = str(out / "chatterbot")
    run(TokenizeOptions([str(jsonl)], str(tok_dir), prefix, kind="sft", progress=False))
    with open(prefix + ".json", encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="pretrained checkpoint dir (its tokenizer)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="folder for tokenizer, jsonl and SFT shards")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N conversations")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    summary = prepare(args.checkpoint, args.output, args.limit)
    print(f"{summary.get('documents')} conversations, {summary.get('tokens')} tokens -> {args.output}/chatterbot")


if __name__ == "__main__":
    main()
