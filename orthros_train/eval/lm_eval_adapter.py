"""lm-evaluation-harness adapter: ``OrthrosLM`` implements lm-eval's LM interface.

``loglikelihood`` / ``loglikelihood_rolling`` score continuations with one packed forward per
batch (ragged rows, no padding) whose output tokens sit only on the positions that predict the
continuation: the base stream reads the context with its window, the output stream scores.
``generate_until`` runs ``orthros_train.infer.generate`` (prefill + decode with the KV cache)
and cuts at the stop strings.

``lm_eval_cli.run_vllm_lm_eval`` is the other route: lm-eval's own ``vllm`` model type on an exported checkpoint
(``orthros-convert to-hf``), served by vLLM through this package's plugin. Its loglikelihoods come
from vLLM's prompt logprobs, for which the served model puts an output token at every prompt
position of those requests (docs/serve.md); it needs vLLM and lm-eval in one environment (the
serving one: ``make serve-env`` installs lm-eval there too).

Registered with lm-eval as model ``orthros``: through the ``lm_eval.models`` entry point (lm-eval
versions that discover plugins: ``lm_eval --model orthros --model_args pretrained=CKPT``), by
importing this module, or by running it: ``python -m orthros_train.eval.lm_eval_cli`` is
lm-eval's own command line with the model registered (for releases that do not read entry
points). ``orthros-eval lm-eval`` does the same for you.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from orthros_train.errors import UserError

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install 'orthros-train[eval]'") from exc

from orthros_train.common.tokenizer import load_tokenizer
from orthros_train.infer.generate import cut_at_stop, generate
from orthros_train.infer.loading import load_model
from orthros_train.ops.keys import prompt_tail_flags
from orthros_train.phase.builders import rl_layout


@register_model("orthros")
class OrthrosLM(TemplateLM):
    """An Orthros checkpoint (``pretrained=DIR``) or an in-memory ``model`` + ``tokenizer``."""

    def __init__(
        self,
        pretrained: str | None = None,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_batch_tokens: int = 16384,
        prefill_chunk_size: int | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it; batches here are bounded by max_batch_tokens
        **overrides: Any,
    ) -> None:
        """``overrides`` are config fields changed at load time (e.g. ``sliding_window=256``)."""
        super().__init__()
        if model is None:
            if pretrained is None:
                raise UserError("OrthrosLM needs pretrained=CHECKPOINT_DIR (or model= and tokenizer=)")
            model = load_model(pretrained, device=device, dtype=dtype, **overrides)
            tokenizer = tokenizer or load_tokenizer(pretrained, pad_with_eos=True)
        if tokenizer is None:
            raise UserError("OrthrosLM needs a tokenizer (none given and none found in the checkpoint)")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" -> 8
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefill_chunk_size = int(prefill_chunk_size) if prefill_chunk_size else None
        cfg_max = int(getattr(model.config, "max_position_embeddings", 4096))
        self._max_length = int(max_length) if max_length else min(cfg_max, 4096)
        self._device = next(model.parameters()).device

    # -- tokenization ---------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else 0

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "orthros")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- scoring ------------------------------------------------------------------------------------
    @torch.no_grad()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]],
                     as_prompt: bool = False) -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), continuation is the greedy choice)`` per pair.

        Rows are ``(context + continuation)`` cut from the left to ``max_length + 1`` tokens; they
        are packed ragged, longest first, up to ``max_batch_tokens`` per forward. With a global
        tail the continuation is read as an answer ``generate`` produced (its tokens and the tail
        before it global), or with ``as_prompt`` each row as one prompt (its last ``R`` tokens
        global): what an export's forward and vLLM's prompt logprobs compute.
        """
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        rows, spans = [], []
        for ctx, cont in pairs:
            if not cont:
                raise UserError("an empty continuation has no likelihood to score")
            full = (list(ctx) + list(cont))[-(self.max_length + 1) :]
            n_cont = min(len(cont), len(full) - 1)
            rows.append(full)
            spans.append((len(full) - n_cont, len(full)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        batch: list[int] = []
        for i in order + [None]:
            if i is not None and (
                not batch or sum(len(rows[j]) for j in batch) + len(rows[i]) <= self.max_batch_tokens
            ):
                batch.append(i)
                continue
            if batch:
                scored = self._score_batch([rows[j] for j in batch], [spans[j] for j in batch], as_prompt)
                for j, res in zip(batch, scored):
                    results[j] = res
            batch = [i] if i is not None else []
        return results  # type: ignore[return-value]

    def _score_batch(self, rows: list[list[int]], spans: list[tuple[int, int]],
                     as_prompt: bool = False) -> list[tuple[float, bool]]:
        layout = rl_layout([torch.tensor(r) for r in rows], [[s] for s in spans])
        tail = self.model.config.base_global_tail
        if as_prompt and tail:
            layout.answers = False
            layout.base_global = torch.cat([prompt_tail_flags(len(r), 0, len(r), tail) for r in rows])
            layout.validate()  # counts the global tokens on the host
        layout = layout.to(self._device)
        logits = self.model.forward_layout(layout).logits.float()
        logp = F.log_softmax(logits, dim=-1)
        token_logp = logp.gather(-1, layout.labels[:, None]).squeeze(-1).cpu()
        greedy = (logits.argmax(-1) == layout.labels).cpu()
        out, offset = [], 0
        for start, end in spans:
            n = end - start
            out.append((float(token_logp[offset : offset + n].sum()), bool(greedy[offset : offset + n].all())))
            offset += n
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.score_tokens([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (string,) = req.args
            windows = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            # A document is read, not generated: each window as a prompt. As answers every token
            # of a window would be global under a tail (the base stream dense, and other numbers
            # than the export's forward or vLLM give the same windows).
            total = sum(lp for lp, _ in self.score_tokens(windows, as_prompt=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # -- generation -------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for idx in groups.values():
            kwargs = dict(requests[idx[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tokenizer.decode([self.eot_token_id])
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_gen = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", 256)))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            sampling = dict(
                temperature=temperature if do_sample or temperature > 0 else 0.0,
                top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                top_k=int(kwargs.pop("top_k", 0) or 0),
                seed=kwargs.pop("seed", None),
            )
            budget = max(1, self.max_length - max_gen)
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s : s + self.batch_size]
                prompts = []
                for i in chunk:
                    ids = self.tok_encode(requests[i].args[0]) or [self.prefix_token_id]
                    prompts.append(ids[-budget:])

                def stop_fn(_row: int, new: list[int], until: list[str] = until) -> bool:
                    tail = self.tokenizer.decode(new[-32:], skip_special_tokens=False)
                    return any(u in tail for u in until)

                res = generate(
                    self.model,
                    prompts,
                    max_new_tokens=max_gen,
                    stop_token_ids=(self.eot_token_id,),
                    prefill_chunk_size=self.prefill_chunk_size,
                    stop_fn=stop_fn,
                    **sampling,
                )
                for i, seq in zip(chunk, res.sequences):
                    text = cut_at_stop(self.tokenizer.decode(seq, skip_special_tokens=False), until)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

