"""Every collective the package issues gets its tensors on the device its group reduces on.

NCCL has no host backend; gloo accepts host and device tensors alike, so a CPU run cannot see a
host tensor handed to an NCCL collective. Two checks make the rule testable on CPU:

- statically, no module but ``orthros_train/parallel/collectives.py`` calls a torch.distributed
  collective, and every tensor that module hands to one comes from its device helper ``place``;
- at run time, the real trainer (gloo, CPU) runs with torch.distributed's collectives wrapped:
  every call the package makes must pass tensors produced by ``place`` and on the device the test
  declares the group requires (the trainer's device here; the CUDA device under NCCL).
"""

from __future__ import annotations

import ast
import sys
import weakref
from pathlib import Path

import pytest
import torch
from fixtures import REPO

PACKAGE = REPO / "orthros_train"
HOME = PACKAGE / "parallel" / "collectives.py"

# torch.distributed functions that communicate (tensor and object collectives, p2p, barrier)
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "monitored_barrier", "all_reduce_coalesced",
}  # fmt: skip
# The data layer may not import the parallel layer (tests/test_layering.py). Its one collective
# is a barrier that carries no tensor of ours: under NCCL it runs on the CUDA device bound to the
# process group at init (init_parallel passes device_id).
ALLOWED_ELSEWHERE = {("orthros_train/data/blend.py", "barrier")}


def _dist_calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """(call, name) for every ``dist.X(...)`` / ``torch.distributed.X(...)`` / bare ``X(...)``
    imported from torch.distributed, X a collective."""
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed"
        for alias in node.names
        if alias.name in COLLECTIVES
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            owner = ast.unparse(func.value)
            if owner in ("dist", "torch.distributed", "td"):
                found.append((node, func.attr))
        elif isinstance(func, ast.Name) and func.id in imported:
            found.append((node, func.id))
    return found


def test_no_module_but_collectives_calls_a_torch_distributed_collective():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == HOME:
            continue
        rel = path.relative_to(REPO).as_posix()
        for call, name in _dist_calls(ast.parse(path.read_text(), rel)):
            if (rel, name) not in ALLOWED_ELSEWHERE:
                offenders.append(f"{rel}:{call.lineno} dist.{name}")
    assert not offenders, (
        "collectives outside orthros_train/parallel/collectives.py (their tensors may be on the host "
        "under NCCL; use its helpers): " + ", ".join(offenders)
    )


def _placed_names(func: ast.FunctionDef) -> set[str]:
    """Names assigned in ``func`` from ``place(...)`` or a comprehension of ``place(...)``."""
    names = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.ListComp):
                value = value.elt
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "place":
                names.add(node.targets[0].id)
    return names


def test_every_tensor_the_collectives_module_communicates_comes_from_place():
    tree = ast.parse(HOME.read_text())
    tensor_collectives = {"all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor"}
    checked = 0
    for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        placed = _placed_names(func)
        for call, name in _dist_calls(func):
            if name not in tensor_collectives:
                continue
            for arg in call.args:
                assert isinstance(arg, ast.Name) and arg.id in placed, (
                    f"collectives.py:{call.lineno} dist.{name} is passed {ast.unparse(arg)}, not a tensor from place()"
                )
                checked += 1
    assert checked >= 4  # all_reduce (x3 helpers) and all_gather's input and outputs


def test_comm_device_follows_the_backend(monkeypatch):
    from orthros_train.parallel import collectives

    assert collectives.comm_device() == torch.device("cpu")  # no process group: the host
    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives.torch.cuda, "current_device", lambda: 3)
    for backend, expected in (
        ("nccl", torch.device("cuda", 3)),
        ("gloo", torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", torch.device("cpu")),  # a mixed group takes host tensors
    ):
        monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None, b=backend: b)
        assert collectives.comm_device() == expected, backend


def test_bad_reduction_op_is_named():
    from orthros_train.parallel import collectives

    with pytest.raises(ValueError, match="reduction op must be one of"):
        collectives.reduce_floats([1.0], op="mean")


# -- the real trainer with torch.distributed's collectives recorded ----------------------------------


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class Recorder:
    """Wraps torch.distributed's collectives; for each call made from a module of the package,
    records the caller and whether each tensor came from ``collectives.place`` and sits on the
    device the test declares the group requires."""

    def __init__(self, monkeypatch, required: torch.device) -> None:
        self.required = required
        self.placed: dict[int, weakref.ref] = {}
        self.calls: list[tuple[str, str, list[str]]] = []
        from orthros_train.parallel import collectives

        original_place = collectives.place

        def place(tensor, group=None):
            out = original_place(tensor, group)
            self.placed[id(out)] = weakref.ref(out)
            return out

        monkeypatch.setattr(collectives, "place", place)
        for name in COLLECTIVES:
            if hasattr(torch.distributed, name):
                monkeypatch.setattr(torch.distributed, name, self._wrap(name, getattr(torch.distributed, name)))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if Path(caller).resolve().is_relative_to(PACKAGE):
                problems = []
                for t in _tensors(list(args) + list(kwargs.values())):
                    ref = self.placed.get(id(t))
                    if ref is None or ref() is not t:
                        problems.append(f"{tuple(t.shape)} tensor not from collectives.place")
                    elif t.device != self.required:
                        problems.append(f"tensor on {t.device}, group requires {self.required}")
                self.calls.append((Path(caller).relative_to(REPO).as_posix(), name, problems))
            return fn(*args, **kwargs)

        return wrapper


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_trainer_communicates_only_tensors_on_the_groups_device(make_trainer, monkeypatch, zero_stage):
    """Steps, a save, a resume, the final save and export: every collective of the package (the
    non-finite flag, step statistics, stop flag, TP grad norm at ZeRO-0, the optimizer step
    count, checkpoint agreement) passes tensors from collectives.place on the trainer's device."""
    from orthros_train.parallel.setup import destroy_parallel

    def make(*overrides: str):
        return make_trainer(f"parallel.zero_stage={zero_stage}", *overrides)

    recorder = Recorder(monkeypatch, required=torch.device("cpu"))
    try:
        trainer = make("trainer.max_steps=2", "trainer.save_every=1")
        recorder.required = trainer.device  # the device the trainer's groups reduce on
        trainer.fit()
        trainer.close()
        destroy_parallel()
        resumed = make("trainer.max_steps=3", "trainer.save_every=1", "trainer.resume=auto")
        resumed.fit()
        resumed.close()
    finally:
        destroy_parallel()
    sites = {(f, n) for f, n, _ in recorder.calls}
    bad = [f"{f} dist.{n}: {'; '.join(p)}" for f, n, p in recorder.calls if p]
    assert not bad, "collectives with tensors off the group's device:\n" + "\n".join(sorted(set(bad)))
    # the run really went through the reductions this test is about
    names = {n for _, n in sites}
    assert {"all_reduce", "broadcast_object_list", "all_gather_object", "barrier"} <= names, sites
    assert len(recorder.calls) >= 10
