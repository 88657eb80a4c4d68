"""The error a bad config value raises, below every module that checks one (so a check anywhere
imports it without importing :mod:`recipes.config.validate`, which imports the checks)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work; the message says which and what is valid."""
