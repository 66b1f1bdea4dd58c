"""splitserve engine: the shared core of the prefill and decode services.

`from engine import LLM, SamplingParams, PoolingParams` mirrors vLLM. Torch-using exports are
loaded lazily, so that `from engine import SamplingParams` (re-exported from the torch-free
`engine_api`) pulls in no torch. The gateway imports `engine_api` itself, never `engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_api.errors import EngineInputError
from engine_api.pooling_params import PoolingParams, PoolingParamsError
from engine_api.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "EmbeddingRequestOutput", "EngineInputError", "LLMEngine",
           "PoolingParams", "PoolingParamsError", "RequestOutput", "SamplingParams",
           "SamplingParamsError"]

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EmbeddingRequestOutput": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
