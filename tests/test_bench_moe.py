"""bench/moe_routing.py: the expert-read counts and the load-balance bookkeeping it reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "moe_routing.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("moe_routing_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_moe(policy: str):
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM

    torch.manual_seed(0)
    cfg = OrthrosConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16, sliding_window=4,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, moe_routing=policy)
    return OrthrosForCausalLM(cfg).eval()


@pytest.mark.parametrize("policy", ["independent", "tied", "joint"])
def test_generation_reads_count_the_router_choices(policy):
    bench = _bench_module()
    model = _tiny_moe(policy)
    prompts = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    reads = bench.generation_reads(model, prompts, new_tokens=4)
    k = model.config.num_experts_per_tok
    assert reads["batch"] == 3 and reads["top_k"] == k
    # A pair reads between k (both streams on the same experts) and 2k experts; tied/joint exactly k.
    assert k <= reads["experts_per_request_pair"] <= 2 * k
    if policy == "independent":
        assert reads["max_experts_per_request_pair"] > k  # random weights: the streams disagree somewhere
    else:
        assert reads["max_experts_per_request_pair"] == k and reads["experts_per_prefill_last_pair"] == k
    assert k <= reads["experts_per_decode_step"] <= min(model.config.num_experts, 2 * k * 3)
    # Bytes follow the count: gate, up and down projections in bf16 per distinct expert and sparse layer.
    layers = len(model.config.sparse_layers)
    per_expert = 3 * model.config.hidden_size * model.config.moe_intermediate_size * 2
    assert reads["expert_mib_per_decode_step"] == pytest.approx(
        reads["experts_per_decode_step"] * layers * per_expert / 2**20)
    assert all(layer.mlp.routing_log is None for layer in model.layers if hasattr(layer.mlp, "routing_log"))


def test_load_balance_counts_every_routed_token():
    bench = _bench_module()
    model = _tiny_moe("tied")
    docs = [list(range(1, 40)), list(range(5, 30))]
    balance = bench.load_balance(model, docs, seq_len=16)
    # Both streams route at the pretraining layout; the last layer's base runs no MLP.
    assert set(balance) == {"base", "output"}
    assert balance["output"]["layers"] == 3 and balance["base"]["layers"] == 2
    for stream in balance.values():
        assert stream["max_over_mean"] >= 1.0 and stream["cv"] >= 0.0


def test_reads_command_writes_its_table(tmp_path):
    out = tmp_path / "reads.json"
    proc = subprocess.run([sys.executable, str(BENCH), "reads", "--prompt", "24", "--new-tokens", "2",
                           "--batches", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["independent", "tied", "joint"]
    by = {r["policy"]: r for r in rows}
    assert by["tied"]["max_experts_per_request_pair"] == by["tied"]["top_k"] == 8
    assert by["independent"]["experts_per_request_pair"] > by["tied"]["experts_per_request_pair"]
    assert "| tied | 1 |" in proc.stdout
