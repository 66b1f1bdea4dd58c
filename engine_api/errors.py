"""The errors the engine's API raises on bad configuration or model files (torch-free, so the
gateway and the tokenizer can raise and catch them too)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


class ModelLoadError(ValueError):
    """A model path or file cannot be loaded; the message names the path and what is wrong."""


class EngineInputError(ValueError):
    """A request the engine cannot serve; the message names the field and the limit."""
