"""orthros-study --overwrite and symbolic links: a model folder or run directory of --out that is
a link is refused before anything is deleted (the previous report included), and nothing outside
--out is touched."""

from __future__ import annotations

import os

import pytest

from orthros_train.errors import UserError
from orthros_train.study.pipeline import StudyOptions, run_study


@pytest.mark.parametrize("linked", ["orthros", "orthros/lr0.001-seed1"])
def test_overwrite_through_a_linked_model_folder_or_run_dir_is_refused_first(tmp_path, linked):
    out, victim = tmp_path / "st", tmp_path / "victim"
    run = victim / "lr0.001-seed1" if linked == "orthros" else victim
    run.mkdir(parents=True)
    (run / "precious.txt").write_text("not the study's")
    out.mkdir()
    (out / "study.json").write_text("{}")
    (out / linked).parent.mkdir(parents=True, exist_ok=True)
    (out / linked).symlink_to(victim)
    opts = StudyOptions(out=out, archs=("orthros",), lrs=(1e-3,), seeds=(1,), quick=True, overwrite=True,
                        prefill_lengths=[])  # fmt: skip
    with pytest.raises(UserError, match=r"--overwrite: the (model folder|run directory) .* is a symbolic link") as err:
        run_study(opts, log=lambda line: None)
    assert "\n" not in str(err.value)
    assert (run / "precious.txt").read_text() == "not the study's"
    assert (out / "study.json").exists()  # the refusal came before the previous report was removed
    assert os.path.islink(out / linked)
