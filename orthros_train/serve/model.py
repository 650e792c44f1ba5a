"""Orthros in vLLM: the model class ``OrthrosForCausalLM`` for what ``orthros-convert to-hf`` exports.

vLLM schedules a flat batch of tokens (``input_ids``, ``positions``) over a paged KV cache; its
attention metadata carries, per request, the row offsets of this step's tokens
(``query_start_loc``), the cached length including them (``seq_lens``) and the block table. The
runner reads logits at the last row of every request (``query_start_loc[1:] - 1``). Orthros
maps onto that as follows:

* **base stream** ``x``: every scheduled token. Its attention is vLLM's own ``Attention`` with
  ``per_layer_sliding_window=W``, which writes the K/V. Its KV spec is reported as full
  attention (``BaseStreamAttention.get_kv_cache_spec``): with vLLM's sliding-window spec the KV
  manager frees blocks that fall out of the window, but the output stream still reads them. With
  sink tokens (``sink_tokens > 0`` in config.json) vLLM only writes the K/V and the window plus the
  request's first ``S`` keys is the model's own op (``torch.ops.orthros.base_attention``).
  With a global tail (``base_global_tail = R > 0``) the base rows of each request's last ``R``
  prompt tokens and of its generated tokens (``tail_rows.py``; the prompt lengths come from a
  logits processor, ``prompt_lengths.py``) are computed again over every key of their request, in
  the same pass, by the output stream's unwindowed attention (``torch.ops.orthros.global_attention``),
  and only those rows.
* **output stream** ``y``: an output token at every row whose logits vLLM reads (``output_rows.py``
  plans them per step: the last row of each request; the last ``1 + k`` under speculative
  decoding; every prompt row of a request that asks for prompt logprobs; every row of a step that
  replays a CUDA graph), a copy of that row's embedding at layer 0. Its query
  ``norm_q(y W_q) * gamma + beta`` attends the request's cached keys up to its own position: a
  second paged-attention call after the base one, causal from the request's end, no window, no K/V
  write (the custom op ``torch.ops.orthros.output_attention``: the CPU backend's own paged
  attention; on GPU vLLM's FlashAttention, or the Triton kernel of ``paged_attention.py``).
* Token-wise work (norms, projections, MLP) runs on ``h = [x; y]``, one tensor for the whole
  pass, with the residual carried beside it as in vLLM's Llama (fused add + RMSNorm); the last
  layer only writes the base stream's K/V (no base attention output, no base MLP), and the
  model returns hidden states whose output rows hold the output stream (the other rows are NaN:
  nothing may read them).

vLLM compiles the model (``support_torch_compile``; on CPU one dynamo trace, inductor fusing the
token-wise work) as it compiles its Llama. What depends on the step's scheduling stays out of the
traced graph: ``OrthrosForCausalLM.forward`` (eager) reads the output rows from the attention
metadata and hands them in as a tensor whose length is a second dynamic size, and the output
attention is an opaque custom op that reads the cache and the metadata at run time, like vLLM's
own attention op. The compiled part returns the output stream's rows only; the eager part
places them.

Tensor parallelism comes from vLLM's layers (QKV/merged column-parallel and row-parallel linears,
vocab-parallel embedding and LM head); ``gamma``/``beta`` are split by heads in their weight
loader. What the design cannot serve is refused when vLLM builds the engine's configuration
(``config.py``); the output stream's rows are the only defined hidden states (the others are NaN),
and which requests want prompt logprobs reaches the model through a logits processor
(``prompt_logprobs.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.library import Library
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.utils.torch_utils import _encode_layer_name, direct_register_custom_op
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from orthros_train.serve import kv_layout
from orthros_train.serve.config import served_global_tail, served_sink_tokens
from orthros_train.serve.output_rows import OutputRows, every_row, plan_output_rows
from orthros_train.serve.prompt_lengths import lengths_of
from orthros_train.serve.prompt_logprobs import prompt_logprob_rows
from orthros_train.serve.refusal import OrthrosServeError
from orthros_train.serve.tail_rows import plan_tail_rows, tail_row_keys

logger = logging.getLogger(__name__)

# HF checkpoint name -> (vLLM fused parameter, shard id), as vLLM's own Llama/Qwen load them.
STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


@dataclass
class OutputQueries:
    """This step's output tokens (set by the eager forward, read by every layer's output attention)."""

    metadata: object | None = None  # the step's attention metadata (None in vLLM's dummy runs)
    plan: OutputRows | None = None  # which rows carry an output token, per request
    cpu_schedule: torch.Tensor | None = None  # the CPU attention op's work split for those queries
    # GPU, Triton kernel with one program per output row: each row's request and key count.
    row_request: torch.Tensor | None = None
    row_keys: torch.Tensor | None = None
    flash: bool = False  # run the output attention with vLLM's FlashAttention (see ``use_flash``)
    # Base stream with sink tokens: every row's request and key count (its own key included; 0 for
    # padding rows), computed on the device once per step for every layer.
    base_request: torch.Tensor | None = None
    base_keys: torch.Tensor | None = None
    # The global tail's base rows. CPU: their suffix plan over the requests that have any
    # (``tail_requests``), with the CPU op's work split; GPU: every row's key count where it is
    # global, else 0 (with ``base_request``, on the device).
    tail: OutputRows | None = None
    tail_requests: torch.Tensor | None = None
    tail_schedule: torch.Tensor | None = None
    tail_keys: torch.Tensor | None = None
    prepared: bool = False  # the cache layout was checked and the Triton kernels compiled (at load)


class BaseStreamAttention(Attention):
    """vLLM's attention with the base stream's window, whose KV blocks are never freed early, and
    the output stream's call over the same cache.

    A windowed layer's ``SlidingWindowSpec`` lets the KV manager drop blocks outside the window
    (wrong tokens under block pressure, since the output stream reads every key); a full-attention
    spec keeps them and makes prefix caching match whole prefixes.

    With sink tokens (``sink_tokens > 0``) vLLM's windowed kernels cannot add a request's first
    keys to every window, so the layer only writes the K/V through vLLM and runs the base stream
    itself (``base_attention``): the Triton kernel of ``paged_attention.py`` on GPU, a plain torch
    gather on CPU.
    """

    output_queries: OutputQueries  # shared by every layer of a model, refreshed every step
    window: int = 0  # the base stream's window W
    sink_tokens: int = 0  # the base stream's sink tokens S (0: vLLM's windowed attention does it all)
    global_tail: int = 0  # the base stream's global tail R (0: no base row sees more than its window)
    layout: str | None = None  # how this model reads the cache by hand (``kv_layout``), where it does
    cache_block_size: int = 16  # vLLM's cache block size (the test block written at load)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size_v,
            dtype=self.kv_cache_torch_dtype,
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM calls this on every attention layer once the weights are on the device (every load
        format): the first layer checks the cache layout and compiles the Triton kernels for the
        whole model, before any KV cache, warm-up run or CUDA-graph capture."""
        super().process_weights_after_loading(act_dtype)
        if not self.output_queries.prepared:
            self.prepare_for_serving()
            self.output_queries.prepared = True

    def prepare_for_serving(self) -> None:
        """Check that the backend writes its cache as this model reads it (its own writer on a
        scratch cache) and, on GPU, compile the paged kernels; ``OrthrosServeError`` with the fix."""
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        if cpu and not self.sink_tokens:
            return  # the output stream runs on the CPU backend's own op: nothing is read by hand
        device = self._k_scale.device
        backend = self.attn_backend.get_name()
        block_size = self.cache_block_size
        what = f"attention backend {backend} (kv_cache_dtype {self.kv_cache_dtype!r}, block size {block_size})"
        try:
            self.layout = kv_layout.layout_for(backend, self.kv_cache_dtype, "cpu" if cpu else "cuda")
            if not self.attn_backend.forward_includes_kv_cache_update:
                if cpu and not hasattr(self, "isa"):
                    # The CPU metadata builder sets the layer's ISA when the cache exists; the same
                    # choice now, to write the test block as the kernels will.
                    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

                    self.isa = _get_attn_isa(self.kv_cache_torch_dtype, block_size, self.head_size,
                                             self.kv_cache_dtype)
                kv_layout.check_layout(
                    self.layout, lambda k, v, cache, slots: self.impl.do_kv_cache_update(self, k, v, cache, slots),
                    self.num_kv_heads, self.head_size, block_size, self.kv_cache_torch_dtype, device,
                    what + (f", ISA {self.isa}" if cpu else ""),
                )
        except kv_layout.KVLayoutError as e:
            hint = (" (the CPU backend's AMX kernels pack keys otherwise: serve with --dtype float32)"
                    if cpu else "")
            raise OrthrosServeError(f"{e}{hint}") from None
        if not cpu:
            from orthros_train.serve.paged_attention import compile_paged_kernels

            compile_paged_kernels(device, self.kv_cache_torch_dtype, self.num_heads, self.num_kv_heads,
                                  self.head_size, base_stream=self.sink_tokens > 0)

    def _paged_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout != kv_layout.PAGED:  # never reached after a load that checked the layout
            raise OrthrosServeError(f"the KV cache layout of attention backend {self.attn_backend.get_name()} was "
                                    "not checked at load (prepare_for_serving)")
        return kv_layout.split_paged(self.kv_cache, self.head_size)

    def base_attention(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """The base stream with sink tokens: row ``t`` (request ``r``, key count ``n`` including its
        own) attends its window ``[n - W, n)`` and its request's first ``S`` keys below it, into
        ``out [T, heads * head_dim]``; padding rows are zeroed."""
        queries = self.output_queries
        md = queries.metadata
        if md is None:  # vLLM's profiling / warm-up run: no cache yet
            out.zero_()
            return
        m = q.shape[0]
        if q.device.type == "cpu":
            self._base_attention_cpu(q, out, md.block_table, md.query_start_loc, md.seq_lens, md.num_actual_tokens)
            return
        from orthros_train.serve.paged_attention import paged_window_attention

        key_cache, value_cache = self._paged_views()
        paged_window_attention(q.view(m, self.num_heads, self.head_size), key_cache, value_cache, md.block_table,
                               queries.base_request[:m], queries.base_keys[:m], self.window, self.sink_tokens,
                               scale=self.impl.scale, out=out.view(m, self.num_heads, self.head_size))

    # Query rows per chunk of the CPU path: a chunk scores its rows against the keys they span
    # (at most rows + W - 1 of them, plus the S sinks), one batched matmul per chunk.
    CPU_CHUNK_ROWS = 256

    def _base_attention_cpu(self, q: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, n: int) -> None:
        """The CPU path: for each chunk of a request's rows, the keys they span (their windows'
        union and the request's sinks) gathered once from the CPU backend's cache
        (``kv_layout.gather_cpu``; layout checked at load), masked per row by the definition (key
        ``j`` below the row's key end ``e``, and ``j >= e - W`` or ``j < S``), softmax in fp32."""
        out[n:].zero_()
        window, sinks = self.window, self.sink_tokens
        block_size = self.kv_cache.shape[2]
        h_kv, group, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        starts, ends, lengths = query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), seq_lens.tolist()
        for r, (a, b, n_keys) in enumerate(zip(starts, ends, lengths)):
            for t0 in range(a, b, self.CPU_CHUNK_ROWS):
                t1 = min(b, t0 + self.CPU_CHUNK_ROWS)
                # Key end (exclusive) of each row: the request's last row sees all n_keys keys.
                end = torch.arange(n_keys - (b - t0) + 1, n_keys - (b - t1) + 1)
                band = max(0, int(end[0]) - window)
                pos = torch.cat([torch.arange(min(sinks, band)), torch.arange(band, int(end[-1]))])
                k, v = kv_layout.gather_cpu(self.kv_cache, block_table[r, pos // block_size].long(), pos % block_size)
                key, row_end = pos[None, :], end[:, None]
                seen = (key < row_end) & ((key >= row_end - window) | (key < sinks))
                qc = q[t0:t1].reshape(t1 - t0, h_kv, group, d).float()
                scores = torch.einsum("chgd,phd->hgcp", qc, k.float()) * self.impl.scale
                scores = scores.masked_fill(~seen, float("-inf"))
                o = torch.einsum("hgcp,phd->chgd", torch.softmax(scores, dim=-1), v.float())
                out[t0:t1] = o.reshape(t1 - t0, -1).to(out.dtype)

    def output_attention(self, q_out: torch.Tensor, out: torch.Tensor) -> None:
        """Each output query against its request's cached keys, causal from the request's end (one
        query per request: all of its keys), into ``out [M, heads * head_dim]``; padding rows
        (past the plan's count) are zeroed."""
        queries = self.output_queries
        md, plan = queries.metadata, queries.plan
        if md is None or plan is None:  # vLLM's profiling / warm-up run: no cache yet
            out.zero_()
            return
        n = plan.count
        if out.shape[0] > n:
            out[n:].zero_()
        if n == 0:
            return
        if q_out.device.type == "cpu":
            self._cpu_suffix_attention(q_out[:n], out[:n], plan.query_start_loc, md.seq_lens, md.block_table,
                                       queries.cpu_schedule)
            return
        # The backend's cache as checked at load (``kv_layout.PAGED``) -> K, V [blocks, block_size, kv heads, D].
        key_cache, value_cache = self._paged_views()
        if queries.flash:
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

            # One varlen call: the output queries of each request (cu_seqlens_q), every cached key of
            # it (seqused_k, block_table), causal from the end, no window, no K/V write.
            flash_attn_varlen_func(
                q=q_out[:n].view(n, self.num_heads, self.head_size), k=key_cache, v=value_cache,
                out=out[:n].view(n, self.num_heads, self.head_size), cu_seqlens_q=plan.query_start_loc,
                max_seqlen_q=max(plan.max_query_len, 1), seqused_k=md.seq_lens, max_seqlen_k=md.max_seq_len,
                softmax_scale=self.impl.scale, causal=True, window_size=None, block_table=md.block_table,
                fa_version=self.impl.vllm_flash_attn_version,
            )
            return
        from orthros_train.serve.paged_attention import paged_output_attention

        if queries.row_request is not None:  # several rows per request, or every row of a graph
            m = queries.row_request.shape[0]
            paged_output_attention(q_out[:m].view(m, self.num_heads, self.head_size), key_cache, value_cache,
                                   md.block_table, queries.row_keys, None, scale=self.impl.scale,
                                   out=out[:m].view(m, self.num_heads, self.head_size),
                                   row_request=queries.row_request)
            return
        paged_output_attention(q_out[:n].view(n, self.num_heads, self.head_size), key_cache, value_cache,
                               md.block_table, md.seq_lens, md.query_start_loc, scale=self.impl.scale,
                               out=out[:n].view(n, self.num_heads, self.head_size))

    def _cpu_suffix_attention(self, q: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
                              seq_lens: torch.Tensor, block_table: torch.Tensor, schedule: torch.Tensor) -> None:
        """The CPU backend's own paged attention: the queries of request ``r`` (rows
        ``query_start_loc[r]:[r + 1]``) are the last rows of its ``seq_lens[r]`` keys, causal, no window."""
        from vllm import _custom_ops as ops

        m = q.shape[0]
        # The CPU cache packs K and V of a block side by side (as its backend reads them).
        key_cache, value_cache = kv_layout.cpu_op_views(self.kv_cache)
        ops.cpu_attention_with_kv_cache(
            query=q.view(m, self.num_heads, self.head_size),
            key_cache=key_cache, value_cache=value_cache, output=out.view(m, self.num_heads, self.head_size),
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=self.impl.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0,
            scheduler_metadata=schedule, s_aux=None, dynamic_causal=None,
            k_scale=self._k_scale_float, v_scale=self._v_scale_float, kv_cache_dtype=self.kv_cache_dtype,
        )

    def global_attention(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """The global tail: the base rows that are global this step (``tail_rows.py``) attend every
        key of their request up to their own, replacing what the windowed base attention wrote in
        ``out [T, heads * head_dim]`` for them; the other rows are left as they are.

        CPU: those rows are gathered and run through the CPU backend's paged attention (they are a
        suffix of each request's rows, as output rows are). GPU: the paged Triton kernel with one
        program per row, every row of the step with its own key count, 0 (nothing read) for the rows
        that are not global, computed on the device, so a captured graph replays it."""
        queries = self.output_queries
        md = queries.metadata
        if md is None:  # vLLM's profiling / warm-up run: no cache yet
            return
        if q.device.type == "cpu":
            tail = queries.tail
            if tail is None:  # no global row in this step
                return
            rows, reqs = tail.rows, queries.tail_requests
            got = out.new_empty(tail.count, out.shape[1])
            self._cpu_suffix_attention(q[rows], got, tail.query_start_loc, md.seq_lens[reqs], md.block_table[reqs],
                                       queries.tail_schedule)
            out[rows] = got
            return
        from orthros_train.serve.paged_attention import paged_global_rows

        m = q.shape[0]
        key_cache, value_cache = self._paged_views()
        shape = (m, self.num_heads, self.head_size)
        paged_global_rows(q.view(shape), key_cache, value_cache, md.block_table, queries.base_request[:m],
                          queries.tail_keys[:m], out[:m].view(shape), scale=self.impl.scale)

    def use_flash(self, graph_mode: object) -> bool:
        """Whether this step's output attention runs with vLLM's FlashAttention: where the base stream
        runs on vLLM's FlashAttention backend (its cache layout and its FA build), with an unquantised
        cache, and not inside a full CUDA graph. A full graph freezes the call's host arguments
        (``max_seqlen_k``, from which FA sizes its splits) at capture; the Triton kernel reads every
        length on the device, so it is the one captured there."""
        from vllm.config import CUDAGraphMode

        impl = self.impl
        return (self.attn_backend.get_name() == "FLASH_ATTN" and getattr(impl, "vllm_flash_attn_version", None)
                is not None and self.kv_cache_dtype == "auto" and not getattr(impl, "fa4_hd256", False)
                and graph_mode != CUDAGraphMode.FULL)


def refuse_breakable_graphs() -> None:
    """vLLM's breakable CUDA graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH``, also turned on by
    ``VLLM_BATCH_INVARIANT``) capture the whole model and replay all but vLLM's own attention op:
    this model's per-step planning of its output rows would run once, at capture, and be replayed
    for every later batch. Refused at model init (vLLM may turn the mode on after the config hook)."""
    try:
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    except ImportError:  # a vLLM without the mode
        return
    if is_breakable_cudagraph_enabled():
        raise OrthrosServeError(
            "Orthros models do not run under vLLM's breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1, also set "
            "by VLLM_BATCH_INVARIANT=1): they plan their output rows per step outside vLLM's attention op, which a "
            "breakable graph would replay from its capture; unset those variables (the default piecewise and full "
            "graphs are supported)"
        )


def _output_attention_op(q_out: torch.Tensor, out: torch.Tensor, layer_name: str,
                         kv_written: torch.Tensor | None = None) -> None:
    """``torch.ops.orthros.output_attention``: opaque to torch.compile, as vLLM's attention op is,
    because it reads the paged cache and the step's metadata (the forward context) at run time.
    ``kv_written`` only orders it after the K/V write of a layer without base attention."""
    del kv_written
    get_forward_context().no_compile_layers[layer_name].output_attention(q_out, out)


def _output_attention_fake(q_out: torch.Tensor, out: torch.Tensor, layer_name: str,
                           kv_written: torch.Tensor | None = None) -> None:
    return None


def _base_attention_op(q: torch.Tensor, out: torch.Tensor, layer_name: str,
                       kv_written: torch.Tensor | None = None) -> None:
    """``torch.ops.orthros.base_attention``: the base stream with sink tokens, opaque as the output
    attention is (it reads the cache and the step's metadata); ``kv_written`` orders it after the
    K/V write."""
    del kv_written
    get_forward_context().no_compile_layers[layer_name].base_attention(q, out)


def _global_attention_op(q: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    """``torch.ops.orthros.global_attention``: the global tail's base rows over every key of their
    request, written over the windowed result in ``out``; opaque as the other two (it reads the
    cache, the step's metadata and its tail plan), ordered after the base attention by ``out``."""
    get_forward_context().no_compile_layers[layer_name].global_attention(q, out)


def _global_attention_fake(q: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    return None


# The ops live in their own library, kept alive as long as this module (the ops' lifetime).
_ORTHROS_OPS = Library("orthros", "FRAGMENT")
direct_register_custom_op("output_attention", _output_attention_op, mutates_args=["out"],
                          fake_impl=_output_attention_fake, target_lib=_ORTHROS_OPS)
direct_register_custom_op("base_attention", _base_attention_op, mutates_args=["out"],
                          fake_impl=_output_attention_fake, target_lib=_ORTHROS_OPS)
direct_register_custom_op("global_attention", _global_attention_op, mutates_args=["out"],
                          fake_impl=_global_attention_fake, target_lib=_ORTHROS_OPS)


def _head_split_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """gamma/beta [heads, head_dim]: this tensor-parallel rank keeps its own query heads."""
    rank, heads = get_tensor_model_parallel_rank(), param.shape[0]
    if loaded.dim() != 2 or loaded.shape[1] != param.shape[1] or loaded.shape[0] % heads:
        raise OrthrosServeError(
            f"gamma/beta in the checkpoint has shape {list(loaded.shape)}; this model expects "
            f"[num_attention_heads, head_dim] with {heads} heads per rank (re-export with orthros-convert to-hf)"
        )
    param.data.copy_(loaded[rank * heads : (rank + 1) * heads])


class OrthrosAttention(nn.Module):
    def __init__(self, vllm_config: VllmConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        tp = get_tensor_model_parallel_world_size()
        self.total_heads, self.total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = self.total_heads // tp
        # Fewer KV heads than ranks: vLLM replicates them, as for its Llama.
        self.num_kv_heads = max(1, self.total_kv_heads // tp)
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.total_heads, self.total_kv_heads,
            bias=bool(config.attention_bias), prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(self.total_heads * self.head_dim, config.hidden_size, bias=False,
                                        prefix=f"{prefix}.o_proj")
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = get_rope(
            self.head_dim, max_position=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters), is_neox_style=True,
        )
        # The only weights the output stream does not share with the base stream.
        self.gamma = nn.Parameter(torch.ones(self.num_heads, self.head_dim), requires_grad=False)
        self.beta = nn.Parameter(torch.zeros(self.num_heads, self.head_dim), requires_grad=False)
        self.gamma.weight_loader = _head_split_loader
        self.beta.weight_loader = _head_split_loader
        self.attn = BaseStreamAttention(
            self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
            per_layer_sliding_window=int(config.base_window), prefix=f"{prefix}.attn",
        )
        self.attn.window = int(config.base_window)
        self.attn.sink_tokens = served_sink_tokens(config, vllm_config.model_config.max_model_len)
        self.attn.global_tail = served_global_tail(config, vllm_config.model_config.max_model_len)
        self.attn.cache_block_size = vllm_config.cache_config.block_size

    def _per_head(self, t: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        if norm is None:
            return t
        return norm(t.view(*t.shape[:-1], -1, self.head_dim)).view(t.shape)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, n_base: int, base_output: bool) -> torch.Tensor:
        """``h`` is the normed ``[x; y]`` (``n_base`` base rows); returns the attention output of
        ``[x; y]``, or of ``y`` alone when nothing reads the base stream's output."""
        qkv, _ = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._per_head(q, self.q_norm), self._per_head(k, self.k_norm)
        # The output queries' affine, in place on their rows (q is this call's own tensor, the
        # projection's or the norm's): no copy of q, as a decode step would pay per layer.
        q[n_base:].view(-1, self.num_heads, self.head_dim).mul_(self.gamma).add_(self.beta)
        q, k = self.rotary_emb(positions, q, k)
        k, v = k[:n_base], v[:n_base]
        if not base_output:
            out = q.new_empty(h.shape[0] - n_base, self.q_size)
            torch.ops.orthros.output_attention(q[n_base:], out, self.attn.layer_name, self._write_kv(k, v))
            return self.o_proj(out)[0]
        if self.attn.sink_tokens:
            # Sink tokens: vLLM only writes the K/V; the base stream's window plus sinks is this
            # model's own op, into the base rows of the buffer the output stream fills too.
            attn = q.new_empty(h.shape[0], self.q_size)
            written = self._write_kv(k, v)
            torch.ops.orthros.base_attention(q[:n_base], attn[:n_base], self.attn.layer_name, written)
            if self.attn.global_tail:
                torch.ops.orthros.global_attention(q[:n_base], attn[:n_base], self.attn.layer_name)
            torch.ops.orthros.output_attention(q[n_base:], attn[n_base:], self.attn.layer_name, written)
            return self.o_proj(attn)[0]
        # Writes the step's K/V, then the windowed attention into the first n_base rows of a buffer
        # that holds the output stream's rows too: vLLM's attention writes only its query's rows
        # (as for a padded batch), so the two streams need no concatenation. The output attention
        # reads what the base call wrote (ordered by its use of the same buffer).
        attn = self.attn(q[:n_base], k, v, output_shape=torch.Size((h.shape[0], self.q_size)))
        if self.attn.global_tail:  # the tail's rows again, over every key (vLLM's call wrote their K/V)
            torch.ops.orthros.global_attention(q[:n_base], attn[:n_base], self.attn.layer_name)
        torch.ops.orthros.output_attention(q[n_base:], attn[n_base:], self.attn.layer_name)
        return self.o_proj(attn)[0]

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """Only the K/V write of the base stream (the last layer needs no base attention output);
        returns what orders a later reader of the cache after it."""
        if self.attn.attn_backend.forward_includes_kv_cache_update:
            # Backends that write inside their attention call: run it and drop the output.
            return self.attn(k.new_zeros(k.shape[0], self.q_size), k, v)
        return torch.ops.vllm.unified_kv_cache_update(k.view(-1, self.num_kv_heads, self.head_dim),
                                                      v.view(-1, self.num_kv_heads, self.head_dim),
                                                      _encode_layer_name(self.attn.layer_name))


class OrthrosMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


def is_sparse_layer(config: object, layer_idx: int) -> bool:
    """Qwen2/3-MoE's rule (as ``OrthrosConfig.is_sparse_layer``): experts in every
    ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``."""
    experts = getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return experts > 0 and layer_idx not in (getattr(config, "mlp_only_layers", None) or []) \
        and (layer_idx + 1) % step == 0


class OrthrosDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = OrthrosAttention(vllm_config, layer_idx, f"{prefix}.self_attn")
        if is_sparse_layer(config, layer_idx):
            from orthros_train.serve.moe import OrthrosSparseMoE

            self.mlp = OrthrosSparseMoE(vllm_config, f"{prefix}.mlp", OrthrosMLP)
        else:
            self.mlp = OrthrosMLP(config.hidden_size, config.intermediate_size, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, n_base: int,
                last: bool, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``/``residual``: ``[x; y]`` (``n_base`` base rows; output token j starts from base row
        ``rows[j]``) as vLLM's Llama carries them; the last layer returns the output stream's rows
        only (the base stream just supplies K/V there)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        attn = self.self_attn(positions, h, n_base, base_output=not last)
        if last:
            residual = residual[n_base:]
        h, residual = self.post_attention_layernorm(attn, residual)
        if isinstance(self.mlp, OrthrosMLP):
            return self.mlp(h), residual
        return self.mlp(h, 0 if last else n_base, rows), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "rows": 0, "inputs_embeds": 0})
class OrthrosModel(nn.Module):
    """The layers, traced by torch.compile when vLLM compiles: everything here is the same for
    every step of a given token count and output-row count."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            OrthrosDecoderLayer(vllm_config, i, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.output_queries = OutputQueries()  # set by the eager forward before each pass
        for layer in self.layers:  # one per model: every layer's output attention reads this step's
            layer.self_attn.attn.output_queries = self.output_queries

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, rows: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The output stream's final hidden states ``[len(rows), hidden]``; output token ``i``
        starts as a copy of input token ``rows[i]`` and uses its RoPE position."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        n = x.shape[0]
        h = torch.cat([x, x[rows]])
        both = torch.cat([positions, positions[rows]])
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h, residual = layer(both, h, residual, n, last=i == last, rows=rows)
        y, _ = self.norm(h, residual)
        return y


class OrthrosForCausalLM(nn.Module):
    """The vLLM model for ``architectures: ["OrthrosForCausalLM"]`` (``model_type: orthros``)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = OrthrosModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      prefix=f"{prefix}.lm_head" if prefix else "lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.dtype = vllm_config.model_config.dtype
        # Output tokens at the end of every request: the verified draft positions and the bonus one.
        spec = vllm_config.speculative_config
        self.output_suffix = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        # The prompt-logprob requests of this engine are published under its config (prompt_logprobs.py).
        self.vllm_config_id = id(vllm_config)
        # Rows of every-row steps are sliced from here: a captured graph reads its inputs at fixed
        # addresses (the model is built on the engine's device).
        scheduler = vllm_config.scheduler_config
        self.register_buffer("arange", torch.arange(max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)),
                             persistent=False)
        refuse_breakable_graphs()
        sinks = self.model.layers[0].self_attn.attn.sink_tokens
        self.global_tail = self.model.layers[0].self_attn.attn.global_tail
        logger.info("Orthros model: %d layers, base window %d, %d sink tokens%s, global tail %d, %d query heads / "
                    "%d kv heads", config.num_hidden_layers, config.base_window, sinks,
                    " (base stream on the model's own attention)" if sinks else "", self.global_tail,
                    config.num_attention_heads, config.num_key_value_heads)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        n = (input_ids if inputs_embeds is None else inputs_embeds).shape[0]
        plan = self._plan_output_queries(n, positions.device)
        rows = plan.rows
        if rows.shape[0] == 1 and getattr(self.model, "compiled", True) is False:
            # The first call of a compiling model traces it: one row would be traced as the
            # constant 1 (0/1 specialisation) and the graph, run without guards, would be wrong
            # for more. vLLM's warm-up run (no metadata, two rows) normally traces first.
            rows = rows.repeat(2)
        y = self.model(input_ids, positions, rows, inputs_embeds)
        if plan.every_row:  # the output stream is the batch, in order
            return y[:n]
        # Only the output rows are defined: NaN elsewhere makes any other reader visibly wrong
        # instead of plausibly wrong (every reader vLLM has is covered by the plan).
        # One scratch row past the step's rows takes the writes of padded requests (``OutputRows.dest``).
        hidden = y.new_full((n + 1, y.shape[1]), float("nan"))
        placed = plan.count if self.model.output_queries.metadata is not None else rows.shape[0]
        hidden[plan.destinations()[:placed]] = y[:placed]
        return hidden[:n]

    def _plan_output_queries(self, num_tokens: int, device: torch.device) -> OutputRows:
        """This step's output tokens (``output_rows.plan_output_rows``); sets the shared
        ``OutputQueries`` that every layer's output attention reads."""
        from vllm.config import CUDAGraphMode

        attn = self.model.layers[0].self_attn
        queries = self.model.output_queries
        context = get_forward_context()
        graph_mode = getattr(context, "cudagraph_runtime_mode", CUDAGraphMode.NONE)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Model Runner V2 captures a full graph with the forward context's mode set to NONE (and
            # replays it without running this code again): a capture is a full graph whatever it says.
            graph_mode = CUDAGraphMode.FULL
        # A captured graph is keyed by the token count alone: every row carries an output token.
        graph = graph_mode not in (None, CUDAGraphMode.NONE)
        raw = context.attn_metadata
        md = raw.get(attn.attn.layer_name) if isinstance(raw, dict) else raw
        queries.metadata, queries.row_request, queries.row_keys = md, None, None
        if md is None:
            if graph:
                plan = every_row(torch.zeros(1, dtype=torch.int32, device=device), num_tokens, 0, 1, self.arange)
            else:
                rows = torch.tensor([0, num_tokens - 1], device=device)
                # One token: the second output row writes the scratch row, not row 0 twice.
                dest = torch.tensor([0, max(num_tokens - 1, 1)], device=device)
                plan = OutputRows(rows=rows, query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
                                  count=0, max_query_len=0, every_row=False, dest=dest)
            queries.plan = plan
            return plan
        plan = plan_output_rows(
            md.query_start_loc, num_tokens, md.num_actual_tokens, md.max_query_len, suffix=self.output_suffix,
            full_requests=prompt_logprob_rows(self.vllm_config_id), graph=graph, arange=self.arange,
        )
        queries.plan = plan
        queries.base_request = queries.base_keys = None
        if (attn.attn.sink_tokens or self.global_tail) and device.type != "cpu":
            # Every row of the step is a base query: its request and key count, on the device (the
            # CPU path reads them per request from the host metadata).
            queries.base_request, queries.base_keys = every_row(
                md.query_start_loc, num_tokens, md.num_actual_tokens, md.max_query_len).row_requests(md.seq_lens)
        if self.global_tail:
            self._plan_tail(md, queries, device)
        if device.type == "cpu":
            queries.cpu_schedule = self._cpu_schedule(plan.query_start_loc.shape[0] - 1, md.seq_lens,
                                                      plan.query_start_loc)
        else:
            from orthros_train.serve.paged_attention import is_compiled

            if not queries.prepared or torch.cuda.is_current_stream_capturing() and not is_compiled(
                    device, attn.attn.kv_cache_torch_dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim):
                # Compiling a Triton kernel inside a CUDA-graph capture fails; they are compiled at load.
                raise OrthrosServeError("the Orthros paged-attention kernels were not compiled when the model was "
                                        "loaded (BaseStreamAttention.process_weights_after_loading did not run)")
            queries.flash = attn.attn.use_flash(graph_mode)
            if not queries.flash and (plan.every_row or plan.max_query_len > 1):
                queries.row_request, queries.row_keys = plan.row_requests(md.seq_lens)
        return plan

    def _plan_tail(self, md: object, queries: OutputQueries, device: torch.device) -> None:
        """This step's global base rows (``tail_rows.py``), from each request's prompt length
        (``prompt_lengths.py``): a host plan on CPU, per-row key counts on the device on GPU."""
        queries.tail = queries.tail_requests = queries.tail_schedule = queries.tail_keys = None
        lengths = lengths_of(self.vllm_config_id)
        if lengths is None:
            raise OrthrosServeError(
                "the Orthros model serves base_global_tail > 0 but its prompt-length logits processor "
                "(orthros_train.serve.prompt_lengths:PromptLengths) was not built: the plugin's config hook did not "
                "run for this engine (is the orthros_train plugin installed in every vLLM process?)"
            )
        if device.type != "cpu":
            if lengths.device is None:
                raise OrthrosServeError("the Orthros prompt-length buffer was not made on the GPU (PromptLengths "
                                        "was built for another device)")
            queries.tail_keys = tail_row_keys(queries.base_request, queries.base_keys, lengths.device, self.global_tail)
            return
        n_req = md.query_start_loc.shape[0] - 1
        tail = plan_tail_rows(md.query_start_loc, md.seq_lens, lengths.host(n_req), self.global_tail, device)
        if tail is None:
            return
        # Only the requests with global rows go to the CPU op (a request with no query is not its case).
        counts = tail.query_start_loc[1:] - tail.query_start_loc[:-1]
        requests = torch.nonzero(counts).flatten()
        qsl = torch.zeros(requests.shape[0] + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(counts[requests], 0)
        tail.query_start_loc = qsl
        queries.tail, queries.tail_requests = tail, requests
        queries.tail_schedule = self._cpu_schedule(requests.shape[0], md.seq_lens[requests], qsl)

    def _cpu_schedule(self, num_requests: int, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """The CPU attention op's work split for suffix queries (``query_start_loc``) of these requests."""
        from vllm import _custom_ops as ops
        from vllm import envs

        attn = self.model.layers[0].self_attn
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_requests, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            seq_lens=seq_lens, dtype=self.dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=attn.attn.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None, kv_cache_dtype=attn.attn.kv_cache_dtype,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # a tied head stored anyway
            if ".mlp.experts." in name:  # vLLM's fused MoE layer loads its experts itself
                owner = name[: name.index(".mlp.experts.") + len(".mlp.experts")]
                module = self._module(owner, name)
                loaded.update(f"{owner}.{p}" for p in module.load_weights([(name[len(owner) + 1 :], tensor)]))
                continue
            for fused, part, shard in STACKED:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    param = self._param(params, target, name)
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                target = name
                param = self._param(params, target, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings else set()))
        if missing:
            raise OrthrosServeError(
                f"the checkpoint lacks {missing[:6]}{' ...' if len(missing) > 6 else ''}: not a complete "
                "`orthros-convert to-hf` export of this config.json (re-export it)"
            )
        return loaded

    def _module(self, path: str, name: str) -> nn.Module:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise OrthrosServeError(
                f"checkpoint tensor {name!r} has no place in the Orthros model of this config.json: not an "
                "`orthros-convert to-hf` export, or config.json and weights disagree (re-export it)"
            ) from None

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
        if target not in params:
            raise OrthrosServeError(
                f"checkpoint tensor {name!r} has no place in the Orthros model of this config.json: not an "
                "`orthros-convert to-hf` export, or config.json and weights disagree (re-export it)"
            )
        return params[target]
