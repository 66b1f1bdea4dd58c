"""The name a deployment serves its model under: the API's `model` (gateway) and the
`model_name` label of every worker's and gateway's metrics, chosen alike everywhere."""

from __future__ import annotations

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's name


def served_model_name_for(model: str | None, served_model_name: str | None = None) -> str:
    """As vLLM picks it: `--served-model-name` if given, else the `--model` argument as written
    (a path, a hub-style id, `dummy:<preset>`), else (no model given: the embedded SmolLM2)
    that model's name."""
    if served_model_name:
        return served_model_name
    return model or DEFAULT_SERVED_MODEL_NAME
