"""Rewinding a run (``trainer.resume=`` an earlier checkpoint of its own run dir) keeps the branch it
leaves: the later checkpoints and ``final/`` move to ``checkpoints/branch-<time>/`` unchanged, and
the rewound run saves its own (docs/checkpoints.md, 'Rewinding a run')."""

from __future__ import annotations

import hashlib
from pathlib import Path

from orthros_train.train.checkpoint import verify_checkpoint
from orthros_train.train.run_dir import set_aside_later_branch


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def test_rewind_moves_the_later_checkpoints_and_final_aside(make_trainer, tmp_path, caplog):
    steps = ("trainer.max_steps=4", "trainer.save_every=1", "trainer.keep_last_k=0")
    make_trainer(*steps).fit()
    root = tmp_path / "run" / "checkpoints"
    before = {name: checksums(root / name) for name in ("step_000000003", "step_000000004", "final")}
    with caplog.at_level("WARNING"):
        make_trainer(*steps, "optim.lr=0.0123", "trainer.resume_changes=allow",
                     f"trainer.resume={root / 'step_000000002'}").fit()  # fmt: skip
    branches = sorted(root.glob("branch-*"))
    assert len(branches) == 1 and "rewound to step_000000002" in caplog.text and branches[0].name in caplog.text
    assert {name: checksums(branches[0] / name) for name in before} == before  # the old branch, untouched
    for name in ("step_000000003", "step_000000004"):  # the rewound run's own saves
        assert verify_checkpoint(root / name) is None
        assert checksums(root / name) != before[name]
    assert (root / "final" / "config.json").is_file() and (root / "latest").read_text().strip() == "step_000000004"


def test_a_plain_resume_or_another_runs_checkpoint_moves_nothing(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for name in ("step_000000001", "step_000000002", "final"):
        (root / name).mkdir(parents=True)
    assert set_aside_later_branch(tmp_path / "run", root / "step_000000002") is None  # the newest
    other = tmp_path / "other" / "checkpoints" / "step_000000001"
    other.mkdir(parents=True)
    assert set_aside_later_branch(tmp_path / "run", other) is None
    assert sorted(p.name for p in root.iterdir()) == ["final", "step_000000001", "step_000000002"]
    branch = set_aside_later_branch(tmp_path / "run", root / "step_000000001")
    assert sorted(p.name for p in branch.iterdir()) == ["final", "step_000000002"]
    assert (root / "latest").read_text() == "step_000000001\n"
