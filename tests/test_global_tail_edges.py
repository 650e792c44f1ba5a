"""The global tail at the edges of the model's context: a tail that, with the window, covers every
position the model reads is refused in one line (the base stream would be dense); from-hf's default
tail steps aside there; ``verify --tokens`` up to the whole context works on a checkpoint with a tail."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from fixtures import TINY_HF_SHAPE, tiny_model

from orthros_train.convert.cli import main as convert_main
from orthros_train.convert.from_hf import DEFAULT_GLOBAL_TAIL, convert_from_hf
from orthros_train.errors import UserError

W = 8
CONTEXT = 40  # the HF model's max_position_embeddings: longer than W, reached by W + DEFAULT_GLOBAL_TAIL


@pytest.fixture(scope="module")
def short_context_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, **TINY_HF_SHAPE, max_position_embeddings=CONTEXT)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root)
    return root


def test_a_tail_that_leaves_no_query_windowed_is_refused():
    """A base query's window cuts its prompt only at positions >= W before the last R tokens: with
    R + W >= max_position_embeddings there is none (R = 10**9 was accepted, and a dry run priced the
    prefill at 15,625,001x)."""
    tiny_model(sliding_window=W, max_position_embeddings=64, base_global_tail=64 - W - 1)  # one position left
    for tail in (64 - W, 10**9):
        with pytest.raises(UserError, match=f"base_global_tail={tail} with sliding_window={W} and "
                                            "max_position_embeddings=64: no prompt .* below 56"):
            tiny_model(sliding_window=W, max_position_embeddings=64, base_global_tail=tail)
    # the sliding baseline reads the same rule; the dense one ignores the tail
    with pytest.raises(UserError, match="below 56"):
        tiny_model(attention_type="sliding", sliding_window=W, max_position_embeddings=64, base_global_tail=60)
    tiny_model(attention_type="dense", sliding_window=W, max_position_embeddings=64, base_global_tail=60)


def test_from_hf_refuses_such_a_tail_in_one_line_and_writes_nothing(short_context_llama, tmp_path, capsys):
    dst = tmp_path / "dst"
    code = convert_main(["from-hf", str(short_context_llama), str(dst), "--window", str(W),
                         "--global-tail", str(10**9)])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "base_global_tail=1000000000" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not dst.exists()


def test_from_hf_default_tail_is_0_where_window_and_tail_reach_the_context(short_context_llama, tmp_path):
    assert W < CONTEXT <= W + DEFAULT_GLOBAL_TAIL
    assert convert_from_hf(short_context_llama, tmp_path / "o", sliding_window=W).config.base_global_tail == 0
    report = convert_from_hf(short_context_llama, tmp_path / "o2", sliding_window=W, global_tail=CONTEXT - W - 1)
    assert report.config.base_global_tail == CONTEXT - W - 1


def test_verify_over_the_whole_context_with_a_tail(short_context_llama, tmp_path, capsys):
    """verify --tokens N > W raises the checkpoint's window to N; with a tail and N at the model's
    context that config was refused ("the window already covers every position ... set
    model.base_global_tail=0"), a key verify has no flag for. With W >= N the tail changes nothing."""
    ckpt = tmp_path / "o"
    assert convert_main(["from-hf", str(short_context_llama), str(ckpt), "--window", str(W),
                         "--global-tail", "4"]) == 0  # fmt: skip
    capsys.readouterr()
    assert convert_main(["verify", str(short_context_llama), str(ckpt), "--tokens", str(CONTEXT)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["window"] == CONTEXT and result["argmax_agreement"] == 1.0
    assert result["max_abs_diff"] < 1e-4 * max(result["max_abs_logit"], 1.0)


def test_ppl_says_the_tail_does_not_change_it():
    """``orthros-eval ppl --override base_global_tail=R`` reads pretraining layouts (no prompt, no
    tail): the numbers are the R = 0 ones, and the run says so instead of looking measured."""
    from orthros_train.eval.ppl import run_ppl

    doc = [int(t) for t in torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0))]
    notes, quiet = [], []
    with_tail = run_ppl(tiny_model(sliding_window=W, base_global_tail=4), [doc], seq_len=32, log=notes.append)
    without = run_ppl(tiny_model(sliding_window=W), [doc], seq_len=32, log=quiet.append)
    assert with_tail["loss"] == without["loss"]
    assert any("base_global_tail=4 does not change these numbers" in line for line in notes)
    assert not any("base_global_tail" in line for line in quiet)


def test_an_override_of_a_setting_the_recipe_leaves_out_names_the_plus_form():
    """``model.base_global_tail=4`` on tiny_cpu (whose model section does not write the key) was
    refused as "not a key ... a key nothing reads": the typed config reads it; Hydra only needs ``+``."""
    from orthros_train.train.cli import override_typo

    assert override_typo("tiny_cpu", ["model.base_global_tail=4"]) == (
        "model.base_global_tail=4: recipe tiny_cpu does not state model.base_global_tail (a model setting, "
        "default 0); set it with +model.base_global_tail=4")
    assert "default 'off'" in override_typo("tiny_cpu", ["model.fused_tokenwise=on"])
    assert "is not a key of recipe tiny_cpu" in override_typo("tiny_cpu", ["model.base_global_tial=4"])
    assert override_typo("tiny_cpu", ["+model.base_global_tail=4"]) is None


class _WordTokenizer:
    """Token ids written as words ("5 17 3"): enough tokenizer for the lm-eval adapter."""

    eos_token_id, bos_token_id, name_or_path = 0, 1, "words"

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [int(w) for w in text.split()]}


@torch.no_grad()
def test_lm_eval_rolling_windows_are_read_as_prompts():
    """``loglikelihood_rolling`` scores a document: each window is read as one prompt (its last R
    tokens global), as an export's forward and vLLM's prompt logprobs read it. Scored as answers,
    every token of a window was global under a tail: the base stream dense, other numbers."""
    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    import torch.nn.functional as F
    from lm_eval import utils as lm_utils

    from orthros_train.convert.prompt_logits import prompt_logits
    from orthros_train.eval.lm_eval_adapter import OrthrosLM

    model = tiny_model(61, output_affine="resampled", sliding_window=4, sink_tokens=1,
                       base_global_tail=3).double().eval()  # fmt: skip
    lm = OrthrosLM(model=model, tokenizer=_WordTokenizer(), max_length=12)
    ids = torch.randint(2, 61, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    (rolled,) = lm.loglikelihood_rolling([SimpleNamespace(args=(" ".join(map(str, ids)),))])
    windows = [lm_utils.make_disjoint_window(w)
               for w in lm_utils.get_rolling_token_windows(ids, lm.prefix_token_id, 12, 1)]  # fmt: skip
    want = 0.0
    for ctx, cont in windows:
        full = torch.tensor((ctx + cont)[-13:])
        logp = F.log_softmax(prompt_logits(model, full[None])[0].float(), -1)
        want += float(logp[-len(cont) - 1 : -1].gather(-1, full[-len(cont) :, None]).sum())
    assert abs(rolled - want) < 1e-4
    as_answers = sum(lp for lp, _ in lm.score_tokens(windows))
    assert abs(as_answers - want) > 1e-3
