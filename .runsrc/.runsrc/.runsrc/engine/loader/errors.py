"""Loader errors (torch-free, so the tokenizer can raise them too)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model path or file cannot be loaded; the message names the path and what is wrong."""
