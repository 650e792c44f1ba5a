"""The global tail under tensor, sequence and context parallelism (2 gloo ranks): logits, loss and
every gradient equal the single-device model on layouts whose answers have global base queries."""

from __future__ import annotations

import pytest
from fixtures import assert_variants_close, result_of, torchrun


@pytest.mark.slow
def test_tp2_sp_with_the_tail_and_sinks_equals_reference():
    assert_variants_close(result_of(torchrun("tp_equivalence", "sinks=2", "tail=3")), 3)


@pytest.mark.slow
def test_cp2_with_the_tail_and_sinks_equals_reference():
    assert_variants_close(result_of(torchrun("cp_equivalence", "1", "none", "sinks=2", "tail=3")), 8)
