"""trainer.deterministic: the run's kernels under torch's reproducibility switch, given back on close."""

from __future__ import annotations

import os

import torch


def test_a_deterministic_run_trains_under_the_switch_and_gives_it_back(make_trainer, monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    trainer = make_trainer("trainer.deterministic=true", "+model.attention_backend=triton")
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one warns, never stops the run
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # before the first GEMM on a GPU
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"  # a resumed process reads the tiles this one chose
    deterministic = [trainer.train_step().loss for _ in range(2)]  # every op of a step has a reproducible kernel
    trainer.close()
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    trainer = make_trainer("+model.attention_backend=triton")
    assert not torch.are_deterministic_algorithms_enabled()
    assert [trainer.train_step().loss for _ in range(2)] == deterministic  # the same run: the switch is no change


def test_a_launcher_s_cublas_workspace_is_kept(make_trainer, monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    make_trainer("trainer.deterministic=true").close()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


def test_the_switch_stays_on_while_any_trainer_that_asked_for_it_is_open() -> None:
    from orthros_train.train.build import set_determinism

    assert not torch.are_deterministic_algorithms_enabled()
    release_a, release_b = set_determinism(True), set_determinism(True)
    release_a()
    assert torch.are_deterministic_algorithms_enabled()  # b still trains under it
    release_a()  # a second close changes nothing
    assert torch.are_deterministic_algorithms_enabled()
    release_b()
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    set_determinism(False)()
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_trainer_that_fails_to_start_gives_the_switch_and_its_lock_back(make_trainer, monkeypatch) -> None:
    import pytest

    import orthros_train.train.trainer as trainer_mod

    def broken_corpus(*args, **kwargs):
        raise RuntimeError("the corpus is unreadable")
    monkeypatch.setattr(trainer_mod, "build_data", broken_corpus)
    with pytest.raises(RuntimeError, match="unreadable"):
        make_trainer("trainer.deterministic=true")
    assert not torch.are_deterministic_algorithms_enabled()
    monkeypatch.undo()
    make_trainer().close()  # the run directory's lock was released: the next start takes it
