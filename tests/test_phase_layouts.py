"""Phase layout builders: which positions get output tokens, and what they reject."""

from __future__ import annotations

import pytest
import torch

from orthros_train.phase import (
    IGNORE_INDEX,
    OrthrosLayout,
    decode_layout,
    prefill_layout,
    pretrain_layout,
    rl_layout,
    sft_layout,
)


def test_pretrain_outputs_everywhere_with_next_token_labels():
    ids = torch.tensor([[5, 6, 7, 8]])
    lay = pretrain_layout(ids)
    assert lay.output_index.tolist() == [0, 1, 2, 3]
    assert lay.labels.tolist() == [6, 7, 8, IGNORE_INDEX]
    assert lay.positions.tolist() == [0, 1, 2, 3]


def test_pretrain_rows_and_documents_pack():
    ids = torch.tensor([[1, 2, 0, 3], [4, 0, 5, 6]])
    lay = pretrain_layout(ids, labels=torch.tensor([[2, 0, 3, 9], [0, 5, 6, 7]]), eod_token_id=0)
    assert lay.cu_seqlens.tolist() == [0, 3, 4, 6, 8]
    assert lay.positions.tolist() == [0, 1, 2, 0, 0, 1, 0, 1]
    # EOD positions predict nothing; the last token of a row keeps its explicit label.
    assert lay.labels.tolist() == [2, 0, IGNORE_INDEX, 9, 0, IGNORE_INDEX, 6, 7]
    assert lay.row_of_output.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_sft_outputs_only_before_answer_tokens():
    ids = torch.arange(10, 20)[None]
    lay = sft_layout(ids, [[(3, 5), (8, 10)]])
    assert lay.output_index.tolist() == [2, 3, 7, 8]
    assert lay.labels.tolist() == [13, 14, 18, 19]
    assert lay.num_tokens == 10  # the whole sequence is still the base stream


def test_rl_weights_follow_target_tokens():
    ids = torch.arange(8)[None]
    weights = torch.linspace(0, 0.7, 8)[None]
    lay = rl_layout(ids, [[(5, 8)]], weights)
    assert lay.output_index.tolist() == [4, 5, 6]
    assert torch.allclose(lay.loss_weights, weights[0, 5:8])


def test_prefill_and_decode():
    lay = prefill_layout([torch.arange(6), torch.arange(3)])
    assert lay.output_index.tolist() == [5, 8]
    assert lay.labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX]
    dec = decode_layout(torch.tensor([7, 9]), [6, 3])
    assert dec.positions.tolist() == [6, 3]
    assert dec.output_index.tolist() == [0, 1]


@pytest.mark.parametrize(
    "spans, message",
    [
        ([[(3, 12)]], "outside"),
        ([[(0, 2)]], "token 0"),
        ([[(5, 5)]], "outside"),
    ],
)
def test_sft_rejects_bad_spans(spans, message):
    with pytest.raises(ValueError, match=message):
        sft_layout(torch.arange(10)[None], spans)


def test_sft_rejects_empty_layout():
    with pytest.raises(ValueError, match="empty"):
        sft_layout(torch.arange(10)[None], [[]])


def test_layout_rejects_unsorted_and_empty():
    base = dict(
        input_ids=torch.arange(4),
        positions=torch.arange(4),
        cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
        labels=torch.zeros(2, dtype=torch.long),
        loss_weights=torch.ones(2),
        row_of_output=torch.zeros(2, dtype=torch.long),
    )
    with pytest.raises(ValueError, match="sorted"):
        OrthrosLayout(output_index=torch.tensor([2, 1]), **base)
    with pytest.raises(ValueError, match="sorted"):
        OrthrosLayout(output_index=torch.tensor([1, 1]), **base)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        OrthrosLayout(output_index=torch.tensor([1, 4]), **base)
    with pytest.raises(ValueError, match="empty"):
        pretrain_layout(torch.zeros((1, 0), dtype=torch.long))
