"""Mixture-of-experts Orthros (docs/moe.md): the routing policies, the losses, transformers'
Qwen3-MoE / Qwen2-MoE as the oracle, conversion both ways and generation."""

from __future__ import annotations

import json

import pytest
import torch

from orthros_train.convert.checkpoint_io import ConversionError
from orthros_train.convert.cli import main as convert_main
from orthros_train.convert.from_hf import convert_from_hf, orthros_config_from_hf
from orthros_train.convert.prompt_logits import prompt_logits
from orthros_train.convert.to_hf import convert_to_hf
from orthros_train.errors import UserError
from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.model.moe import SparseMoE, StreamPairs, expert_reads, load_balancing_loss, route
from orthros_train.options import MoERouting
from orthros_train.phase import pretrain_layout

transformers = pytest.importorskip("transformers")

VOCAB = 128
W = 8
POLICIES = [p.value for p in MoERouting]
MOE_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 80,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "sliding_window": W,
}


def moe_config(**overrides) -> OrthrosConfig:
    return OrthrosConfig(**{**MOE_SHAPE, **overrides})


def twin(model: OrthrosForCausalLM, **overrides) -> OrthrosForCausalLM:
    other = OrthrosForCausalLM(OrthrosConfig(**{**model.config.to_dict(), **overrides}))
    other.load_state_dict(model.state_dict())
    return other.eval()


# -- the routing function -------------------------------------------------------------------------


def _pairs_case():
    torch.manual_seed(3)
    n_base, n_out, experts = 6, 3, 8
    logits = torch.randn(n_base + n_out, experts)
    pairs = StreamPairs(num_base=n_base, out_base_row=torch.tensor([1, 3, 5]))
    return logits, pairs


def test_independent_routing_is_each_rows_own_top_k():
    logits, pairs = _pairs_case()
    r = route(logits, pairs, MoERouting.independent, 2, norm_topk_prob=False)
    probs = torch.softmax(logits, -1)
    assert torch.equal(r.experts, torch.topk(probs, 2, -1).indices)
    assert torch.allclose(r.weights, torch.topk(probs, 2, -1).values)


def test_tied_routing_gives_output_rows_their_base_rows_experts_with_their_own_weights():
    logits, pairs = _pairs_case()
    r = route(logits, pairs, MoERouting.tied, 2, norm_topk_prob=True)
    own = route(logits, pairs, MoERouting.independent, 2, norm_topk_prob=True)
    assert torch.equal(r.experts[:6], own.experts[:6])  # base rows: their own choice
    assert torch.equal(r.experts[6:], own.experts[pairs.out_base_row])
    probs = torch.softmax(logits, -1)
    expected = probs[6:].gather(-1, r.experts[6:])
    assert torch.allclose(r.weights[6:], expected / expected.sum(-1, keepdim=True))
    # Not vacuous: in this case an output row's own top-k differs from its base row's.
    assert not torch.equal(own.experts[6:], own.experts[pairs.out_base_row])


def test_joint_routing_picks_the_pairs_top_k_of_the_mean_probability():
    logits, pairs = _pairs_case()
    r = route(logits, pairs, MoERouting.joint, 2, norm_topk_prob=False)
    probs = torch.softmax(logits, -1)
    mean = 0.5 * (probs[pairs.out_base_row] + probs[6:])
    chosen = torch.topk(mean, 2, -1).indices
    assert torch.equal(r.experts[6:], chosen)
    assert torch.equal(r.experts[pairs.out_base_row], chosen)
    unpaired = torch.tensor([0, 2, 4])  # base rows without an output token route alone
    assert torch.equal(r.experts[unpaired], torch.topk(probs[unpaired], 2, -1).indices)
    assert torch.allclose(r.weights, probs.gather(-1, r.experts))


@pytest.mark.parametrize("policy", POLICIES)
def test_output_rows_without_base_rows_route_alone(policy):
    logits, _ = _pairs_case()
    alone = StreamPairs(num_base=0, out_base_row=torch.arange(logits.shape[0]))
    r = route(logits, alone, MoERouting(policy), 2, norm_topk_prob=False)
    assert torch.equal(r.experts, torch.topk(torch.softmax(logits, -1), 2, -1).indices)


def test_load_balancing_loss_is_transformers_for_one_layer():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    logits = torch.randn(40, 8)
    r = route(logits, StreamPairs.alone(40), MoERouting.independent, 2, norm_topk_prob=True)
    ours = load_balancing_loss(r, 8)
    theirs = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert torch.allclose(ours, theirs, atol=1e-6)
    uniform = route(torch.zeros(16, 8), StreamPairs.alone(16), MoERouting.independent, 2, True)
    assert torch.allclose(load_balancing_loss(uniform, 8), torch.tensor(2.0))  # k at perfect balance


# -- the model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_moe_orthros_equals_moe_dense_when_window_covers_sequence(policy):
    """gamma = 1, beta = 0, W >= T: the output token equals its base token at every layer, so every
    policy routes a pair identically and the model is the dense-attention MoE transformer."""
    t = 24
    model = OrthrosForCausalLM(moe_config(sliding_window=t, moe_routing=policy)).eval()
    dense = twin(model, attention_type="dense")
    ids = torch.randint(0, VOCAB, (2, t))
    with torch.no_grad():
        assert (model(ids).logits - dense(ids).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("policy", ["independent", "tied"])
def test_moe_forward_prefill_and_decode_agree_beyond_window(policy):
    model = OrthrosForCausalLM(moe_config(moe_routing=policy, qk_norm=True)).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.3)  # the pair's tokens differ: the policies matter
    ids = torch.randint(0, VOCAB, (2, 3 * W))
    with torch.no_grad():
        full = model(ids).logits
        logits, cache = model.prefill(ids[:, : W + 3])
        assert (logits - full[:, W + 2]).abs().max() <= 1e-4
        for p in range(W + 3, 3 * W):
            logits, cache = model.decode_step(ids[:, p], cache)
            assert (logits - full[:, p]).abs().max() <= 1e-4


def test_joint_routing_makes_the_base_stream_depend_on_the_phase():
    """Why ``joint`` is not the default: a base token's experts depend on whether its position
    carries an output token, so the K/V a prefill writes (one output token) is not the K/V of the
    training layout (an output token everywhere). ``tied`` keeps the base stream output-free."""
    model = OrthrosForCausalLM(moe_config(moe_routing="joint")).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.5)
    ids = torch.randint(0, VOCAB, (1, 3 * W))
    chosen = {}
    for name, positions in (("prefill", torch.tensor([3 * W - 1])), ("pretrain", None)):
        logs = _record_routing(model)
        with torch.no_grad():
            model(ids, output_positions=positions)
        chosen[name] = logs[1][0].experts[: 3 * W]  # layer 1's base rows
    assert not torch.equal(chosen["prefill"], chosen["pretrain"])
    tied = twin(model, moe_routing="tied")
    for name, positions in (("prefill", torch.tensor([3 * W - 1])), ("pretrain", None)):
        logs = _record_routing(tied)
        with torch.no_grad():
            tied(ids, output_positions=positions)
        chosen[name] = logs[1][0].experts[: 3 * W]
    assert torch.equal(chosen["prefill"], chosen["pretrain"])


def test_routing_policies_really_differ_beyond_the_window():
    model = OrthrosForCausalLM(moe_config(moe_routing="independent")).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.3)
    ids = torch.randint(0, VOCAB, (2, 4 * W))
    logits = {}
    with torch.no_grad():
        for policy in POLICIES:
            logits[policy] = twin(model, moe_routing=policy)(ids).logits
    assert (logits["independent"] - logits["tied"]).abs().max() > 1e-3
    assert (logits["tied"] - logits["joint"]).abs().max() > 1e-3


def _record_routing(model: OrthrosForCausalLM) -> dict[int, list]:
    logs = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.routing_log = logs[i] = []
    return logs


@pytest.mark.parametrize("policy", ["tied", "joint"])
def test_generate_reads_at_most_top_k_experts_per_position_pair(policy):
    """The bar of the tied policies: with W < T, every decode step's base + output pair reads at
    most top-k distinct experts at every sparse layer (read off the routers' choices); the
    independent policy reads more on the same model (so the check can fail)."""
    config = moe_config(moe_routing=policy, num_experts=16, num_experts_per_tok=3)
    model = OrthrosForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.5)
    prompt = torch.randint(0, VOCAB, (2, 3 * W))

    def most_read(m: OrthrosForCausalLM) -> int:
        logs = _record_routing(m)
        m.generate_greedy(prompt, max_new_tokens=6)
        worst = 0
        for layer_idx, calls in logs.items():
            assert calls, f"layer {layer_idx} never routed"
            for routing in calls:
                worst = max(worst, expert_reads(routing)["max_per_position"])
        return worst

    assert most_read(model) <= 3
    assert most_read(twin(model, moe_routing="independent")) > 3


def test_last_layer_routes_only_the_output_stream():
    model = OrthrosForCausalLM(moe_config()).eval()
    logs = _record_routing(model)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 20)), output_positions=torch.tensor([5, 19]))
    last = logs[2][0]
    assert last.pairs.num_base == 0 and last.experts.shape[0] == 2
    assert logs[0][0].experts.shape[0] == 22  # 20 base + 2 output tokens


def test_training_loss_adds_the_router_losses_and_eval_loss_does_not():
    model = OrthrosForCausalLM(moe_config(router_aux_loss_coef=0.5, router_z_loss_coef=0.1))
    layout = pretrain_layout(torch.randint(0, VOCAB, (2, 20)))
    model.train()
    out = model.forward_layout(layout)
    model.eval()
    with torch.no_grad():
        ce = model.forward_layout(layout).loss
    assert out.router_loss is not None and out.router_loss > 0
    assert torch.allclose(out.loss.detach(), ce + out.router_loss, atol=1e-6)
    out.loss.backward()
    assert model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    dense = OrthrosForCausalLM(OrthrosConfig(**{**MOE_SHAPE, "num_experts": 0}))
    assert dense.forward_layout(layout).router_loss is None


def test_config_counts_expert_parameters_and_active_ones():
    cfg = moe_config(mlp_only_layers=[1], shared_expert_intermediate_size=16)
    model = OrthrosForCausalLM(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    assert cfg.sparse_layers == [0, 2]
    d = cfg.hidden_size
    assert cfg.mlp_parameters(0, active=True) == d * 8 + 2 * 3 * d * 24 + 3 * d * 16 + d
    assert cfg.mlp_parameters(1, active=True) == 3 * d * 80


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_experts": -1}, "num_experts"),
        ({"mlp_only_layers": [3]}, "mlp_only_layers"),
        ({"mlp_only_layers": [0, 1, 2]}, "no layer is sparse"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"moe_routing": "shared"}, "moe_routing"),
        ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef"),
        ({"shared_expert_intermediate_size": -4}, "shared_expert_intermediate_size"),
    ],
)
def test_bad_moe_config_names_the_field(overrides, message):
    with pytest.raises(UserError, match=message):
        moe_config(**overrides)


# -- conversion against transformers --------------------------------------------------------------


def _tiny_hf_moe(kind: str, **overrides):
    common = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        initializer_range=0.15, bos_token_id=1, eos_token_id=2,
    )
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**common, "head_dim": 16, "norm_topk_prob": True, **overrides})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(**{**common, "shared_expert_intermediate_size": 40, **overrides})
        model = transformers.Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias") or name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)  # routers that really route, biases that show when dropped
    return model.eval()


@pytest.fixture(scope="module")
def hf_moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    torch.manual_seed(0)
    dirs = {}
    for kind, overrides in (
        ("qwen3_moe", {}),
        ("qwen3_moe_sparse_step", {"decoder_sparse_step": 2, "norm_topk_prob": False}),
        ("qwen2_moe", {"mlp_only_layers": [1]}),
    ):
        model_type = kind if kind.startswith("qwen2") else "qwen3_moe"
        _tiny_hf_moe(model_type, **overrides).save_pretrained(root / kind)
        dirs[kind] = root / kind
    return dirs


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_sparse_step", "qwen2_moe"])
@pytest.mark.parametrize("policy", POLICIES)
def test_converted_moe_equals_transformers_when_window_covers_sequence(hf_moe_dirs, tmp_path, kind, policy):
    t = 20
    convert_from_hf(hf_moe_dirs[kind], tmp_path / "o", sliding_window=t)
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "o", moe_routing=policy).eval()
    assert model.config.num_experts == 8 and model.config.qk_norm == kind.startswith("qwen3")
    hf = _hf_model(hf_moe_dirs[kind])
    ids = torch.randint(0, VOCAB, (2, t))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids).logits
    scale = ref.abs().max()
    assert scale > 1.0
    assert (ref - got).abs().max() <= 1e-5 * scale


def test_converted_moe_keeps_hf_logits_inside_a_short_window_and_differs_beyond(hf_moe_dirs, tmp_path):
    convert_from_hf(hf_moe_dirs["qwen3_moe"], tmp_path / "o", sliding_window=W)
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "o").eval()
    hf = _hf_model(hf_moe_dirs["qwen3_moe"])
    ids = torch.randint(0, VOCAB, (2, 4 * W))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids).logits
    scale = ref.abs().max()
    assert (ref[:, :W] - got[:, :W]).abs().max() <= 1e-5 * scale
    assert (ref[:, 2 * W :] - got[:, 2 * W :]).abs().max() > 1e-3


# config.json of Qwen/Qwen3-30B-A3B as published (transformers 4 names).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_hub_qwen3_30b_a3b_config_maps_to_orthros():
    hub = QWEN3_30B_A3B
    cfg = orthros_config_from_hf(hub)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.sparse_layers == list(range(48))
    # ~30.5B parameters, ~3.3B active per token: the model's name.
    assert 30.0e9 < cfg.num_parameters() < 31.0e9
    active = cfg.num_parameters() - sum(cfg.mlp_parameters(i) - cfg.mlp_parameters(i, True) for i in range(48))
    assert 3.0e9 < active < 3.6e9


def test_convert_qwen3_30b_a3b_recipe_describes_the_converted_checkpoint():
    """The recipe's model section must be what `orthros-convert from-hf` writes for the hub model."""
    from pathlib import Path

    omegaconf = pytest.importorskip("omegaconf")
    path = Path(__file__).resolve().parents[1] / "recipes" / "convert_qwen3_30b_a3b.yaml"
    model = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(path).model)
    assert model.pop("init_from")
    converted = orthros_config_from_hf(QWEN3_30B_A3B)
    converted.extra = {}
    assert OrthrosConfig(**model) == converted


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_local_experts": 0}, "num_experts"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_experts": 4}, "disagree"),
    ],
)
def test_from_hf_refuses_moe_configs_it_cannot_express(hf_moe_dirs, tmp_path, changes, message):
    src = tmp_path / "src"
    src.mkdir()
    hf = json.loads((hf_moe_dirs["qwen3_moe"] / "config.json").read_text())
    assert hf["num_local_experts"] == 8  # how transformers 5 writes num_experts
    hf.update(changes)
    (src / "config.json").write_text(json.dumps(hf))
    (src / "model.safetensors").symlink_to(hf_moe_dirs["qwen3_moe"] / "model.safetensors")
    with pytest.raises(ConversionError, match=message):
        convert_from_hf(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("policy", ["tied", "joint"])
def test_to_hf_moe_export_loads_matches_and_generates(hf_moe_dirs, tmp_path, policy):
    convert_from_hf(hf_moe_dirs["qwen2_moe"], tmp_path / "o", sliding_window=W)
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    cfg["moe_routing"] = policy
    (tmp_path / "o" / "config.json").write_text(json.dumps(cfg))
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "o").eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.3)  # beyond W the policies differ: the export must follow
    model.save_pretrained(tmp_path / "trained")
    convert_to_hf(tmp_path / "trained", tmp_path / "hf", tokenizer=hf_moe_dirs["qwen2_moe"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", trust_remote_code=True, dtype=torch.float32
    ).eval()
    ids = torch.randint(0, VOCAB, (2, 4 * W))
    with torch.no_grad():
        # the export reads ids as a prompt (its global tail included), as prompt_logits does
        assert (exported(ids).logits - prompt_logits(model, ids)).abs().max() <= 1e-4
        ours = model.generate_greedy(ids, max_new_tokens=6)
        theirs = exported.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(theirs[:, ids.shape[1] :], ours)


def test_verify_cli_covers_moe_beyond_the_window(hf_moe_dirs, tmp_path, capsys):
    convert_from_hf(hf_moe_dirs["qwen3_moe"], tmp_path / "o", sliding_window=W)
    assert convert_main(["verify", str(hf_moe_dirs["qwen3_moe"]), str(tmp_path / "o"), "--tokens", str(3 * W)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == 3 * W and result["window"] == 3 * W  # compared as the dense model beyond W
    assert result["max_abs_diff"] <= 1e-5 * result["max_abs_logit"] and result["argmax_agreement"] == 1.0


def test_flops_count_the_active_experts_and_the_router():
    """A top-k MoE layer costs what a dense MLP of width k x expert width costs, plus its router."""
    from orthros_train.train.metrics import layout_flops

    moe = moe_config()
    dense = OrthrosConfig(**{**MOE_SHAPE, "num_experts": 0, "intermediate_size": 2 * 24})
    layout = pretrain_layout(torch.randint(0, VOCAB, (2, 20)))
    t, n, layers = layout.num_tokens, layout.num_outputs, moe.num_hidden_layers
    router_rows = t * (layers - 1) + n * layers  # the last layer's base stream skips its MLP
    router = 2 * moe.hidden_size * moe.num_experts * router_rows
    assert layout_flops(moe, layout, training=False) == layout_flops(dense, layout, training=False) + router
    assert layout_flops(moe, layout) == 3 * layout_flops(moe, layout, training=False)
