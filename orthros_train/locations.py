"""Where the project's files outside the package live.

This module imports nothing of the project: every layer may use it.
"""

from __future__ import annotations

from pathlib import Path

# The Hydra recipes, at the repository root next to the package (an editable install, which is
# how the project is installed: ``make install``).
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"

__all__ = ["RECIPES_DIR"]
