"""A run's model as the list of its chunks (one per virtual pipeline stage): what a save and a
load walk, and the run's loop and metrics too."""

from __future__ import annotations


def model_chunks(model) -> list:
    """The list of model chunks of ``model`` (one DDP-wrapped model or a list of them)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]
