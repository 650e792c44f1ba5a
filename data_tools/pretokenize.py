"""``orthros-data tokenize`` / ``sft`` / ``rl``: records -> megatron-core indexed shards, resumable.

Raw records are cut into shards of ``docs_per_shard`` consecutive records (bad records count
toward their shard too, so a shard's range never depends on the skip policy). The main process
reads records and writes shards in order; N worker processes tokenize batches (fast tokenizers
encode a whole batch in one Rust call). A shard is written under a temporary name and renamed
when complete; the summary JSON (``OUTPUT.json``) is rewritten after every shard and doubles as
the resume manifest: a rerun with the same inputs, tokenizer and settings keeps every recorded
shard whose files check out, and reads through (without tokenizing) the records they cover.

``tokenize`` writes one sequence per document (EOD appended). ``sft`` writes one document per
conversation whose sequences are segments with a mode (prompt / answer), ``rl`` one document
per prompt (prompt segment, optional reference answer); see ``orthros_train/data/indexed.py``.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from data_tools.sources import (
    BadInputPolicy,
    Record,
    count_records,
    expand_inputs,
    iter_records,
    record_text,
    source_fingerprint,
)
from orthros_train.common.files import write_json_atomic
from orthros_train.common.tokenizer import load_tokenizer
from orthros_train.data.cache import BuildLock
from orthros_train.data.chat import (
    TRAIN_TURNS,
    BadRecord,
    ChatFields,
    check_chat_template,
    record_messages,
    render_conversation,
    render_prompt,
)
from orthros_train.data.indexed import (
    DataError,
    ShardWriter,
    read_index_header,
    shard_prefix,
    summary_path,
)
from orthros_train.data.tokenize import encode_texts, eod_token_id, tokenizer_info
from orthros_train.errors import UserError

log = logging.getLogger("orthros_data")
KINDS = ("pretrain", "sft", "rl")


@dataclass
class TokenizeOptions:
    inputs: list[str]
    tokenizer: str
    output: str
    kind: str = "pretrain"
    workers: int = 1
    text_field: str = "text"
    docs_per_shard: int = 100_000
    batch_size: int = 256
    on_error: str = "raise"
    txt_sample_by: str = "document"
    append_eod: bool = True
    add_special_tokens: bool = False
    eod_token: str | None = None
    hub_split: str = "train"
    hub_config: str | None = None
    # sft / rl
    fields: ChatFields = field(default_factory=ChatFields)
    train_turns: str = "all"
    chat_template: str | None = None  # a Jinja template file overriding the tokenizer's
    # run behaviour (not part of the output identity)
    progress: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"kind must be one of {KINDS}")
        if self.train_turns not in TRAIN_TURNS:
            raise UserError(f"train_turns must be one of {TRAIN_TURNS}")
        if self.docs_per_shard < 1 or self.batch_size < 1 or self.workers < 1:
            raise UserError("docs_per_shard, batch_size and workers must be >= 1")

    def template_text(self) -> str | None:
        """The --chat-template file's text, checked to be a readable, parsable Jinja template
        (a syntax error would otherwise reject every record one by one, or skip them all)."""
        if self.chat_template is None:
            return None
        path = os.path.expanduser(self.chat_template)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise DataError(f"--chat-template {self.chat_template}: cannot read it ({reason}); give a "
                            "UTF-8 Jinja template file") from e
        import jinja2

        try:
            jinja2.Environment().parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"--chat-template {self.chat_template}:{e.lineno}: not a valid Jinja template "
                            f"({e.message})") from e
        return text

    def settings(self) -> dict:
        """What determines the output bytes (a resumed run must match it)."""
        keep = ["kind", "docs_per_shard", "on_error", "hub_split", "hub_config"]
        if self.kind == "pretrain":
            keep += ["text_field", "txt_sample_by", "append_eod", "add_special_tokens", "eod_token"]
        else:
            keep += ["train_turns", "chat_template"]
        out = {k: getattr(self, k) for k in keep}
        if self.kind != "pretrain":
            out["fields"] = vars(self.fields)
        return out


# ---- encoding (runs in the worker processes, or inline with one worker) ------------------------


class _Encoder:
    """Holds the tokenizer and turns a batch of payloads into writable results."""

    def __init__(self, opts: TokenizeOptions, tok=None) -> None:
        self.opts = opts
        self.tok = tok if tok is not None else load_tokenizer(opts.tokenizer)
        self.eod = eod_token_id(self.tok, opts.eod_token)[0] if opts.append_eod and opts.kind == "pretrain" else None
        self.template = opts.template_text()

    def __call__(self, item: tuple) -> tuple:
        if item[0] != "batch":
            return item
        _, shard, payloads = item
        if self.opts.kind == "pretrain":
            return ("docs", shard, *encode_texts(self.tok, payloads, self.opts.add_special_tokens, self.eod))
        out = []
        for where, payload in payloads:
            try:
                if self.opts.kind == "sft":
                    out.append(render_conversation(self.tok, payload, self.opts.train_turns, self.template))
                else:
                    out.append(render_prompt(self.tok, payload[0], self.template, payload[1]))
            except BadRecord as e:
                out.append(("bad", e.kind, where, str(e)))
        return ("chats", shard, out)


_WORKER: dict = {}


def _init_worker(opts: TokenizeOptions) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER["encoder"] = _Encoder(opts)


def _work(item: tuple) -> tuple:
    return _WORKER["encoder"](item)


# ---- reading (main process) --------------------------------------------------------------------


def _payload(record: Record, opts: TokenizeOptions, policy: BadInputPolicy):
    if opts.kind == "pretrain":
        return record_text(record, opts.text_field, policy)
    if record.error is not None:
        policy.bad(record.kind, record.where, record.error)
        return None
    try:
        messages = record_messages(record.value or {}, opts.fields, need_answer=opts.kind == "sft")
    except BadRecord as e:
        policy.bad(e.kind, record.where, str(e))
        return None
    if opts.kind == "sft":
        return (record.where, messages)
    value = record.value or {}
    ref_field = opts.fields.reference
    final_answer = None
    if messages[-1]["role"] == "assistant":  # a chat record: its final answer is the fallback reference
        final_answer = messages[-1]["content"]
        messages = messages[:-1]
        if not messages:
            policy.bad("no_prompt", record.where, "only an assistant message, no prompt")
            return None
    if ref_field is None:
        return (record.where, (messages, final_answer))
    try:
        reference = reference_text(value, ref_field, final_answer)
    except BadRecord as e:
        policy.bad(e.kind, record.where, str(e))
        return None
    return (record.where, (messages, reference))


def reference_text(value: dict, field: str, final_answer: str | None = None) -> str:
    """The reference answer of an RL record's ``field`` as text.

    Numbers are written as JSON writes them (``4`` -> "4", ``2.5`` -> "2.5"): an exact-match or
    numeric reward compares text with text, and a numeric answer is the commonest kind in math
    sets, so refusing them would make --reference-field useless there. Booleans, null, lists and
    objects, NaN/inf and empty text are refused (their text form is ambiguous, or there is nothing
    to compare with); so is a missing field, unless the record is a chat whose last assistant
    message then serves as the reference.
    """
    if field not in value:
        if final_answer is not None and final_answer.strip():
            return final_answer
        keys = ", ".join(sorted(value)) or "none"
        raise BadRecord("missing_reference", f"no reference answer field {field!r} (fields: {keys}); "
                        "choose the field with --reference-field")
    ref = value[field]
    if isinstance(ref, bool) or ref is None or not isinstance(ref, (str, int, float)):
        raise BadRecord("bad_reference", f"reference answer {field!r} is {json.dumps(ref)[:60]} "
                        f"({type(ref).__name__}); it must be text or a number")
    if isinstance(ref, float) and not math.isfinite(ref):
        raise BadRecord("bad_reference", f"reference answer {field!r} is {ref}, not a finite number")
    text = ref if isinstance(ref, str) else json.dumps(ref)
    if not text.strip():
        raise BadRecord("bad_reference", f"reference answer {field!r} is empty")
    return text


def _work_items(records: Iterator[Record], opts: TokenizeOptions, done: set[int], policy: BadInputPolicy):
    """("batch", shard, payloads) items and ("end", shard, skipped counts, records) markers, in order."""
    shard, batch, before, n_records = 0, [], Counter(), 0
    for ordinal, record in enumerate(records):
        s = ordinal // opts.docs_per_shard
        if s != shard:
            if batch:
                yield ("batch", shard, batch)
                batch = []
            if shard not in done:
                yield ("end", shard, dict(policy.counts - before), n_records)
            shard, before, n_records = s, Counter(policy.counts), 0
        n_records += 1
        if s in done:
            continue
        try:
            payload = _payload(record, opts, policy)
        except DataError as e:  # raise policy: report it after the records before it (in file order)
            if batch:
                yield ("batch", shard, batch)
            yield ("raise", e)
            return
        if payload is None:
            continue
        batch.append(payload)
        if len(batch) >= opts.batch_size:
            yield ("batch", shard, batch)
            batch = []
    if batch:
        yield ("batch", shard, batch)
    if shard not in done and n_records:
        yield ("end", shard, dict(policy.counts - before), n_records)


def _write_json(path: str, data: dict) -> None:
    write_json_atomic(path, data, indent=2)


def _shard_ok(output: str, entry: dict) -> bool:
    if entry.get("prefix") is None:
        return True  # a shard whose records were all skipped: nothing on disk
    prefix = os.path.join(os.path.dirname(output), entry["prefix"])
    try:
        header = read_index_header(prefix)
    except DataError as e:
        log.warning("redoing shard %s: %s", entry["index"], e)
        return False
    return header.num_documents == entry["documents"] and header.num_tokens == entry["tokens"]


def run(opts: TokenizeOptions) -> dict:
    """Run one ``orthros-data`` build; returns the summary (also written to ``OUTPUT.json``).

    Holds ``OUTPUT.lock`` while it runs: a second build of the same output waits, then finds it
    complete (or resumes it). The lock is a hard-linked lock file with a heartbeat
    (``orthros_train.data.cache.BuildLock`` on ``common.lock``) rather than ``flock``, because outputs usually sit on
    a file system shared by nodes (NFS, Lustre), where ``flock`` may not exclude another node.
    """
    check_output_writable(opts.output)
    with BuildLock(opts.output + ".lock"):
        return _run(opts)


def check_output_writable(output: str) -> None:
    """Fail before any tokenizing (and before any file is written) when ``--output`` cannot be
    written: a missing parent that cannot be made, a file where a directory should be, no write
    permission, a read-only file system."""
    directory = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".orthros-data-write-check-"):
            pass
    except OSError as e:
        raise DataError(
            f"--output {output}: cannot write in {directory} ({e.strerror or e}); pick a writable --output "
            "(nothing was written)"
        ) from e


def _run(opts: TokenizeOptions) -> dict:
    t0 = time.time()
    files = expand_inputs(opts.inputs)
    _refuse_output_over_inputs(opts.output, files)
    tok = load_tokenizer(opts.tokenizer)
    eod = eod_token_id(tok, opts.eod_token)
    if opts.kind != "pretrain":
        check_chat_template(tok, opts.template_text())
    info = tokenizer_info(tok, opts.tokenizer, eod)
    out_json = summary_path(opts.output)
    os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
    identity = {
        "kind": opts.kind,
        "tokenizer": info,
        "source": {"inputs": files, "fingerprint": source_fingerprint(files)},
        "settings": opts.settings(),
    }
    done, shards, replaced = _plan_resume(opts, out_json, identity, info)
    if done is not None:
        return done
    policy = BadInputPolicy(opts.on_error)
    late = BadInputPolicy(opts.on_error)  # bad records found while encoding (chat rendering)

    def manifest(complete: bool) -> dict:
        return _manifest(identity, opts, shards, replaced, {**late.examples, **policy.examples}, t0, complete)

    if opts.overwrite and os.path.exists(out_json):
        # from the first rewritten shard on, the old output is gone: say so before touching a shard,
        # so no reader takes half-rewritten shards for the complete old dataset
        _write_json(out_json, {**identity, "complete": False, "shards": [], "replacing": sorted(set(replaced))})
    records = iter_records(files, opts.txt_sample_by, opts.hub_split, opts.hub_config)
    pool, results = _start_encoding(opts, tok, _work_items(records, opts, set(shards), policy))
    total = count_records(files, opts.txt_sample_by, opts.hub_split) if opts.progress else None
    progress = _Progress(opts.progress, total)
    try:
        for shard, entry in _write_shards(results, opts.output, info["vocab_size"], progress, late):
            shards[shard] = entry
            _write_json(out_json, manifest(False))  # a crash from here on resumes after this shard
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        progress.close()
    if pool is not None:
        pool.close()
        pool.join()
    return _finish(opts, out_json, manifest, replaced, progress.tokens / max(time.time() - t0, 1e-9))


def _plan_resume(
    opts: TokenizeOptions, out_json: str, identity: dict, info: dict
) -> tuple[dict | None, dict[int, dict], list[str]]:
    """What an earlier run at ``--output`` leaves to do: (its summary if it is complete, else None;
    its finished shards to keep, by index; the shard prefixes of an output being overwritten).

    The shards of an overwritten output are removed once the new one is complete; until then they
    stay in the manifest (``replacing``), so a resumed or repeated run after a crash still removes
    them. An output of other inputs, tokenizer or settings is refused unless ``--overwrite``.
    """
    shards: dict[int, dict] = {}
    old = _read_summary(out_json, opts.overwrite) if os.path.exists(out_json) else None
    replaced: list[str] = list(old.get("replacing", [])) if old is not None else []
    if old is not None and opts.overwrite:
        replaced += [e["prefix"] for e in old.get("shards", []) if isinstance(e, dict) and e.get("prefix")]
        old = None
    if old is None:
        return None, shards, replaced
    same = all(old.get(k) == v for k, v in identity.items() if k != "tokenizer")
    if not same or old.get("tokenizer", {}).get("vocab_size") != info["vocab_size"]:
        raise DataError(
            f"{out_json}: exists for other inputs, tokenizer or settings; "
            "choose another --output or pass --overwrite"
        )
    if old.get("complete"):
        log.info("%s is complete; nothing to do", out_json)
        return old, shards, replaced
    shards = {e["index"]: e for e in old.get("shards", []) if _shard_ok(opts.output, e)}
    if shards:
        log.info("resuming: keeping %d finished shards", len(shards))
    return None, shards, replaced


def _manifest(identity: dict, opts: TokenizeOptions, shards: dict[int, dict], replaced: list[str],
              skipped_examples: dict, t0: float, complete: bool) -> dict:
    """The summary written to ``OUTPUT.json``: after every finished shard (``complete`` False, what
    a resume reads) and once at the end."""
    entries = [shards[i] for i in sorted(shards)]
    totals = Counter()
    for e in entries:
        totals.update(e.get("skipped", {}))
    return {
        **identity,
        "complete": complete,
        "documents": sum(e["documents"] for e in entries),
        "tokens": sum(e["tokens"] for e in entries),
        "records": sum(e["records"] for e in entries),
        "on_error": opts.on_error,
        "skipped": dict(totals),
        "skipped_examples": skipped_examples,
        "seconds_this_run": round(time.time() - t0, 3),
        "shards": entries,
        **({"replacing": sorted(set(replaced))} if replaced and not complete else {}),
    }


def _start_encoding(opts: TokenizeOptions, tok, items: Iterator[tuple]):
    """``(pool, results)``: the encoded work items in order, from ``opts.workers`` processes (pool
    None: encoded in this process, one at a time)."""
    if opts.workers <= 1:
        return None, map(_Encoder(opts, tok), items)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism; no nested threads
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ctx.Pool(opts.workers, initializer=_init_worker, initargs=(opts,))
    return pool, _ordered_map(pool, items, window=4 * opts.workers)


def _write_shards(results, output: str, vocab_size: int, progress: _Progress,
                  late: BadInputPolicy) -> Iterator[tuple[int, dict]]:
    """Write the encoded items into shards; yields ``(index, manifest entry)`` as each shard is
    finished. Bad records found while encoding go to ``late`` and count in their shard's entry.
    A failure aborts the shard being written (no half shard is left under its name)."""
    writer: ShardWriter | None = None
    shard_late: Counter = Counter()
    try:
        for item in results:
            if item[0] == "docs":
                _, shard, flat, lengths = item
                if writer is None:
                    writer = ShardWriter(shard_prefix(output, shard), vocab_size)
                for doc in np.split(flat, np.cumsum(lengths)[:-1]):
                    writer.add_document(doc)
                progress.update(len(lengths), int(lengths.sum()))
            elif item[0] == "chats":
                _, shard, convs = item
                if writer is None:
                    writer = ShardWriter(shard_prefix(output, shard), vocab_size, multimodal=True)
                for conv in convs:
                    if conv[0] == "bad":
                        late.bad(conv[1], conv[2], conv[3])
                        shard_late[conv[1]] += 1
                        continue
                    writer.add_segments(*conv)
                    progress.update(1, sum(len(s) for s in conv[0]))
            elif item[0] == "raise":
                raise item[1]
            else:
                _, shard, skipped, n_records = item
                entry = {"index": shard, "prefix": None, "documents": 0, "tokens": 0,
                         "records": n_records, "skipped": dict(Counter(skipped) + shard_late)}
                shard_late = Counter()
                if writer is not None:
                    writer.finish()
                    entry.update(prefix=os.path.basename(writer.prefix), **writer.record())
                    writer = None
                yield shard, entry
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


def _finish(opts: TokenizeOptions, out_json: str, manifest, replaced: list[str], tokens_per_second: float) -> dict:
    """Write the complete summary and remove the shards of an overwritten output; an output with
    no document is an error, and leaves no summary that promises a resume."""
    summary = manifest(True)
    if summary["documents"] == 0:
        if replaced:  # an overwritten output: keep the list of its old shards for the next run to remove
            _write_json(out_json, manifest(False))
        elif os.path.exists(out_json):  # nothing was written: leave no summary that promises a resume
            os.remove(out_json)
        what = (f"no usable records (skipped: {summary['skipped']})" if summary["records"]
                else "no records at all (empty input)")
        raise DataError(f"{', '.join(opts.inputs)}: {what}; nothing was written")
    summary["tokens_per_second_this_run"] = round(tokens_per_second, 1)
    _write_json(out_json, summary)
    _remove_stale_shards(opts.output, replaced, {e["prefix"] for e in summary["shards"] if e.get("prefix")})
    return summary


def _refuse_output_over_inputs(output: str, files: list[str]) -> None:
    """An --output whose summary or shards would be one of the input files (``--output docs`` for
    the input ``docs.json``) would overwrite the data being read; refuse it before anything runs."""
    inputs = {os.path.realpath(f) for f in files if not f.startswith(("hub:", "disk:"))}
    base = os.path.realpath(os.path.abspath(os.path.expanduser(output)))
    for f in sorted(inputs):
        name = os.path.basename(f)
        if os.path.dirname(f) == os.path.dirname(base) and (
            name in (os.path.basename(base) + ".json", os.path.basename(base) + ".lock")
            or (name.startswith(os.path.basename(base) + "_") and name.endswith((".bin", ".idx")))
        ):
            raise DataError(f"--output {output} would overwrite the input {f} (its summary is {output}.json); "
                            "choose another --output (nothing was written)")


def _read_summary(path: str, overwrite: bool) -> dict | None:
    """The summary of an earlier run into the same output; a corrupt one is an error (or, with
    --overwrite, ignored: the output is rebuilt anyway)."""
    try:
        with open(path) as f:
            old = json.load(f)
        if not isinstance(old, dict):
            raise UserError("not a JSON object")
        return old
    except (OSError, ValueError, UserError) as e:  # ValueError: json's, a malformed file
        if overwrite:
            log.warning("%s: unreadable (%s); rebuilding the output (--overwrite)", path, e)
            return None
        raise DataError(f"{path}: unreadable summary of an earlier run ({e}); pass --overwrite to rebuild the "
                        "output, or choose another --output") from e


def _remove_stale_shards(output: str, old: list[str], keep: set[str]) -> None:
    """Shards of the overwritten output that the new one does not have (it has fewer shards):
    left on disk they would be read by anyone who points a trainer at the directory."""
    base = os.path.dirname(os.path.abspath(output))
    for name in old:
        if name in keep or os.path.basename(name) != name:
            continue  # only plain shard names beside the summary, never a path elsewhere
        for ext in (".bin", ".idx"):
            path = os.path.join(base, name + ext)
            if os.path.isfile(path):
                os.remove(path)
        log.info("removed %s (a shard of the overwritten output)", os.path.join(base, name))


class _Resolved:
    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        return self.value


def _ordered_map(pool, items: Iterator[tuple], window: int) -> Iterator[tuple]:
    """Results in input order with at most ``window`` batches in flight (``Pool.imap`` would read
    the whole corpus ahead into its task queue)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(_work, (item,)) if item[0] == "batch" else _Resolved(item))
        while len(pending) > window or (pending and isinstance(pending[0], _Resolved)):
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _Progress:
    """tqdm bar (stderr) with documents/s and tokens/s; with ``total`` (records, when cheap to
    count) it shows the share done and the time left."""

    def __init__(self, enabled: bool, total: int | None = None) -> None:
        self.docs = self.tokens = 0
        self.t0 = time.time()
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit=" docs", desc="tokenize", dynamic_ncols=True)

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        if self.bar is not None:
            dt = max(time.time() - self.t0, 1e-9)
            self.bar.update(docs)
            self.bar.set_postfix_str(f"{self.tokens / dt / 1e3:.1f}k tok/s, {self.tokens:,} tokens", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
