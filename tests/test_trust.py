"""Nothing read from disk runs code (docs/checkpoints.md, 'Trust').

A crafted ``rank_00000.pt`` (an object whose ``__reduce__`` calls ``os.system``, its manifest
entry fixed so the checkpoint verifies) is refused on resume with one line and runs nothing; an
export whose ``modeling_orthros.py`` was edited runs nothing under ``orthros-convert verify`` or
the eval loaders unless ``--trust-remote-code`` is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import TINY_HF_SHAPE, cli_env

from orthros_train.train.rank_state import ProcessRNG, UnsafeCheckpointError, load_rank_state

W = 16


class _Payload:
    """Unpickling this runs a shell command (what a crafted checkpoint would carry)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned-by-checkpoint > {self.marker}",))


def plant(checkpoint: Path, marker: Path, rank_file: str = "rank_00000.pt") -> None:
    """Add the payload to ``checkpoint``'s rank file and fix its size and sha256 in the manifest."""
    path = checkpoint / rank_file
    state = torch.load(path, weights_only=True)  # our own file: plain data
    state["data"]["extra"] = _Payload(marker)
    torch.save(state, path)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    entry = manifest["files"][rank_file]
    entry["size"] = path.stat().st_size
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_crafted_rank_file_is_refused_on_resume_and_runs_nothing(make_trainer, tmp_path):
    trainer = make_trainer("trainer.max_steps=2", "trainer.save_every=1")
    trainer.fit()
    root = tmp_path / "run" / "checkpoints"
    marker = tmp_path / "PWNED"
    plant(root / "step_000000002", marker)
    for resume in ("auto", str(root / "step_000000002")):
        with pytest.raises(UnsafeCheckpointError, match=r"rank_00000.pt: refused.*Nothing in it was run"):
            make_trainer("trainer.max_steps=3", f"trainer.resume={resume}").fit()
        assert not marker.exists()
    # the planted file would run its payload under an unrestricted load: the test can fail
    torch.load(root / "step_000000002" / "rank_00000.pt", weights_only=False)
    assert marker.read_text().strip() == "pwned-by-checkpoint"


def test_rank_state_round_trips_the_random_streams_and_reads_older_files(tmp_path):
    rng = ProcessRNG()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    torch.save({"rng": rng.state_dict(), "data": {"consumed_samples": 4}}, tmp_path / "new.pt")
    # an older file: numpy's state as numpy's own tuple of an array and numbers
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"rng": old, "data": {}}, tmp_path / "old.pt")
    want = (random.random(), np.random.standard_normal(), np.random.random(), torch.rand(1))
    for name in ("new.pt", "old.pt"):
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        rng.load_state_dict(load_rank_state(tmp_path / name)["rng"])
        got = (random.random(), np.random.standard_normal(), np.random.random(), torch.rand(1))
        assert got[:3] == want[:3] and torch.equal(got[3], want[3]), name


def test_no_unrestricted_unpickling_in_the_code():
    root = Path(__file__).resolve().parents[1]
    found = []
    for folder in ("orthros_train", "data_tools", "bench", "launch"):
        for path in (root / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "weights_only=False" in line or "pickle.load" in line:
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, found


# -- an export with edited remote code ----------------------------------------------------------------


@pytest.fixture(scope="module")
def evil_export(tmp_path_factory):
    """An Orthros conversion of a tiny Llama and its to-hf export whose modeling_orthros.py writes
    a marker file when imported; returns (orthros dir, export dir, marker)."""
    transformers = pytest.importorskip("transformers")
    from orthros_train.convert.from_hf import convert_from_hf
    from orthros_train.convert.to_hf import convert_to_hf

    root = tmp_path_factory.mktemp("trust")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, **TINY_HF_SHAPE, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "hf")
    convert_from_hf(root / "hf", root / "orthros", sliding_window=W)
    convert_to_hf(root / "orthros", root / "export")
    marker = root / "PWNED2"
    code = root / "export" / "modeling_orthros.py"
    text = code.read_text().replace(  # after the __future__ import, which must come first
        "from __future__ import annotations\n",
        f"from __future__ import annotations\nopen({str(marker)!r}, 'w').write('remote code ran')\n", 1)
    assert "remote code ran" in text
    code.write_text(text)
    return root / "orthros", root / "export", marker


def test_verify_runs_none_of_the_exports_code_by_default(evil_export, capsys):
    from orthros_train.convert.cli import main as convert_main

    orthros, export, marker = evil_export
    assert convert_main(["verify", str(export), str(orthros)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["max_abs_diff"] < 1e-4
    assert not marker.exists()


def test_eval_loaders_run_none_of_the_exports_code(evil_export):
    from orthros_train.common.tokenizer import load_tokenizer
    from orthros_train.errors import UserError
    from orthros_train.infer.loading import load_model

    _, export, marker = evil_export
    with pytest.raises(UserError, match="not an Orthros model config"):
        load_model(str(export))
    load_tokenizer(str(export), required=False)
    assert not marker.exists()


@pytest.mark.slow
def test_verify_with_trust_remote_code_runs_the_exports_code(evil_export, tmp_path):
    """The flag is the one way the folder's code runs (and the planted code really would run)."""
    orthros, shared, shared_marker = evil_export
    export, marker = tmp_path / "export", tmp_path / "PWNED2"  # a copy: the shared marker stays absent
    shutil.copytree(shared, export)
    code = export / "modeling_orthros.py"
    code.write_text(code.read_text().replace(str(shared_marker), str(marker)))
    proc = subprocess.run(
        [sys.executable, "-m", "orthros_train.convert.cli", "verify", str(export), str(orthros), "--trust-remote-code"],
        env=cli_env(HF_MODULES_CACHE=str(tmp_path / "modules")), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "remote code ran"
