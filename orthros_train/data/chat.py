"""Chat-formatted records -> token segments with the assistant spans marked (SFT) or prompts (RL).

A conversation is rendered with the tokenizer's chat template and cut, by characters, into
segments at the boundaries of each trained assistant turn: the text from the end of
``template(messages[:i], add_generation_prompt=True)`` to the end of ``template(messages[:i+1])``
is turn ``i``'s answer (its content plus the template's end-of-turn marker, which the model must
learn to emit). Each segment is tokenized on its own, so an answer span is a whole number of
tokens by construction; the segments decode back to the rendered conversation. (Across a segment
boundary the tokens can differ from tokenizing the whole text at once only where a merge would
straddle it; chat templates put special tokens there, which never merge.) A template whose
rendering of a prefix is not a prefix of the whole rendering cannot be cut this way, and is
reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orthros_train.data.indexed import MODE_ANSWER, MODE_PROMPT, MODE_REFERENCE, DataError
from orthros_train.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
TRAIN_TURNS = ("all", "last")


class BadRecord(Exception):
    """A record that cannot be used; ``kind`` names its skip counter."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class ChatFields:
    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"
    system: str | None = None
    reference: str | None = None  # RL: a reference answer field stored beside the prompt


def record_messages(value: dict, fields: ChatFields, need_answer: bool = True) -> list[dict]:
    """The conversation of a record: its ``messages`` list, or built from prompt/response fields."""
    if fields.messages in value and value[fields.messages] is not None:
        msgs = value[fields.messages]
        if not isinstance(msgs, list) or not msgs:
            raise BadRecord("missing_field", f"{fields.messages!r} must be a non-empty list of messages")
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise BadRecord("missing_field", f"message {j} needs 'role' and 'content'")
            if m["role"] not in ROLES:
                raise BadRecord("bad_role", f"message {j} has role {m['role']!r}; expected one of {ROLES}")
            if not isinstance(m["content"], str):
                raise BadRecord("missing_field", f"message {j} content is a {type(m['content']).__name__}, not text")
            out.append({"role": m["role"], "content": m["content"]})
        return out
    prompt = value.get(fields.prompt)
    response = value.get(fields.response)
    if not isinstance(prompt, str) or (need_answer and not isinstance(response, str)):
        wanted = f"{fields.messages!r}, or {fields.prompt!r}" + (f" and {fields.response!r}" if need_answer else "")
        keys = ", ".join(sorted(value)) or "none"
        raise BadRecord("missing_field", f"no {wanted} field (fields: {keys})")
    out = []
    if fields.system and isinstance(value.get(fields.system), str):
        out.append({"role": "system", "content": value[fields.system]})
    out.append({"role": "user", "content": prompt})
    if need_answer:
        out.append({"role": "assistant", "content": response})
    return out


def check_chat_template(tokenizer, template: str | None) -> None:
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?') or type(tokenizer).__name__}) has no chat "
            "template; pass --chat-template FILE (a Jinja template) or use a chat/instruct tokenizer"
        )


def _render(tokenizer, messages: list[dict], template: str | None, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=template
        )
    except Exception as e:  # jinja raises on templates that reject a conversation shape
        raise BadRecord("template_error", f"the chat template rejects this conversation ({e})") from e


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_conversation(
    tokenizer, messages: list[dict], train_turns: str = "all", template: str | None = None
) -> tuple[list[np.ndarray], list[int]]:
    """(segments, modes): token segments of the rendered conversation, MODE_ANSWER on trained turns."""
    if train_turns not in TRAIN_TURNS:
        raise UserError(f"train_turns must be one of {TRAIN_TURNS}")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        raise BadRecord("no_answer", "no assistant message to train on")
    trained = answers if train_turns == "all" else answers[-1:]
    for i in trained:  # an empty answer would train only the template's end-of-turn marker
        if not messages[i]["content"].strip():
            raise BadRecord("empty_answer", f"assistant message {i} is empty (nothing to train on but the "
                            "end-of-turn marker); fill it in or drop the record")
    full = _render(tokenizer, messages, template, False)
    cuts = []
    for i in trained:
        if i == 0:
            raise BadRecord("no_answer", "the conversation starts with an assistant turn (nothing to condition on)")
        pre = _render(tokenizer, messages[:i], template, True)
        post = _render(tokenizer, messages[: i + 1], template, False)
        if not (full.startswith(post) and post.startswith(pre)):
            raise BadRecord(
                "template_not_prefix_stable",
                f"the chat template renders turns before assistant message {i} differently once more turns "
                "follow, so its answer span cannot be cut out exactly",
            )
        if len(post) > len(pre):
            cuts.append((len(pre), len(post)))
    segments, modes, prev = [], [], 0
    for a, b in cuts:
        for text, mode in ((full[prev:a], MODE_PROMPT), (full[a:b], MODE_ANSWER)):
            ids = _encode(tokenizer, text) if text else []
            if ids:
                segments.append(np.asarray(ids, dtype=np.int64))
                modes.append(mode)
        prev = b
    tail = _encode(tokenizer, full[prev:]) if full[prev:] else []
    if tail:
        segments.append(np.asarray(tail, dtype=np.int64))
        modes.append(MODE_PROMPT)
    if MODE_ANSWER not in modes:
        raise BadRecord("no_answer", "the trained assistant turns are empty")
    if modes[0] == MODE_ANSWER:
        raise BadRecord("no_answer", "the rendered conversation starts with an answer token")
    return segments, modes


def render_prompt(
    tokenizer, messages: list[dict], template: str | None = None, reference: str | None = None
) -> tuple[list[np.ndarray], list[int]]:
    """RL prompt: the conversation so far plus the generation prompt (MODE_PROMPT), then an optional
    reference answer (MODE_REFERENCE, tokenized as plain text, for rewards; never model input)."""
    if messages and messages[-1]["role"] == "assistant":
        raise BadRecord("bad_role", "an RL prompt must not end with an assistant message")
    ids = _encode(tokenizer, _render(tokenizer, messages, template, True))
    if not ids:
        raise BadRecord("empty", "empty prompt")
    segments, modes = [np.asarray(ids, dtype=np.int64)], [MODE_PROMPT]
    if reference:
        ref = _encode(tokenizer, reference)
        if ref:
            segments.append(np.asarray(ref, dtype=np.int64))
            modes.append(MODE_REFERENCE)
    return segments, modes
