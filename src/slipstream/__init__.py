"""slipstream: make PyTorch training and inference faster through software alone, measured.

Public API: Recipe (and its sections), presets, Session, train. Importing has no side effects.
"""

from .presets import PRESETS, get_preset, resolve_recipe
from .profile.steps import mark_step
from .recipe import (
    CompileConfig,
    KernelsConfig,
    OptimizerConfig,
    PrecisionConfig,
    Recipe,
    RecipeError,
    RuntimeConfig,
    ShapesConfig,
    load_recipe,
    save_recipe,
)
from .session import Session
from .train import TrainResult, train

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CompileConfig",
    "KernelsConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "Recipe",
    "RecipeError",
    "RuntimeConfig",
    "Session",
    "ShapesConfig",
    "TrainResult",
    "get_preset",
    "load_recipe",
    "mark_step",
    "resolve_recipe",
    "save_recipe",
    "train",
]
