"""Long-context extension: the sequence-length schedule (stages, constant tokens, resume) and the
CPU-scale extension run (tiny model trained at 256, extended to 2K with RoPE scaling, needle
recall at 2K with window 128)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import QUIET_RUN, SMALL_TINY_CPU, by_step, run_train, tiny_model

from orthros_train.data.sampler import ResumableSampler
from orthros_train.data.schedule import SeqLenScheduledData, check_seq_len_schedule
from orthros_train.errors import UserError


class FakeData:
    """The build_data interface over a synthetic stream: sample i of length L is [i*L, (i+1)*L)."""

    def __init__(self, seq_len: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.sampler = ResumableSampler(10_000, micro_batch_size, seed=0, dp_rank=dp_rank, dp_size=dp_size)
        self.tokenizer, self.vocab_size, self.eod_token_id = "tok", 7, 0

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def next_batch(self) -> np.ndarray:
        idx = self.sampler.next_indices()
        return np.stack([np.arange(i * self.seq_len, (i + 1) * self.seq_len) for i in idx])

    def valid_batches(self, n: int) -> list:
        return [np.zeros((self.micro_batch_size, self.seq_len))] * n

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


SCHEDULE = [(0, 32), (3, 64), (5, 128)]


def _scheduled(grad_accum: int = 2, dp_rank: int = 0, dp_size: int = 1) -> SeqLenScheduledData:
    return SeqLenScheduledData(
        lambda length, micro: FakeData(length, micro, dp_rank, dp_size), list(SCHEDULE), 128, 1, grad_accum
    )


def test_stages_switch_at_their_step_with_constant_tokens():
    data = _scheduled(grad_accum=2)
    shapes = []
    for _step in range(7):
        shapes.append({data.next_batch().shape for _ in range(2)})
    assert shapes == [{(4, 32)}] * 3 + [{(2, 64)}] * 2 + [{(1, 128)}] * 2
    assert all(int(np.prod(next(iter(s)))) == 128 for s in shapes)  # tokens per micro batch
    assert data.tokenizer == "tok" and data.seq_len == 128
    # A new stage continues through the stream instead of re-reading it: stage 2 skips the
    # 3 steps x 2 micro batches x 4 samples x 32 tokens of stage 1 = 768 tokens = 12 samples of 64.
    assert data.consumed_tokens == 7 * 2 * 128


def test_resume_lands_in_the_same_stage_at_the_same_sample():
    straight = _scheduled()
    ref = [straight.next_batch() for _ in range(14)]
    for cut in (3, 6, 7, 9, 11):  # inside stages and exactly at their boundaries (6, 10 micro batches)
        first = _scheduled()
        got = [first.next_batch() for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
        second = _scheduled()
        second.load_state_dict(state)
        got += [second.next_batch() for _ in range(14 - cut)]
        assert all(np.array_equal(a, b) for a, b in zip(ref, got)), cut


def test_data_parallel_ranks_split_each_stage():
    ranks = [_scheduled(dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(14):
        a, b = (r.next_batch() for r in ranks)
        assert a.shape == b.shape and not set(a.ravel()) & set(b.ravel())


def test_bad_schedules_name_the_field():
    with pytest.raises(UserError, match="start with a stage at step 0"):
        check_seq_len_schedule([[5, 64]], 128, 1)
    with pytest.raises(UserError, match="lengths must increase"):
        check_seq_len_schedule([[0, 64], [5, 32]], 128, 1)
    with pytest.raises(UserError, match=r"does not divide .*trainer.seq_len x trainer.micro_batch_size = 128"):
        check_seq_len_schedule([[0, 48], [5, 128]], 128, 1)
    with pytest.raises(UserError, match="never runs"):
        check_seq_len_schedule([[0, 64], [50, 128]], 128, 1, max_steps=10)
    with pytest.raises(UserError, match="same schedule"):
        data = _scheduled()
        state = data.state_dict()
        state["seq_len_schedule"] = [[0, 128]]
        _scheduled().load_state_dict(state)


# 5 steps at a constant learning rate, 32-token sequences for 2 steps then 64.
TINY = [
    "--config-name", "tiny_cpu", *SMALL_TINY_CPU, *QUIET_RUN, "optim.schedule=constant", "optim.warmup_steps=0",
    "trainer.max_steps=5", "trainer.seq_len_schedule=[[0,32],[2,64]]",
]  # fmt: skip


def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run_train(*TINY, f"trainer.run_dir={run_dir}", *overrides, cwd=run_dir.parent)


@pytest.mark.slow
def test_trainer_resumes_inside_a_later_stage_bitwise(tmp_path):
    """A run killed in the 64-token stage resumes there at the same sample: same losses."""
    straight = _train(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _train(tmp_path / "killed", "trainer.save_every=3", "trainer.fail_at_step=4")
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = _train(tmp_path / "killed", "trainer.save_every=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = by_step(tmp_path / "straight"), by_step(tmp_path / "killed")
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4, 5]
    assert ref == got


# --- CPU-scale extension: 256 -> 2K tokens with window 128 -------------------------------------

W = 128
SHORT, LONG = 256, 2048
VOCAB = 96  # keys, values and filler from three disjoint thirds (eval/recall.py's token format)
YARN = {"rope_type": "yarn", "factor": LONG / SHORT, "original_max_position_embeddings": SHORT}


def _recall_batch(rng, length: int, n: int):
    from orthros_train.eval.recall import make_token_sample

    samples = [make_token_sample(VOCAB, length, 1, rng) for _ in range(n)]
    ids = torch.tensor([s.input_ids for s in samples])
    pos = torch.tensor([s.output_positions for s in samples])
    return ids, pos, torch.tensor([s.targets for s in samples])


def _fit(model, rng, length: int, batch: int, steps: int, lr: float) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        ids, pos, labels = _recall_batch(rng, length, batch)
        loss = model(ids, output_positions=pos, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _needle_recall(model, length: int, min_distance: int) -> dict:
    from orthros_train.eval.recall import run_recall

    model.eval()
    return run_recall(
        model, None, length=length, num_pairs=1, num_samples=32, fmt="tokens", min_distance=min_distance, seed=1,
        log=None,
    )  # fmt: skip


@pytest.mark.slow
def test_tiny_model_extended_from_256_to_2k_recalls_needles_beyond_the_window(tmp_path):
    """Passkey retrieval (one key -> value pair in random filler, queried at the end) learnt at
    256 tokens, then the model is extended to 2K with YaRN (factor 8) through the same path a run
    uses (a checkpoint reloaded with another ``rope_scaling``) and trained a few steps at 2K.
    The needle sits 512..2048 tokens before its query: 4-16 windows away, reachable only through
    the output stream's full attention. Chance is 1/32 (the value third of the vocabulary)."""
    import random

    from orthros_train.model import OrthrosForCausalLM

    model = tiny_model(VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=None, intermediate_size=128,
                       sliding_window=W, max_position_embeddings=SHORT)  # fmt: skip
    rng = random.Random(0)
    short_loss = _fit(model, rng, SHORT, batch=16, steps=350, lr=3e-3)
    at_short = _needle_recall(model, SHORT, min_distance=W)
    model.save_pretrained(tmp_path / "short")

    plain = OrthrosForCausalLM.from_pretrained(tmp_path / "short")
    zero_shot_plain = _needle_recall(plain, LONG, min_distance=512)
    extended = OrthrosForCausalLM.from_pretrained(tmp_path / "short", rope_scaling=YARN, max_position_embeddings=LONG)
    assert extended.layers[0].self_attn.rotary.attention_scaling > 1.0  # YaRN really applied
    zero_shot_yarn = _needle_recall(extended, LONG, min_distance=512)
    long_loss = _fit(extended, rng, LONG, batch=4, steps=20, lr=1e-3)
    at_long = _needle_recall(extended, LONG, min_distance=512)

    report = {
        "train_loss_256": round(short_loss, 3),
        "recall_256_beyond_window": at_short["accuracy_beyond_window"],
        "recall_2k_zero_shot_plain_rope": zero_shot_plain["accuracy"],
        "recall_2k_zero_shot_yarn": zero_shot_yarn["accuracy"],
        "train_loss_2k": round(long_loss, 3),
        "recall_2k_after_extension": at_long["accuracy"],
    }
    print(json.dumps(report))
    assert all(q["distance"] >= 512 > W for q in at_long["queries"])
    assert at_long["accuracy_beyond_window"] == at_long["accuracy"]
    assert at_long["accuracy"] >= 0.5, report  # chance: 1/32
