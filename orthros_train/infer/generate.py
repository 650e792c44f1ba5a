"""Batched generation with a KV cache: (chunked) prefill, then one base+output pair per step.

Prefill runs the base stream over the prompt (sliding window) with one output token at the last
position; each decode step appends the sampled token as one base token plus one output token.
Batches are ragged (a list of prompts of any lengths) or padded ``[B, T]`` with an
``attention_mask`` (left or right padding; padding is dropped, never attended). Rows that have
finished (stop token, stop callback) leave the batch: later steps run on the others only.

A long prompt is read in chunks of ``prefill_chunk_size`` tokens that continue the cache, so no
forward materialises more than ``chunk x (chunk + W)`` base scores or the full ``T x T`` matrix.
By default (``"auto"``) Orthros and sliding-window models read prompts in chunks of
``PREFILL_CHUNK``: the same FLOPs, but each forward's activations stay small (on CPU, one thread,
a 16K prompt of the 20m preset took 4.9 s in 2K chunks against 5.7 s in one forward: a 16K-token
forward's tensors fall out of cache and every fresh allocation page-faults). Dense models read the
prompt in one forward: a later chunk of theirs needs an explicit causal mask over all earlier
keys, which loses SDPA's ``is_causal`` kernel (20 s -> 27 s for the same prompt).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from orthros_train.errors import UserError
from orthros_train.infer.sampling import SamplingParams, sample_next
from orthros_train.model.cache import KVCache
from orthros_train.phase.builders import decode_layout, prefill_layout
from orthros_train.phase.layout import OrthrosLayout

Prompts = torch.Tensor | Sequence[Sequence[int] | torch.Tensor]
ChunkSize = int | Literal["auto"] | None
PREFILL_CHUNK = 2048  # prompt tokens per prefill forward under "auto" (see the module docstring)
StopFn = Callable[[int, list[int]], bool]
log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    """New tokens per row (a hit stop token is included) and what the run cost."""

    sequences: list[list[int]]
    finish_reasons: list[str]  # "stop_token" | "stop_fn" | "length"
    prompt_lengths: list[int]
    cache_bytes_per_token: float = 0.0
    cache_nbytes: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_setup_seconds: float = 0.0  # cuda_graph: building and capturing the step, not in decode_seconds
    decode_steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ttft_seconds(self) -> float:
        """Time to first token: prefill plus choosing the first token."""
        return self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        tokens = sum(max(len(s) - 1, 0) for s in self.sequences)
        return tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def as_rows(prompts: Prompts, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Prompt rows as 1-D CPU long tensors, padding (``attention_mask == 0``) removed."""
    if isinstance(prompts, torch.Tensor):
        ids = prompts[None] if prompts.dim() == 1 else prompts
        if ids.dim() != 2:
            raise UserError(f"prompts must be [T] or [B, T], got shape {tuple(prompts.shape)}")
        ids = ids.detach().cpu().long()
        if attention_mask is None:
            rows = list(ids.unbind(0))
        else:
            mask = torch.as_tensor(attention_mask).detach().cpu().bool()
            mask = mask[None] if mask.dim() == 1 else mask
            if mask.shape != ids.shape:
                raise UserError(f"attention_mask {tuple(mask.shape)} must match the prompts {tuple(ids.shape)}")
            rows = [r[m] for r, m in zip(ids.unbind(0), mask.unbind(0))]
    else:
        if attention_mask is not None:
            raise UserError("attention_mask goes with a padded [B, T] tensor, not with ragged prompts")
        rows = [
            torch.as_tensor(list(r) if not isinstance(r, torch.Tensor) else r).reshape(-1).long().cpu() for r in prompts
        ]
    if not rows:
        raise UserError("no prompts given")
    for i, r in enumerate(rows):
        if r.numel() == 0:
            raise UserError(f"prompt {i} is empty; give every row at least one token (e.g. a BOS token)")
    return rows


def resolve_chunk_size(model: torch.nn.Module, chunk_size: ChunkSize) -> int | None:
    """Prompt tokens per prefill forward (None: all at once) for ``chunk_size`` on ``model``."""
    if chunk_size != "auto":
        return chunk_size
    return None if model.config.attention_type == "dense" else PREFILL_CHUNK


@torch.no_grad()
def prefill(
    model: torch.nn.Module,
    rows: Sequence[torch.Tensor],
    cache: KVCache | None = None,
    chunk_size: ChunkSize = "auto",
) -> tuple[torch.Tensor, KVCache]:
    """Read ragged prompts into a cache; returns the last position's logits ``[B, V]`` and the cache.

    With ``chunk_size`` the prompts are read ``chunk_size`` tokens at a time; each chunk continues
    the cache rows (RoPE positions start at the cached length), rows that are done sit out. Only
    a row's last chunk carries its output query: earlier chunks just write the base stream's K/V.
    """
    rows = [torch.as_tensor(r).reshape(-1).long().cpu() for r in rows]
    b = len(rows)
    lengths = [r.numel() for r in rows]
    if min(lengths) < 1:
        raise UserError("every prompt needs at least one token")
    device = model_device(model)
    if cache is None:
        cache = KVCache(model.config.num_hidden_layers, b)
    if cache.num_rows != b:
        raise UserError(f"cache has {cache.num_rows} rows, {b} prompts given")
    cache.reserve(int((cache.lengths + torch.tensor(lengths)).max()))
    chunk_size = resolve_chunk_size(model, chunk_size)
    step = max(lengths) if chunk_size is None else int(chunk_size)
    # Where each row's prompt ends: a chunk's tokens are in the global tail by their distance to it,
    # so a prompt read in chunks gets the same global tokens as one read at once.
    prompt_ends = (cache.lengths + torch.tensor(lengths)).tolist()
    tail = model.config.base_global_tail
    last: list[torch.Tensor | None] = [None] * b
    for offset in range(0, max(lengths), step):
        active = [i for i in range(b) if lengths[i] > offset]
        view = cache if len(active) == b else cache.select(active)
        pieces = [rows[i][offset : offset + step] for i in active]
        finishing = [j for j, i in enumerate(active) if lengths[i] <= offset + step]
        pieces_layout = prefill_layout(pieces, start_positions=view.lengths, global_tail=tail,
                                       prompt_lengths=[prompt_ends[i] for i in active])
        layout = _outputs_of_rows(pieces_layout, finishing)
        logits = model.forward_layout(layout.to(device), view).logits
        for j, row_logits in zip(finishing, logits):
            last[active[j]] = row_logits
    return torch.stack(last), cache


def _outputs_of_rows(layout: OrthrosLayout, rows: list[int]) -> OrthrosLayout:
    """``layout`` with the output tokens of ``rows`` only (the rows whose prompt ends here)."""
    if len(rows) == layout.num_rows:
        return layout
    keep = torch.isin(layout.row_of_output, torch.tensor(rows, dtype=torch.long))
    return replace(
        layout,
        output_index=layout.output_index[keep],
        labels=layout.labels[keep],
        loss_weights=layout.loss_weights[keep],
        row_of_output=layout.row_of_output[keep],
    )


@torch.no_grad()
def decode(
    model: torch.nn.Module, next_ids: torch.Tensor, cache: KVCache, rows: Sequence[int] | None = None
) -> torch.Tensor:
    """One decode step for ``rows`` of the cache (default: all): appends ``next_ids``; logits ``[n, V]``."""
    view = cache if rows is None or len(rows) == cache.num_rows else cache.select(rows)
    layout = decode_layout(next_ids.detach().cpu().reshape(-1), view.lengths, model.config.base_global_tail)
    layout = layout.to(model_device(model))
    return model.forward_layout(layout, view).logits


class _EagerSteps:
    """``decode`` as a step function (the default)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    def __call__(self, rows: list[int], next_ids: torch.Tensor) -> torch.Tensor:
        return decode(self.model, next_ids, self.cache, rows)

    def close(self) -> None:
        pass


class _StaticSteps:
    """``StaticDecoder`` built at the first decode step (a one-token generation never builds it)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache) -> None:
        from orthros_train.infer.static_decode import check_static_decode

        check_static_decode(model)  # refused before the prompt is read, not after
        self.model, self.cache, self.decoder = model, cache, None

    def prepare(self) -> None:
        """Build the decoder over the prefilled cache and capture its graph (outside the decode timing)."""
        if self.decoder is None:
            from orthros_train.infer.static_decode import StaticDecoder

            graph = model_device(self.model).type == "cuda"
            if not graph:
                log.info("cuda_graph on a %s model: the static decode step runs without a graph",
                         model_device(self.model).type)  # fmt: skip
            self.decoder = StaticDecoder(self.model, self.cache, graph=graph)
            self.decoder.capture()

    def __call__(self, rows: list[int], next_ids: torch.Tensor) -> torch.Tensor:
        self.prepare()
        return self.decoder.step(rows, next_ids)

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()


def _decode_steps(model: torch.nn.Module, cache: KVCache, cuda_graph: bool) -> _EagerSteps | _StaticSteps:
    return _StaticSteps(model, cache) if cuda_graph else _EagerSteps(model, cache)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Prompts,
    params: SamplingParams | None = None,
    attention_mask: torch.Tensor | None = None,
    stop_fn: StopFn | None = None,
    **overrides,
) -> GenerationOutput:
    """Generate continuations of a batch of prompts.

    ``params`` (or keyword ``overrides`` of its fields, e.g. ``max_new_tokens=32``) choose greedy
    or sampled decoding, stop tokens and the prefill chunk size. ``stop_fn(row, new_tokens)`` is
    asked after every token (e.g. to stop at a string); a row stops when it returns True.
    """
    if params is None:
        params = SamplingParams(**overrides)
    elif overrides:
        params = SamplingParams(**{**params.__dict__, **overrides})
    rows = as_rows(prompts, attention_mask)
    b = len(rows)
    device = model_device(model)
    was_training = model.training
    model.eval()
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    out = GenerationOutput(
        sequences=[[] for _ in range(b)], finish_reasons=["length"] * b, prompt_lengths=[r.numel() for r in rows]
    )
    try:
        cache = KVCache(model.config.num_hidden_layers, b)
        cache.reserve(max(out.prompt_lengths) + params.max_new_tokens)  # cuda_graph: the step's capacity
        step_fn = _decode_steps(model, cache, params.cuda_graph)
        if params.max_new_tokens == 0:
            return out
        _sync(device)
        t0 = time.perf_counter()
        logits, cache = prefill(model, rows, cache, params.prefill_chunk_size)
        nxt = sample_next(logits, params, generator)
        _sync(device)
        t1 = time.perf_counter()
        out.prefill_seconds = t1 - t0
        active = list(range(b))
        stops = set(params.stop_token_ids)
        for step in range(params.max_new_tokens):
            still = []
            for j, i in enumerate(active):
                tok = int(nxt[j])
                out.sequences[i].append(tok)
                if tok in stops:
                    out.finish_reasons[i] = "stop_token"
                elif stop_fn is not None and stop_fn(i, out.sequences[i]):
                    out.finish_reasons[i] = "stop_fn"
                else:
                    still.append(j)
            if not still or step == params.max_new_tokens - 1:
                break
            keep = torch.tensor(still)
            active = [active[j] for j in still]
            if params.cuda_graph and step == 0:  # the step is built and captured here, outside the decode timing
                t_setup = time.perf_counter()
                step_fn.prepare()
                _sync(device)
                out.decode_setup_seconds = time.perf_counter() - t_setup
                t1 += out.decode_setup_seconds
            logits = step_fn(active, nxt[keep])
            nxt = sample_next(logits, params, generator)
            out.decode_steps += 1
        _sync(device)
        out.decode_seconds = time.perf_counter() - t1
        step_fn.close()
        out.cache_nbytes = cache.nbytes()
        out.cache_bytes_per_token = cache.bytes_per_token()
        return out
    finally:
        model.train(was_training)


def generate_text(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    params: SamplingParams | None = None,
    stop_strings: Sequence[str] = (),
    add_special_tokens: bool = False,
    **overrides,
) -> tuple[list[str], GenerationOutput]:
    """Text in, text out: prompts are tokenized, continuations decoded and cut at ``stop_strings``."""
    if params is None:
        params = SamplingParams(**overrides)
    elif overrides:
        params = SamplingParams(**{**params.__dict__, **overrides})
    if not params.stop_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
        params = SamplingParams(**{**params.__dict__, "stop_token_ids": (tokenizer.eos_token_id,)})
    ids = [tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts]
    stop_strings = [s for s in stop_strings if s]

    def stop_fn(_row: int, new: list[int]) -> bool:
        if not stop_strings:
            return False
        tail = tokenizer.decode(new[-32:], skip_special_tokens=True)
        return any(s in tail for s in stop_strings)

    result = generate(model, ids, params, stop_fn=stop_fn if stop_strings else None)
    texts = []
    for seq in result.sequences:
        if seq and seq[-1] in params.stop_token_ids:
            seq = seq[:-1]
        texts.append(cut_at_stop(tokenizer.decode(seq, skip_special_tokens=True), stop_strings))
    return texts, result


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest of ``stop_strings``."""
    cut = len(text)
    for s in stop_strings:
        if s:
            pos = text.find(s)
            if pos != -1:
                cut = min(cut, pos)
    return text[:cut]
