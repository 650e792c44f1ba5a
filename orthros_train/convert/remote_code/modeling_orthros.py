"""Orthros for Hugging Face transformers (remote code; needs only torch and transformers).

Written by ``orthros-convert to-hf`` next to the weights, so an exported model loads with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` without orthros_train.

Every layer carries two token streams that share all weights except a per-head affine on the
output stream's queries:

* base stream ``x``: one token per input position, sliding-window causal self-attention over
  the ``base_window`` most recent base keys (its own included) and, with ``sink_tokens = S``,
  the first ``S`` keys of its sequence; it alone writes K/V, so the KV cache is exactly the base
  stream's K/V;
* output stream ``y``: one token per position that must predict the next token (a copy of that
  input token's embedding at layer 0); its query, ``norm_q(y W_q) * gamma + beta``, attends all
  base keys up to its position. Nothing attends to it; the LM head reads it.

``forward`` puts output tokens at every position (training, perplexity) or, with
``logits_to_keep=k``, at the last ``k`` positions only. ``generate`` therefore runs Orthros'
inference phases through the standard transformers loop: the prompt step is the prefill (base
tokens for the whole prompt, one output token at the last position, ``logits_to_keep=1``) and
every later step appends one base + output pair to a ``DynamicCache`` that holds all base K/V.

Batches may be left-padded (``attention_mask``); padded keys are never attended.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_orthros import OrthrosConfig

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
# transformers 5 renamed the cache argument and output field from `past_key_values` to `cache`.
_CACHE_FIELD = (
    "cache" if any(f.name == "cache" for f in dataclasses.fields(CausalLMOutputWithPast)) else ("past_key_values")
)
QUERY_CHUNK = 1024  # queries per attention call: bounds the score matrix to chunk x keys


class OrthrosRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _yarn_mscale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(config):
    """(inverse RoPE frequencies [head_dim/2] in fp32, attention factor for cos/sin).

    rope_type default, linear, llama3 or yarn, computed as transformers computes them; the
    attention factor is YaRN's temperature (1 for the other types).
    """
    params = config.rope_parameters
    dim = config.head_dim
    theta = params["rope_theta"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        factor = float(params["factor"])
        old_len = float(params["original_max_position_embeddings"])
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction_dim(rotations):
            return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        pos_freqs = theta**exponents
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return inv_freq, float(attention_factor)
    inv_freq = 1.0 / (theta**exponents)
    if kind == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported by Orthros (default, linear, llama3 or yarn)")
    return inv_freq, 1.0


def rope_cos_sin(inv_freq, positions, attention_factor=1.0):
    """cos, sin [B, T, 1, head_dim] (fp32) for integer positions [B, T], times the attention factor."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos[:, :, None, :], sin[:, :, None, :]


def apply_rope(x, cos, sin):
    """Rotate [B, T, heads, head_dim] in the rotate-half layout of Llama/Qwen checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


def orthros_attention(q, k, v, q_index, q_window, key_valid, sinks=None):
    """Masked softmax attention in fp32 over the base keys.

    q [B, H, Lq, D]; k, v [B, Hkv, S, D]; ``q_index[i]`` is the key index of query i's own token
    and ``q_window[i]`` how many keys back it may look (its own included); ``key_valid`` [B, S]
    marks non-padding keys (None: all). Query i attends key j iff ``j <= q_index[i]``,
    ``q_index[i] - j < q_window[i]`` and key j is valid. A query always sees its own key, which
    keeps padded rows finite (their outputs are never read).

    ``sinks``: ``(key_sink [B, S], span)`` with sink tokens, else None. A query also attends the
    keys ``key_sink`` marks (each row's first ``sink_tokens`` valid keys, all before ``span``) up
    to its own; a chunk scores them beside its window range, so its scores stay ``chunk x
    (window + sinks)`` wide.
    """
    b, h, n_q, d = q.shape
    out = q.new_empty(b, h, n_q, d)
    kf, vf = k.float(), v.float()
    gqa = h != k.shape[1]
    for c0 in range(0, n_q, QUERY_CHUNK):
        keys, allowed = _chunk_keys(q_index[c0 : c0 + QUERY_CHUNK], q_window[c0 : c0 + QUERY_CHUNK], key_valid, sinks)
        o = F.scaled_dot_product_attention(
            q[:, :, c0 : c0 + QUERY_CHUNK].float(),
            kf[:, :, keys],
            vf[:, :, keys],
            attn_mask=allowed[:, None],
            enable_gqa=gqa,
        )
        out[:, :, c0 : c0 + QUERY_CHUNK] = o.to(out.dtype)
    return out


def _chunk_keys(qi, win, key_valid, sinks):
    """(the keys a chunk of queries scores, which of them each query attends [B or 1, chunk, keys]).

    The keys are the chunk's window range ``lo:hi`` (a slice: no copy) or, with sinks, the sink
    keys before that range followed by the range (an index: each key once). Padding keys
    (``key_valid`` false) are masked, except a query's own key."""
    lo = max(int((qi - win + 1).min()), 0)
    hi = int(qi.max()) + 1
    j = torch.arange(lo, hi, device=qi.device)
    keys = slice(lo, hi)
    if sinks is not None:
        key_sink, span = sinks
        j = torch.cat([torch.arange(min(span, lo), device=qi.device), j])
        keys = j
    causal = j[None, :] <= qi[:, None]
    allowed = (causal & (qi[:, None] - j[None, :] < win[:, None]))[None]
    if sinks is not None:
        allowed = allowed | (key_sink[:, None, keys] & causal[None])
    if key_valid is not None:
        allowed = (allowed & key_valid[:, None, keys]) | (j[None, :] == qi[:, None])[None]
    return keys, allowed


class OrthrosAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        h, kv, hd, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = OrthrosRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = OrthrosRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        # The only weights the output stream does not share with the base stream.
        self.gamma = nn.Parameter(torch.ones(h, hd))
        self.beta = nn.Parameter(torch.zeros(h, hd))

    def forward(self, h, n_base, plan, cache, with_base_queries):
        """``h`` is the normed ``[x; y]`` [B, T+N, D]; returns the attention output of ``[x; y]``
        (or of ``y`` alone when the base stream's output feeds nothing)."""
        b = h.shape[0]
        n_out = h.shape[1] - n_base
        base = h[:, :n_base]
        k = self.k_proj(base).view(b, n_base, self.num_kv_heads, self.head_dim)
        v = self.v_proj(base).view(b, n_base, self.num_kv_heads, self.head_dim)
        q = self.q_proj(h if with_base_queries else h[:, n_base:]).view(b, -1, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if n_out:
            n_q = q.shape[1]
            q = torch.cat([q[:, : n_q - n_out], q[:, n_q - n_out :] * self.gamma + self.beta], dim=1)
        if with_base_queries:
            cos = torch.cat([plan["base_cos"], plan["out_cos"]], dim=1)
            sin = torch.cat([plan["base_sin"], plan["out_sin"]], dim=1)
            q_index, q_window = plan["q_index"], plan["q_window"]
        else:
            cos, sin = plan["out_cos"], plan["out_sin"]
            q_index, q_window = plan["out_q_index"], plan["out_q_window"]
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, plan["base_cos"], plan["base_sin"]).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if k.shape[2] != plan["num_keys"]:
            raise ValueError(
                f"layer {self.layer_idx} sees {k.shape[2]} keys, expected {plan['num_keys']}: Orthros needs a "
                "cache that keeps every base key (DynamicCache); sliding-window or static caches are not supported"
            )
        o = orthros_attention(q, k, v, q_index, q_window, plan["key_valid"], plan["sinks"])
        return self.o_proj(o.transpose(1, 2).reshape(b, o.shape[2], -1))


class OrthrosMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x, n_base=None, output_index=None):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OrthrosSparseMoeBlock(nn.Module):
    """Qwen3-MoE's mixture of experts (softmax router, top-k, ``norm_topk_prob``; Qwen2-MoE's gated
    shared expert when ``shared_expert_intermediate_size``), with ``moe_routing`` deciding how a
    position's base and output tokens pick experts: ``independent`` (each its own top-k), ``tied``
    (the output token takes its base token's experts, weighted by its own probabilities over them)
    or ``joint`` (the pair takes the top-k of the mean of both tokens' probabilities, each weighting
    them by its own). Base tokens without an output token route alone."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routing = config.moe_routing
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(OrthrosMLP(config, config.moe_intermediate_size) for _ in range(self.num_experts))
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = OrthrosMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, h, n_base, output_index):
        """``h`` [B, n_base + N, D]: base rows, then output token m of each row paired with base row
        ``output_index[m]`` (``n_base`` 0: the output tokens have no base partner)."""
        b, rows, d = h.shape
        flat = h.reshape(-1, d)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        experts = torch.topk(probs, self.top_k, dim=-1).indices
        n_out = rows - n_base
        if n_base and n_out and self.routing != "independent":
            row0 = torch.arange(b, device=h.device)[:, None] * rows
            base_of = (row0 + output_index[None, :]).flatten()
            out_rows = (row0 + n_base + torch.arange(n_out, device=h.device)[None, :]).flatten()
            if self.routing == "joint":
                chosen = torch.topk(0.5 * (probs[base_of] + probs[out_rows]), self.top_k, dim=-1).indices
                experts[base_of] = chosen
            else:
                chosen = experts[base_of]
            experts[out_rows] = chosen
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in experts.unique().tolist():
            row, slot = torch.nonzero(experts == e, as_tuple=True)
            y = self.experts[e](flat[row]) * weights[row, slot, None].to(flat.dtype)
            out.index_add_(0, row, y)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(b, rows, d)


def _is_sparse_layer(config, layer_idx):
    return (
        getattr(config, "num_experts", 0) > 0
        and layer_idx not in (config.mlp_only_layers or [])
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class OrthrosDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = OrthrosRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = OrthrosAttention(config, layer_idx)
        self.post_attention_layernorm = OrthrosRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = OrthrosSparseMoeBlock(config) if _is_sparse_layer(config, layer_idx) else OrthrosMLP(config)

    def forward(self, x, y, plan, cache, base_feeds_nothing):
        n_base = x.shape[1]
        h = torch.cat([x, y], dim=1)
        attn = self.self_attn(self.input_layernorm(h), n_base, plan, cache, not base_feeds_nothing)
        if base_feeds_nothing:  # last layer: the base stream only supplies K/V
            y = y + attn
            return x, y + self.mlp(self.post_attention_layernorm(y), 0, plan["output_index"])
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h), n_base, plan["output_index"])
        return h[:, :n_base], h[:, n_base:]


class OrthrosPreTrainedModel(PreTrainedModel):
    config_class = OrthrosConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["OrthrosDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, OrthrosAttention):
            module.gamma.fill_(1.0)
            module.beta.zero_()
        elif isinstance(module, OrthrosRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.Linear):  # routers and experts included
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)


def _with_cache(output_cls, cache, **fields):
    return output_cls(**fields, **{_CACHE_FIELD: cache})


class OrthrosModel(OrthrosPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OrthrosDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = OrthrosRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
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
    ):
        """Final normed hidden states of the output tokens at ``output_index`` (positions within
        this call's tokens; default every position): ``last_hidden_state`` [B, N, D]."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = x.shape[:2]
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        device = x.device
        key_valid = _valid_keys(attention_mask, b, past + t, device)
        if position_ids is None:
            position_ids = _default_positions(key_valid, past, past + t, device)
        position_ids = position_ids.to(device).expand(b, t)
        if output_index is None:
            output_index = torch.arange(t, device=device)
        plan = self._attention_plan(position_ids, output_index.to(device), past, key_valid)
        y = x[:, plan["output_index"]]  # output token p starts as a copy of input token p
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, y = layer(x, y, plan, cache, base_feeds_nothing=i == last)
        return _with_cache(BaseModelOutputWithPast, cache if use_cache else None, last_hidden_state=self.norm(y))

    def _attention_plan(self, position_ids, output_index, past, key_valid):
        """What every layer's attention needs for this call: RoPE of the base tokens and of the
        output tokens, each query's key index and window (base queries first, then output ones),
        the valid and sink keys, and the base row each output token pairs with (MoE routing)."""
        b, t = position_ids.shape
        device = position_ids.device
        num_keys = past + t
        inv_freq, attention_factor = rope_inv_freq(self.config)
        base_cos, base_sin = rope_cos_sin(inv_freq.to(device), position_ids, attention_factor)
        base_index = past + torch.arange(t, device=device)
        out_q_index = base_index[output_index]
        out_q_window = torch.full_like(out_q_index, num_keys + 1)  # unbounded: every earlier key
        window = self.config.base_window
        return {
            "base_cos": base_cos,
            "base_sin": base_sin,
            "out_cos": base_cos[:, output_index],
            "out_sin": base_sin[:, output_index],
            "q_index": torch.cat([base_index, out_q_index]),
            "q_window": torch.cat([torch.full_like(base_index, window), out_q_window]),
            "out_q_index": out_q_index,
            "out_q_window": out_q_window,
            "key_valid": key_valid,
            "sinks": _sink_keys(getattr(self.config, "sink_tokens", 0), key_valid, b, num_keys, device),
            "num_keys": num_keys,
            "output_index": output_index,
        }


def _valid_keys(attention_mask, b, num_keys, device):
    """The non-padding keys [B, num_keys] of a left-padded batch (None when every key is valid)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[1] != num_keys:
        raise ValueError(
            f"attention_mask must be 2-D [batch, cached + new tokens] = [{b}, {num_keys}], "
            f"got {tuple(attention_mask.shape)}"
        )
    if bool(attention_mask.all()):
        return None
    return attention_mask.to(device=device, dtype=torch.bool)


def _default_positions(key_valid, past, num_keys, device):
    """Positions of this call's tokens [B or 1, T]: counted from each row's first valid key."""
    if key_valid is not None:
        return (key_valid.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    return torch.arange(past, num_keys, device=device)[None]


def _sink_keys(n_sinks, key_valid, b, num_keys, device):
    """``(key_sink [B, num_keys], span)``: each row's first ``n_sinks`` valid keys (after any left
    padding) and the key index past the last of them in any row; None without sink tokens."""
    if not n_sinks:
        return None
    if key_valid is None:
        key_sink = (torch.arange(num_keys, device=device) < n_sinks)[None].expand(b, num_keys)
    else:
        key_sink = key_valid & (key_valid.long().cumsum(-1) <= n_sinks)
    span = int(key_sink.any(0).nonzero().max()) + 1 if bool(key_sink.any()) else 0
    return key_sink, span


class OrthrosForCausalLM(OrthrosPreTrainedModel, GenerationMixin):
    if _TRANSFORMERS_MAJOR >= 5:
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    else:
        _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = OrthrosModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

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
    ):
        """Logits of output tokens at every position (``logits_to_keep=0``), at the last ``k``
        positions (``logits_to_keep=k``: with k=1 the prompt step is Orthros' prefill) or at the
        positions of a 1-D index tensor. ``labels`` [B, T] give the usual shifted LM loss."""
        t = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if isinstance(logits_to_keep, int):
            keep = t if logits_to_keep <= 0 else min(logits_to_keep, t)
            output_index = torch.arange(t - keep, t, device=device)
        else:
            output_index = logits_to_keep.to(device).long().flatten()
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
                ignore_index=-100,
            )
        return _with_cache(CausalLMOutputWithPast, getattr(out, _CACHE_FIELD), loss=loss, logits=logits)
