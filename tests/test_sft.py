"""SFT: answer-span layouts give the gradient of a full-sequence computation restricted to the
answer tokens (per-token or per-conversation average); the demo's chat template; the recipe trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from fixtures import REPO, cli_env, metrics, run_train, tiny_model

from orthros_train.data import DataConfig, build_data
from orthros_train.data.sft import average_per_sequence
from orthros_train.errors import UserError
from orthros_train.phase import sft_layout
from orthros_train.train.global_loss import loss_units

V = 40


# Conversations: token ids and answer spans [start, end) inside each conversation.
CONVERSATIONS = [
    (11, [(4, 7), (9, 11)]),  # two answer turns
    (9, [(6, 9)]),
    (13, [(10, 12)]),
]
PACKING = [[0, 1], [2]]  # row 0 packs conversations 0 and 1, row 1 holds conversation 2


def conversations(seed: int = 0) -> list[tuple[torch.Tensor, list]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (n,), generator=g), spans) for n, spans in CONVERSATIONS]


def packed_layout(convs):
    rows, spans, docs = [], [], []
    for members in PACKING:
        ids, row_spans, doc, offset = [], [], [], 0
        for d, c in enumerate(members):
            tokens, conv_spans = convs[c]
            ids.append(tokens)
            row_spans += [(offset + a, offset + b) for a, b in conv_spans]
            doc.append(torch.full((tokens.numel(),), d))
            offset += tokens.numel()
        rows.append(torch.cat(ids))
        spans.append(row_spans)
        docs.append(torch.cat(doc))
    return sft_layout(rows, spans, document_ids=docs)


def direct_loss(model, convs, average: str) -> torch.Tensor:
    """Cross entropy of the answer tokens from a plain full-sequence forward of each conversation."""
    per_conv = []
    for tokens, spans in convs:
        logits = model(tokens[None]).logits[0]  # output token at every position
        targets = torch.cat([torch.arange(a, b) for a, b in spans])
        per_conv.append(F.cross_entropy(logits[targets - 1].double(), tokens[targets], reduction="none"))
    if average == "token":
        return torch.cat(per_conv).mean()
    return torch.stack([ce.mean() for ce in per_conv]).mean()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("average", ["token", "sequence"])
def test_sft_gradient_equals_full_sequence_computation_on_answer_tokens(average):
    # float64, the plain-torch attention; the output-stream affine off identity so the two streams differ
    model = tiny_model(V, output_affine="nudged", sliding_window=4, attention_backend="reference").double()
    convs = conversations()
    layout = packed_layout(convs)
    n_answer = sum(b - a for _, spans in convs for a, b in spans)
    assert layout.num_outputs == n_answer  # output tokens on the answer targets only
    units = loss_units(layout, average)  # labelled tokens, or conversations with an answer
    if average == "sequence":
        layout = average_per_sequence(layout)
    out = model.forward_layout(layout, loss_normalizer=units)
    out.loss.backward()
    got = grads(model)
    model.zero_grad(set_to_none=True)
    want_loss = direct_loss(model, convs, average)
    want_loss.backward()
    want = grads(model)
    # the model takes the cross entropy in fp32 (attention and norms too), hence float tolerances
    assert float(out.loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert got.keys() == want.keys()
    for name in got:
        scale = float(want[name].abs().max())
        assert float((got[name] - want[name]).abs().max()) <= 1e-5 * scale, name


def test_per_sequence_weights_make_every_conversation_count_the_same():
    convs = conversations(1)
    layout = average_per_sequence(packed_layout(convs))
    doc = torch.tensor([c for c, (_, spans) in enumerate(convs) for a, b in spans for _ in range(a, b)])
    per_conv = torch.zeros(len(convs), dtype=torch.float64).index_add_(0, doc, layout.loss_weights.double())
    torch.testing.assert_close(per_conv, torch.ones(3, dtype=torch.float64))  # each conversation sums to 1
    assert loss_units(layout, "sequence") == 3


def test_plain_chat_template_cuts_answers_ending_with_eos(plain_tokenizer_dir):
    """A BPE tokenizer without a chat template (like the tiny pretrained model's) takes the plain one."""
    from orthros_train.common.tokenizer import load_tokenizer
    from orthros_train.data.chat import render_conversation
    from orthros_train.data.embedded import with_chat_template
    from orthros_train.data.indexed import MODE_ANSWER, MODE_PROMPT

    tok = with_chat_template(load_tokenizer(plain_tokenizer_dir))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is AI?"},
        {"role": "assistant", "content": "Machines that think."},
        {"role": "user", "content": "Really?"},
        {"role": "assistant", "content": "Yes."},
    ]
    assert tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True) == (
        "System: Be brief.\nUser: What is AI?\nAssistant:"
    )
    segments, modes = render_conversation(tok, msgs)
    text = [tok.decode(s) for s in segments]
    assert modes == [MODE_PROMPT, MODE_ANSWER, MODE_PROMPT, MODE_ANSWER]
    assert text[1] == " Machines that think.<|endoftext|>" and text[3] == " Yes.<|endoftext|>"
    assert text[2] == "User: Really?\nAssistant:"
    assert int(segments[3][-1]) == tok.eos_token_id  # the model learns to stop


def test_demo_data_sequence_average_and_held_out_eval(plain_tokenizer_dir, tmp_path):
    # the embedded chat corpus, rendered on first use with the given tokenizer + the plain template
    cfg = dict(source="embedded", corpus="chatterbot", tokenizer=plain_tokenizer_dir, split="90,10,0",
               cache_dir=str(tmp_path / "cache"))
    token = build_data(DataConfig(**cfg), 128, 4, 0)
    seq = build_data(DataConfig(**cfg, loss_average="sequence"), 128, 4, 0)
    a, b = token.next_batch(), seq.next_batch()
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert torch.all(a.loss_weights == 1)
    doc = b.document_ids()[b.output_index]
    per_doc = torch.zeros(int(doc.max()) + 1).index_add_(0, doc, b.loss_weights)
    used = per_doc[per_doc > 0]
    torch.testing.assert_close(used, torch.ones_like(used))
    # held-out conversations: evaluated per token whatever the training average
    valid = seq.valid_batches(2)
    assert valid and all(torch.all(v.loss_weights == 1) for v in valid)
    assert token.tokenizer.chat_template  # the template travels with the recorded tokenizer
    with pytest.raises(UserError, match="loss_average"):
        DataConfig(**cfg, loss_average="mean")


@pytest.mark.slow
def test_sft_tiny_cpu_recipe_trains_with_eval(plain_tokenizer_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "--config-name", "sft_tiny_cpu", "model.init_from=null", f"data.tokenizer={plain_tokenizer_dir}",
        "data.tokenizer_vocab_size=1024", f"data.cache_dir={tmp_path / 'cache'}", "data.split='90,10,0'",
        "data.loss_average=sequence", "model.hidden_size=64", "model.num_hidden_layers=2",
        "trainer.max_steps=12", "trainer.eval_every=6", "trainer.eval_batches=2", "trainer.seq_len=128",
        "trainer.micro_batch_size=4", "trainer.progress=false", "trainer.sample_tokens=4",
        "trainer.wandb.enabled=false", "optim.lr=3e-3", "optim.warmup_steps=2", f"trainer.run_dir={run_dir}",
        cwd=tmp_path, env=cli_env(WANDB_MODE="disabled"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert (run_dir / "checkpoints").is_dir()


def test_bench_sweep_attention_work_follows_answer_tokens():
    """bench/train_step.py --sweep: output-stream pairs grow with answer tokens x T, base pairs with T*W."""
    w = 16
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "train_step.py"), "--json", "--lengths", "64", "128", "--hidden", "32",
         "--layers", "1", "--heads", "2", "--vocab", "64", "--window", str(w), "--steps", "1", "--warmup", "0",
         "--layouts", "rl", "--sweep", "--sweep-answer", "8", "--sweep-answers", "8", "32"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert [r["layout"] for r in result["rows"]] == ["rl", "rl"]
    sweep = result["sweep"]
    assert {(r["layout"], r["seq_len"], r["answer_tokens"]) for r in sweep} == {
        (k, t, a) for k in ("sft", "rl") for t, a in ((64, 8), (128, 8), (128, 32))
    }
    for r in sweep:
        t, a = r["seq_len"], r["answer_tokens"]
        assert r["outputs"] == a
        assert r["output_pairs"] == sum(p + 1 for p in range(t - a - 1, t - 1))  # answer queries see all keys
        assert r["base_pairs"] == sum(min(w, p + 1) for p in range(t))
        assert r["dense_pairs"] == t * (t + 1) // 2
