"""How the served model reads vLLM's paged KV cache by hand, and the check at load that this is how
the attention backend writes it (torch only; vLLM's writer is passed in).

vLLM 0.32 gives every attention layer a cache tensor of logical shape
``(blocks, kv_heads, block_size, 2 * head_dim)``, but what sits inside is each backend's own
business:

* ``PAGED``: FlashAttention, Triton and FlexAttention with an unquantised cache write K and V
  side by side along the last dimension: ``kv_cache.transpose(1, 2).split(head_dim,
  -1)`` are the ``[blocks, block_size, kv_heads, head_dim]`` views the Triton kernels read
  (``paged_attention.py``; strides, so any physical stride order vLLM picks is read correctly).
* ``CPU``: the CPU backend puts a block-and-head's keys first and its values after them, the
  values slot-major ``[block_size, head_dim]`` and the keys, for its ``vec``/``vec16`` kernels,
  dim-major ``[head_dim, block_size]``. Its own paged-attention op reads it for the output
  stream; only the base stream with sink tokens reads it by hand (``gather_cpu``).

FlashInfer writes its cache the same way but its step metadata lacks what the model reads
(``query_start_loc``, ``seq_lens``, ``block_table``): it is refused with the others. Anything else
(a quantised cache, another backend, the CPU backend's AMX packing) is refused at
load with the fix, after ``check_layout`` has written known keys and values with the backend's own
writer and read them back: a layout that changed under us fails there, not in wrong tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PAGED = "paged"
CPU = "cpu"
PAGED_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
PLAIN_CACHE_DTYPES = ("bfloat16", "float16", "half", "float32", "float")  # unquantised, named explicitly


class KVLayoutError(ValueError):
    """The backend's KV cache is not laid out as this model reads it (the message says what to change)."""


def layout_for(backend: str, kv_cache_dtype: str, device_type: str) -> str:
    """The layout of ``backend``'s cache (``PAGED`` or ``CPU``), or ``KVLayoutError`` with the fix."""
    if device_type == "cpu":
        if backend != "CPU_ATTN":
            raise KVLayoutError(f"the Orthros model on CPU reads the KV cache of vLLM's CPU_ATTN backend, not "
                                f"{backend}: drop the attention backend setting")
        return CPU
    if kv_cache_dtype in PLAIN_CACHE_DTYPES:
        raise KVLayoutError(
            f"the Orthros model's own attention kernels read a KV cache in the model's dtype, as "
            f"--kv-cache-dtype auto keeps it; kv_cache_dtype={kv_cache_dtype!r} is not taken: serve with "
            "--kv-cache-dtype auto (and --dtype for the model's and the cache's dtype)"
        )
    if kv_cache_dtype != "auto":
        raise KVLayoutError(
            f"the Orthros model's own attention kernels read an unquantised KV cache, not kv_cache_dtype="
            f"{kv_cache_dtype!r} (they have no scales): serve with --kv-cache-dtype auto"
        )
    if backend not in PAGED_BACKENDS:
        raise KVLayoutError(
            f"the Orthros model reads the paged KV cache as FlashAttention lays it out; attention backend {backend} "
            f"is not one it knows to do so: serve with --attention-backend FLASH_ATTN (or one of "
            f"{', '.join(PAGED_BACKENDS)})"
        )
    return PAGED


def split_paged(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``PAGED`` layout: ``(blocks, kv_heads, block_size, 2 * head_dim)`` -> K, V views
    ``[blocks, block_size, kv_heads, head_dim]``."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise KVLayoutError(f"expected a KV cache (blocks, kv_heads, block_size, 2 * {head_size}), got "
                            f"{tuple(kv_cache.shape)}")
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def cpu_op_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``CPU`` layout: the K and V halves of every block-and-head, as the CPU backend's ops take them."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    return key_cache, value_cache


def gather_cpu(kv_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``CPU`` layout: keys and values at ``(blocks, slots)`` (any equal shapes ``S``) -> ``[*S, kv_heads, D]``."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    halves = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * d)
    keys = halves[:, :, 0].view(num_blocks, num_kv_heads, d, block_size)  # dim-major
    values = halves[:, :, 1].view(num_blocks, num_kv_heads, block_size, d)  # slot-major
    # Advanced indices split by a slice put their dimensions first: [*S, kv_heads, D] for both.
    return keys[blocks, :, :, slots], values[blocks, :, slots, :]


def gather_paged(kv_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor,
                 head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``PAGED`` layout: keys and values at ``(blocks, slots)`` -> ``[*S, kv_heads, D]``."""
    key_cache, value_cache = split_paged(kv_cache, head_size)
    return key_cache[blocks, slots], value_cache[blocks, slots]


def check_layout(layout: str, write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
                 num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, what: str) -> None:
    """Write known keys and values with the backend's own ``write(key, value, kv_cache, slot_mapping)``
    into a scratch cache and read them back as ``layout`` says; ``KVLayoutError`` naming ``what``
    (the backend and setting) if they differ."""
    g = torch.Generator().manual_seed(0)
    blocks = 3
    kv_cache = torch.zeros(blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype, device=device)
    slots = torch.tensor([0, 1, block_size + 2, 2 * block_size + block_size - 1, block_size - 1], device=device)
    n = slots.shape[0]
    key = (torch.randn(n, num_kv_heads, head_size, generator=g) + 3.0).to(dtype).to(device)
    value = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype).to(device)
    try:
        write(key, value, kv_cache, slots)
    except Exception as e:  # the backend refuses this setting outright: say which, with its reason
        raise KVLayoutError(f"{what} could not write a test block of the KV cache: {e}") from e
    b, s = slots // block_size, slots % block_size
    if layout == CPU:
        got_k, got_v = gather_cpu(kv_cache, b, s)
    else:
        got_k, got_v = gather_paged(kv_cache, b, s, head_size)
    if not (torch.equal(got_k, key) and torch.equal(got_v, value)):
        raise KVLayoutError(
            f"{what} does not lay out its KV cache as the Orthros model reads it ({layout} layout: written keys "
            f"and values read back differ)"
        )
