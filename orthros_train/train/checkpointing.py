"""The run's checkpoint policy: resume at the start, a save every ``save_every`` steps, the final
save. The mechanics (atomic publish, sharded files, async writes) are ``train/checkpoint.py``'s.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from orthros_train.errors import UserError
from orthros_train.logging_setup import RANK_ZERO
from orthros_train.parallel import collectives
from orthros_train.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointState,
    TrainingCounters,
    verify_checkpoint,
)
from orthros_train.train.config import TrainerConfig
from orthros_train.train.run_dir import (
    check_fresh_start,
    check_resume,
    existing_run,
    set_aside_later_branch,
    tokenizer_difference,
)

log = logging.getLogger(__name__)


class Checkpointing:
    """``resume`` once, ``after_step`` every step, ``save`` at the end. ``state`` gives the
    current ``CheckpointState`` (engine, data, counters) whenever a save or a load needs it."""

    def __init__(
        self,
        manager: CheckpointManager,
        cfg: TrainerConfig,
        recipe: dict,
        state: Callable[[], CheckpointState],
        is_main: bool,
    ) -> None:
        self.manager = manager
        self.cfg = cfg
        self.recipe = recipe
        self.state = state
        self.is_main = is_main
        self.resumed_from: Path | None = None

    def resume(self) -> TrainingCounters | None:
        """Load the checkpoint ``trainer.resume`` names (``auto``: this run's newest that
        verifies), after refusing one of another run; None when the run starts afresh."""
        mode, run_dir = self.cfg.resume, Path(self.cfg.run_dir)
        stale = check_fresh_start(run_dir, mode, self.cfg.overwrite)
        if stale:  # trainer.overwrite=true: the run that was here goes first
            log.warning("trainer.overwrite=true: deleting the previous run's %s", ", ".join(stale), extra=RANK_ZERO)
            if self.is_main:
                for path in map(Path, stale):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            collectives.barrier()
        if mode == "none":
            return None
        if mode == "auto":
            path = self.manager.find_latest()
            if path is None:
                found = existing_run(run_dir)
                if found:
                    # Starting afresh would append a second step 1... to this run's metrics and
                    # replace its checkpoints: the user decides.
                    raise UserError(
                        f"trainer.run_dir={run_dir} holds a run ({', '.join(found)}) but no usable checkpoint to "
                        "resume (none was saved, or none verifies): pass trainer.resume=none trainer.overwrite=true "
                        "to start over (deleting it), or pick another trainer.run_dir"
                    )
                return None
        else:
            path = Path(mode)
            problem = verify_checkpoint(path) if path.is_dir() else "no such directory"
            if problem:
                raise UserError(
                    f"trainer.resume={mode}: {problem} (trainer.resume takes auto, none or a checkpoint directory)"
                )
        for line in check_resume(path, self.recipe, self.cfg.resume_changes):  # the same run only
            log.warning("%s", line, extra=RANK_ZERO)
        difference = tokenizer_difference(path, self.state().tokenizer)
        if difference:
            raise UserError(
                f"cannot resume {path} on this data: {difference}. The data was tokenized again with another "
                "tokenizer; tokenize it with the checkpoint's tokenizer, or start a new run (another trainer.run_dir)"
            )
        counters = self.manager.load(self.state(), path).counters
        log.info("resumed from %s at step %d", path, counters.step)
        if self.is_main:  # a rewind: the later checkpoints and final/ are kept aside, not overwritten
            set_aside_later_branch(run_dir, path)
        self.resumed_from = path
        return counters

    def save(self, asynchronous: bool | None = None) -> Path | None:
        """A checkpoint of the current step; a failed save is reported and training goes on.
        ``asynchronous`` defaults to ``trainer.async_save``."""
        try:
            return self.manager.save(self.state(), asynchronous)
        except CheckpointError as exc:
            log.error("ERROR: %s", exc, extra=RANK_ZERO)
            return None

    def after_step(self, step: int) -> None:
        """The periodic save (the final step's is the final save)."""
        if self.cfg.save_every > 0 and step % self.cfg.save_every == 0 and step < self.cfg.max_steps:
            self.save()

    def final(self, trained: bool) -> Path | None:
        """The end-of-run save (synchronous: the process is about to end); a run resumed at its
        end with nothing new trained keeps the checkpoint it resumed from."""
        if not trained and self.resumed_from is not None:
            return self.resumed_from
        return self.save(asynchronous=False)


__all__ = ["Checkpointing"]
