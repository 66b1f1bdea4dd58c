"""Session fixtures shared across the test folders: the tiny random Hugging Face model
directories (tests/support/tiny_models.py), their `transformers` references, and one SmolLM2
engine.

They live here, at the root, so that one session builds each of them once whichever folders
(unit/engine, kernels, e2e, ...) ask for them; this module imports neither torch nor
transformers (the fixtures import them when first requested), so collecting or running the
torch-free tests (tests/unit/gateway) never loads them.

The test folders: unit/<package> (one per product package), kernels (Triton kernels under
TRITON_INTERPRET=1), e2e (real servers and stacks); helpers shared by them in support/.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# The helpers' asserts report their operands like the tests' own.
pytest.register_assert_rewrite("tests.support")

# The suite builds ~380 engines, each start paying a full garbage collection for the startup
# heap's freeze (engine/heap.py): off here and in the servers tests start (they inherit the
# environment), on where tests/unit/engine/test_engine_gc.py checks the freeze itself.
os.environ["SPLITSERVE_GC_FREEZE"] = "0"


def freeze_collected_heap() -> None:
    """Move what is alive now out of the garbage collector's reach, after a full collection.

    Each engine start still makes a full collection (engine/heap.py `thaw_heap`: it frees the
    engines dropped since), and walking what collecting the suite imported (torch,
    transformers, every test module: ~570k objects) took 0.34 s of it, ~130 s over the suite's
    engines. Those objects live as long as the session; frozen, each collection walks only
    what the tests built since."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    freeze_collected_heap()


def pytest_unconfigure(config: pytest.Config) -> None:
    # The interpreter's last collection must reach everything again: extension modules
    # (Triton's nanobind) report frozen objects as leaks at exit.
    gc.unfreeze()


@pytest.fixture(scope="module")
def unfrozen_heap() -> Iterator[None]:
    """For a module that checks the engine's own freeze (tests/unit/engine/test_engine_gc.py):
    nothing frozen while it runs, the suite's freeze back after it."""
    gc.unfreeze()
    yield
    gc.unfreeze()  # the module's last engine's freeze: its engines may be collected
    freeze_collected_heap()

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.llm import LLM


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> HF directory (config.json + model.safetensors) for each of TINY_MODELS."""
    from tests.support.tiny_models import write_tiny_model_dirs

    return write_tiny_model_dirs(tmp_path_factory)


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dirs: dict[str, Path]) -> Callable[[str], PreTrainedModel]:
    """name -> the transformers model read back from the saved dir (eager attention, float32)."""
    from tests.support.tiny_models import load_hf_reference

    cache: dict[str, PreTrainedModel] = {}

    def get(name: str) -> PreTrainedModel:
        if name not in cache:
            cache[name] = load_hf_reference(tiny_model_dirs[name], name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    """The default SmolLM2-135M-Instruct GGUF engine (loaded once: it takes ~20 s on 2 cores)."""
    from engine.llm import LLM

    return LLM(num_gpu_blocks=512, device="cpu")


@pytest.fixture(scope="session")
def smollm2_yes_no() -> LLM:
    """SmolLM2 as a yes/no cross-encoder (`classifier_from_token=["no", "yes"]`): one engine
    for the classifier's unit tests and the cross-encoder e2e tests' reference."""
    from engine.llm import LLM

    return LLM(num_gpu_blocks=128, device="cpu", classifier_from_token=["no", "yes"])
