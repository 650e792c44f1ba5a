"""model.fused_tokenwise: every fused op against its plain-torch reference (the Triton kernels run
under TRITON_INTERPRET=1, which conftest sets), and the fused model against the eager one: the same
loss to 1e-5 in fp32 and the same gradients, on the tiny model and on the 1.3B shape's first layer."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from fixtures import tiny_config, tiny_model

from orthros_train.errors import UserError
from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.model.fused import fusion_active, join_streams
from orthros_train.ops import fused_tokenwise as fused
from orthros_train.ops import fused_tokenwise_reference as ref
from orthros_train.options import FusedTokenwise
from orthros_train.phase.builders import pretrain_layout, rl_layout, sft_layout

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_the_kernels_run_here() -> None:
    """The comparisons below test the Triton kernels, not the references against themselves."""
    assert fused.kernels_apply(torch.zeros(1)), "run the tests with TRITON_INTERPRET=1 (conftest sets it)"
    assert fused.kernel_problem(torch.device("cpu"), torch.float32) is None


def leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def grads_of(out, inputs) -> list[torch.Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))  # not a plain sum
    return list(torch.autograd.grad((out * weight).sum(), inputs))


def assert_all_close(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,cols", [(7, 48), (33, 40), (1, 2048), (0, 16)])
def test_add_rms_norm_equals_reference(rows: int, cols: int) -> None:
    x, r, w = leaf(rows, cols, seed=1), leaf(rows, cols, seed=2), leaf(cols, seed=3)
    y, s = fused.add_rms_norm(x, r, w, 1e-6)
    y_ref, s_ref = ref.add_rms_norm_reference(x, r, w, 1e-6)
    assert_all_close([y, s], [y_ref, s_ref])
    both = torch.cat([y, 2 * s])  # the sum feeds the next sub-layer too: both gradients meet
    both_ref = torch.cat([y_ref, 2 * s_ref])
    assert_all_close(grads_of(both, (x, r, w)), grads_of(both_ref, (x, r, w)))


def test_rms_norm_equals_reference_on_a_strided_view() -> None:
    wide, w = leaf(9, 3 * 24), leaf(24, seed=4)
    x = wide[:, 24:48]  # a column slice of a merged projection: rows with a stride of their own
    assert_all_close([fused.rms_norm(x, w, 1e-6)], [ref.rms_norm_reference(x, w, 1e-6)])
    assert_all_close(grads_of(fused.rms_norm(x, w, 1e-6), (wide, w)),
                     grads_of(ref.rms_norm_reference(x, w, 1e-6), (wide, w)))


@pytest.mark.parametrize("head_dim,heads_q,heads_k", [(16, 4, 2), (12, 3, 3), (64, 32, 32)])
def test_rope_qk_equals_reference(head_dim: int, heads_q: int, heads_k: int) -> None:
    merged = leaf(6, (heads_q + heads_k) * head_dim)  # q and k read in place from one GEMM output
    q = merged[:, : heads_q * head_dim].view(6, heads_q, head_dim)
    k = merged[:, heads_q * head_dim :].view(6, heads_k, head_dim)
    extra_q = leaf(4, heads_q, head_dim, seed=5)  # the output stream's queries: more rows than keys
    queries = torch.cat([q, extra_q])
    g = torch.Generator().manual_seed(6)
    angles = [torch.randn(n, 1, head_dim, generator=g) for n in (10, 10, 6, 6)]
    out = fused.rope_qk(queries, k, angles[:2], angles[2:])
    want = ref.rope_qk_reference(queries, k, angles[:2], angles[2:])
    assert_all_close(out, want)
    flat, flat_ref = torch.cat([t.flatten() for t in out]), torch.cat([t.flatten() for t in want])
    assert_all_close(grads_of(flat, (merged, extra_q)), grads_of(flat_ref, (merged, extra_q)))


@pytest.mark.parametrize("rows,inter", [(5, 40), (3, 1500), (0, 8)])
def test_silu_mul_equals_reference(rows: int, inter: int) -> None:
    gate_up = leaf(rows, 2 * inter)
    out, want = fused.silu_mul(gate_up), ref.silu_mul_reference(gate_up)
    assert_all_close([out], [want])
    assert_all_close(grads_of(out, (gate_up,)), grads_of(want, (gate_up,)))


def test_kernels_in_bf16_round_as_eager_does() -> None:
    x, r, w = (t.detach().bfloat16() for t in (leaf(8, 64), leaf(8, 64, seed=1), leaf(64, seed=2)))
    y, s = fused.add_rms_norm(x, r, w, 1e-6)
    y_ref, s_ref = ref.add_rms_norm_reference(x, r, w, 1e-6)
    # bf16 outputs within bf16's rounding (triton's interpreter may round its casts otherwise than a GPU)
    assert y.dtype == s.dtype == torch.bfloat16
    torch.testing.assert_close(s, s_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    gate_up = leaf(4, 96).detach().bfloat16()
    torch.testing.assert_close(fused.silu_mul(gate_up), ref.silu_mul_reference(gate_up), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 64])
def test_linear_cross_entropy_equals_the_full_logits(chunk_rows: int | None) -> None:
    h, w = leaf(11, 32), leaf(50, 32, seed=1)
    labels = torch.randint(0, 50, (11,), generator=torch.Generator().manual_seed(2))
    labels[[3, 7]] = ref.IGNORE_INDEX
    weights = torch.rand(11, generator=torch.Generator().manual_seed(3)) * 2 - 1  # RL advantages
    loss = fused.linear_cross_entropy(h, w, labels, weights, 7.0, chunk_rows=chunk_rows)
    want = ref.linear_cross_entropy_reference(h, w, labels, weights, 7.0)
    assert_all_close([loss], [want])
    got_grads = torch.autograd.grad(3 * loss, (h, w))
    assert_all_close(got_grads, torch.autograd.grad(3 * want, (h, w)))


def test_cross_entropy_chunks_hold_about_the_hidden_states() -> None:
    rows = fused.cross_entropy_chunk_rows(4096, 2048, 32000)  # the 1.3B model at 4K tokens
    assert rows == 256 and rows * 32000 <= 2 * 4096 * 2048
    assert fused.cross_entropy_chunk_rows(3, 32, 64) == 2


def test_join_streams_reuses_the_previous_layers_buffer() -> None:
    h = torch.randn(10, 4)
    x, y = h[:6], h[6:]
    assert join_streams(x, y) is h
    other = torch.randn(4, 4)
    joined = join_streams(x, other)
    assert joined is not h and torch.equal(joined, torch.cat([x, other]))
    assert torch.equal(join_streams(h[:3], h[5:]), torch.cat([h[:3], h[5:]]))  # not the halves


def fused_copy(model: OrthrosForCausalLM) -> OrthrosForCausalLM:
    """The same weights with every module's ``fused_tokenwise`` set to ``on``."""
    other = copy.deepcopy(model)
    for module in other.modules():
        if hasattr(module, "fusion"):
            module.fusion = FusedTokenwise.on
    return other


def assert_fused_equals_eager(eager: OrthrosForCausalLM, layouts, rtol: float = 1e-5) -> None:
    fast = fused_copy(eager)
    assert list(fast.state_dict()) == list(eager.state_dict())  # checkpoints do not change
    for layout in layouts:
        losses = []
        for model in (eager, fast):
            model.zero_grad()
            loss = model.forward_layout(layout, return_logits=False).loss  # the training call
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=1e-5)
        for (name, a), (_, b) in zip(eager.named_parameters(), fast.named_parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                scale = max(float(a.grad.abs().max()), 1e-3)
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
        with torch.no_grad():  # inference asks for the logits: same path, same values
            torch.testing.assert_close(fast.forward_layout(layout).logits, eager.forward_layout(layout).logits,
                                       rtol=1e-5, atol=1e-5)


def layouts(vocab: int = 64, length: int = 24):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, length), generator=g)
    weights = torch.rand((2, length), generator=g) * 2 - 1
    return [
        pretrain_layout(ids, labels=torch.roll(ids, -1, 1)),
        sft_layout(ids, [[(3, 9)], [(12, length)]]),
        rl_layout(ids, [[(4, 12)], [(15, length)]], weights),
    ]


@pytest.mark.parametrize("overrides,kinds", [
    ({}, (0, 1, 2)),  # pretrain, SFT, RL
    ({"qk_norm": True, "attention_bias": True}, (2,)),
    ({"tie_word_embeddings": True, "sink_tokens": 2}, (1,)),
    ({"attention_type": "dense"}, (1,)),
    ({"attention_type": "sliding"}, (0,)),
])
def test_fused_tiny_model_equals_eager(overrides: dict, kinds: tuple[int, ...]) -> None:
    eager = tiny_model(sliding_window=8, output_affine="resampled", **overrides)
    assert_fused_equals_eager(eager, [layouts()[i] for i in kinds])


def test_fused_moe_model_keeps_its_experts_eager_and_equals_eager() -> None:
    eager = tiny_model(sliding_window=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)
    assert_fused_equals_eager(eager, layouts()[:1])


def test_fused_first_layer_of_the_1p3b_shape_equals_eager() -> None:
    shape = yaml.safe_load((RECIPES / "model" / "orthros_1p3b.yaml").read_text())
    shape = {k: v for k, v in shape.items() if k != "init_from"}
    cfg = OrthrosConfig(**{**shape, "num_hidden_layers": 1, "vocab_size": 4096})  # one layer, smaller table
    torch.manual_seed(0)
    eager = OrthrosForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    assert_fused_equals_eager(eager, [pretrain_layout(ids, labels=torch.roll(ids, -1, 1))])


def test_fused_generation_equals_eager() -> None:
    eager = tiny_model(sliding_window=8, output_affine="resampled")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(fused_copy(eager).generate_greedy(ids, 5), eager.generate_greedy(ids, 5))


def test_config_key_parses_and_auto_stays_eager_on_cpu() -> None:
    assert tiny_config().fused_tokenwise == "off"  # until a GPU run of gpu_check's item timed it
    assert tiny_config(fused_tokenwise="auto").fused_tokenwise == "auto"
    assert tiny_config(fused_tokenwise=True).fused_tokenwise == "on"  # YAML 1.1's bare on
    assert tiny_config(fused_tokenwise=False).fused_tokenwise == "off"
    with pytest.raises(UserError, match="fused_tokenwise must be one of auto|on|off"):
        tiny_config(fused_tokenwise="yes please")
    model = tiny_model(fused_tokenwise="auto")
    assert {m.fusion for m in model.modules() if hasattr(m, "fusion")} == {FusedTokenwise.auto}
    assert not fusion_active(FusedTokenwise.auto, torch.zeros(1))  # a CPU run is eager by default
    assert fusion_active(FusedTokenwise.on, torch.zeros(1)) and not fusion_active(FusedTokenwise.off, torch.zeros(1))


def test_tensor_parallel_refuses_on_and_turns_auto_off() -> None:
    from orthros_train.parallel.model import TensorParallelFactory

    tp2, tp1 = SimpleNamespace(tp=2), SimpleNamespace(tp=1)
    on, auto = tiny_config(fused_tokenwise="on"), tiny_config(fused_tokenwise="auto")
    with pytest.raises(UserError, match="fused_tokenwise=on with parallel.tensor_parallel=2"):
        TensorParallelFactory.fused_tokenwise(tp2, on)
    assert TensorParallelFactory.fused_tokenwise(tp2, auto) == "off"
    assert TensorParallelFactory.fused_tokenwise(tp1, on) == "on"


def test_fused_parallel_build_at_tp1_equals_eager() -> None:
    """Training builds the model through the tensor-parallel factory (megatron's linears, its
    vocab-parallel head) also on one GPU: the fused path there equals the eager reference."""
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import DistributedEnv, ParallelConfig, destroy_parallel, init_parallel

    cfg = tiny_config(64, sliding_window=4, qk_norm=True, fused_tokenwise="on")
    init_parallel(ParallelConfig(backend="gloo"), cfg, DistributedEnv())
    try:
        model = build_parallel_model(cfg, ParallelConfig(), seed=7)
        assert {m.fusion for m in model.modules() if hasattr(m, "fusion")} == {FusedTokenwise.on}
        eager = OrthrosForCausalLM(OrthrosConfig(**{**cfg.to_dict(), "fused_tokenwise": "off"}))
        eager.reset_parameters(torch.Generator().manual_seed(7))  # the parallel build's seeded weights
        layout = layouts()[1]
        losses = []
        for m in (eager, model):
            loss = m.forward_layout(layout, return_logits=False).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for (name, a), (_, b) in zip(eager.named_parameters(), model.named_parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        destroy_parallel()
