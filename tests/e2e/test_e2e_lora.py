"""LoRA adapters through the whole stack: the gateway's `model` names an adapter the workers
report; the prompt runs with it on the prefill worker, its KV (hashed under the adapter's
root) is pulled by the decode worker, which decodes with it too. Greedy tokens equal the
offline engine's with the same adapter, token for token, and differ from the base model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")

from openai import NotFoundError, OpenAI  # noqa: E402

from engine.config import LoadConfig, LoRAConfig  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loader import load_model_source  # noqa: E402
from engine.lora.adapter import TARGETS  # noqa: E402
from engine_api.sampling_params import SamplingParams  # noqa: E402
from protos.splitserve.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.support.e2e_stack import MODEL_NAME, LoopThread, Stack, start_stack  # noqa: E402
from tests.unit.engine.test_lora import write_adapter  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

ADAPTER = "smol-lora"
PROMPT = [504, 3575, 282, 4649, 314, 253, 1345, 282]  # "The capital of France is a city of"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = load_model_source(LoadConfig()).config
    path = tmp_path_factory.mktemp("smol_lora") / ADAPTER
    write_adapter(path, cfg, TARGETS, rank=8, alpha=4, seed=7)
    return path


@pytest.fixture(scope="module")
def lora_stack(loop_thread: LoopThread, adapter_dir: Path) -> Iterator[Stack]:
    stack = start_stack(loop_thread, colocated=False,
                        lora=LoRAConfig(modules=((ADAPTER, str(adapter_dir)),)))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def offline(adapter_dir: Path) -> Iterator[dict[str, list[int]]]:
    """The offline engine's greedy tokens: base model and adapter."""
    llm = LLM(num_gpu_blocks=128, device="cpu", lora_modules={ADAPTER: str(adapter_dir)})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {"base": llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids,
           ADAPTER: llm.generate([{"prompt_token_ids": PROMPT}], params,
                                 lora_request=ADAPTER)[0].outputs[0].token_ids}
    llm.shutdown()
    yield out


def _pulls(stack: Stack) -> int:
    aengine = stack.workers["decode"].aengine
    assert aengine is not None
    loader = aengine.kv_loader
    return sum(s.pulls for s in dict(getattr(loader, "transport_stats", {})).values())


def test_the_model_field_picks_the_adapter(lora_stack: Stack,
                                           offline: dict[str, list[int]]) -> None:
    client = OpenAI(base_url=lora_stack.rest_url, api_key="x", max_retries=0, timeout=120)
    aengine = lora_stack.workers["decode"].aengine
    assert aengine is not None and aengine.engine.tokenizer is not None
    tokenizer = aengine.engine.tokenizer
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, ADAPTER}
    assert models[ADAPTER].model_extra and models[ADAPTER].model_extra["parent"] == MODEL_NAME
    assert offline[ADAPTER] != offline["base"]
    for model, want in ((ADAPTER, offline[ADAPTER]), (MODEL_NAME, offline["base"])):
        before = _pulls(lora_stack)
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.model == model
        assert out.choices[0].text == tokenizer.decode(want), model
        assert _pulls(lora_stack) == before + 1, "the decode worker pulled the prompt's KV"
    with pytest.raises(NotFoundError, match=ADAPTER):
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)


def test_grpc_generate_with_the_adapter(lora_stack: Stack,
                                        offline: dict[str, list[int]]) -> None:
    with grpc.insecure_channel(lora_stack.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=PROMPT), model=ADAPTER,
            sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True})
        tokens = [t for r in stub.Generate(request, timeout=120) if r.HasField("chunk")
                  for t in r.chunk.token_ids]
        assert tokens == offline[ADAPTER]
        bad = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT),
                                          model="nope")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_handle_binds_its_adapter(lora_stack: Stack) -> None:
    """KV computed under the adapter is not this prompt's KV for the base model (nor the
    reverse): the decode worker's handle check tells them apart, partial block included."""
    from protos.splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
    from tests.support.e2e_stack import worker_channel
    from worker.decode_servicer import _handle_problem

    aengine = lora_stack.workers["decode"].aengine
    assert aengine is not None
    with worker_channel(lora_stack, "prefill") as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=2)
        for i, lora in enumerate((ADAPTER, "")):
            response = stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=f"bind-{i}", prompt_token_ids=PROMPT, sampling=sampling,
                lease_ms=1000, lora_name=lora), timeout=60)
            handle = response.kv_handle
            other = "" if lora else ADAPTER
            assert _handle_problem(handle, PROMPT, aengine.engine, lora or None) is None
            problem = _handle_problem(handle, PROMPT, aengine.engine, other or None)
            assert problem is not None and "prompt_hash" in problem
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(prefill_pb2.PrefillRequest(
                request_id="bind-x", prompt_token_ids=PROMPT, sampling=sampling,
                lora_name="nope"), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown LoRA adapter" in (err.value.details() or "")
