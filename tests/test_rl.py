"""RL: rollout log-probs and GRPO gradients on rl layouts equal a direct full-sequence computation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.train.config import OptimConfig
from orthros_train.train.rl import (
    GRPOTrainer,
    PatternTask,
    RLConfig,
    Rollout,
    RolloutGenerator,
    compute_advantages,
    grpo_loss,
    load_rollouts,
    normalizer,
    response_logprobs,
    rollout_layout,
    save_rollouts,
    surrogate_layout,
)

V = 24


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int = 0, **kw) -> OrthrosForCausalLM:
    torch.manual_seed(seed)
    cfg = OrthrosConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, sliding_window=4, attention_backend="reference", **kw,
    )
    model = OrthrosForCausalLM(cfg)
    with torch.no_grad():  # leave the identity init of the output-stream affine: streams must differ
        for layer in model.layers:
            layer.self_attn.gamma.add_(0.1 * torch.randn_like(layer.self_attn.gamma))
            layer.self_attn.beta.add_(0.1 * torch.randn_like(layer.self_attn.beta))
    return model.double()


def make_rollouts(seed: int = 0, with_old: bool = True, with_ref: bool = False) -> list[Rollout]:
    """Ragged prompts (longer than the window) and responses, two groups."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate([(9, 3), (5, 6), (12, 1), (7, 4), (6, 5)]):
        prompt = torch.randint(0, V, (p,), generator=g).tolist()
        response = torch.randint(0, V, (r,), generator=g).tolist()
        kw = {"reward": float(torch.rand((), generator=g))}
        if with_old:  # a "sampler" whose log-probs differ from the policy's: ratios on both sides of the clip
            kw["logprobs"] = (-torch.rand(r, generator=g) * 4 - 1).tolist()
        if with_ref:
            kw["ref_logprobs"] = (-torch.rand(r, generator=g) * 4 - 1).tolist()
        out.append(Rollout(prompt, response, group=i % 2, **kw))
    return out


def full_sequence_logprobs(model: OrthrosForCausalLM, r: Rollout) -> torch.Tensor:
    """log p(response token k) from a plain full-sequence forward (output token at every position)."""
    ids = torch.tensor(r.prompt_ids + r.response_ids)
    logits = model(ids[None]).logits[0]  # [T, V], position p predicts token p + 1
    p = len(r.prompt_ids)
    logp = torch.log_softmax(logits.double(), -1)
    return logp[p - 1 : len(ids) - 1].gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]


def direct_grpo_loss(model, rollouts, cfg: RLConfig, advantages) -> torch.Tensor:
    """GRPO written out per rollout, from full-sequence logits (independent of the rl layout)."""
    per_row = []
    n_tokens = sum(len(r.response_ids) for r in rollouts)
    for r, adv in zip(rollouts, advantages):
        logp = full_sequence_logprobs(model, r)
        old = torch.tensor(r.logprobs, dtype=logp.dtype) if r.logprobs is not None else logp.detach()
        terms = []
        for k in range(len(r.response_ids)):
            ratio = torch.exp(logp[k] - old[k])
            a = float(adv[k])
            clipped = min(max(ratio.item(), 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high)
            # -min(ratio * a, clip(ratio) * a); the clipped branch has no gradient
            term = -ratio * a if ratio.item() * a <= clipped * a else -(ratio * 0 + clipped * a)
            if cfg.kl_coef:
                d = r.ref_logprobs[k] - logp[k]
                term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
            terms.append(term)
        row = torch.stack(terms)
        per_row.append(row.sum() / n_tokens if cfg.loss_average == "token" else row.mean() / len(rollouts))
    return torch.stack(per_row).sum()


class NoStep(torch.optim.SGD):
    """An optimizer that leaves the gradients of the last update in place and the weights alone."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)

    def step(self, closure=None):
        return None


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict, b: dict, rel: float = 1e-6):
    """Equal up to float rounding: attention and norms compute in fp32 even in a float64 model."""
    assert a.keys() == b.keys()
    for name in a:
        scale = float(b[name].abs().max())
        assert scale > 0, name
        err = float((a[name] - b[name]).abs().max())
        assert err <= rel * scale, f"{name}: max |diff| {err:.3g} vs max |grad| {scale:.3g}"


def test_rollout_logprobs_on_the_rl_layout_equal_full_sequence_forward():
    model = tiny_model()
    rollouts = make_rollouts(with_old=False)
    layout = rollout_layout(rollouts)
    # output tokens sit exactly on the positions that predict response tokens
    assert layout.num_outputs == sum(len(r.response_ids) for r in rollouts)
    assert layout.labels.tolist() == [t for r in rollouts for t in r.response_ids]
    with torch.no_grad():
        got = response_logprobs(model, layout)
        want = torch.cat([full_sequence_logprobs(model, r) for r in rollouts])
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-7)  # attention and norms run in fp32


@pytest.mark.parametrize("loss_average", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_grpo_gradient_equals_direct_full_sequence_computation(loss_average, kl_coef):
    model = tiny_model(1)
    rollouts = make_rollouts(1, with_old=True, with_ref=True)
    cfg = RLConfig(loss_average=loss_average, kl_coef=kl_coef, clip_eps_low=0.2, clip_eps_high=0.28, micro_batch_rows=2)
    advantages = compute_advantages(rollouts)

    # the trainer's update (rl layout, micro-batches of 2 rows accumulated), optimizer stopped
    trainer = GRPOTrainer(model, cfg, OptimConfig(grad_clip=0.0), optimizer=NoStep(model.parameters()),
                          ref_model=tiny_model(2))
    stats = trainer.update(rollouts)
    assert 0 < stats["clip_fraction"] < 1  # both clip branches are exercised
    got = grads(model)

    model.zero_grad(set_to_none=True)
    direct_grpo_loss(model, rollouts, cfg, advantages).backward()
    assert_same_grads(got, grads(model))


def test_surrogate_layout_gives_the_grpo_gradient_through_the_plain_layout_loss():
    """The trainer's loss is sum(w * CE) / N: surrogate weights make it a GRPO step exactly."""
    model = tiny_model(3)
    rollouts = make_rollouts(3, with_old=True, with_ref=True)
    adv = torch.cat(compute_advantages(rollouts)).double()
    layout = rollout_layout(rollouts)
    old = torch.tensor([v for r in rollouts for v in r.logprobs], dtype=torch.float64)
    ref = torch.tensor([v for r in rollouts for v in r.ref_logprobs], dtype=torch.float64)
    w = normalizer(layout, "sequence").double()
    objective = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.1)

    logp = response_logprobs(model, layout)
    loss, _ = grpo_loss(logp, old, adv, w, ref, **objective)
    loss.backward()
    want = grads(model)

    model.zero_grad(set_to_none=True)
    sur = surrogate_layout(layout, logp.detach(), old, adv, w, ref, **objective)
    assert torch.equal(sur.output_index, layout.output_index)
    model.forward_layout(sur).loss.backward()
    # (the model's layout loss takes the cross entropy in fp32, hence the fp32 tolerance)
    assert_same_grads(grads(model), want, rel=1e-5)


def test_on_policy_step_is_the_advantage_weighted_layout_loss():
    """ratio == 1, no KL: the GRPO gradient is that of the rl layout with weights = advantages."""
    model = tiny_model(4)
    rollouts = make_rollouts(4, with_old=False)
    trainer = GRPOTrainer(model, RLConfig(), OptimConfig(grad_clip=0.0), optimizer=NoStep(model.parameters()))
    trainer.update(rollouts)
    got = grads(model)
    model.zero_grad(set_to_none=True)
    layout = rollout_layout(rollouts, compute_advantages(rollouts))
    model.forward_layout(layout).loss.backward()  # sum(A * CE) / N == -sum(A * logp) / N
    assert_same_grads(got, grads(model), rel=1e-5)


def test_advantages_group_normalised_and_process_rewards_to_go():
    seq = [Rollout([1], [2, 3], reward=r, group="a") for r in (1.0, 0.0, 0.5)]
    seq += [Rollout([1], [2], reward=7.0, group="b")]  # alone in its group: advantage 0
    adv = compute_advantages(seq)
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    want = ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).float()
    assert [float(a[0]) for a in adv[:3]] == pytest.approx(want.tolist(), abs=1e-6)
    assert all(torch.equal(a, a[:1].expand_as(a)) for a in adv)  # one value per response
    assert float(adv[3][0]) == 0.0
    unscaled = compute_advantages(seq[:3], scale=False)
    assert [float(a[0]) for a in unscaled] == pytest.approx([0.5, -0.5, 0.0])

    tok = [Rollout([1], [2, 3, 4], token_rewards=[1, 0, 1], group=0), Rollout([1], [5], token_rewards=[0], group=0)]
    flat = torch.tensor([1.0, 0, 1, 0])
    norm = (flat - flat.mean()) / (flat.std(unbiased=False) + 1e-6)
    adv = compute_advantages(tok)
    assert adv[0].tolist() == pytest.approx([float(norm[0:3].sum()), float(norm[1:3].sum()), float(norm[2])], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([float(norm[3])], abs=1e-5)

    given = compute_advantages([Rollout([1], [2, 3], advantages=[0.5, -1.0]), Rollout([1], [2], advantages=2.0)])
    assert given[0].tolist() == [0.5, -1.0] and given[1].tolist() == [2.0]
    with pytest.raises(ValueError, match="mixes"):
        compute_advantages([Rollout([1], [2], reward=1.0, group=0), Rollout([1], [2], token_rewards=[1.0], group=0)])


def test_rollouts_jsonl_round_trip_and_clear_errors(tmp_path):
    rollouts = make_rollouts(5, with_old=True, with_ref=True)
    path = tmp_path / "r.jsonl"
    save_rollouts(path, rollouts)
    back = load_rollouts(path)
    assert [r.to_json() for r in back] == [r.to_json() for r in rollouts]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1], "response_ids": [2, 3], "reward": 1, "logprobs": [-1.0]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*logprobs has 1 entries for 2"):
        load_rollouts(bad)
    bad.write_text("\n" + json.dumps({"prompt_ids": [1], "response_ids": [2], "rewrd": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*unknown field"):
        load_rollouts(bad)
    with pytest.raises(ValueError, match="one of reward"):
        Rollout([1], [2])


def test_generation_logprobs_match_the_training_layout():
    """What prefill/decode sampled from is what the rl layout trains: same log-probs."""
    model = tiny_model(6).float().eval()
    prompt = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(0))
    logits, cache = model.prefill(prompt)
    tokens, logps = [], []
    for _ in range(5):
        nxt = logits.argmax(-1)
        logps.append(float(torch.log_softmax(logits.float(), -1)[0, nxt]))
        tokens.append(int(nxt))
        logits, cache = model.decode_step(nxt, cache)
    with torch.no_grad():
        got = response_logprobs(model, rollout_layout([Rollout(prompt[0].tolist(), tokens, reward=0.0)]))
    assert got.tolist() == pytest.approx(logps, abs=1e-5)


def test_rollout_generator_groups_and_rewards():
    model = tiny_model(7).float()
    task = PatternTask(vocab_size=V, prompt_len=4, response_len=3)
    cfg = RLConfig(group_size=3, max_new_tokens=3, seed=1)
    rollouts = RolloutGenerator(task.reward, cfg)(model, task.prompts(2), group_offset=10)
    assert [r.group for r in rollouts] == [10, 10, 10, 11, 11, 11]
    assert all(len(r.response_ids) == 3 and r.reward == task.reward(r.prompt_ids, r.response_ids) for r in rollouts)
    assert task.reward([5], task.target([5])[:3]) == 1.0 and task.target([V - 1])[0] == task.low


def test_ppo_epochs_and_minibatches_run_and_move_the_policy():
    model = tiny_model(8).float()
    rollouts = make_rollouts(8, with_old=False)
    cfg = RLConfig(ppo_epochs=2, minibatches=2, kl_coef=0.01)
    trainer = GRPOTrainer(model, cfg, OptimConfig(lr=1e-2, min_lr=1e-2, warmup_steps=0, weight_decay=0.0))
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.update(rollouts)
    assert trainer.optimizer_steps == 4 and trainer.step == 1
    assert math.isfinite(stats["loss"]) and stats["kl"] >= 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.slow
def test_toy_task_reward_rises():
    torch.manual_seed(0)
    cfg = OrthrosConfig(vocab_size=16, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, sliding_window=8, tie_word_embeddings=True)
    model = OrthrosForCausalLM(cfg)
    task = PatternTask(vocab_size=16, prompt_len=8, response_len=6, token_rewards=True)
    rl = RLConfig(group_size=8, prompts_per_step=8, max_new_tokens=6)
    optim = OptimConfig(lr=3e-3, min_lr=3e-3, warmup_steps=0, schedule="constant", weight_decay=0.0)
    trainer = GRPOTrainer(model, rl, optim, max_steps=40)
    history = trainer.train(lambda step: task.prompts(rl.prompts_per_step), RolloutGenerator(task.reward, rl))
    first = sum(h["reward_mean"] for h in history[:5]) / 5
    last = sum(h["reward_mean"] for h in history[-5:]) / 5
    assert last > first + 1.0, (first, last)  # hits per 6-token response


def _recipe(tmp_path, task: dict, rl: dict, vocab: int = V, steps: int = 2, **sections) -> dict:
    return {
        "model": {"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 64, "sliding_window": 4, "init_from": None},
        "optim": {"lr": 1e-2, "min_lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
        "trainer": {"max_steps": steps, "run_dir": str(tmp_path / "run"), "device": "cpu", "log_every": 0,
                    "seed": 0, "wandb": {"enabled": False}},
        "parallel": {"zero_stage": 0},
        "rl": rl,
        "task": task,
        **sections,
    }


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_run_rl_trains_on_an_external_engines_rollouts(tmp_path):
    from orthros_train.train.rl_cli import run_rl

    rollouts = make_rollouts(9, with_old=True) + make_rollouts(10, with_old=True)
    save_rollouts(tmp_path / "r.jsonl", rollouts)
    summary = run_rl(_recipe(tmp_path, {"name": "rollouts", "rollouts": str(tmp_path / "r.jsonl")},
                             {"group_size": 5, "prompts_per_step": 1, "kl_coef": 0.02}, steps=5))
    records = _metrics(tmp_path)
    assert summary["steps"] == 2 and [r["step"] for r in records] == [1, 2]  # 10 rollouts, 5 per update
    assert all(r["loss_tokens"] == sum(len(x.response_ids) for x in rollouts[5 * i : 5 * i + 5])
               for i, r in enumerate(records))
    assert all(math.isfinite(r["loss"]) and r["kl"] >= 0 for r in records)
    model = OrthrosForCausalLM.from_pretrained(summary["checkpoint"])
    assert model.config.vocab_size == V


def test_run_rl_prompt_set_with_reference_rewards(tmp_path):
    from data_helpers import make_tokenizer, write_jsonl

    from data_tools.chat import ChatFields
    from data_tools.pretokenize import TokenizeOptions, run
    from orthros_train.train.rl_cli import run_rl

    tok_dir = make_tokenizer(tmp_path / "tok", vocab_size=300)
    rows = [{"prompt": f"Count to {n}", "answer": " ".join(str(i) for i in range(n))} for n in range(2, 8)]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    run(TokenizeOptions([str(src)], str(tok_dir), str(tmp_path / "rl"), kind="rl", progress=False,
                        fields=ChatFields(reference="answer")))
    summary = run_rl(_recipe(
        tmp_path,
        {"name": "prompts", "reward": "orthros_train.train.rl:reference_match_reward", "stop_token_ids": [0]},
        {"group_size": 2, "prompts_per_step": 3, "max_new_tokens": 4},
        vocab=300,
        data={"source": "indexed", "paths": [str(tmp_path / "rl")]},
    ))
    records = _metrics(tmp_path)
    assert summary["steps"] == 2 and len(records) == 2
    assert all(0 < r["response_len_mean"] <= 4 and math.isfinite(r["loss"]) for r in records)
