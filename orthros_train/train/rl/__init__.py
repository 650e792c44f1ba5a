"""RL fine-tuning with GRPO through the same trainer as every other phase (docs/sft_rl.md).

A *rollout* is a prompt, a sampled response and how good it was. The package is split by concern:

========================  =====================================================================
``rollout.py``            the rollout format (``Rollout``), JSONL read/write, checked by type
``advantages.py``         advantages from rewards within groups (GRPO) or as given
``batch.py``              rollouts -> the rl ``OrthrosLayout`` the trainer reads; log-probs
``grpo.py``               the GRPO loss and the surrogate layout with the GRPO gradient
``objective.py``          ``GRPOObjective``: the trainer's objective for RL runs
``policy.py``             ``Policy``: the model sampled from and read log-probs of, as one object
``generation.py``         ``RolloutGenerator``: sampling with the policy and scoring
``rewards.py``            reward functions and ``module:function`` specs
``pattern_task.py``       ``PatternTask``, the CPU toy task
``sources.py``            where a step's rollouts come from: generated or an external file
``data.py``               ``RolloutData``: rollouts served as trainer data, with resumable state
========================  =====================================================================
"""

from orthros_train.train.rl.advantages import compute_advantages
from orthros_train.train.rl.batch import (
    OLD_LOGPROBS,
    REF_LOGPROBS,
    REWARD,
    response_logprobs,
    rollout_layout,
    token_logprobs,
)
from orthros_train.train.rl.data import RolloutData, build_rollout_data, numbered_tokenizer
from orthros_train.train.rl.generation import RolloutGenerator
from orthros_train.train.rl.grpo import average_weights, grpo_loss, surrogate_layout
from orthros_train.train.rl.objective import GRPOObjective
from orthros_train.train.rl.pattern_task import PatternTask
from orthros_train.train.rl.policy import Policy
from orthros_train.train.rl.rewards import load_reward, reference_match_reward
from orthros_train.train.rl.rollout import RewardFn, Rollout, load_rollouts, rollout_reward, save_rollouts
from orthros_train.train.rl.sources import FileRollouts, GeneratedRollouts, RolloutSource

__all__ = [
    "OLD_LOGPROBS",
    "REF_LOGPROBS",
    "REWARD",
    "FileRollouts",
    "GRPOObjective",
    "GeneratedRollouts",
    "PatternTask",
    "Policy",
    "RewardFn",
    "Rollout",
    "RolloutData",
    "RolloutGenerator",
    "RolloutSource",
    "average_weights",
    "build_rollout_data",
    "compute_advantages",
    "grpo_loss",
    "load_reward",
    "load_rollouts",
    "numbered_tokenizer",
    "reference_match_reward",
    "response_logprobs",
    "rollout_layout",
    "rollout_reward",
    "save_rollouts",
    "surrogate_layout",
    "token_logprobs",
]
