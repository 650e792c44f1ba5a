"""The Orthros model against its definition (docs/architecture.md): equivalences, consistency,
no leakage."""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_config as shared_tiny_config

from orthros_train.errors import UserError
from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.phase import IGNORE_INDEX, pretrain_layout, sft_layout

# Three layers (one neither first nor last), a prime vocabulary and a window shorter than most
# test sequences: the shape these equivalences were written for.
MODEL_SHAPE = {"hidden_size": 48, "num_hidden_layers": 3, "intermediate_size": 96, "sliding_window": 8}


def tiny_config(**overrides) -> OrthrosConfig:
    return shared_tiny_config(**{"vocab_size": 97, **MODEL_SHAPE, **overrides})


def twin(model: OrthrosForCausalLM, **overrides) -> OrthrosForCausalLM:
    """A model with the same weights and some config fields changed."""
    other = OrthrosForCausalLM(OrthrosConfig(**{**model.config.to_dict(), **overrides}))
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_orthros_equals_dense_when_window_covers_sequence(qk_norm, kv_heads):
    t = 40
    model = OrthrosForCausalLM(tiny_config(qk_norm=qk_norm, num_key_value_heads=kv_heads, sliding_window=t))
    dense = twin(model, attention_type="dense")
    ids = torch.randint(0, 97, (2, t))
    diff = (model(ids).logits - dense(ids).logits).abs().max()
    assert diff <= 1e-5


def test_window_and_query_affine_really_change_the_model():
    """The equivalence above is not vacuous: a short window or gamma != 1 breaks it."""
    t = 40
    model = OrthrosForCausalLM(tiny_config(sliding_window=t))
    dense = twin(model, attention_type="dense")
    ids = torch.randint(0, 97, (1, t))
    short = twin(model, sliding_window=4)
    assert (short(ids).logits - dense(ids).logits).abs().max() > 1e-3
    with torch.no_grad():
        model.layers[1].self_attn.gamma.mul_(1.5)
    assert (model(ids).logits - dense(ids).logits).abs().max() > 1e-3
    # Below the window the short model still equals dense: positions < W see the same keys.
    assert (short(ids).logits[:, :4] - dense(ids).logits[:, :4]).abs().max() <= 1e-5


def test_sliding_baseline_differs_from_orthros_beyond_window():
    model = OrthrosForCausalLM(tiny_config())
    sliding = twin(model, attention_type="sliding")
    ids = torch.randint(0, 97, (1, 30))
    a, b = model(ids).logits, sliding(ids).logits
    assert (a[:, :8] - b[:, :8]).abs().max() <= 1e-5  # inside the window: identical
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-3  # beyond it the output stream sees more


@pytest.mark.parametrize("qk_norm", [False, True])
def test_forward_prefill_and_decode_agree_beyond_window(qk_norm):
    torch.manual_seed(1)
    model = OrthrosForCausalLM(tiny_config(qk_norm=qk_norm, sliding_window=6)).eval()
    with torch.no_grad():  # a non-trivial query affine must also agree between phases
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.2)
            layer.self_attn.beta.normal_(0.0, 0.2)
    t = 32
    ids = torch.randint(0, 97, (2, t))
    with torch.no_grad():
        full = model(ids).logits
    for i in (0, 5, 6, 17, t - 1):
        logits, _ = model.prefill(ids[:, : i + 1])
        assert (logits - full[:, i]).abs().max() <= 1e-4, i
    logits, cache = model.prefill(ids[:, :3])
    for i in range(3, t):
        logits, cache = model.decode_step(ids[:, i], cache)
        assert (logits - full[:, i]).abs().max() <= 1e-4, i
    assert int(cache.lengths.min()) == t
    # Cache: K and V for every layer and token (fp32).
    cfg = model.config
    assert cache.bytes_per_token() == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4


def test_decode_on_ragged_rows():
    model = OrthrosForCausalLM(tiny_config()).eval()
    a, b = torch.randint(0, 97, (20,)), torch.randint(0, 97, (13,))
    with torch.no_grad():
        full_a, full_b = model(a[None]).logits[0], model(b[None]).logits[0]
    # Prefill the two rows separately-sized, then decode both together.
    from orthros_train.model import KVCache
    from orthros_train.phase import prefill_layout

    cache = KVCache(model.config.num_hidden_layers, 2)
    with torch.no_grad():
        logits = model.forward_layout(prefill_layout([a[:10], b[:5]]), cache).logits
    assert (logits[0] - full_a[9]).abs().max() <= 1e-4 and (logits[1] - full_b[4]).abs().max() <= 1e-4
    for step in range(8):
        logits, cache = model.decode_step(torch.stack([a[10 + step], b[5 + step]]), cache)
        assert (logits[0] - full_a[10 + step]).abs().max() <= 1e-4
        assert (logits[1] - full_b[5 + step]).abs().max() <= 1e-4


def test_no_leakage_from_future_tokens():
    model = OrthrosForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 97, (1, 30))
    j = 17
    changed = ids.clone()
    changed[0, j] = (changed[0, j] + 1) % 97
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert (a[:, :j] - b[:, :j]).abs().max() == 0
    assert (a[:, j:] - b[:, j:]).abs().max() > 0


def test_base_stream_sees_only_its_window_in_first_layer():
    w = 8
    model = OrthrosForCausalLM(tiny_config(sliding_window=w)).eval()
    captured = []
    model.layers[0].register_forward_hook(lambda mod, inp, out: captured.append(out[0].detach()))
    ids = torch.randint(0, 97, (1, 40))
    j = 5
    changed = ids.clone()
    changed[0, j] = (changed[0, j] + 1) % 97
    with torch.no_grad():
        model(ids)
        model(changed)
    x_a, x_b = captured
    delta = (x_a - x_b).abs().amax(dim=-1)
    assert delta[: j].max() == 0
    assert bool((delta[j : j + w] > 0).all())  # inside the window the change is seen ...
    assert delta[j + w :].max() == 0  # ... and more than `window` positions later it is not


def test_packed_documents_equal_documents_alone():
    model = OrthrosForCausalLM(tiny_config()).eval()
    docs = [torch.randint(0, 97, (n,)) for n in (11, 3, 20)]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        together = model(packed, document_ids=doc_ids).logits[0]
        alone = torch.cat([model(d[None]).logits[0] for d in docs])
    assert (together - alone).abs().max() <= 1e-5
    # Without document ids the same tokens do attend across: the test can tell.
    with torch.no_grad():
        crossing = model(packed).logits[0]
    assert (crossing - alone).abs().max() > 1e-3


def test_eod_separated_documents_in_pretrain_layout():
    model = OrthrosForCausalLM(tiny_config()).eval()
    eod = 0
    a, b = torch.randint(1, 97, (9,)), torch.randint(1, 97, (12,))
    row = torch.cat([a, torch.tensor([eod]), b])
    layout = pretrain_layout(row[None], eod_token_id=eod)
    assert layout.cu_seqlens.tolist() == [0, 10, 22]
    assert layout.labels[9] == IGNORE_INDEX  # the EOD position predicts nothing across documents
    with torch.no_grad():
        packed = model.forward_layout(layout).logits
        alone_b = model(b[None]).logits[0]
    assert (packed[10:] - alone_b).abs().max() <= 1e-5


def test_sft_loss_equals_pretrain_loss_restricted_to_answers():
    model = OrthrosForCausalLM(tiny_config())
    ids = torch.randint(0, 97, (2, 30))
    spans = [[(5, 9), (20, 26)], [(12, 30)]]
    sft = sft_layout(ids, spans)
    sft_loss = model.forward_layout(sft).loss
    pre = pretrain_layout(ids)
    logits = model.forward_layout(pre).logits.view(2, 30, -1)
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1), reduction="none"
    ).view(2, 29)
    mask = torch.zeros(2, 29, dtype=torch.bool)  # position p is trained iff token p+1 is an answer
    for row, row_spans in enumerate(spans):
        for s, e in row_spans:
            mask[row, s - 1 : e - 1] = True
    expected = ce[mask].mean()
    assert torch.allclose(sft_loss, expected, atol=1e-5)
    assert sft.num_outputs == int(mask.sum())
    # Gradients agree too (the sft layout is not just a relabelled pretrain pass).
    g_sft = torch.autograd.grad(sft_loss, model.embed_tokens.weight)[0]
    logits = model.forward_layout(pretrain_layout(ids)).logits.view(2, 30, -1)
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1), reduction="none"
    ).view(2, 29)
    g_pre = torch.autograd.grad(ce[mask].mean(), model.embed_tokens.weight)[0]
    assert torch.allclose(g_sft, g_pre, atol=1e-6)


def test_last_layer_skips_base_stream_work():
    model = OrthrosForCausalLM(tiny_config()).eval()
    calls = []
    last = model.layers[-1]
    last.mlp.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    last.self_attn.o_proj.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    ids = torch.randint(0, 97, (1, 25))
    with torch.no_grad():
        model(ids, output_positions=torch.tensor([3, 24]))
    assert calls == [2, 2]  # only the two output tokens, not the 25 base tokens


def test_save_and_load_pretrained_roundtrip(tmp_path):
    model = OrthrosForCausalLM(tiny_config(tie_word_embeddings=True)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    again = OrthrosForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    other = OrthrosForCausalLM(tiny_config(hidden_size=64))
    with pytest.raises(ValueError, match="shape"):
        other.load_pretrained_weights(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="config.json"):
        OrthrosForCausalLM.from_pretrained(tmp_path / "missing")


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(sliding_window=0), "sliding_window"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=50, num_attention_heads=4), "head_dim"),
        (dict(attention_type="linear"), "attention_type"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(UserError, match=field):
        tiny_config(**overrides)


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from orthros_train.model.layers import rope_inv_freq

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_cfg = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(ours, hf_inv_freq.float(), rtol=0, atol=0)
