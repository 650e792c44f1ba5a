"""Orthros for Hugging Face transformers: ``PreTrainedModel`` + ``GenerationMixin`` around the package's model.

Shipped by ``orthros-convert to-hf`` next to the weights together with the package modules it
imports (``shipping.py``), so an export loads with ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` without orthros_train installed and computes exactly what the package
computes: the layers are the package's ``OrthrosBlock``s, the attention plan its
``plan_for_layout``, the keys each query sees its ``ops/keys.py``, the cache its ``KVCache``. This
file only translates transformers' calling convention (a left-padded ``[B, T]`` batch, an
``attention_mask``, a cache object, ``logits_to_keep``) into the package's packed layouts.

**Which base tokens are global** (``base_global_tail = R``; ``ops/keys.py``). Every ``forward``
reads its tokens as a prompt: in each row, the last ``R`` of the tokens this call appends (after
its own padding, so a left-padded row's tail ends at its own last token) have global base queries.
A decode step appends one token, the last of its call: every generated token is global. So
``generate``'s prompt step is the package's prefill and each later step its decode step, and
``forward(ids).logits[:, -1]`` equals the prompt step's logits (``logits_to_keep`` only chooses
which logits are returned). A cache kept across calls (a second chat turn) keeps the K/V each token
wrote when it was read, as the package's ``generate`` does. A prompt fed in several forward calls
(``prefill_chunk_size``) would mark each chunk's last tokens instead: refused with a tail.

The cache is ``OrthrosCache`` (every base key of every row, padding never stored: a row's sink
tokens are its own first tokens). ``generate`` starts with an empty ``DynamicCache``; the first
call replaces it with an ``OrthrosCache``, which the outputs carry back to ``generate``. Beam
search reorders its rows. Logits at padded positions are 0 (a padded token is never read).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from orthros_train.convert.remote_code.configuration_orthros import OrthrosConfig
from orthros_train.model.cache import KVCache
from orthros_train.model.layers import RMSNorm, RotaryEmbedding, rope_parameters
from orthros_train.model.orthros import ModuleFactory, OrthrosAttention
from orthros_train.phase.builders import prefill_layout
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
# transformers 5 renamed the cache argument and output field from `past_key_values` to `cache`.
_CACHE_FIELD = (
    "cache" if any(f.name == "cache" for f in dataclasses.fields(CausalLMOutputWithPast)) else "past_key_values"
)


class OrthrosCache(Cache):
    """The K/V of every base token read so far, per row without padding (the package's ``KVCache``),
    and how many columns of the padded batch it has seen (``get_seq_length``: what ``generate``
    slices its inputs by)."""

    is_compileable = False  # rows of different lengths, grown in place: no static shapes

    def __init__(self, num_layers: int, num_rows: int) -> None:
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers < 4.56: a Cache has no layer list
            super().__init__()
        self.kv = KVCache(num_layers, num_rows)
        self.columns = 0

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.columns

    def update(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - Cache's signature
        # the Cache API's per-layer write does not fit a cache whose rows hold no padding
        raise TypeError("OrthrosCache is written by the Orthros model itself (KVCache.extend), not update()")

    def crop(self, max_length: int) -> None:
        raise ValueError(
            "an Orthros cache cannot be cropped (assisted decoding, DoLa): its rows hold no padding and its "
            "global tail depends on where each read ended; generate without an assistant model"
        )

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._take(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._take(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._take(torch.arange(self.kv.num_rows).repeat_interleave(repeats))

    def _take(self, rows: torch.Tensor) -> None:
        """Keep the cache rows ``rows`` (in that order, repeats allowed)."""
        old = self.kv
        rows = torch.as_tensor(rows).long().cpu().reshape(-1)
        new = KVCache(old.num_layers, rows.numel(), old.capacity, old.growth)
        for layer, (k, v) in enumerate(zip(old.k, old.v)):
            if k is None:
                continue
            per_row = (old.num_rows, k.shape[0] // old.num_rows, *k.shape[1:])
            index = rows.to(k.device)
            new.k[layer] = k.view(per_row)[index].flatten(0, 1)
            new.v[layer] = v.view(per_row)[index].flatten(0, 1)
        new.set_lengths(old.lengths[rows])
        self.kv = new


@dataclasses.dataclass
class _Reading:
    """One forward call in the package's terms: the packed layout of the rows that get tokens and,
    for every output token, the batch row and the returned position it belongs to."""

    layout: OrthrosLayout
    rows: list[int]  # batch rows with at least one new (unpadded) token, in layout order
    out_batch: torch.Tensor  # [N] batch row of each output token
    out_slot: torch.Tensor  # [N] its position among the returned positions
    valid: torch.Tensor  # [B, T] bool: the call's unpadded tokens


def _new_tokens(attention_mask: torch.Tensor | None, b: int, t: int, past: int) -> torch.Tensor:
    """Which of this call's ``[B, T]`` tokens are real (not padding), on the CPU."""
    if attention_mask is None:
        return torch.ones(b, t, dtype=torch.bool)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (b, past + t):
        raise ValueError(
            f"attention_mask must be 2-D [batch, cached + new tokens] = [{b}, {past + t}], "
            f"got {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, past:].detach().cpu().bool()


def _reading(
    ids: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
    position_ids: torch.Tensor | None, global_tail: int,
) -> _Reading:
    """The package layout of one call: each row's unpadded tokens continue its cache row (RoPE
    positions from its cached length, or ``position_ids``), its last ``global_tail`` tokens are the
    tail (``prefill_layout``), and output tokens sit at the returned positions ``slots`` of it."""
    b = ids.shape[0]
    rows = [r for r in range(b) if bool(valid[r].any())]
    pieces = [ids[r][valid[r]] for r in rows]
    layout = prefill_layout(pieces, start_positions=[int(starts[r]) for r in rows], global_tail=global_tail)
    within = valid.long().cumsum(-1) - 1  # each token's index among its row's new tokens
    offset, index, row_of, batch_of, slot_of = 0, [], [], [], []
    for j, (r, piece) in enumerate(zip(rows, pieces)):
        kept = valid[r, slots].nonzero().flatten()  # returned positions that hold a token of row r
        index.append(offset + within[r, slots[kept]])
        row_of.append(torch.full_like(kept, j))
        batch_of.append(torch.full_like(kept, r))
        slot_of.append(kept)
        offset += piece.numel()
    output_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    n = output_index.numel()
    layout = dataclasses.replace(
        layout, output_index=output_index, labels=torch.full((n,), IGNORE_INDEX, dtype=torch.long),
        loss_weights=torch.zeros(n), row_of_output=torch.cat(row_of) if row_of else output_index.clone(),
    )
    if position_ids is not None:
        given = position_ids.detach().cpu().long().expand(b, -1)
        layout.positions = torch.cat([given[r][valid[r]] for r in rows])
    empty = torch.zeros(0, dtype=torch.long)
    return _Reading(layout, rows, torch.cat(batch_of) if rows else empty, torch.cat(slot_of) if rows else empty, valid)


class OrthrosPreTrainedModel(PreTrainedModel):
    config_class = OrthrosConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["OrthrosBlock"]

    def __init__(self, config: OrthrosConfig, *inputs, **kwargs) -> None:
        super().__init__(config, *inputs, **kwargs)
        # The package's config of this export (refuses a config.json without W, S or R).
        self.model_config = config.model_config()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The package's initial values (weights a checkpoint does not hold, and the RoPE frequencies,
        which no checkpoint holds)."""
        std = self.config.initializer_range
        if isinstance(module, OrthrosAttention):
            module.gamma.fill_(1.0)
            module.beta.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, RotaryEmbedding):
            cfg = self.model_config
            inv_freq, module.attention_scaling = rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            module.inv_freq.copy_(inv_freq)
        elif isinstance(module, nn.Linear):  # routers and experts included
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)


def _with_cache(output_cls, cache, **fields):  # noqa: ANN001, ANN202
    return output_cls(**fields, **{_CACHE_FIELD: cache})


class OrthrosModel(OrthrosPreTrainedModel):
    """The package's embedding, ``OrthrosBlock``s and final norm (HF names ``model.*``)."""

    def __init__(self, config: OrthrosConfig) -> None:
        super().__init__(config)
        cfg, self.factory = self.model_config, ModuleFactory()
        self.embed_tokens = self.factory.embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.factory.block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = self.factory.norm("norm", cfg.hidden_size, cfg.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        output_index=None,
        **kwargs,
    ):  # noqa: ANN001, ANN201 - transformers' calling convention
        """Final normed hidden states of the output tokens at ``output_index`` (positions within this
        call's tokens; default every position): ``last_hidden_state`` [B, N, D] (0 where padded)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        given = input_ids if input_ids is not None else inputs_embeds
        b, t = given.shape[:2]
        cache = self._orthros_cache(cache if cache is not None else past_key_values, b, use_cache)
        past = cache.columns if cache is not None else 0
        valid = _new_tokens(attention_mask, b, t, past)
        slots = torch.arange(t) if output_index is None else output_index.detach().cpu().long().flatten()
        ids = input_ids.detach().cpu() if input_ids is not None else torch.zeros(b, t, dtype=torch.long)
        starts = cache.kv.lengths if cache is not None else torch.zeros(b, dtype=torch.long)
        reading = _reading(ids, valid, slots, starts, position_ids, self.model_config.base_global_tail)
        hidden = given.new_zeros((b, slots.numel(), self.config.hidden_size), dtype=self.embed_tokens.weight.dtype)
        if reading.rows:
            embeds = None if inputs_embeds is None else inputs_embeds[valid.to(inputs_embeds.device)]
            out = self._read(reading, cache, embeds)
            hidden[reading.out_batch.to(hidden.device), reading.out_slot.to(hidden.device)] = out.to(hidden.dtype)
        if cache is not None:
            cache.columns += t
        return _with_cache(BaseModelOutputWithPast, cache, last_hidden_state=hidden)

    def _orthros_cache(self, cache: Cache | None, b: int, use_cache: bool | None) -> OrthrosCache | None:
        """The cache this call continues: the given ``OrthrosCache``, a new one for an empty cache
        (``generate`` starts with an empty ``DynamicCache``), None without a cache."""
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if isinstance(cache, OrthrosCache):
            if cache.kv.num_rows != b:
                raise ValueError(f"the cache holds {cache.kv.num_rows} rows, the batch has {b}")
            return cache
        if cache is not None and type(cache) is not DynamicCache:
            raise ValueError(
                f"an Orthros model keeps its K/V in an OrthrosCache (rows of different lengths, no padding), not a "
                f"{type(cache).__name__}: generate with the default cache (no cache_implementation)"
            )
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(
                f"an Orthros model continues only the OrthrosCache its own forward returned, got a filled "
                f"{type(cache).__name__}: pass the cache of the previous call, or no cache"
            )
        return OrthrosCache(self.model_config.num_hidden_layers, b) if use_cache or cache is not None else None

    def _read(self, reading: _Reading, cache: OrthrosCache | None, embeds: torch.Tensor | None) -> torch.Tensor:
        """The package model over one call's layout: ``OrthrosForCausalLM._hidden_states`` on these
        modules (the plan of ``plan_for_layout``, every block, the final norm); ``[N, D]``."""
        device = self.embed_tokens.weight.device
        view = None
        if cache is not None:
            view = cache.kv if len(reading.rows) == cache.kv.num_rows else cache.kv.select(reading.rows)
        plan = self.factory.plan(self.model_config, reading.layout.to(device), view)
        x = self.embed_tokens(plan.input_ids) if embeds is None else embeds.to(device)
        y = x[plan.output_rows]  # output token p starts as a copy of input token p
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, y = layer(x, y, plan, view, base_feeds_nothing=i == last)
        if view is not None:
            view.advance(plan.new_lengths)
        return self.norm(y)


class OrthrosForCausalLM(OrthrosPreTrainedModel, GenerationMixin):
    if _TRANSFORMERS_MAJOR >= 5:
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    else:
        _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: OrthrosConfig) -> None:
        super().__init__(config)
        self.model = OrthrosModel(config)
        self.lm_head = self.model.factory.lm_head(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - GenerationMixin's signature
        config = kwargs.get("generation_config") or self.generation_config
        chunk = kwargs.get("prefill_chunk_size", getattr(config, "prefill_chunk_size", None))
        if chunk and self.model_config.base_global_tail:
            raise ValueError(
                f"prefill_chunk_size={chunk} with base_global_tail={self.model_config.base_global_tail}: each chunk "
                "would be read as a prompt of its own and mark its own last tokens global; read the prompt in one "
                "step (prefill_chunk_size=None)"
            )
        return super().generate(*args, **kwargs)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):  # noqa: ANN001, ANN201 - transformers' calling convention
        """Logits of output tokens at every position (``logits_to_keep=0``), at the last ``k``
        positions (``logits_to_keep=k``: with k=1 the prompt step is Orthros' prefill) or at the
        positions of a 1-D index tensor. ``labels`` [B, T] give the usual shifted LM loss."""
        t = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if isinstance(logits_to_keep, int):
            keep = t if logits_to_keep <= 0 else min(logits_to_keep, t)
            output_index = torch.arange(t - keep, t)
        else:
            output_index = logits_to_keep.detach().cpu().long().flatten()
        if labels is not None and output_index.numel() != t:
            raise ValueError("labels need logits at every position: call with logits_to_keep=0")
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_index=output_index,
        )
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels[:, 1:].to(logits.device).reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        return _with_cache(CausalLMOutputWithPast, getattr(out, _CACHE_FIELD), loss=loss, logits=logits)
