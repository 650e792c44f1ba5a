"""Runs one vLLM engine with speculative decoding in its own process and prints its greedy outputs
and acceptance counters as JSON (tests/serve/test_vllm_equality.py reads them).

Its own process because vLLM's n-gram proposer JIT-compiles with numba, which imports llvmlite, whose
``ffi.lib`` object answers ``vars()`` with a foreign-function wrapper; every later engine of the same
process then fails in its worker's kernel-override scan of ``sys.modules``
(``vllm/triton_utils/dispatcher.py``). One engine per process, as users run it, is unaffected.

    python spec_engine.py EXPORT_DIR SPEC_JSON PROMPTS_JSON NEW TOP_K
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    export, spec, prompts, new, top_k = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), \
        int(sys.argv[4]), int(sys.argv[5])
    llm = LLM(model=export, dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=32 << 20,
              seed=0, max_logprobs=top_k, speculative_config=spec, disable_log_stats=False)
    params = SamplingParams(max_tokens=new, temperature=0.0, logprobs=top_k, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    counts = {names[m.name]: int(m.value) for m in llm.get_metrics() if m.name in names}
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        "counts": counts,
    }
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
