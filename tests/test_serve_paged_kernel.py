"""The output stream's paged-cache Triton kernel (orthros_train/serve/paged_attention.py) against a
plain gather of the same vLLM-style block layout; runs under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from orthros_train.serve.paged_attention import paged_output_attention, paged_output_attention_reference


def _paged_case(seq_lens: list[int], h_q: int, h_kv: int, d: int, block_size: int, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Random K/V for each request scattered over shuffled physical blocks, plus spare blocks of noise."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(n / block_size) for n in seq_lens]
    width = max(max(blocks_per_req), 1) + 1  # one unused column: a stale entry must never be read
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.full((len(seq_lens), width), num_blocks - 1, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        block_table[r, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    k = torch.randn(num_blocks, block_size, h_kv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, h_kv, d, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), h_q, d, generator=g).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, block_table, seq, qsl)]


@pytest.mark.parametrize(
    "seq_lens,h_q,h_kv,d,block_size,splits",
    [
        ([1, 7, 16, 33], 4, 2, 16, 16, 4),  # GQA 2, lengths around block edges
        ([40, 3], 4, 1, 32, 8, 3),  # MQA, splits that do not divide the blocks
        ([129], 2, 2, 64, 16, 16),  # more splits than blocks of one split each
        ([5, 70, 17], 6, 3, 24, 16, 2),  # head_dim not a power of two
    ],
)
def test_paged_kernel_equals_a_plain_gather(seq_lens, h_q, h_kv, d, block_size, splits):
    q, k, v, bt, seq, qsl = _paged_case(seq_lens, h_q, h_kv, d, block_size)
    got = paged_output_attention(q, k, v, bt, seq, qsl, num_splits=splits)
    want = paged_output_attention_reference(q, k, v, bt, seq, qsl)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_paged_kernel_reads_only_the_request_blocks():
    """Poisoning every block a request does not own (and the slots past its length) changes nothing."""
    q, k, v, bt, seq, qsl = _paged_case([9, 20], 4, 2, 16, 8, seed=3)
    want = paged_output_attention(q, k, v, bt, seq, qsl, num_splits=2)
    owned = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool)
    for r, n in enumerate(seq.tolist()):
        for pos in range(n):
            owned[bt[r, pos // 8], pos % 8] = True
    k2, v2 = k.clone(), v.clone()
    k2[~owned] = float("nan")
    v2[~owned] = float("nan")
    got = paged_output_attention(q, k2, v2, bt, seq, qsl, num_splits=2)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_padded_requests_are_masked_to_zero():
    """Model Runner V2 pads the batch by repeating the last query_start_loc entry: those rows are zero
    and read no keys, even when their seq_lens / block_table entries are garbage."""
    q, k, v, bt, seq, _ = _paged_case([12, 30, 5, 8], 4, 2, 16, 8, seed=1)
    qsl = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)  # requests 2 and 3 are padding
    seq[2:] = 10**6  # would read far past the table if not masked
    bt[2:] = 10**6
    got = paged_output_attention(q, k, v, bt, seq, qsl, num_splits=3)
    assert torch.all(got[2:] == 0)
    want = paged_output_attention_reference(q[:2], k, v, bt[:2], seq[:2], qsl[:3])
    torch.testing.assert_close(got[:2], want, atol=2e-5, rtol=2e-5)


def test_chunk_rows_use_the_row_offsets_not_the_row_index():
    """A request with several tokens this step (chunked prefill) still has one output query."""
    q, k, v, bt, seq, _ = _paged_case([24, 10], 2, 1, 16, 8, seed=2)
    qsl = torch.tensor([0, 16, 17], dtype=torch.int32)
    got = paged_output_attention(q, k, v, bt, seq, qsl, num_splits=2)
    want = paged_output_attention_reference(q, k, v, bt, seq, qsl)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_bad_shapes_are_refused_with_the_shapes_named():
    q, k, v, bt, seq, qsl = _paged_case([4], 4, 2, 16, 8)
    with pytest.raises(ValueError, match="query heads 4 vs kv heads 3"):
        paged_output_attention(q, k[:, :, :1].expand(-1, -1, 3, -1).contiguous(),
                               v[:, :, :1].expand(-1, -1, 3, -1).contiguous(), bt, seq, qsl)
    with pytest.raises(ValueError, match="must cover R=1"):
        paged_output_attention(q, k, v, bt, seq, qsl[:1])


@pytest.mark.gpu
def test_paged_kernel_on_cuda_syncs_nothing_and_captures_in_a_cuda_graph():
    q, k, v, bt, seq, qsl = _paged_case([300, 1000, 17], 8, 2, 128, 16, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    paged_output_attention(q, k, v, bt, seq, qsl, out=out)  # compile outside the graph
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_output_attention(q, k, v, bt, seq, qsl, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_output_attention(q, k, v, bt, seq, qsl, out=out)
    seq.copy_(torch.tensor([200, 900, 16], dtype=torch.int32))  # new lengths, same graph
    graph.replay()
    torch.cuda.synchronize()
    want = paged_output_attention_reference(q, k, v, bt, seq, qsl)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def _causal_rows_reference(q, k, v, bt, seq, out_qsl):
    """Each request's last m_r output queries, query i of m_r seeing seq_len - m_r + 1 + i keys."""
    out = torch.zeros_like(q)
    for r in range(len(seq)):
        lo, hi = int(out_qsl[r]), int(out_qsl[r + 1])
        for i in range(lo, hi):
            keys = torch.tensor([int(seq[r]) - (hi - 1 - i)], dtype=torch.int32)
            out[i] = paged_output_attention_reference(q[i : i + 1], k, v, bt[r : r + 1], keys,
                                                      torch.tensor([0, 1], dtype=torch.int32))[0]
    return out


def test_several_output_rows_per_request_see_causal_prefixes():
    """Speculative verification and prompt logprobs put several output tokens on one request: with
    ``row_request`` each row reads its request's blocks up to its own position; padding rows are zero."""
    from orthros_train.serve.output_rows import OutputRows

    _, k, v, bt, seq, _ = _paged_case([20, 9, 33], 4, 2, 16, 8, seed=5)
    out_qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)  # 3, 1 and 5 output tokens
    padded = 11  # two padding rows, as a captured graph has
    q = torch.randn(padded, 4, 16, generator=torch.Generator().manual_seed(6))
    plan = OutputRows(rows=torch.arange(padded), query_start_loc=out_qsl, count=9, max_query_len=5, every_row=False)
    request, keys = plan.row_requests(seq)
    assert request.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2]
    assert keys.tolist() == [18, 19, 20, 9, 29, 30, 31, 32, 33, 0, 0]
    got = paged_output_attention(q, k, v, bt, keys, None, num_splits=3, row_request=request)
    want = _causal_rows_reference(q[:9], k, v, bt, seq, out_qsl)
    torch.testing.assert_close(got[:9], want, atol=2e-5, rtol=2e-5)
    assert torch.all(got[9:] == 0)
    ref = paged_output_attention_reference(q, k, v, bt, keys, None, row_request=request)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
