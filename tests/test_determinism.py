"""trainer.deterministic: the run's kernels under torch's reproducibility switch, given back on close."""

from __future__ import annotations

import os

import torch


def test_a_deterministic_run_trains_under_the_switch_and_gives_it_back(make_trainer, monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    trainer = make_trainer("trainer.deterministic=true", "+model.attention_backend=triton")
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one warns, never stops the run
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # before the first GEMM on a GPU
    deterministic = [trainer.train_step().loss for _ in range(2)]  # every op of a step has a reproducible kernel
    trainer.close()
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    trainer = make_trainer("+model.attention_backend=triton")
    assert not torch.are_deterministic_algorithms_enabled()
    assert [trainer.train_step().loss for _ in range(2)] == deterministic  # the same run: the switch is no change


def test_a_launcher_s_cublas_workspace_is_kept(make_trainer, monkeypatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    make_trainer("trainer.deterministic=true").close()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
