"""Typed run configuration: a Hydra recipe is resolved into these dataclasses, then objects.

Every section is checked against its dataclass as an OmegaConf structured config: an unknown
key or a value of the wrong type fails with the full key, the value and the expected type before
anything is built.
"""

from __future__ import annotations

import logging
import math
import re
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from orthros_train.common.blank import refuse_blank
from orthros_train.common.overrides import check_types
from orthros_train.data import DataConfig
from orthros_train.errors import UserError
from orthros_train.model.config import OrthrosConfig
from orthros_train.options import Device, DistillAlign, LRSchedule, Precision, ResumeChanges, RLTask, WandbMode
from orthros_train.parallel.setup import ParallelConfig, check_expert_layout, expert_precision_problem

log = logging.getLogger(__name__)

@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 100
    schedule: LRSchedule = LRSchedule.cosine  # after linear warmup
    grad_clip: float = 1.0  # 0 disables clipping
    # The first frozen_steps optimizer steps update only the output-stream query affine
    # (gamma, beta); every other weight is held (learning rate 0). 0: nothing is frozen.
    frozen_steps: int = 0
    # A learning rate above 1 is almost always a typo (3e3 for 3e-3): refused unless this is true.
    allow_large_lr: bool = False
    # A regular expression on parameter names (re.search): only the weights it matches train; the
    # rest are frozen (no weight gradient, no optimizer state). Cheap continued training of a
    # converted model, e.g. "self_attn|gamma|beta". None: every weight trains.
    trainable: str | None = None

    def __post_init__(self) -> None:
        # '' is a regular expression that matches every name: training everything is trainable=null
        refuse_blank("optim.trainable", self.trainable, "a regular expression on parameter names (e.g. 'self_attn')",
                     "null to train every weight")
        if self.trainable is not None:
            try:
                re.compile(self.trainable)
            except (re.error, TypeError) as exc:
                raise UserError(
                    f"optim.trainable={self.trainable!r} is not a regular expression ({exc}); e.g. "
                    "optim.trainable='self_attn|gamma|beta', or leave it unset to train every weight"
                ) from None
        if self.frozen_steps < 0:
            raise UserError(f"optim.frozen_steps must be >= 0, got {self.frozen_steps}")
        if not 0 < self.lr <= 1 and not (self.allow_large_lr and self.lr > 0):
            raise UserError(
                f"optim.lr={self.lr} must lie in (0, 1] (a typo such as 3e3 for 3e-3?); "
                "set optim.allow_large_lr=true if a rate above 1 is meant"
            )
        if not 0 <= self.min_lr <= self.lr:
            raise UserError(f"optim.min_lr={self.min_lr} must lie in [0, optim.lr={self.lr}]")
        for key in ("weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise UserError(f"optim.{key}={getattr(self, key)} must be >= 0 (0 turns it off)")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise UserError(f"optim.{key}={getattr(self, key)} must lie in [0, 1) (e.g. 0.9, 0.95)")
        if self.eps <= 0:
            raise UserError(f"optim.eps={self.eps} must be > 0 (e.g. 1e-8)")
        self.schedule = LRSchedule.parse(self.schedule, "optim.schedule")
        if self.warmup_steps < 0:
            raise UserError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class WandbConfig:
    enabled: bool = True
    project: str = "orthros"
    name: str | None = None
    group: str | None = None
    mode: WandbMode = WandbMode.offline

    def __post_init__(self) -> None:
        self.mode = WandbMode.parse(self.mode, "trainer.wandb.mode")


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    seed: int = 1234
    run_dir: str = "runs/default"
    dry_run: bool = False
    seq_len: int = 256
    # Batch geometry (resolve_batch_geometry): the recipe states the global batch and the micro
    # batch; the data-parallel size follows from the world size, and the accumulation steps from
    # global / (micro x data_parallel). Without global_batch_size the batch is micro x
    # grad_accum_steps (default 1) x data_parallel, so it grows with the world size.
    global_batch_size: int | None = None  # sequences per optimizer step over all data-parallel ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    grad_accum_steps: int | None = None  # None: derived; a number is checked against the derivation
    # [[start_step, seq_len], ...]: sequence length grows in stages at constant tokens per micro
    # batch (seq_len x micro_batch_size); see orthros_train/data/schedule.py. None: seq_len throughout.
    seq_len_schedule: list[list[int]] | None = None
    total_tokens: int | None = None  # informational: the token budget the recipe was sized for
    precision: Precision = Precision.fp32  # bf16: autocast where the device supports it
    device: Device = Device.auto
    log_every: int = 10
    eval_every: int = 100  # <= 0: only at the end
    eval_batches: int = 4
    progress: bool = True
    peak_tflops: float | None = None  # per-device peak for MFU; None: known GPUs (H100 989), else no MFU
    # The GPU the recipe is laid out for: the dry run checks the memory estimate against it, a run
    # on a GPU checks it against the device it got. None: no stated GPU (CPU recipes).
    gpu: str | None = None
    gpu_memory_gib: float | None = None  # memory per device as torch reports it (H100 80 GB: 79.6)
    allow_memory_overflow: bool = False  # start even when the estimate exceeds the device's memory
    # checkpoints and resume (see orthros_train/train/checkpoint.py)
    save_every: int = 0  # steps between checkpoints; 0: only the final one
    keep_last_k: int = 3  # checkpoints kept (older ones deleted after a successful save); 0 keeps all
    checkpoint_hashes: bool = True  # sha256 of every file in the manifest (sizes are always checked)
    resume: str = "auto"  # auto: latest complete checkpoint in run_dir, if any | none | a checkpoint path
    # true: a run started afresh (resume=none, or a checkpoint of another run) may replace the run
    # already in run_dir, whose checkpoints and metrics are deleted first; false refuses it
    overwrite: bool = False
    # refuse | allow: resuming with another optimisation (lr, seed, seq_len, tokens per step) than
    # the checkpoint's recipe; another model or data is always refused (orthros_train/train/run_dir.py)
    resume_changes: ResumeChanges = ResumeChanges.refuse
    async_save: bool = False  # periodic saves: snapshot to host memory, write/publish in a background thread
    # true: every kernel reproducible run to run (torch.use_deterministic_algorithms, a fixed cuBLAS
    # workspace, attention on flash-attn's atomic-free backward or the Triton kernels), so a GPU
    # resume continues bit for bit; slower
    deterministic: bool = False
    # faults
    max_nonfinite_steps: int = 5  # consecutive NaN/Inf steps (skipped) before the run stops
    loss_spike_factor: float = 3.0  # log a spike when loss > factor x running mean (0 disables)
    fail_at_step: int | None = None  # fault injection for tests: this process dies after that step
    sample_prompt: str | None = None  # greedy continuation printed after training
    sample_tokens: int = 40  # 0: no sample
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        if isinstance(self.wandb, dict):
            self.wandb = WandbConfig(**self.wandb)  # checked by typed_section with its parent
        for name in ("max_steps", "seq_len", "micro_batch_size", "grad_accum_steps", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"trainer.{name} must be >= 1, got {value}")
        refuse_blank("trainer.run_dir", self.run_dir, "a directory for the run", "runs/NAME")
        refuse_blank("trainer.resume", self.resume, "auto, none or a checkpoint directory", "auto")
        if self.fail_at_step is not None and not 1 <= self.fail_at_step <= self.max_steps:
            # a test hook (trainer.py): a value the loop never reaches would silently do nothing
            raise UserError(
                f"trainer.fail_at_step={self.fail_at_step} can never fire: steps run 1..trainer.max_steps="
                f"{self.max_steps}. It is a test hook that kills the process after that step (a lost node); "
                "leave it null for a normal run"
            )
        if self.overwrite and self.resume == "auto":
            raise UserError(
                "trainer.overwrite=true replaces the run in trainer.run_dir with a new one, but trainer.resume=auto "
                "continues it: pass trainer.resume=none to start afresh (or drop trainer.overwrite)"
            )
        self.precision = Precision.parse(self.precision, "trainer.precision")
        self.device = Device.parse(self.device, "trainer.device")
        self.resume_changes = ResumeChanges.parse(self.resume_changes, "trainer.resume_changes")
        if self.save_every < 0 or self.keep_last_k < 0 or self.max_nonfinite_steps < 1:
            raise UserError("trainer.save_every and trainer.keep_last_k must be >= 0, max_nonfinite_steps >= 1")
        if self.sample_tokens < 0:
            raise UserError(f"trainer.sample_tokens={self.sample_tokens} must be >= 0 (0: no sample)")
        if self.loss_spike_factor < 0:
            raise UserError(f"trainer.loss_spike_factor={self.loss_spike_factor} must be >= 0 (0 turns it off)")
        for key in ("peak_tflops", "gpu_memory_gib"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise UserError(f"trainer.{key}={getattr(self, key)} must be > 0 (or null)")
        if self.seq_len_schedule is not None:
            from orthros_train.data.schedule import check_seq_len_schedule

            check_seq_len_schedule(self.seq_len_schedule, self.seq_len, self.micro_batch_size, self.max_steps)


@dataclass
class ModelInit:
    """How the model's weights start: random (``init_from=None``) or from a checkpoint dir."""

    init_from: str | None = None

    def __post_init__(self) -> None:
        # '' would read as "no checkpoint" and train random weights without a word
        refuse_blank("model.init_from", self.init_from, "a checkpoint directory", "null to start from random weights")


@dataclass
class RLConfig:
    """GRPO settings (the ``rl`` section of an RL recipe; orthros_train/train/rl.py)."""

    group_size: int = 8  # responses sampled per prompt (the group is the baseline)
    # prompts per optimizer step over all data-parallel ranks; prompts_per_step x group_size
    # rollouts = trainer.micro_batch_size x trainer.grad_accum_steps x parallel.data_parallel
    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0  # sampling (1.0: the policy's own distribution, so old logp == policy logp)
    top_p: float = 1.0
    clip_eps_low: float = 0.2  # ratio clipped to [1 - low, 1 + high] (DAPO "clip-higher": high > low)
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0  # beta of KL(policy || reference); > 0 keeps a frozen copy of the initial policy
    scale_advantages: bool = True  # divide group-centred rewards by the group std (GRPO) or not (Dr. GRPO)
    # A rollout batch holds minibatches x prompts_per_step prompts; each optimizer step trains on
    # one minibatch, and ppo_epochs passes run over the batch (minibatches x ppo_epochs steps).
    # More than one update per batch makes it off-policy: the sampling policy's log-probs are
    # taken before its first update.
    minibatches: int = 1
    ppo_epochs: int = 1
    recompute_old_logprobs: bool = False  # ignore rollouts' logprobs: use the policy's before the batch's updates
    seed: int = 0  # sampling seed

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "minibatches", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise UserError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0 or self.clip_eps_low >= 1:
            raise UserError("rl.clip_eps_low must lie in [0, 1) and rl.clip_eps_high must be >= 0")
        if self.kl_coef < 0:
            raise UserError(f"rl.kl_coef must be >= 0, got {self.kl_coef}")
        if self.temperature <= 0:
            raise UserError("rl.temperature must be > 0 (RL samples; greedy rollouts carry no exploration)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"rl.top_p={self.top_p} must lie in (0, 1] (1: no nucleus cut)")


@dataclass
class TaskConfig:
    """Where an RL run's rollouts come from (the ``task`` section of an RL recipe)."""

    name: RLTask = RLTask.pattern
    # pattern (toy): prompts of random tokens in [low, model.vocab_size); count up from the last one
    low: int = 2
    prompt_len: int = 8
    response_len: int = 8
    token_rewards: bool = False  # per-token (process) rewards instead of one reward per response
    # prompts: an `orthros-data rl` set (data.paths) + reward_fn(prompt_ids, response_ids, reference_ids)
    reward: str | None = None  # "package.module:function"
    stop_token_ids: list[int] | None = None  # None: the tokenizer's EOS when there is one
    # rollouts: an external engine's rollouts (JSONL of Rollout records), read in file order
    rollouts: str | None = None

    def __post_init__(self) -> None:
        self.name = RLTask.parse(self.name, "task.name")
        refuse_blank("task.reward", self.reward, "a reward function 'package.module:function'")
        refuse_blank("task.rollouts", self.rollouts, "a JSONL file of rollouts")
        if self.name == "prompts" and not self.reward:
            raise UserError("task.name=prompts needs task.reward (a reward function 'module:function')")
        if self.name == "rollouts" and not self.rollouts:
            raise UserError("task.name=rollouts needs task.rollouts (a JSONL file of rollouts)")


# The distill keys' values when distillation is on and the recipe leaves them unset (None).
DISTILL_DEFAULTS: dict[str, Any] = {
    "alpha": 0.5, "temperature": 1.0, "beyond_window_only": False, "align": DistillAlign.none,
    "align_weight": 1.0, "align_steps": 0,
}


@dataclass
class DistillConfig:
    """Distillation from the dense twin (the ``distill`` section; orthros_train/train/distill.py,
    docs/convert.md "Distillation"). At every output token the loss is
    ``(1 - alpha) * CE + alpha * temperature^2 * KL(teacher || student)`` at ``temperature``,
    weighted like the cross entropy. Every key but ``enabled`` is None when the recipe leaves it
    unset: with distillation off, a key that is set is refused (it would do nothing), and with it
    on the unset ones take ``DISTILL_DEFAULTS``."""

    enabled: bool = False
    teacher: str | None = None  # the teacher's checkpoint directory; None: model.init_from
    alpha: float | None = None  # weight of the KD term, in [0, 1] (0: plain cross entropy)
    temperature: float | None = None  # > 0; both distributions are softened by it
    beyond_window_only: bool | None = None  # KD term only at output positions >= sliding_window in their document
    # A first stage of align_steps steps adds align_weight x the per-layer distance (mse | cosine)
    # between the student's base-stream hidden states and the teacher's, at positions >= sliding_window.
    align: DistillAlign | None = None
    align_weight: float | None = None
    align_steps: int | None = None

    def __post_init__(self) -> None:
        refuse_blank("distill.teacher", self.teacher, "a checkpoint directory", "null to use model.init_from")
        given = [f.name for f in fields(self) if f.name != "enabled" and getattr(self, f.name) is not None]
        if not self.enabled:
            if given:
                keys = ", ".join(f"distill.{k}={getattr(self, k)}" for k in given)
                # A preset (+distill=dense_twin) sets keys the user never typed: say so, and how to turn it off.
                raise UserError(
                    f"{keys} set but distill.enabled=false: they would do nothing. To turn distillation off, "
                    "leave out the preset that set them (+distill=dense_twin) or pick distill=disabled in a recipe "
                    "with a distill default; to distill, set distill.enabled=true; or drop the keys"
                )
            return
        for key, default in DISTILL_DEFAULTS.items():
            if getattr(self, key) is None:
                setattr(self, key, default)
        self.align = DistillAlign.parse(self.align, "distill.align")
        if not (math.isfinite(self.alpha) and 0 <= self.alpha <= 1):
            raise UserError(f"distill.alpha={self.alpha} must lie in [0, 1] (0: plain cross entropy, 1: KD only)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"distill.temperature={self.temperature} must be a finite number > 0 (1: plain softmax)")
        if not (math.isfinite(self.align_weight) and self.align_weight >= 0):
            raise UserError(f"distill.align_weight={self.align_weight} must be a finite number >= 0")
        if self.align_steps < 0:
            raise UserError(f"distill.align_steps={self.align_steps} must be >= 0")
        if self.align == DistillAlign.none and ("align_steps" in given or "align_weight" in given):
            raise UserError(
                "distill.align_steps / distill.align_weight set but distill.align=none: set distill.align=mse or "
                "cosine for an alignment stage, or drop them"
            )
        if self.align != DistillAlign.none and self.align_steps == 0:
            raise UserError(
                f"distill.align={self.align} needs distill.align_steps >= 1 (the steps of the alignment stage)"
            )


@dataclass
class RunConfig:
    model: OrthrosConfig
    data: DataConfig
    optim: OptimConfig
    trainer: TrainerConfig
    parallel: ParallelConfig
    init: ModelInit
    # An RL run (GRPO through the same trainer): both sections set, or neither.
    rl: RLConfig | None = None
    task: TaskConfig | None = None
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        check_distill(self.distill, self.init, self.rl is not None)
        check_distill_positions(self.distill, self.trainer, self.model)
        check_sinks(self.model)
        # Every RunConfig carries a resolved geometry; idempotent for one already resolved.
        resolve_batch_geometry(self.trainer, self.parallel, self.parallel.world_size, self.rl)
        check_expert_layout(self.parallel, self.model)  # a config error, before any process starts
        check_frozen_steps(self.optim, self.trainer, self.model)
        problem = expert_precision_problem(
            self.parallel, bool(self.model.num_experts), self.trainer.precision == Precision.bf16
        )
        if problem:
            raise UserError(problem)
        if self.rl is not None and self.parallel.expert_parallel > 1:
            # Every forward of a sparse layer is an all-to-all over the EP ranks, and each
            # data-parallel rank decodes its own rollouts until its own end of sequence.
            raise UserError(
                f"rl with parallel.expert_parallel={self.parallel.expert_parallel} is not supported: the "
                "data-parallel ranks generate their rollouts for different numbers of decode steps, and every "
                "expert-parallel rank must join each forward's all-to-all; use parallel.expert_parallel=1"
            )
        if self.rl is not None and self.task is not None and self.task.name == RLTask.pattern:
            self.rl.max_new_tokens = self.task.response_len  # the toy task's responses have a fixed length

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro batch x accumulation x data-parallel ranks."""
        return self.trainer.micro_batch_size * self.trainer.grad_accum_steps * self.parallel.data_parallel

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.trainer.seq_len


def check_frozen_steps(optim: OptimConfig, trainer: TrainerConfig, model: OrthrosConfig) -> None:
    """optim.frozen_steps holds every weight but the output-stream affine (gamma, beta): past
    trainer.max_steps, or on a model without that affine, the whole run would train little or nothing."""
    frozen = optim.frozen_steps
    if frozen > trainer.max_steps:
        raise UserError(
            f"optim.frozen_steps={frozen} exceeds trainer.max_steps={trainer.max_steps}: only gamma/beta would "
            f"train for the whole run; use optim.frozen_steps <= {trainer.max_steps} (0: nothing frozen)"
        )
    if frozen and model.attention_type != "orthros":
        raise UserError(
            f"optim.frozen_steps={frozen} holds every weight but the output-stream affine, which a "
            f"model.attention_type={model.attention_type} model does not have: nothing would train; "
            "set optim.frozen_steps=0"
        )


@dataclass
class BatchGeometry:
    """How one optimizer step's global batch is laid out over the processes."""

    world_size: int
    data_parallel: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int


def check_distill(distill: DistillConfig, init: ModelInit, rl: bool) -> None:
    """The teacher of a distillation run: ``distill.teacher``, else ``model.init_from``."""
    if not distill.enabled:
        return
    if rl:
        raise UserError("distill.enabled=true in an RL recipe: distillation trains on cross entropy data, not on "
                         "rollouts; drop the distill section or the rl/task sections")
    if distill.teacher is None:
        distill.teacher = init.init_from
    if not distill.teacher:
        raise UserError(
            "distill.enabled=true but there is no teacher: set distill.teacher=PATH (an Orthros checkpoint "
            "directory, e.g. the output of orthros-convert from-hf) or model.init_from=PATH (the teacher by default)"
        )


def check_distill_positions(distill: DistillConfig, trainer: TrainerConfig, model: OrthrosConfig) -> None:
    """distill.beyond_window_only and the alignment stage act on output positions >= the window
    only: with sequences no longer than the window there are none, and the run would silently train
    on (1 - alpha) x cross entropy alone."""
    if not distill.enabled:
        return
    longest = max([trainer.seq_len, *(length for _, length in trainer.seq_len_schedule or [])])
    if longest > model.sliding_window:
        return
    keys = (["distill.beyond_window_only=true"] if distill.beyond_window_only else []) + (
        [f"distill.align={distill.align}"] if distill.align != DistillAlign.none else [])
    if keys:
        verb = "acts" if len(keys) == 1 else "act"
        raise UserError(
            f"{' and '.join(keys)} {verb} only on positions >= model.sliding_window={model.sliding_window}, but "
            f"trainer.seq_len={longest} holds none beyond it: the term would never apply. Use a "
            f"model.sliding_window below trainer.seq_len, or drop {' and '.join(k.split('=')[0] for k in keys)}"
        )


def check_sinks(model: OrthrosConfig) -> None:
    """Sink tokens or a global tail on a dense model do nothing (its window already holds every
    earlier token): refused up front, as megatron refuses an argument its model cannot use, instead
    of training a model whose exported config claims what it never had."""
    why = model.tail_on_dense()
    if why:
        raise UserError(why)
    if model.sink_tokens and model.attention_type == "dense":
        raise UserError(
            f"model.sink_tokens={model.sink_tokens} with model.attention_type=dense: a dense model attends every "
            "earlier token already, so the sinks would do nothing (yet be recorded in its config.json); set "
            "model.sink_tokens=0, or model.attention_type=orthros|sliding for a windowed model with sinks"
        )


def _neighbours(value: int, candidates: list[int]) -> list[int]:
    """The nearest candidates below and above ``value`` (one each side, where they exist)."""
    below = [c for c in candidates if c < value]
    above = [c for c in candidates if c > value]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def _or(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def resolve_batch_geometry(
    trainer: TrainerConfig, parallel: ParallelConfig, world_size: int | None = None, rl: RLConfig | None = None
) -> BatchGeometry:
    """Derive the data-parallel size and the accumulation steps, as megatron and torchtitan do:
    the recipe fixes the global batch and the micro batch, the world size the rest.

    ``world_size``: the launcher's process count, or the count a dry run plans for; None: the
    recipe's ``parallel.world_size``, else ``parallel.data_parallel`` (or 1) x TP x CP. The result
    is written into ``trainer`` and ``parallel`` (data_parallel, world_size, grad_accum_steps,
    global_batch_size). An impossible combination raises UserError with the numbers and the
    nearest valid choices. An RL step trains on rl.prompts_per_step x rl.group_size rollouts:
    that is its global batch."""
    tp, cp = parallel.tensor_parallel, parallel.context_parallel
    model_ranks = tp * cp
    layout = f"parallel.tensor_parallel={tp} x parallel.context_parallel={cp}"
    if world_size is None:
        # Planned with no count given: the fewest data-parallel ranks that also hold whole
        # expert-parallel groups (world = expert_parallel x expert-data-parallel ranks).
        fewest_dp = parallel.expert_parallel // math.gcd(parallel.expert_parallel, model_ranks)
        world_size = parallel.world_size or (parallel.data_parallel or fewest_dp) * model_ranks
    elif parallel.world_size is not None and parallel.world_size != world_size:
        log.info("the recipe plans for %d processes (parallel.world_size); %d were launched: the batch geometry "
                 "follows the launch", parallel.world_size, world_size)
    if world_size % model_ranks:
        valid = _neighbours(world_size, [model_ranks * k for k in range(1, world_size // model_ranks + 2)])
        raise UserError(
            f"world size {world_size} is not divisible by {layout} = {model_ranks}: use a world size of {_or(valid)}"
        )
    dp = world_size // model_ranks
    if parallel.data_parallel is not None and parallel.data_parallel != dp:
        raise UserError(
            f"world size {world_size} / ({layout}) = {dp} data-parallel ranks, but parallel.data_parallel="
            f"{parallel.data_parallel}: leave parallel.data_parallel unset (null) so that it follows the world size, "
            f"or use {parallel.data_parallel * model_ranks} processes"
        )
    micro = trainer.micro_batch_size
    rows = rl.prompts_per_step * rl.group_size if rl is not None else None
    if rows is not None and trainer.global_batch_size is not None and trainer.global_batch_size != rows:
        raise UserError(
            f"trainer.global_batch_size={trainer.global_batch_size}, but an RL step trains on rl.prompts_per_step x "
            f"rl.group_size = {rl.prompts_per_step} x {rl.group_size} = {rows} rollouts: drop "
            "trainer.global_batch_size (RL derives it) or change the rl section"
        )
    global_batch = trainer.global_batch_size if trainer.global_batch_size is not None else rows
    if global_batch is None:  # no global batch stated: it grows with the data-parallel size
        accum = trainer.grad_accum_steps or 1
        global_batch = micro * accum * dp
    else:
        stated = trainer.global_batch_size is not None
        what = f"trainer.global_batch_size={global_batch}" if stated else f"the RL step's {global_batch} rollouts"
        if global_batch % (micro * dp):
            per_rank = global_batch / dp
            batches = _neighbours(global_batch, [micro * dp * k for k in range(1, global_batch // (micro * dp) + 2)])
            micros = _neighbours(micro, [m for m in range(1, global_batch + 1) if global_batch % (m * dp) == 0])
            dps = [d for d in range(1, global_batch // micro + 1) if global_batch % (micro * d) == 0]
            worlds = _neighbours(world_size, [d * model_ranks for d in dps])
            choices = [f"trainer.global_batch_size={_or(batches)}"] if stated else []
            if micros:
                choices.append(f"trainer.micro_batch_size={_or(micros)}")
            if worlds:
                choices.append(f"a world size of {_or(worlds)}")
            raise UserError(
                f"{what} (sequences per step) do not split into micro batches of "
                f"trainer.micro_batch_size={micro} on {dp} data-parallel rank(s) "
                f"(world size {world_size} / ({layout})): "
                f"{global_batch} / ({micro} x {dp}) = {global_batch / (micro * dp):g} accumulation steps"
                + (f" ({per_rank:g} sequences per rank)" if global_batch % dp else "")
                + ". Nearest valid: " + "; ".join(choices)
            )
        accum = global_batch // (micro * dp)
        if trainer.grad_accum_steps is not None and trainer.grad_accum_steps != accum:
            raise UserError(
                f"trainer.grad_accum_steps={trainer.grad_accum_steps}, but {what} / "
                f"(trainer.micro_batch_size={micro} x {dp} data-parallel ranks) = {accum}: leave "
                "trainer.grad_accum_steps unset (null), it follows"
            )
    trainer.grad_accum_steps, trainer.global_batch_size = accum, global_batch
    parallel.data_parallel, parallel.world_size = dp, world_size
    return BatchGeometry(world_size, dp, micro, accum, global_batch)


def typed_section(cls: type, values: dict[str, Any] | None, name: str) -> Any:
    """One recipe section as its dataclass, checked against the dataclass as an OmegaConf
    structured config: an unknown key or a value of the wrong type (an int given a float or a
    word, a bool given anything but true/false) fails here naming the full key, the value and the
    expected type, before the section's own checks (``__post_init__``) run."""
    checked = check_types(cls, values, name)
    try:
        return cls(**checked)
    except TypeError as exc:
        # Only a TypeError of the call itself (a required field missing) is the recipe's: one
        # raised inside __post_init__ or a library it calls is a bug and keeps its traceback.
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
            raise UserError(f"recipe section '{name}': {exc}; set the missing key in the recipe") from exc
        raise
    # A section's own checks raise UserError (one line naming the key); any other exception,
    # a ValueError from inside torch included, propagates with its traceback as a bug.


def run_config_from_dict(cfg: dict[str, Any], world_size: int | None = None) -> RunConfig:
    """Build the typed config from a resolved recipe (``OmegaConf.to_container(resolve=True)``).
    ``world_size``: the launched process count the batch geometry follows (None: the recipe's
    ``parallel.world_size``, what a dry run plans for; see ``resolve_batch_geometry``).

    Every field of ``RunConfig`` but ``init`` is a recipe section typed by its dataclass: a new
    section or field needs no code here."""
    hints = typing.get_type_hints(RunConfig)
    optional = {"rl": RLConfig, "task": TaskConfig}  # present in RL recipes only
    sections = [name for name in hints if name != "init" and name not in optional]
    unknown = sorted(set(cfg) - set(sections) - set(optional) - {"hydra"})
    if unknown:
        raise UserError(f"unknown top-level recipe section(s) {unknown}; expected {', '.join(sections)}")
    if ("rl" in cfg) != ("task" in cfg):
        raise UserError("an RL recipe needs both an 'rl' section (GRPO settings) and a 'task' section (rollouts)")
    model = dict(cfg.get("model") or {})
    init = ModelInit(init_from=model.pop("init_from", None))
    given = {**cfg, "model": model}
    typed = {name: typed_section(hints[name], given.get(name), name) for name in sections}
    extra = {name: typed_section(cls, cfg[name], name) for name, cls in optional.items() if name in cfg}
    check_expert_layout(typed["parallel"], typed["model"], world_size)  # first: the experts' layout sets the world
    resolve_batch_geometry(typed["trainer"], typed["parallel"], world_size, extra.get("rl"))
    return RunConfig(**typed, init=init, **extra)


def record_geometry(resolved: dict[str, Any], cfg: RunConfig) -> None:
    """Write the derived geometry into the resolved recipe (recipe.json, checkpoints' meta)."""
    resolved.setdefault("trainer", {}).update(
        global_batch_size=cfg.trainer.global_batch_size, grad_accum_steps=cfg.trainer.grad_accum_steps
    )
    resolved.setdefault("parallel", {}).update(
        data_parallel=cfg.parallel.data_parallel, world_size=cfg.parallel.world_size
    )
