"""The per-GPU memory model of orthros_train/train/memory.py: consistency, a hand computation,
and (with CUDA) a real training step against torch.cuda.max_memory_allocated."""

from __future__ import annotations

import pytest
import torch
from fixtures import compose_recipe

from orthros_train.errors import UserError
from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.parallel.setup import ParallelConfig
from orthros_train.train.memory import estimate_memory, params_per_rank

LLAMA_8B = OrthrosConfig(
    vocab_size=128256,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
)


def _est(model=LLAMA_8B, seq_len=131072, mb=1, precision="bf16", backend="flash", **parallel):
    layout = dict(tensor_parallel=8, sequence_parallel=True, context_parallel=8, data_parallel=1, zero_stage=1)
    layout.update(parallel)
    return estimate_memory(model, ParallelConfig(**layout), seq_len, mb, precision, backend)


def test_context_parallel_halves_activations_and_logits():
    one, two = _est(context_parallel=4, recompute="selective"), _est(context_parallel=8, recompute="selective")
    assert two.activations * 2 == pytest.approx(one.activations, rel=1e-6)
    assert two.logits * 2 == one.logits
    assert two.weights == one.weights


def test_zero_stages_partition_optimizer_then_grads_then_weights():
    dp = 4
    z0, z1, z2, z3 = (_est(context_parallel=2, data_parallel=dp, zero_stage=s) for s in range(4))
    group = dp * 2  # ZeRO partitions over data-parallel x context-parallel ranks
    p = z0.params_per_rank
    assert z0.optimizer == 12 * p  # fp32 master + two fp32 Adam moments
    assert z1.optimizer == 12 * (p // group)
    assert z1.grads == z0.grads + 4 * (p // group)  # + the fp32 gradient of the partition
    assert z2.grads < z1.grads and z3.weights == z2.weights // group
    assert _est(zero_stage=1, offload_optimizer=True).optimizer == 0


def test_recompute_reduces_activations():
    none, sel, full = (_est(recompute=r, backend="reference", seq_len=16384) for r in ("none", "selective", "full"))
    assert none.activations > sel.activations > full.activations
    assert none.kv > sel.kv == full.kv > 0  # the gathered K/V is kept per layer only without recompute
    # With the flash kernel there are no attention intermediates for selective recompute to drop.
    assert _est(recompute="none").activations == _est(recompute="selective").activations


def test_activations_grow_linearly_with_sequence_under_flash_attention():
    short, long = _est(seq_len=32768, recompute="selective"), _est(seq_len=131072, recompute="selective")
    assert long.activations == pytest.approx(4 * short.activations, rel=1e-3)
    # The reference op keeps the output stream's scores: quadratic in the sequence.
    ref_s = _est(seq_len=8192, backend="reference", context_parallel=1)
    ref_l = _est(seq_len=16384, backend="reference", context_parallel=1)
    assert ref_l.activations > 3 * ref_s.activations


def test_tiny_config_matches_a_hand_computation():
    cfg = OrthrosConfig(
        vocab_size=100,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=16,
    )
    pcfg = ParallelConfig(zero_stage=0)
    est = estimate_memory(cfg, pcfg, seq_len=10, micro_batch_size=1, precision="fp32")
    # parameters: q 8*8, k 8*4, v 8*4, o 8*8, gamma+beta 2*8, mlp 3*8*16, norms 2*8 + final 8,
    # embeddings + untied head 2*100*8
    p = 64 + 32 + 32 + 64 + 16 + 384 + 16 + 8 + 1600
    assert params_per_rank(cfg, 1) == p == sum(t.numel() for t in OrthrosForCausalLM(cfg).parameters())
    assert (est.weights, est.grads, est.optimizer) == (4 * p, 4 * p, 8 * p)
    n_b = n_o = 10
    n = n_b + n_o
    per_layer = (
        4
        * (
            2 * 2 * n * 8  # norms
            + n * 8
            + 2 * n_b * 4  # q, k, v
            + n_o * 8  # q_out before gamma/beta
            + n * 8
            + n_b * 4  # roped q, k
            + 2 * (n + n_b) * 4  # cos/sin
            + n * 8  # attention output
            + 4 * n * 16  # MLP
        )
        + n * 2 * 4
    )  # fp32 lse
    assert est.activations_per_layer == per_layer
    assert est.activations == per_layer + 2 * n_b * 8 * 4
    assert est.kv == 0
    assert est.logits == n_o * 100 * 16
    assert est.total == 16 * p + est.activations + est.logits


def test_bad_input_names_the_field():
    with pytest.raises(UserError, match="precision"):
        _est(precision="fp8")
    with pytest.raises(UserError, match="attention_backend"):
        _est(backend="xformers")
    with pytest.raises(UserError, match="context_parallel=8"):
        _est(seq_len=100)


@pytest.mark.parametrize("seq_len, layers, qk_norm", [(512, 2, False), (1024, 4, False), (1024, 2, True)])
def test_activation_estimate_matches_what_autograd_saves(seq_len, layers, qk_norm):
    """CPU check of the activation term: the bytes autograd keeps for the backward (every saved
    tensor's storage counted once, parameters excluded), fp32, reference attention op."""
    cfg = OrthrosConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        sliding_window=128,
        attention_backend="reference",
        qk_norm=qk_norm,
    )
    torch.manual_seed(0)
    model = OrthrosForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids[:, :-1], labels=ids[:, 1:])
    est = estimate_memory(cfg, ParallelConfig(zero_stage=0), seq_len, 1, "fp32", "reference")
    forward_logits = seq_len * cfg.vocab_size * (4 + 4)  # logits + log-softmax; the rest is backward-only
    expected = est.activations + forward_logits
    assert abs(sum(storages.values()) - expected) <= 0.2 * expected


# Measured: see docs/memory.md ("Checked against a GPU").
GPU_TOLERANCE = 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seq_len", [2048, 8192])
def test_estimate_matches_max_memory_allocated_on_gpu(seq_len):
    """One real fp32 step (forward, backward, AdamW) of a small model with the Triton kernels."""
    cfg = OrthrosConfig(
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1536,
        attention_backend="triton",
    )
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = OrthrosForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), device=device)

    def step() -> None:
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()

    step()  # creates the Adam moments; the second step is the steady state that is measured
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    est = estimate_memory(cfg, ParallelConfig(zero_stage=0), seq_len, 1, precision="fp32").total
    print(f"seq {seq_len}: estimate {est / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert abs(est - measured) <= GPU_TOLERANCE * measured


def test_longctx_128k_dry_run_memory_fits_and_would_not_without_context_parallel():
    from orthros_train.train.plan import plan_summary

    summary = plan_summary(compose_recipe("longctx_128k"))
    assert summary["parallel"]["context_parallel"] == 8 and summary["parallel"]["world_size"] == 64
    memory = summary["memory_per_gpu"]
    assert [s["seq_len"] for s in memory["stages"]] == [32768, 65536, 131072]
    assert [s["micro_batch_size"] for s in memory["stages"]] == [4, 2, 1]
    assert memory["peak_gib"] < 64  # H100 80 GB with >= 15 GiB headroom (docs/memory.md)
    no_cp = plan_summary(compose_recipe("longctx_128k", "parallel.context_parallel=1", "parallel.data_parallel=8"))
    assert no_cp["memory_per_gpu"]["peak_gib"] > 80


GPU_RECIPES = [
    "pretrain_1p3b",
    "scaling/orthros_160m",
    "scaling/orthros_410m",
    "scaling/orthros_1p3b",
    "scaling/orthros_2p7b",
    "scaling/orthros_6p8b",
    "convert_llama31_8b",
    "convert_qwen3_8b",
    "convert_qwen3_30b_a3b",
    "longctx_128k",
]


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_gpu_recipe_states_its_gpu_and_fits_it_with_headroom(name):
    from orthros_train.train.memory import HEADROOM_FRACTION
    from orthros_train.train.plan import plan_summary

    cfg = compose_recipe(name)
    assert cfg.trainer.gpu and cfg.trainer.gpu_memory_gib, f"{name} states no GPU"
    memory = plan_summary(cfg)["memory_per_gpu"]
    device = memory["device"]
    assert memory["peak_gib"] <= HEADROOM_FRACTION * cfg.trainer.gpu_memory_gib, (name, memory["peak_gib"])
    assert device["fits_with_headroom"] and device["fraction_used"] <= HEADROOM_FRACTION


def test_dry_run_warns_in_red_when_the_estimate_exceeds_the_stated_gpu(capsys):
    from orthros_train.train.cli import warn_memory_fit
    from orthros_train.train.plan import plan_summary

    warn_memory_fit(plan_summary(compose_recipe("pretrain_1p3b"))["memory_per_gpu"])
    assert capsys.readouterr().err == ""
    too_big = plan_summary(compose_recipe("pretrain_1p3b", "trainer.micro_batch_size=8", "trainer.grad_accum_steps=4"))
    warn_memory_fit(too_big["memory_per_gpu"])
    err = capsys.readouterr().err
    assert err.startswith("\033[31mWARNING") and "exceeds the 79.6 GiB of H100 SXM 80GB" in err
    assert "trainer.micro_batch_size" in err


def test_a_gpu_run_refuses_a_layout_that_overflows_the_device_unless_told(monkeypatch, caplog):
    from types import SimpleNamespace

    from orthros_train.train.build import check_memory_fit

    cfg = compose_recipe("pretrain_1p3b", "trainer.micro_batch_size=8", "trainer.grad_accum_steps=4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Fake GPU")
    cuda = torch.device("cuda", 0)
    with pytest.raises(UserError, match=r"140\.3 GiB per GPU exceeds the 80\.0 GiB of Fake GPU.*overflow=true"):
        check_memory_fit(cfg, cuda)
    cfg.trainer.allow_memory_overflow = True
    check_memory_fit(cfg, cuda)  # starts, with a warning
    assert "starting anyway" in caplog.text
    check_memory_fit(compose_recipe("pretrain_1p3b"), cuda)


def _moe(**overrides) -> OrthrosConfig:
    shape = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384, sliding_window=128, attention_backend="reference", num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=96, mlp_only_layers=[1])
    return OrthrosConfig(**{**shape, **overrides})


def test_expert_parallel_splits_the_experts_and_their_optimizer_states():
    cfg = _moe()
    model = OrthrosForCausalLM(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    assert params_per_rank(cfg, 1, 1) == total
    assert params_per_rank(cfg, 1, 4) == total - experts + experts // 4
    one = estimate_memory(cfg, ParallelConfig(data_parallel=4, zero_stage=1), 512, 1, "bf16", "reference")
    four = estimate_memory(cfg, ParallelConfig(data_parallel=4, expert_parallel=4, zero_stage=1), 512, 1,
                           "bf16", "reference")
    assert four.weights == one.weights - experts * 2 * 3 // 4
    # ZeRO-1 partitions experts over the ranks holding them (world / EP): 4 ranks x all experts at
    # EP=1, 1 rank x a quarter at EP=4 -- the same optimizer bytes; the weights and grads shrink.
    assert four.optimizer == pytest.approx(one.optimizer, rel=1e-6)
    assert four.grads < one.grads
    assert four.activations == one.activations


@pytest.mark.parametrize("shared", [0, 64])
def test_moe_activation_estimate_matches_what_autograd_saves(shared):
    cfg = _moe(shared_expert_intermediate_size=shared)
    torch.manual_seed(0)
    model = OrthrosForCausalLM(cfg)
    seq_len = 512
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids[:, :-1], labels=ids[:, 1:])
    est = estimate_memory(cfg, ParallelConfig(zero_stage=0), seq_len, 1, "fp32", "reference")
    forward_logits = seq_len * cfg.vocab_size * (4 + 4)
    expected = est.activations + forward_logits
    assert abs(sum(storages.values()) - expected) <= 0.2 * expected
