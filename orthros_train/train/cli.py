"""``orthros-train``: the Hydra entry point. Recipes are primary configs (``--config-name``)."""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from orthros_train.train.config import run_config_from_dict

# Recipes live at the repository root (``recipes/``), next to the package in an editable install.
RECIPES_DIR = str(Path(__file__).resolve().parents[2] / "recipes")


def run(cfg: DictConfig) -> dict:
    """Resolve the recipe into typed config, then dry-run or train."""
    from orthros_train.train.trainer import Trainer, plan_summary

    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    run_cfg = run_config_from_dict(resolved)
    if run_cfg.trainer.dry_run:
        summary = plan_summary(run_cfg)
        print(json.dumps(summary, indent=2))
        return summary
    trainer = Trainer(run_cfg, resolved)
    result = trainer.fit()
    print(f"final eval loss {result['eval_loss']:.4f}; checkpoint {result['checkpoint']}")
    prompt = run_cfg.trainer.sample_prompt
    if prompt:
        text = trainer.sample(prompt, run_cfg.trainer.sample_tokens)
        print(f"sample (greedy, prefill + decode):\n  prompt: {prompt!r}\n  continuation: {text!r}")
    return result


@hydra.main(config_path=RECIPES_DIR, config_name=None, version_base="1.3")
def main(cfg: DictConfig) -> None:
    if not cfg:
        raise SystemExit("orthros-train: pick a recipe, e.g. `orthros-train --config-name tiny_cpu`")
    try:
        run(cfg)
    except ValueError as exc:  # configuration errors: one clear line, not a traceback
        raise SystemExit(f"orthros-train: {exc}") from exc


if __name__ == "__main__":
    main()
