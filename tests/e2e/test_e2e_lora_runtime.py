"""LoRA adapters loaded and unloaded while the stack runs: vLLM's `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter` on the gateway, fanned out to the prefill and decode workers
(started with two adapter slots, `--max-loras 2`), all or nothing.

The oracle: a worker started with the adapter among its `--lora-modules` (the same engine, the
adapter loaded at start). An adapter loaded at runtime must give its greedy tokens, token for
token, through the disaggregated stack (prefill with it, KV pulled, decode with it). That
worker has no slots to spare, so it also shows a worker refusing the RPCs.

One stack for the module: the stack's own gateway runs without --allow-runtime-lora-updating
(it refuses), a second one in front of the same workers with it and an API key.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

pytest.register_assert_rewrite("tests.support.e2e_stack")

from openai import NotFoundError, OpenAI, RateLimitError  # noqa: E402

from engine.config import LoadConfig, LoRAConfig  # noqa: E402
from engine.loader import load_model_source  # noqa: E402
from engine.lora.adapter import TARGETS  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.server import GatewayServer  # noqa: E402
from protos.splitserve.v1 import (  # noqa: E402
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)
from tests.support.e2e_stack import (  # noqa: E402
    HOST,
    MODEL_NAME,
    LoopThread,
    Stack,
    engine_config,
    extra_gateway,
    greedy_sampling,
    start_stack,
    start_worker,
    worker_channel,
)
from tools.gpu.gpu_lora_check import write_adapter  # noqa: E402
from worker.server import WorkerHandle  # noqa: E402

pytest_plugins = ["tests.support.e2e_stack"]
pytestmark = pytest.mark.slow

PROMPT = [504, 3575, 282, 4649, 314, 253, 1345, 282]  # "The capital of France is a city of"
MAX_TOKENS = 10
API_KEY = "runtime-lora-admin-key"
ADAPTERS = ("rt-a", "rt-b", "rt-c")  # rt-a is also the oracle worker's start-time adapter


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cfg = load_model_source(LoadConfig()).config
    root = tmp_path_factory.mktemp("runtime_lora")
    for seed, name in enumerate(ADAPTERS, start=7):
        write_adapter(root / name, cfg, TARGETS, rank=8, alpha=4, seed=seed)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def stack(loop_thread: LoopThread) -> Iterator[Stack]:
    """Prefill + decode workers with two adapter slots each, none loaded."""
    stack = start_stack(loop_thread, colocated=False, lora=LoRAConfig(max_loras=2))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def admin(stack: Stack) -> Iterator[GatewayServer]:
    """A gateway in front of the stack's workers that takes adapter updates (with its key)."""
    with extra_gateway(stack, allow_runtime_lora_updating=True, api_key=API_KEY) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def oracle_worker(loop_thread: LoopThread, adapter_dirs: dict[str, Path]
                  ) -> Iterator[WorkerHandle]:
    """A colocated worker with rt-a loaded at start and no slots to spare (max_loras 0)."""
    config = engine_config("colocated", lora=LoRAConfig(
        modules=(("rt-a", str(adapter_dirs["rt-a"])),)))

    async def start() -> WorkerHandle:
        handle = await start_worker(config, HOST, 0)
        assert handle.load_task is not None
        await handle.load_task
        return handle

    handle = loop_thread.run(start(), 300)
    yield handle
    loop_thread.run(handle.stop(1.0), 60)


@pytest.fixture(scope="module")
def oracle(oracle_worker: WorkerHandle) -> dict[str, list[int]]:
    """The oracle worker's greedy tokens: base model ("") and rt-a (loaded at start)."""
    out = {}
    with grpc.insecure_channel(f"{HOST}:{oracle_worker.port}") as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        for lora in ("", "rt-a"):
            request = decode_pb2.DecodeRequest(
                request_id=f"oracle-{lora}", prompt_token_ids=PROMPT,
                sampling=greedy_sampling(MAX_TOKENS), lora_name=lora)
            out[lora] = [t for r in stub.Decode(request, timeout=120) if r.HasField("chunk")
                         for t in r.chunk.token_ids]
    assert out["rt-a"] != out[""], "the adapter changes the greedy output"
    return out


def _url(gateway: GatewayServer, path: str) -> str:
    return f"http://{HOST}:{gateway.rest_port}{path}"


def _post(gateway: GatewayServer, path: str, body: object, key: str | None = API_KEY
          ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(_url(gateway, path), json=body, headers=headers, timeout=120)


def _load(gateway: GatewayServer, name: str, path: Path | str) -> httpx.Response:
    return _post(gateway, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def _unload(gateway: GatewayServer, name: str) -> httpx.Response:
    return _post(gateway, "/v1/unload_lora_adapter", {"lora_name": name})


def _error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    message: str = r.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def _client(gateway: GatewayServer) -> OpenAI:
    return OpenAI(base_url=_url(gateway, "/v1"), api_key=API_KEY, max_retries=0, timeout=120)


def _models(gateway: GatewayServer) -> set[str]:
    return {m.id for m in _client(gateway).models.list().data}


def _greedy(gateway: GatewayServer, model: str) -> str:
    out = _client(gateway).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def _worker_adapters(stack: Stack) -> dict[str, list[str]]:
    return {role: sorted(w.aengine.engine.lora_names()) for role, w in stack.workers.items()
            if w.aengine is not None}


def test_a_loaded_adapter_serves_as_if_loaded_at_start(
        stack: Stack, admin: GatewayServer, adapter_dirs: dict[str, Path],
        oracle: dict[str, list[int]]) -> None:
    r = _load(admin, "rt-a", adapter_dirs["rt-a"])
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'rt-a' added successfully."
    # Listed and routed as soon as the call answered: no waiting for a poll.
    assert _models(admin) == {MODEL_NAME, "rt-a"}
    tokenizer = stack.tokenizer
    assert _greedy(admin, "rt-a") == tokenizer.decode(oracle["rt-a"])
    assert _greedy(admin, MODEL_NAME) == tokenizer.decode(oracle[""])
    assert _worker_adapters(stack) == {"prefill": ["rt-a"], "decode": ["rt-a"]}

    r = _unload(admin, "rt-a")
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'rt-a' removed successfully."
    assert _models(admin) == {MODEL_NAME}
    with pytest.raises(NotFoundError, match="rt-a"):
        _greedy(admin, "rt-a")
    assert _worker_adapters(stack) == {"prefill": [], "decode": []}
    _error(_unload(admin, "rt-a"), 404, "rt-a", "not loaded")
    stack.wait_idle()


def test_refused_loads_change_nothing(stack: Stack, admin: GatewayServer,
                                      adapter_dirs: dict[str, Path]) -> None:
    try:
        assert _load(admin, "rt-a", adapter_dirs["rt-a"]).status_code == 200
        _error(_load(admin, "rt-a", adapter_dirs["rt-a"]), 400, "already been loaded")
        _error(_load(admin, "rt-x", adapter_dirs["rt-a"].parent / "missing"), 400, "missing")
        _error(_load(admin, MODEL_NAME, adapter_dirs["rt-b"]), 400, "base model")
        _error(_post(admin, "/v1/load_lora_adapter", {"lora_name": "rt-b"}), 400, "lora_path")
        _error(_load(admin, "rt-b", "x" * 5000), 400, "lora_path", "4096")
        assert _load(admin, "rt-b", adapter_dirs["rt-b"]).status_code == 200
        _error(_load(admin, "rt-c", adapter_dirs["rt-c"]), 400, "slots")  # both taken
        assert _models(admin) == {MODEL_NAME, "rt-a", "rt-b"}
        assert _worker_adapters(stack) == {"prefill": ["rt-a", "rt-b"],
                                           "decode": ["rt-a", "rt-b"]}
        _greedy(admin, MODEL_NAME)  # the stack still serves
    finally:
        for name in ("rt-a", "rt-b"):
            _unload(admin, name)
    assert _worker_adapters(stack) == {"prefill": [], "decode": []}


def test_a_load_one_worker_refuses_is_undone_on_the_others(
        stack: Stack, admin: GatewayServer, adapter_dirs: dict[str, Path]) -> None:
    """rt-b already on the prefill worker alone (loaded there directly): the decode worker
    takes it, the prefill worker refuses, so the decode worker unloads it again."""
    with worker_channel(stack, "prefill") as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
            lora_name="rt-b", lora_path=str(adapter_dirs["rt-b"])), timeout=60)
        try:
            _error(_load(admin, "rt-b", adapter_dirs["rt-b"]), 400, "prefill worker",
                   "already been loaded")
            assert _worker_adapters(stack) == {"prefill": ["rt-b"], "decode": []}
            # Not on every pool: requests may not name it.
            assert _models(admin) == {MODEL_NAME}
        finally:
            stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="rt-b"),
                                   timeout=60)


def test_an_adapter_in_use_is_not_unloaded(stack: Stack, admin: GatewayServer,
                                           adapter_dirs: dict[str, Path]) -> None:
    """A stream runs on the decode worker with the adapter: the unload is refused there with
    the engine's message, and the prefill worker (done with the prompt) loads it back."""
    assert _load(admin, "rt-c", adapter_dirs["rt-c"]).status_code == 200
    with _client(admin).completions.with_streaming_response.create(
            model="rt-c", prompt=PROMPT, max_tokens=500, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) as response:
        # Kept referenced: a line iterator collected closes the stream (cancelling the request).
        lines = response.iter_lines()
        chunks = []
        for line in lines:
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:  # decoding: the prefill worker's part is over
                break
        assert all(c.get("choices") for c in chunks), chunks
        _error(_unload(admin, "rt-c"), 400, "in use")
        assert _worker_adapters(stack) == {"prefill": ["rt-c"], "decode": ["rt-c"]}
        assert _models(admin) == {MODEL_NAME, "rt-c"}
    stack.wait_idle()  # closing the stream cancelled it
    assert _unload(admin, "rt-c").status_code == 200
    assert _models(admin) == {MODEL_NAME}


def test_the_grpc_gateway_api(stack: Stack, admin: GatewayServer,
                              adapter_dirs: dict[str, Path]) -> None:
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    path = str(adapter_dirs["rt-b"])
    with grpc.insecure_channel(f"{HOST}:{admin.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        loaded = stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
            lora_name="rt-b", lora_path=path), metadata=metadata, timeout=60)
        assert list(loaded.lora_adapters) == ["rt-b"]
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
                lora_name="rt-b", lora_path=path), metadata=metadata, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        unloaded = stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(
            lora_name="rt-b"), metadata=metadata, timeout=60)
        assert list(unloaded.lora_adapters) == [] and unloaded.lora_path == path
        with pytest.raises(grpc.RpcError) as err:
            stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="rt-b"),
                                   metadata=metadata, timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # The stack's own gateway runs without the flag.
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
                lora_name="rt-b", lora_path=path), timeout=60)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--allow-runtime-lora-updating" in (err.value.details() or "")


def test_updates_need_the_flag_and_the_api_key(stack: Stack, admin: GatewayServer,
                                               adapter_dirs: dict[str, Path]) -> None:
    body = {"lora_name": "rt-b", "lora_path": str(adapter_dirs["rt-b"])}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        _error(_post(stack.gateway, path, body, key=None), 403,
               "--allow-runtime-lora-updating")
        _error(_post(admin, path, body, key=None), 401, "API key")
        _error(_post(admin, path, body, key="wrong-key"), 401, "API key")
    assert _worker_adapters(stack) == {"prefill": [], "decode": []}


def test_a_worker_without_slots_refuses(oracle_worker: WorkerHandle,
                                        adapter_dirs: dict[str, Path]) -> None:
    with grpc.insecure_channel(f"{HOST}:{oracle_worker.port}") as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        calls = {
            "load": lambda: stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
                lora_name="rt-b", lora_path=str(adapter_dirs["rt-b"])), timeout=60),
            "unload": lambda: stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(
                lora_name="rt-a"), timeout=60)}
        for what, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, what
            assert "--max-loras" in (err.value.details() or ""), what
        for request, field in ((common_pb2.LoadLoRAAdapterRequest(lora_path="/x"), "lora_name"),
                               (common_pb2.LoadLoRAAdapterRequest(lora_name="x"), "lora_path")):
            with pytest.raises(grpc.RpcError) as err:
                stub.LoadLoRAAdapter(request, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in (err.value.details() or "")
        report = stub.GetLoad(common_pb2.LoadRequest(), timeout=10)  # still serving
        assert list(report.lora_adapters) == ["rt-a"]


def test_a_colocated_gateway_asks_its_worker(loop_thread: LoopThread,
                                              oracle_worker: WorkerHandle,
                                              adapter_dirs: dict[str, Path]) -> None:
    """The colocated pool is the only one; its worker (no slots) refuses, with its reason."""
    assert oracle_worker.aengine is not None
    config = GatewayConfig(decode_addresses=(f"{HOST}:{oracle_worker.port}",), colocated=True,
                           served_model_name=MODEL_NAME, allow_runtime_lora_updating=True,
                           load_poll_interval_s=0.5, shutdown_grace_s=1.0)
    gateway = GatewayServer(config, rest_host=HOST, rest_port=0, grpc_host=HOST, grpc_port=0,
                            tokenizer=oracle_worker.aengine.engine.tokenizer)
    loop_thread.run(gateway.start(), 60)
    try:
        r = _post(gateway, "/v1/load_lora_adapter",
                  {"lora_name": "rt-b", "lora_path": str(adapter_dirs["rt-b"])}, key=None)
        _error(r, 400, "decode worker", "--max-loras")
        r = _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "rt-a"}, key=None)
        _error(r, 400, "decode worker", "--max-loras")
        assert _models(gateway) == {MODEL_NAME, "rt-a"}
    finally:
        loop_thread.run(gateway.stop(), 60)


@contextlib.contextmanager
def _streaming(gateway: GatewayServer, model: str) -> Iterator[None]:
    """A long greedy stream with `model` running on the decode worker while the block runs
    (three chunks in: the prefill worker is done with it); closed, so cancelled, after."""
    with _client(gateway).completions.with_streaming_response.create(
            model=model, prompt=PROMPT, max_tokens=500, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) as response:
        lines = response.iter_lines()  # kept referenced: collected, it closes the stream
        chunks = 0
        for line in lines:
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
        yield


def test_adapters_resolved_from_a_directory(stack: Stack, admin: GatewayServer,
                                            adapter_dirs: dict[str, Path],
                                            oracle: dict[str, list[int]]) -> None:
    """--lora-resolver-dir (vLLM's filesystem resolver): a request naming a directory there
    loads that adapter on both workers first and runs with it; with both slots taken, the least
    recently used adapter the resolver loaded makes room; one loaded by the admin endpoint
    never does; when every candidate is in use the request is a 429."""
    root = adapter_dirs["rt-a"].parent
    tokenizer = stack.tokenizer
    assert _worker_adapters(stack) == {"prefill": [], "decode": []}
    with extra_gateway(stack, lora_resolver_dir=str(root), api_key=API_KEY,
                       allow_runtime_lora_updating=True) as gw:
        assert _models(gw) == {MODEL_NAME}
        assert _greedy(gw, "rt-a") == tokenizer.decode(oracle["rt-a"])
        assert _worker_adapters(stack) == {"prefill": ["rt-a"], "decode": ["rt-a"]}
        _greedy(gw, "rt-b")
        _greedy(gw, "rt-a")  # rt-b is now the least recently used
        _greedy(gw, "rt-c")
        assert _worker_adapters(stack) == {"prefill": ["rt-a", "rt-c"],
                                           "decode": ["rt-a", "rt-c"]}
        assert _greedy(gw, "rt-a") == tokenizer.decode(oracle["rt-a"])  # unchanged by swaps
        for bad in ("rt-missing", "../runtime_lora0/rt-a", ".rt-a"):
            with pytest.raises(NotFoundError, match="does not exist"):
                _greedy(gw, bad)
        # Tokenizing with a resolvable name needs no adapter: nothing is loaded for it.
        r = httpx.post(_url(gw, "/tokenize"), json={"model": "rt-b", "prompt": "Paris"},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert r.status_code == 200, r.text
        assert _worker_adapters(stack)["decode"] == ["rt-a", "rt-c"]

        # Both slots' adapters in use: rt-b has no room, a 429 to retry.
        with _streaming(gw, "rt-a"), _streaming(gw, "rt-c"):
            with pytest.raises(RateLimitError, match="retry later"):
                _greedy(gw, "rt-b")
            assert _worker_adapters(stack)["prefill"] == ["rt-a", "rt-c"]  # reloaded there
        stack.wait_idle()
        # An adapter loaded through the admin endpoint is not the resolver's to unload: rt-c
        # (the resolver's own) goes, although rt-a was used less recently.
        assert _unload(gw, "rt-a").status_code == 200
        assert _load(gw, "rt-a", adapter_dirs["rt-a"]).status_code == 200
        _greedy(gw, "rt-c")
        _greedy(gw, "rt-b")
        assert _worker_adapters(stack)["decode"] == ["rt-a", "rt-b"]
    for name in ("rt-a", "rt-b"):
        assert _unload(admin, name).status_code == 200
    assert _worker_adapters(stack) == {"prefill": [], "decode": []}


def test_a_worker_that_lost_an_adapter_gets_it_back(stack: Stack, admin: GatewayServer,
                                                     adapter_dirs: dict[str, Path],
                                                     oracle: dict[str, list[int]]) -> None:
    """A worker that restarted comes back with its start-time adapters only: the gateway that
    loaded one at runtime sees it missing from that worker's load report and loads it there
    again. Here the decode worker drops it behind the gateway's back (its own RPC)."""
    assert _load(admin, "rt-a", adapter_dirs["rt-a"]).status_code == 200
    with worker_channel(stack, "decode") as channel:
        left = decode_pb2_grpc.DecodeStub(channel).UnloadLoRAAdapter(
            common_pb2.UnloadLoRAAdapterRequest(lora_name="rt-a"), timeout=60)
    assert list(left.lora_adapters) == []
    deadline = time.monotonic() + 20
    while _worker_adapters(stack)["decode"] != ["rt-a"]:
        assert time.monotonic() < deadline, "the gateway did not load it back"
        time.sleep(0.1)
    assert _greedy(admin, "rt-a") == stack.tokenizer.decode(oracle["rt-a"])
    assert _unload(admin, "rt-a").status_code == 200
    # Unloaded everywhere by another gateway (the stack's own has no flag: a worker's RPC
    # again, on both): no worker serves it, so it is forgotten, not put back.
    assert _load(admin, "rt-b", adapter_dirs["rt-b"]).status_code == 200
    for role, stub in (("prefill", prefill_pb2_grpc.PrefillStub),
                       ("decode", decode_pb2_grpc.DecodeStub)):
        with worker_channel(stack, role) as channel:
            stub(channel).UnloadLoRAAdapter(
                common_pb2.UnloadLoRAAdapterRequest(lora_name="rt-b"), timeout=60)
    time.sleep(3 * admin.config.load_poll_interval_s + 0.5)
    assert _worker_adapters(stack) == {"prefill": [], "decode": []}
    assert _models(admin) == {MODEL_NAME}


def test_an_adapter_another_gateway_loaded_is_put_back(stack: Stack, admin: GatewayServer,
                                                       adapter_dirs: dict[str, Path]) -> None:
    """The workers report runtime adapters' directories, so a gateway puts back an adapter it
    never loaded itself (another gateway did, here the workers' own RPCs standing in for it)."""
    stubs = (("prefill", prefill_pb2_grpc.PrefillStub), ("decode", decode_pb2_grpc.DecodeStub))
    for role, stub in stubs:
        with worker_channel(stack, role) as channel:
            stub(channel).LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
                lora_name="rt-c", lora_path=str(adapter_dirs["rt-c"])), timeout=120)
    deadline = time.monotonic() + 20
    while "rt-c" not in _models(admin):
        assert time.monotonic() < deadline, "the admin gateway never saw rt-c"
        time.sleep(0.1)
    assert "rt-c" not in admin.state.runtime_loras   # not this gateway's own load
    with worker_channel(stack, "decode") as channel:
        decode_pb2_grpc.DecodeStub(channel).UnloadLoRAAdapter(
            common_pb2.UnloadLoRAAdapterRequest(lora_name="rt-c"), timeout=60)
    deadline = time.monotonic() + 20
    while _worker_adapters(stack)["decode"] != ["rt-c"]:
        assert time.monotonic() < deadline, "the gateway did not load it back"
        time.sleep(0.1)
    assert _unload(admin, "rt-c").status_code == 200
    assert _worker_adapters(stack) == {"prefill": [], "decode": []}
