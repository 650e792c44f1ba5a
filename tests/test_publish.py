"""Publishing folders (common/publish.py) and the conversions that use it (convert/destination.py).

A folder is built aside and swapped in whole: a kill -9 or a full disk at any moment leaves the
previous folder (same sha256 of every file) or the whole new one; ``--overwrite`` replaces only
what an earlier conversion wrote; symbolic links are refused with one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fixtures import TINY_HF_SHAPE, cli_env

from orthros_train.common import publish
from orthros_train.common.publish import UnsafeFolderError, publish_folder, recover
from orthros_train.convert.checkpoint_io import ConversionError
from orthros_train.convert.cli import main as convert_main
from orthros_train.convert.destination import MANIFEST
from orthros_train.convert.from_hf import convert_from_hf
from orthros_train.convert.to_hf import convert_to_hf

transformers = pytest.importorskip("transformers")

W = 16


def checksums(folder: Path) -> dict[str, str]:
    """``relative path -> sha256`` of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name != folder.name)


# -- the publish module --------------------------------------------------------------------------------


def _write(files: dict[str, str]) -> Callable[[Path], str]:
    def write(folder: Path) -> str:
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        return "done"

    return write


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-fallback"])
def test_publish_replaces_whole_and_carries_named_entries(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    target = tmp_path / "out"
    assert publish_folder(target, _write({"a.txt": "1", "sub/b.txt": "2", "keep.md": "mine"})) == "done"
    publish_folder(target, _write({"a.txt": "new"}), carry=["keep.md", "missing"])
    assert checksums(target).keys() == {"a.txt", "keep.md"}
    assert (target / "a.txt").read_text() == "new" and (target / "keep.md").read_text() == "mine"
    assert siblings(target) == []  # no build, old or retired folder left


def test_a_failed_build_leaves_the_previous_folder(tmp_path):
    target = tmp_path / "out"
    publish_folder(target, _write({"a.txt": "1"}))
    before = checksums(target)

    def fail(folder: Path) -> None:
        (folder / "a.txt").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        publish_folder(target, fail)
    assert checksums(target) == before and siblings(target) == []


def test_symlinked_target_or_subfolder_is_refused_and_nothing_outside_changes(tmp_path):
    outside = tmp_path / "victim"
    outside.mkdir()
    (outside / "notes.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(outside)
    with pytest.raises(UnsafeFolderError, match="is a symbolic link"):
        publish_folder(link, _write({"a.txt": "1"}))
    target = tmp_path / "out"
    publish_folder(target, _write({"a.txt": "1"}))
    (target / "sub").symlink_to(outside)
    with pytest.raises(UnsafeFolderError, match="symbolic link to a folder"):
        publish_folder(target, _write({"a.txt": "2"}))
    assert checksums(outside) == {"notes.txt": hashlib.sha256(b"keep").hexdigest()}
    assert (target / "a.txt").read_text() == "1"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_recover_restores_a_folder_swapped_out_by_a_writer_that_died(tmp_path):
    """The rename fallback has one instant with the old folder under a hidden name: a writer
    killed there leaves it, and the next publish of the target (or ``recover``) puts it back."""
    import socket

    target = tmp_path / "out"
    prefix = f".out.{socket.gethostname()}.{_dead_pid()}."
    old, build = tmp_path / f"{prefix}aaaa1111.old", tmp_path / f"{prefix}bbbb2222.new"
    old.mkdir()
    (old / "a.txt").write_text("previous")
    build.mkdir()
    (build / "a.txt").write_text("partial")
    recover(target)
    assert (target / "a.txt").read_text() == "previous" and siblings(target) == []


def test_a_live_writers_build_is_left_alone(tmp_path):
    import socket

    target = tmp_path / "out"
    live = tmp_path / f".out.{socket.gethostname()}.{os.getppid()}.cccc3333.new"
    live.mkdir()
    recover(target)
    assert live.is_dir()


# -- conversions: --overwrite keeps the previous model until the new one is whole ---------------------


def _hf_model(seed: int, path: Path, vocab: int = 128) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, **TINY_HF_SHAPE, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two HF models of the same shape, their Orthros conversions, and the export of the first."""
    root = tmp_path_factory.mktemp("models")
    hf1, hf2 = _hf_model(0, root / "hf1"), _hf_model(1, root / "hf2", vocab=4096)  # hf2: ~1.3 MB of weights
    convert_from_hf(hf1, root / "o1", sliding_window=W)
    convert_from_hf(hf2, root / "o2", sliding_window=W)
    convert_to_hf(root / "o1", root / "x1")
    convert_to_hf(root / "o2", root / "x2")
    return root


# (command, source of the previous model, source of the new one, flags)
DIRECTIONS = {
    "from-hf": ("hf1", "hf2", ["--window", str(W)]),
    "to-hf": ("o1", "o2", []),
}
EXPECTED = {"from-hf": ("o1", "o2"), "to-hf": ("x1", "x2")}  # what the previous and the new conversion write


def _previous(models: Path, command: str, dst: Path) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """``dst`` holding the earlier conversion plus unrelated files; returns the argv of the new
    conversion, the checksums of the previous and of the new complete folder."""
    old_src, new_src, flags = DIRECTIONS[command]
    assert convert_main([command, str(models / old_src), str(dst), *flags]) == 0
    (dst / "NOTES.md").write_text("my notes")
    (dst / "my_lora_adapter.safetensors").write_bytes(b"not ours")
    old = checksums(dst)
    new = checksums(models / EXPECTED[command][1])
    new.update({k: old[k] for k in ("NOTES.md", "my_lora_adapter.safetensors")})
    return [command, str(models / new_src), str(dst), *flags, "--overwrite"], old, new


def _same_model(got: dict[str, str], want: dict[str, str]) -> bool:
    """Equal checksums, but the manifest (it names the files, the same in both) compared by name."""
    return got.keys() == want.keys() and all(got[k] == want[k] for k in got if k != MANIFEST)


@pytest.mark.parametrize("command", ["from-hf", "to-hf"])
def test_overwrite_keeps_unrelated_files_and_records_what_it_wrote(models, tmp_path, command, capsys):
    argv, old, new = _previous(models, command, tmp_path / "dst")
    assert convert_main(argv) == 0
    got = checksums(tmp_path / "dst")
    assert _same_model(got, new), sorted(set(got) ^ set(new))
    manifest = json.loads((tmp_path / "dst" / MANIFEST).read_text())
    assert "NOTES.md" not in manifest["files"] and "config.json" in manifest["files"]
    assert siblings(tmp_path / "dst") == []


def _in_child(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child (no second import of torch); its exit status, or -signal."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            work()
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _kill_self(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


# Where a conversion is killed: while the weights are written, once they are written (before the
# config), after the build is fsynced (before the swap), after the swap (before the old folder
# is deleted), and between the two renames of the fallback swap.
KILL_POINTS = ["weights", "side-files", "before-swap", "after-swap", "between-renames"]


def _arm(point: str) -> None:
    """In the child: make the conversion SIGKILL itself at ``point``."""
    from orthros_train.common.safetensors_io import ShardedSafetensorsWriter
    from orthros_train.convert import checkpoint_io, from_hf, to_hf

    if point == "weights":
        real = ShardedSafetensorsWriter.add
        count = iter(range(10**6))

        def add(self, name, tensor):
            if next(count) == 5:
                _kill_self()
            return real(self, name, tensor)

        ShardedSafetensorsWriter.add = add
    elif point == "side-files":
        from_hf.copy_side_files = to_hf._copy_remote_code_and_side_files = _kill_self
        checkpoint_io.copy_side_files = _kill_self
    elif point == "before-swap":
        publish._exchange = _kill_self
    elif point == "after-swap":
        publish._retire = _kill_self
    else:
        real_rename = os.rename
        publish._exchange = lambda a, b: False

        def rename(a, b):
            real_rename(a, b)
            if Path(a).name == "dst":  # the previous folder moved aside, the build not yet in
                _kill_self()

        publish.os.rename = rename


@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("command", ["from-hf", "to-hf"])
def test_kill_9_at_any_point_of_overwrite_keeps_the_old_model_or_the_new_whole(models, tmp_path, command, point):
    dst = tmp_path / "dst"
    argv, old, new = _previous(models, command, dst)

    def convert() -> None:
        _arm(point)
        convert_main(argv)

    assert _in_child(convert) == -signal.SIGKILL
    recover(dst)  # what the next publish of dst does first (the rename fallback's one gap)
    got = checksums(dst)
    assert got == old or _same_model(got, new), f"neither the old nor the new model: {sorted(got)}"
    if point in ("weights", "side-files", "before-swap", "between-renames"):
        assert got == old
    assert convert_main(argv) == 0 and _same_model(checksums(dst), new)  # the rerun cleans up too
    assert siblings(dst) == []


@pytest.mark.parametrize("command", ["from-hf", "to-hf"])
def test_file_size_limit_keeps_the_previous_model_and_says_so(models, tmp_path, command):
    """A disk that fills (RLIMIT_FSIZE: EFBIG) while the new, bigger model is written: one line
    naming the destination, the previous model intact, exit status 2."""
    dst = tmp_path / "dst"
    argv, old, _ = _previous(models, command, dst)
    err = tmp_path / "stderr"

    def convert() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))  # hf1's model fits, hf2's does not
        with open(err, "w") as f:
            os.dup2(f.fileno(), 2)
            sys.stderr = os.fdopen(2, "w")
            code = convert_main(argv)
            sys.stderr.flush()
            os._exit(code)

    assert _in_child(convert) == 2
    text = err.read_text()
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert f"writing {dst} failed" in text and "previous model" in text and "intact" in text
    assert checksums(dst) == old and siblings(dst) == ["stderr"]


def test_overwrite_refuses_symlinked_destination_or_subfolder(models, tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(victim)
    argv = ["from-hf", str(models / "hf1"), str(link), "--window", str(W), "--overwrite"]
    assert convert_main(argv) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    dst = tmp_path / "dst"
    assert convert_main(["from-hf", str(models / "hf1"), str(dst), "--window", str(W)]) == 0
    (dst / "adapters").symlink_to(victim)
    assert convert_main(["from-hf", str(models / "hf1"), str(dst), "--window", str(W), "--overwrite"]) == 2
    assert "symbolic link to a folder" in capsys.readouterr().err
    assert sorted(os.listdir(victim)) == ["notes.txt"]


def test_legacy_destination_without_manifest_keeps_files_no_conversion_writes(models, tmp_path):
    """A destination an older version wrote (no manifest): the names a conversion writes are
    replaced, an unrelated ``*.safetensors`` is kept."""
    dst = tmp_path / "dst"
    convert_from_hf(models / "hf1", dst, sliding_window=W)
    (dst / MANIFEST).unlink()
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an older conversion")
    (dst / "my_lora_adapter.safetensors").write_bytes(b"not ours")
    convert_from_hf(models / "hf2", dst, sliding_window=W, overwrite=True)
    assert (dst / "my_lora_adapter.safetensors").read_bytes() == b"not ours"
    assert not (dst / "model-00001-of-00002.safetensors").exists()
    with pytest.raises(ConversionError, match="not empty.*--overwrite"):
        convert_from_hf(models / "hf1", dst, sliding_window=W)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_kill_9_of_the_command_line_by_the_clock(models, tmp_path, delay):
    """The real command, killed ``delay`` s after the destination's folder first changes (a build
    appears beside it): the old model, or the new one whole."""
    dst = tmp_path / "dst"
    argv, old, new = _previous(models, "from-hf", dst)
    proc = subprocess.Popen([sys.executable, "-m", "orthros_train.convert.cli", *argv], env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = set(os.listdir(tmp_path))
    deadline = time.monotonic() + 120
    while set(os.listdir(tmp_path)) == before and checksums(dst) == old and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    recover(dst)
    got = checksums(dst)
    assert got == old or _same_model(got, new)


# -- the other folders published the same way ----------------------------------------------------------


def test_a_symlinked_final_export_or_study_run_dir_is_refused_with_one_line(tmp_path):
    """The run's final/ (train/run_dir.publish_directory) and a study's run dir under --overwrite
    (study/runs.py) refuse a link instead of writing or deleting through it."""
    from orthros_train.errors import UserError
    from orthros_train.study.runs import train_or_reuse
    from orthros_train.train.run_dir import publish_directory

    victim = tmp_path / "victim2"
    victim.mkdir()
    (victim / "notes.txt").write_text("keep")
    (victim / "study_train.json").write_text("{}")
    final = tmp_path / "run" / "checkpoints" / "final"
    final.parent.mkdir(parents=True)
    final.symlink_to(victim)
    with pytest.raises(UserError, match="is a symbolic link"):
        publish_directory(final, _write({"config.json": "{}"}))
    run_dir = tmp_path / "st" / "orthros" / "lr0.001-seed1"
    run_dir.parent.mkdir(parents=True)
    run_dir.symlink_to(victim)
    with pytest.raises(UserError, match="--overwrite: the run directory .* is a symbolic link") as refused:
        train_or_reuse(["orthros-train", "--config-name", "tiny_cpu"], run_dir, log=lambda line: None, overwrite=True)
    assert "\n" not in str(refused.value)
    assert sorted(os.listdir(victim)) == ["notes.txt", "study_train.json"] and run_dir.is_symlink()
