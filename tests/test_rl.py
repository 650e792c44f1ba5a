"""RL: rollout log-probs and GRPO gradients on rl layouts equal a direct full-sequence computation."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fixtures import (
    TINY_SHAPE,
    by_step,
    finish,
    kill_tree,
    metrics,
    result_of,
    start_train,
    tiny_model,
    torchrun,
    trainer_for,
    wait_for_step,
)

from orthros_train.errors import UserError
from orthros_train.model import OrthrosForCausalLM
from orthros_train.train.config import RLConfig
from orthros_train.train.global_loss import loss_units
from orthros_train.train.rl import (
    GRPOObjective,
    PatternTask,
    Policy,
    Rollout,
    RolloutGenerator,
    average_weights,
    compute_advantages,
    grpo_loss,
    load_rollouts,
    response_logprobs,
    rollout_layout,
    save_rollouts,
    surrogate_layout,
)

V = 24


def policy(seed: int = 0) -> OrthrosForCausalLM:
    """A float64 tiny policy (window 4, the plain-torch attention) whose output-stream affine left
    the identity init, so the two streams differ."""
    return tiny_model(V, seed=seed, output_affine="nudged", sliding_window=4, attention_backend="reference").double()


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


def direct_grpo_loss(model, rollouts, cfg: RLConfig, advantages, loss_average: str) -> torch.Tensor:
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
        per_row.append(row.sum() / n_tokens if loss_average == "token" else row.mean() / len(rollouts))
    return torch.stack(per_row).sum()


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
    model = policy()
    rollouts = make_rollouts(with_old=False)
    layout = rollout_layout(rollouts)
    # output tokens sit exactly on the positions that predict response tokens
    assert layout.num_outputs == sum(len(r.response_ids) for r in rollouts)
    assert layout.labels.tolist() == [t for r in rollouts for t in r.response_ids]
    with torch.no_grad():
        got = response_logprobs(model, layout)
        want = torch.cat([full_sequence_logprobs(model, r) for r in rollouts])
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-7)  # attention and norms run in fp32


def objective_step(model, rollouts, cfg: RLConfig, loss_average: str, micro_rows: int, ref_model=None):
    """What the trainer does with a step's rollouts: micro batches -> GRPOObjective -> the layout
    loss over the step's units, accumulated; returns the logged GRPO loss and diagnostics."""
    adv = compute_advantages(rollouts)
    batches = [rollout_layout(rollouts[i : i + micro_rows], adv[i : i + micro_rows])
               for i in range(0, len(rollouts), micro_rows)]
    units = sum(loss_units(b, loss_average) for b in batches)
    reference = Policy("cpu", module=ref_model) if ref_model else None
    step = GRPOObjective(cfg, loss_average, Policy("cpu", module=model), reference).prepare(batches, units)
    for layout in step.layouts:
        model.forward_layout(layout, loss_normalizer=units).loss.backward()
    return sum(step.values), step.stats


@pytest.mark.parametrize("loss_average", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_grpo_gradient_equals_direct_full_sequence_computation(loss_average, kl_coef):
    model = policy(1)
    rollouts = make_rollouts(1, with_old=True, with_ref=True)
    cfg = RLConfig(kl_coef=kl_coef, clip_eps_low=0.2, clip_eps_high=0.28)
    advantages = compute_advantages(rollouts)

    # the trainer's path: micro-batches of 2 rows, each with the step's global normalizer
    value, stats = objective_step(model, rollouts, cfg, loss_average, 2, ref_model=policy(2))
    assert 0 < stats["clip_fraction"] < 1  # both clip branches are exercised
    got = grads(model)

    model.zero_grad(set_to_none=True)
    want = direct_grpo_loss(model, rollouts, cfg, advantages, loss_average)
    want.backward()
    assert value == pytest.approx(float(want), rel=1e-5)  # the logged loss is the GRPO loss
    assert_same_grads(got, grads(model))


def test_surrogate_layout_gives_the_grpo_gradient_through_the_plain_layout_loss():
    """The trainer's loss is sum(w * CE) / N: surrogate weights make it a GRPO step exactly."""
    model = policy(3)
    rollouts = make_rollouts(3, with_old=True, with_ref=True)
    adv = torch.cat(compute_advantages(rollouts)).double()
    layout = rollout_layout(rollouts)
    old = torch.tensor([v for r in rollouts for v in r.logprobs], dtype=torch.float64)
    ref = torch.tensor([v for r in rollouts for v in r.ref_logprobs], dtype=torch.float64)
    w = average_weights(layout, "sequence").double()
    objective = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.1)

    logp = response_logprobs(model, layout)
    loss, _ = grpo_loss(logp, old, adv, w, ref, **objective)
    loss.backward()
    want = grads(model)

    model.zero_grad(set_to_none=True)
    sur, value, _ = surrogate_layout(layout, logp.detach(), old, adv, w, ref, **objective)
    assert torch.equal(sur.output_index, layout.output_index)
    assert value == pytest.approx(float(loss), rel=1e-9)
    model.forward_layout(sur).loss.backward()
    # (the model's layout loss takes the cross entropy in fp32, hence the fp32 tolerance)
    assert_same_grads(grads(model), want, rel=1e-5)


def test_on_policy_step_is_the_advantage_weighted_layout_loss():
    """ratio == 1, no KL: the GRPO gradient is that of the rl layout with weights = advantages,
    and no extra forward is needed (the objective never asks for log-probs)."""
    model = policy(4)
    rollouts = make_rollouts(4, with_old=False)

    def no_forward(layout):
        raise AssertionError("an on-policy step without KL needs no log-probs")

    adv = compute_advantages(rollouts)
    batch = rollout_layout(rollouts, adv)
    step = GRPOObjective(RLConfig(), "token", SimpleNamespace(logprobs=no_forward)).prepare([batch], batch.num_outputs)
    stats = step.stats
    model.forward_layout(step.layouts[0], loss_normalizer=batch.num_outputs).loss.backward()
    assert stats["ratio_mean"] == 1.0 and stats["clip_fraction"] == 0.0
    got = grads(model)
    model.zero_grad(set_to_none=True)
    model.forward_layout(rollout_layout(rollouts, adv)).loss.backward()  # sum(A * CE) / N == -sum(A * logp) / N
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
    with pytest.raises(UserError, match="mixes"):
        compute_advantages([Rollout([1], [2], reward=1.0, group=0), Rollout([1], [2], token_rewards=[1.0], group=0)])


def test_rollouts_jsonl_round_trip_and_clear_errors(tmp_path):
    rollouts = make_rollouts(5, with_old=True, with_ref=True)
    path = tmp_path / "r.jsonl"
    save_rollouts(path, rollouts)
    back = load_rollouts(path)
    assert [r.to_json() for r in back] == [r.to_json() for r in rollouts]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1], "response_ids": [2, 3], "reward": 1, "logprobs": [-1.0]}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: .*logprobs has 1 entries for 2"):
        load_rollouts(bad)
    bad.write_text("\n" + json.dumps({"prompt_ids": [1], "response_ids": [2], "rewrd": 1}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2: .*unknown field"):
        load_rollouts(bad)
    with pytest.raises(UserError, match="one of reward"):
        Rollout([1], [2])


def _one_line(tmp_path, record, name="bad.jsonl"):
    path = tmp_path / name
    good = {"prompt_ids": [1, 2], "response_ids": [3, 4], "reward": 1.0}
    path.write_text(json.dumps(good) + "\n" + (record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


@pytest.mark.parametrize(
    "record, message",
    [
        ('{"prompt_ids": [1], "response_ids": [2], "reward": NaN}', "NaN is not a number"),
        ('{"prompt_ids": [1], "response_ids": [2], "reward": Infinity}', "Infinity is not a number"),
        ('{"prompt_ids": [1], "response_ids": [2], "advantages": [-Infinity]}', "Infinity is not a number"),
        ('{"prompt_ids": [1], "response_ids": [2], "reward": 1e400}', "reward is inf"),  # json reads 1e400 as inf
        ({"prompt_ids": [1], "response_ids": [2], "reward": "1.0"}, "reward must be a number, got '1.0'"),
        ({"prompt_ids": [1], "response_ids": [2], "reward": True}, "reward must be a number, got True"),
        ({"prompt_ids": [1], "response_ids": [2, 3], "token_rewards": [1, "0"]}, "token_rewards must be a number"),
        ({"prompt_ids": [1], "response_ids": [4.5], "reward": 1}, "response_ids holds 4.5, not an integer"),
        ({"prompt_ids": ["7"], "response_ids": [2], "reward": 1}, "prompt_ids holds '7', not an integer"),
        ({"prompt_ids": [True], "response_ids": [2], "reward": 1}, "prompt_ids holds True"),
        ({"prompt_ids": "12", "response_ids": [2], "reward": 1}, "prompt_ids must be a list"),
        ({"prompt_ids": [1], "response_ids": [-3], "reward": 1}, "response_ids holds -3: token ids are >= 0"),
        ({"prompt_ids": [1], "response_ids": [V], "reward": 1}, f"token id {V}, outside the model's vocabulary"),
        ({"prompt_ids": [1], "response_ids": [2], "reward": 1, "advantages": 0.5},
         "exactly one of reward, token_rewards or advantages, got reward and advantages"),
        ({"prompt_ids": [1], "response_ids": [2], "reward": 1, "token_rewards": [1]}, "got reward and token_rewards"),
        ({"prompt_ids": [1], "response_ids": [2, 3], "advantages": [1.0]}, "advantages has 1 entries for 2"),
        ({"prompt_ids": [1], "response_ids": [2], "reward": 1, "logprobs": [float("nan")]}, "NaN is not a number"),
        ({"prompt_ids": [1], "response_ids": [2], "reward": 1, "group": [1]}, "group must be an integer or a string"),
        ({"response_ids": [2], "reward": 1}, "missing field.*prompt_ids"),
        ("[1, 2]", "expected a JSON object"),
        ("{not json", "Expecting property name"),
    ],
)
def test_rollouts_are_validated_by_type_at_read_time_naming_file_and_line(tmp_path, record, message):
    """Nothing is coerced (4.5 is not token 4), nothing non-finite reaches the loss, no id reaches
    the embedding outside the vocabulary: each bad field is refused with the file and line."""
    path = _one_line(tmp_path, record)
    with pytest.raises(UserError, match=rf"bad.jsonl:2: bad rollout: .*{message}"):
        load_rollouts(path, vocab_size=V)


def test_rollouts_file_missing_empty_or_binary_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"task.rollouts=.*nope.jsonl: no such file"):
        load_rollouts(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match=r"is a directory"):
        load_rollouts(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match=r"empty.jsonl: no rollouts"):
        load_rollouts(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match=r"bin.jsonl: not UTF-8"):
        load_rollouts(tmp_path / "bin.jsonl")


def test_a_reward_function_returning_nan_is_named():
    def nan_reward(prompt, response, ref):
        return float("nan")

    gen = RolloutGenerator(nan_reward, RLConfig(group_size=2, prompts_per_step=1, max_new_tokens=2))
    with pytest.raises(UserError, match=r"reward function 'nan_reward' returned nan: reward is nan"):
        gen(policy(0).float().eval(), [[1, 2, 3]], [0])


def test_trainer_refuses_a_bad_rollouts_file_before_training(tmp_path):
    save_rollouts(tmp_path / "r.jsonl", make_rollouts(9, with_old=True))
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    record["response_ids"][0] = V + 5  # past model.vocab_size: an IndexError in the embedding before
    lines[3] = json.dumps(record)
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    task = {"name": "rollouts", "rollouts": str(tmp_path / "r.jsonl")}
    rl = {"group_size": 5, "prompts_per_step": 1}
    with pytest.raises(UserError, match=rf"r.jsonl:4: bad rollout: response_ids holds token id {V + 5}"):
        _train(_recipe(tmp_path, task, rl, steps=1))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    mixed = [Rollout([1], [2], reward=1.0, group=3), Rollout([1], [4], token_rewards=[0.5], group=3)] * 3
    save_rollouts(tmp_path / "mixed.jsonl", make_rollouts(9, with_old=True)[:4] + mixed)
    task["rollouts"] = str(tmp_path / "mixed.jsonl")
    with pytest.raises(UserError, match=r"mixed.jsonl: group 3 mixes reward \(rollout 5\) and token_rewards"):
        _train(_recipe(tmp_path, task, rl, steps=1))
    task["rollouts"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match=r"task.rollouts=.*missing.jsonl: no such file"):
        _train(_recipe(tmp_path, task, rl, steps=1))


def test_generation_logprobs_match_the_training_layout():
    """What prefill/decode sampled from is what the rl layout trains: same log-probs."""
    model = policy(6).float().eval()
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


def test_rollout_generator_groups_rewards_and_samples_independently_of_the_batch():
    model = policy(7).float()
    task = PatternTask(vocab_size=V, prompt_len=4, response_len=3)
    cfg = RLConfig(group_size=3, max_new_tokens=3, seed=1)
    generate = RolloutGenerator(task.reward, cfg)
    rollouts = generate(model, task.prompts([10, 11]), slots=[10, 11])
    assert [r.group for r in rollouts] == [10, 10, 10, 11, 11, 11]
    assert all(len(r.response_ids) == 3 and r.reward == task.reward(r.prompt_ids, r.response_ids) for r in rollouts)
    assert task.reward([5], task.target([5])[:3]) == 1.0 and task.target([V - 1])[0] == task.low
    # a prompt's rollouts depend on its slot only, not on the other prompts of the call (a
    # data-parallel rank samples exactly what one process would)
    alone = generate(model, task.prompts([11]), slots=[11])
    assert [r.response_ids for r in alone] == [r.response_ids for r in rollouts[3:]]
    assert task.prompts([11]) == task.prompts([3, 11])[1:]


# -- RL through the trainer ------------------------------------------------------------------------
def _recipe(tmp_path, task: dict, rl: dict, vocab: int = V, steps: int = 2, micro: int = 5, **sections) -> dict:
    return {
        "model": {"vocab_size": vocab, **TINY_SHAPE, "sliding_window": 4, "init_from": None},
        "optim": {"lr": 1e-2, "min_lr": 1e-2, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0},
        "trainer": {"max_steps": steps, "run_dir": str(tmp_path / "run"), "device": "cpu", "log_every": 0,
                    "seed": 0, "eval_every": 0, "micro_batch_size": micro, "progress": False,
                    "wandb": {"enabled": False}},
        "parallel": {"zero_stage": 0},
        "rl": rl,
        "task": task,
        **sections,
    }


def _train(recipe: dict) -> dict:
    from orthros_train.parallel.setup import destroy_parallel

    trainer = None
    try:
        trainer = trainer_for(recipe)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()  # its run lock, released here and not by a finaliser after the test
        destroy_parallel()


def test_trainer_runs_grpo_on_an_external_engines_rollouts(tmp_path):
    rollouts = make_rollouts(9, with_old=True) + make_rollouts(10, with_old=True)
    save_rollouts(tmp_path / "r.jsonl", rollouts)
    task = {"name": "rollouts", "rollouts": str(tmp_path / "r.jsonl")}
    rl = {"group_size": 5, "prompts_per_step": 1, "kl_coef": 0.02}
    with pytest.raises(UserError, match="2 steps of .* set trainer.max_steps=2"):
        _train(_recipe(tmp_path, task, rl, steps=3))
    with pytest.raises(UserError, match=r"micro_batch_size=4 .*Nearest valid: trainer.micro_batch_size=1 or 5"):
        _train(_recipe(tmp_path, task, rl, micro=4))
    result = _train(_recipe(tmp_path, task, rl, steps=2))
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]  # 10 rollouts, 5 per step
    assert all(r["loss_tokens"] == sum(len(x.response_ids) for x in rollouts[5 * i : 5 * i + 5])
               for i, r in enumerate(records))
    assert all(math.isfinite(r["loss"]) and r["kl"] >= 0 and 0 <= r["clip_fraction"] <= 1 for r in records)
    model = OrthrosForCausalLM.from_pretrained(result["checkpoint"])
    assert model.config.vocab_size == V


def test_trainer_runs_grpo_on_a_prompt_set_with_reference_rewards(bpe_tokenizer_dir, tmp_path):
    from data_helpers import write_jsonl

    from data_tools.pretokenize import TokenizeOptions, run
    from orthros_train.data.chat import ChatFields

    tok_dir = bpe_tokenizer_dir(300)
    rows = [{"prompt": f"Count to {n}", "answer": " ".join(str(i) for i in range(n))} for n in range(2, 8)]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    run(TokenizeOptions([str(src)], str(tok_dir), str(tmp_path / "rl"), kind="rl", progress=False,
                        fields=ChatFields(reference="answer")))
    _train(_recipe(
        tmp_path,
        {"name": "prompts", "reward": "orthros_train.train.rl:reference_match_reward", "stop_token_ids": [0]},
        {"group_size": 2, "prompts_per_step": 3, "max_new_tokens": 4},
        vocab=300, micro=6,
        data={"source": "indexed", "paths": [str(tmp_path / "rl")], "tokenizer": str(tok_dir)},
    ))
    records = metrics(tmp_path / "run")
    assert len(records) == 2
    assert all(0 < r["response_len_mean"] <= 4 and math.isfinite(r["loss"]) for r in records)


def test_ppo_epochs_and_minibatches_reuse_a_rollout_batch_and_resume_inside_it(tmp_path):
    """2 minibatches x 2 epochs: one rollout batch serves 4 steps; the first update is on-policy
    (ratio 1), the later ones see the ratio to the sampling policy; a run stopped after step 1
    (inside the batch) and resumed logs the same losses, bitwise."""
    task = {"name": "pattern", "prompt_len": 4, "response_len": 3, "token_rewards": True}
    rl = {"group_size": 4, "prompts_per_step": 2, "minibatches": 2, "ppo_epochs": 2}
    straight = _recipe(tmp_path / "a", task, rl, steps=4, micro=8)
    _train(straight)
    records = metrics(tmp_path / "a" / "run")
    assert [r["consumed_samples"] for r in records] == [16] * 4  # one draw of 2 minibatches x 8 rollouts
    assert records[0]["ratio_mean"] == 1.0 and records[0]["grad_norm"] > 0
    assert all(r["ratio_mean"] != 1.0 for r in records[1:])  # the policy moved since it sampled
    stopped = _recipe(tmp_path / "b", task, rl, steps=1, micro=8)
    _train(stopped)
    resumed = _recipe(tmp_path / "b", task, rl, steps=4, micro=8)
    _train(resumed)
    again = {r["step"]: r["loss"] for r in metrics(tmp_path / "b" / "run")}
    assert again == {r["step"]: r["loss"] for r in records}


def test_sampling_builds_no_second_model(tmp_path, monkeypatch):
    """An RL step samples with the trainer's own (sharded) policy: no OrthrosForCausalLM is built
    and no weights are gathered while it samples and trains."""
    from orthros_train.parallel.setup import destroy_parallel
    from orthros_train.train import trainer as trainer_module

    recipe = _recipe(tmp_path, {"name": "pattern", "prompt_len": 4, "response_len": 3},
                     {"group_size": 4, "prompts_per_step": 2, "kl_coef": 0.05}, steps=1, micro=8)
    built, gathered = [], []
    try:
        trainer = trainer_for(recipe)
        init = OrthrosForCausalLM.__init__
        monkeypatch.setattr(OrthrosForCausalLM, "__init__",
                            lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
        gather = trainer_module.gather_full_state_dict
        monkeypatch.setattr(trainer_module, "gather_full_state_dict",
                            lambda *a, **k: (gathered.append(1), gather(*a, **k))[1])
        metrics = trainer.train_step()
        trainer.close()
    finally:
        destroy_parallel()
    assert math.isfinite(metrics.loss) and metrics.objective["reward_mean"] >= 0
    assert built == [] and gathered == []


@pytest.mark.slow
def test_generation_on_tensor_and_context_parallel_shards_equals_one_device():
    """torchrun: prefill + decode on TP = 2 (with and without SP) and CP = 2 shards give the
    single-device model's logits and the same greedy and seeded sampled tokens; no TP rank
    creates a tensor of the full embedding's shape while it generates."""
    tp = result_of(torchrun("sharded_generation"))
    cp = result_of(torchrun("sharded_generation", "cp"))
    assert set(tp) == {"tp2", "tp2_sp"} and set(cp) == {"cp2"}
    for name, r in {**tp, **cp}.items():
        assert r["logit_diff"] <= 1e-5 and r["same_tokens"], (name, r)
    assert not tp["tp2"]["full_embedding"] and not tp["tp2_sp"]["full_embedding"], tp


# -- the recipe, end to end (orthros-train --config-name rl_tiny_cpu) -------------------------------
RL_TINY = ["--config-name", "rl_tiny_cpu", "trainer.progress=false", "trainer.wandb.enabled=false",
           "trainer.log_every=0"]  # fmt: skip


def rl_cli(*overrides: str, nproc: int = 1, cwd: Path) -> subprocess.Popen:
    return start_train(*RL_TINY, *overrides, nproc=nproc, cwd=cwd)


def finished(proc: subprocess.Popen) -> str:
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    return out


@pytest.mark.slow
def test_toy_task_reward_rises(tmp_path):
    finished(rl_cli("trainer.max_steps=40", f"trainer.run_dir={tmp_path / 'run'}", cwd=tmp_path))
    rewards = list(by_step(tmp_path / "run", "reward_mean").values())
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 1.0, (first, last)  # hits per 6-token response


@pytest.mark.slow
def test_two_ranks_log_the_same_losses_and_rewards_as_one(tmp_path):
    """torchrun, gloo: DP = 2 under ZeRO-3 (each rank samples half of the prompts) and TP = 2 (the
    policy and the frozen reference sharded); with a KL term, so the reference model and the
    policy's log-probs take part."""
    common = ["trainer.max_steps=3", "rl.kl_coef=0.05"]
    finished(rl_cli(*common, f"trainer.run_dir={tmp_path / 'one'}", cwd=tmp_path))
    layouts = {
        "dp2_zero3": ["parallel.data_parallel=2", "parallel.zero_stage=3", "trainer.micro_batch_size=32"],
        "tp2": ["parallel.tensor_parallel=2"],
    }
    for name, layout in layouts.items():
        finished(rl_cli(*common, *layout, f"trainer.run_dir={tmp_path / name}", nproc=2, cwd=tmp_path))
        # The KL diagnostic is a small difference of log-probs: the fp32 rounding of ZeRO-3's
        # reduce-scatter moves it by ~1e-5 of itself after a few steps, hence its own bound.
        for key, rel in (("loss", 1e-5), ("reward_mean", 1e-5), ("kl", 1e-4)):
            one, two = by_step(tmp_path / "one", key), by_step(tmp_path / name, key)
            assert sorted(one) == sorted(two) == [1, 2, 3]
            for step in one:
                assert two[step] == pytest.approx(one[step], rel=rel, abs=1e-7), (name, key, step, one, two)


@pytest.mark.slow
def test_kill_9_mid_run_resumes_bitwise(tmp_path):
    steps = ["trainer.max_steps=6", "trainer.save_every=2"]
    finished(rl_cli(*steps, f"trainer.run_dir={tmp_path / 'straight'}", cwd=tmp_path))
    run = tmp_path / "killed"
    proc = rl_cli(*steps, f"trainer.run_dir={run}", cwd=tmp_path)
    wait_for_step(run, 3, proc)  # the checkpoint of step 2 exists once step 3 is logged
    kill_tree(proc.pid)
    proc.wait()
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step_000000002", "step_000000004")
    out = finished(rl_cli(*steps, f"trainer.run_dir={run}", cwd=tmp_path))
    assert "resumed from" in out and latest in out
    for key in ("loss", "reward_mean"):
        straight, resumed = by_step(tmp_path / "straight", key), by_step(run, key)
        assert sorted(straight) == sorted(resumed) == list(range(1, 7))
        assert all(straight[s] == resumed[s] for s in straight), (key, straight, resumed)  # bitwise
