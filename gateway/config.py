"""Gateway configuration: one frozen dataclass; the CLI (`gateway.server.main`) reads defaults here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from engine_api.model_name import DEFAULT_SERVED_MODEL_NAME
from engine_api.model_name import (  # re-exported: the gateway's CLIs name it from here
    served_model_name_for as served_model_name_for,
)
from gateway.discovery import DiscoveryError, check_targets
from rpc.auth import AuthConfigError, check_secret
from rpc.tls import TlsConfigError, read_pem

# The engine's limit on drafts per step (engine.config.MAX_SPECULATIVE_TOKENS, kept equal by
# tests/unit/gateway/test_spec_policy.py; the gateway imports no engine config). A
# `speculative_tokens` above it would fail every Decode call with INVALID_ARGUMENT: refused at
# start-up instead.
MAX_SPECULATIVE_TOKENS = 16

KvFailurePolicyName = Literal["recompute", "fail"]
# The speculative decoding policy (gateway/spec_policy.py) and the proposers it may ask for.
SPEC_POLICIES = ("adaptive", "threshold", "always")
SPEC_POLICY_METHODS = ("auto", "ngram", "suffix", "draft_model")
# How `tool_choice: "auto"` output is parsed into tool calls (gateway/tools.py).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# How a thinking model's <think> text is split off a chat answer (gateway/reasoning.py).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class GatewayConfigError(ValueError):
    """An invalid gateway setting; the message names the field and what is allowed."""


# The public API key's variable (vLLM reads VLLM_API_KEY): a key in the environment is not on
# the command line, where `ps` shows it to every user of the machine.
API_KEY_ENV = "SPLITSERVE_API_KEY"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway process needs; never mutated after construction."""

    # Prefill services (also KvTransfer) and Decode services: host:port entries and DNS names
    # `dns:[//DNS_SERVER/]NAME:PORT` (every address of NAME; gateway/discovery.py).
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    # True: no prefill pool; DecodeRequest goes without kv_handle and decode computes the prompt.
    colocated: bool = False
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME  # see `served_model_name_for`
    tokenizer_path: str = ""                  # tokenizer.json / .gguf; "" = the embedded SmolLM2 GGUF
    max_model_len: int = 8192                 # prompt + output tokens
    api_key: str | None = None                # bearer token for /v1/* and gRPC; None = no auth
    # TLS on the public ports (REST and gRPC), as vLLM's --ssl-certfile/--ssl-keyfile: PEM files
    # of the gateway's certificate chain and key (both or neither); with `ssl_ca_certs` clients
    # must also present a certificate that CA signed. None: plaintext (TLS ends at an ingress).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    # The cluster's shared secret sent with every call to the workers (rpc/auth.py; from
    # SPLITSERVE_INTERNAL_TOKEN); None: the workers take calls without one.
    internal_token: str | None = None
    max_body_bytes: int = 4 << 20             # REST request body limit (413 above it)
    max_prompt_tokens: int = 8192             # hard prompt limit, independent of max_model_len
    max_n: int = 8                            # completions per request
    max_prompts_per_request: int = 32         # prompts in one /v1/completions batch
    max_embedding_inputs: int = 2048          # inputs of one embeddings request (OpenAI's limit)
    max_tokens_cap: int = 4096                # largest max_tokens a request may ask for
    request_timeout_s: float = 600.0          # whole-request deadline passed to every hop
    kv_failure_policy: KvFailurePolicyName = "recompute"
    decode_retries: int = 1                   # resumes on another decode worker after UNAVAILABLE
    # Load shedding at the gateway: generation and embeddings requests in flight here (a stream
    # until it ends) at most; one more is refused at once with 429 / RESOURCE_EXHAUSTED before
    # any worker is called. 0: no bound (the workers' --max-queued-requests may still refuse).
    max_concurrent_requests: int = 0
    # Speculative decoding policy (gateway/spec_policy.py), decided per Decode call: ask for
    # this many drafts per step while the chosen decode worker has fewer than
    # `speculative_max_load` other requests pending (this gateway's own calls in flight there
    # plus the rest of its last load report: `Worker.routing_key`), 0 (off) from there on.
    # speculative_tokens=0: never ask (every call sends 0). A worker started without
    # --speculative-method ignores it; one with a smaller --num-speculative-tokens caps it.
    speculative_tokens: int = 4
    speculative_max_load: int = 4
    # Below this many other pending requests a worker that has a draft model is asked to draft
    # with it; from here up to `speculative_max_load`, with n-gram lookup (its drafts cost no
    # model steps, which start to weigh once the verify batch grows; docs/performance.md).
    speculative_draft_max_load: int = 2
    # How the policy decides: "adaptive" (default) picks the method and drafts that maximise
    # the batch's tokens per second from the worker's measured step cost and acceptance (the
    # threshold rule above until a worker has reported them); "threshold": the rule above
    # alone; "always": `speculative_tokens` drafts every step whatever the load (fixed: the
    # worker's step budget does not lower them). `speculative_policy_method`
    # limits it to one proposer ("auto": any the worker has). `speculative_tpot_slo_ms` (> 0):
    # no choice whose predicted step time exceeds it (unless a plain step already does).
    speculative_policy: str = "adaptive"
    speculative_policy_method: str = "auto"
    speculative_tpot_slo_ms: float = 0.0
    # Tool calling: the parser of `tool_choice: "auto"` output (None: "auto" is refused; named
    # and "required" choices need none) and a chat template used in place of the model's (its
    # text: `--chat-template` reads the file), for models whose own does not show tools.
    tool_call_parser: str | None = None
    chat_template: str | None = None
    # vLLM's --trust-request-chat-template: a request may send its own `chat_template` (a Jinja2
    # template run, sandboxed, in place of the one above). Off: such a request is a 400, since
    # the template is code the gateway runs and can spend its CPU and memory.
    trust_request_chat_template: bool = False
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter (and their gRPC Gateway methods) load an adapter on every worker
    # or unload it. Off: they are refused (403), since they make the workers read any
    # directory they can see.
    allow_runtime_lora_updating: bool = False
    # vLLM's filesystem LoRA resolver: a request whose `model` names no adapter the workers
    # serve, but a directory DIR/<model>, gets that adapter loaded on every worker first
    # (gateway/model_resolution.py; least recently used ones it loaded are unloaded when the
    # slots are full). The workers must see DIR at the same path. None: off.
    lora_resolver_dir: str | None = None
    # The model's recommended sampling values (vLLM's --generation-config auto: its
    # generation_config.json, engine_api/generation_defaults.py), used where a request leaves the
    # field unset: (engine SamplingParams field, value) pairs.
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    # Reasoning outputs: the parser that splits a thinking model's <think> text off a chat
    # answer into `reasoning` (gateway/reasoning.py; None: the text is all content).
    reasoning_parser: str | None = None
    # Stored responses of the Responses API (gateway/response_store.py), in this process's
    # memory: at most this many, of at most this many bytes together (their JSON), the least
    # recently used out first. 0 (either): nothing is stored; `store: true` is taken as false.
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 64 << 20
    # vLLM's --enable-log-requests / --disable-log-requests: one INFO line per request (its id,
    # prompt length and sampling settings; never the prompt's text). Off by default, as vLLM.
    log_requests: bool = False
    # uvicorn's own log level (its access log is one line per request at "info").
    uvicorn_log_level: str = "warning"
    load_poll_interval_s: float = 1.0         # router GetLoad period
    load_poll_timeout_s: float = 1.0
    # dns: targets are looked up again this often (sooner when their TTL is shorter).
    discovery_interval_s: float = 5.0
    # Load polls in a row a worker may miss before its health check decides whether it stays
    # in routing, and that check's deadline (gateway/worker_health.py).
    load_poll_max_misses: int = 3
    liveness_timeout_s: float = 5.0
    # A Decode stream silent this long (at least; more for a worker with slow steps) has its
    # worker's health asked; no answer within liveness_timeout_s: resumed elsewhere
    # (gateway/stream_watch.py).
    stream_stall_s: float = 2.0
    # A streaming client (REST SSE or gRPC) that takes no data for this long (it stopped
    # reading: its TCP window stays closed) is cut: the request aborted, its downstream calls
    # cancelled, its place of the request limit given back (gateway/streaming.py).
    stream_send_timeout_s: float = 30.0
    shutdown_grace_s: float = 10.0            # drain time for in-flight requests on shutdown

    def __post_init__(self) -> None:
        self.validate()

    @property
    def tls(self) -> bool:
        """Whether the public ports serve TLS."""
        return self.ssl_certfile is not None

    def _validate_tls(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise GatewayConfigError("ssl_certfile and ssl_keyfile go together (both or neither)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise GatewayConfigError("ssl_ca_certs (client certificates) needs ssl_certfile and "
                                     "ssl_keyfile")
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None:
                try:
                    read_pem(path, name)
                except TlsConfigError as e:
                    raise GatewayConfigError(str(e)) from None

    @property
    def defaults(self) -> dict[str, float | int]:
        """`sampling_defaults` as a mapping."""
        return dict(self.sampling_defaults)

    def validate(self) -> None:
        if not self.decode_addresses:
            raise GatewayConfigError("decode_addresses: at least one decode worker is required")
        if self.lora_resolver_dir is not None and not os.path.isdir(self.lora_resolver_dir):
            raise GatewayConfigError(f"lora_resolver_dir: {self.lora_resolver_dir!r} is not a "
                                     "directory")
        if self.colocated and self.prefill_addresses:
            raise GatewayConfigError(
                "prefill_addresses must be empty when colocated=True (decode computes the prompt)")
        if not self.colocated and not self.prefill_addresses:
            raise GatewayConfigError(
                "prefill_addresses: at least one prefill worker is required unless colocated=True")
        for name in ("max_model_len", "max_body_bytes", "max_prompt_tokens", "max_n",
                     "max_prompts_per_request", "max_embedding_inputs", "max_tokens_cap"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise GatewayConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("responses_store_max_entries", "responses_store_max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise GatewayConfigError(f"{name} must be an integer >= 0 (0: store no "
                                         f"responses), got {value!r}")
        value = self.max_concurrent_requests
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise GatewayConfigError(f"max_concurrent_requests must be an integer >= 0 (0: no "
                                     f"bound), got {value!r}")
        try:
            check_targets(self.prefill_addresses, "prefill_addresses")
            check_targets(self.decode_addresses, "decode_addresses")
        except DiscoveryError as e:
            raise GatewayConfigError(str(e)) from None
        if not isinstance(self.load_poll_max_misses, int) or self.load_poll_max_misses < 1:
            raise GatewayConfigError(f"load_poll_max_misses must be an integer >= 1, got "
                                     f"{self.load_poll_max_misses!r}")
        for name in ("request_timeout_s", "load_poll_interval_s", "load_poll_timeout_s",
                     "discovery_interval_s", "liveness_timeout_s",
                     "stream_stall_s", "stream_send_timeout_s"):
            if getattr(self, name) <= 0:
                raise GatewayConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise GatewayConfigError(
                f"kv_failure_policy must be 'recompute' or 'fail', got {self.kv_failure_policy!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise GatewayConfigError("api_key must not be empty (omit it to disable auth)")
        self._validate_tls()
        if self.internal_token is not None:
            try:
                check_secret(self.internal_token, "internal_token")
            except AuthConfigError as e:
                raise GatewayConfigError(str(e)) from None
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise GatewayConfigError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got "
                                     f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise GatewayConfigError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                                     f"{self.reasoning_parser!r}")
        if self.decode_retries < 0:
            raise GatewayConfigError(f"decode_retries must be >= 0, got {self.decode_retries}")
        if (not isinstance(self.speculative_tokens, int) or isinstance(self.speculative_tokens, bool)
                or not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise GatewayConfigError(
                f"speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0: never "
                f"ask for speculative decoding), got {self.speculative_tokens!r}")
        if (not isinstance(self.speculative_max_load, int)
                or isinstance(self.speculative_max_load, bool) or self.speculative_max_load < 1):
            raise GatewayConfigError(
                "speculative_max_load must be an integer >= 1 (pending requests on a decode "
                f"worker from which speculation is off), got {self.speculative_max_load!r}")
        if (not isinstance(self.speculative_draft_max_load, int)
                or isinstance(self.speculative_draft_max_load, bool)
                or self.speculative_draft_max_load < 0):
            raise GatewayConfigError(
                "speculative_draft_max_load must be an integer >= 0 (pending requests on a "
                "decode worker from which its draft model gives way to n-gram lookup; 0: never "
                f"the draft model), got {self.speculative_draft_max_load!r}")
        if self.speculative_policy not in SPEC_POLICIES:
            raise GatewayConfigError(f"speculative_policy must be one of {SPEC_POLICIES}, got "
                                     f"{self.speculative_policy!r}")
        if self.speculative_policy_method not in SPEC_POLICY_METHODS:
            raise GatewayConfigError(f"speculative_policy_method must be one of "
                                     f"{SPEC_POLICY_METHODS}, got "
                                     f"{self.speculative_policy_method!r}")
        slo = self.speculative_tpot_slo_ms
        if not isinstance(slo, (int, float)) or isinstance(slo, bool) or not slo >= 0:
            raise GatewayConfigError(f"speculative_tpot_slo_ms must be a number >= 0 (0: no "
                                     f"guard), got {slo!r}")

    def replace(self, **changes: Any) -> GatewayConfig:
        return dataclasses.replace(self, **changes)


def add_chat_args(parser: argparse.ArgumentParser, role: str = "") -> None:
    """The flags of chat rendering, tool calling, the Responses API's store, the bound on
    requests in flight and runtime LoRA updates, for every process that serves the REST API
    (the gateway role and the colocated role's in-process gateway)."""
    note = f"{role}: " if role else ""
    d = GatewayConfig.__dataclass_fields__
    parser.add_argument("--chat-template", default=None,
                        help=f"{note}a Jinja2 chat template file used in place of the model's "
                             f"(e.g. gateway/chat_templates/chatml_hermes_tools.jinja: ChatML "
                             f"with tools)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help=f"{note}accept a request's own `chat_template` (a Jinja2 template "
                             f"the server runs, sandboxed, in place of its own); without it "
                             f"such a request is refused")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help=f"{note}parse tool calls out of the model's output, enabling "
                             f"tool_choice \"auto\" (hermes: <tool_call> blocks; llama3_json: "
                             f"Llama 3.x JSON calls)")
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help=f"{note}split a thinking model's <think>...</think> text off chat "
                             f"answers into `reasoning` (deepseek_r1: the output starts in it; "
                             f"qwen3: when it starts with <think> or the prompt left one open)")
    parser.add_argument("--responses-store-max-entries", type=int,
                        default=d["responses_store_max_entries"].default,
                        help=f"{note}responses (POST /v1/responses with store) kept in memory "
                             f"for GET /v1/responses/ID and previous_response_id, least "
                             f"recently used out first (0: none; store is then taken as false)")
    parser.add_argument("--responses-store-max-bytes", type=int,
                        default=d["responses_store_max_bytes"].default,
                        help=f"{note}bytes of stored responses (their JSON with their "
                             f"conversations) kept in memory (0: none)")
    parser.add_argument("--max-concurrent-requests", type=int,
                        default=d["max_concurrent_requests"].default,
                        help=f"{note}generation and embeddings requests in flight at most (a "
                             f"stream until it ends); one more is refused at once with 429 "
                             f"(Retry-After: 1) / RESOURCE_EXHAUSTED (0: no bound)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help=f"{note}serve POST /v1/load_lora_adapter and "
                             f"/v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): "
                             f"an adapter loaded on every worker (started with --max-loras N) "
                             f"or unloaded; without it they answer 403")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help=f"{note}sampling defaults for requests that leave them unset "
                             f"(temperature, top_p, top_k, min_p, repetition_penalty, "
                             f"max_tokens): auto, the model's generation_config.json (vLLM's "
                             f"default); vllm, none; or DIR/generation_config.json")
    parser.add_argument("--override-generation-config", default=None, metavar="JSON",
                        help=f"{note}sampling defaults over the generation config's, e.g. "
                             f"'{{\"temperature\": 0.5}}'")
    parser.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                        help=f"{note}a request naming an adapter no worker serves, whose "
                             f"directory DIR/<name> exists, gets it loaded on every worker "
                             f"first (vLLM's filesystem LoRA resolver; the workers need "
                             f"--max-loras N and DIR at the same path); the least recently "
                             f"used adapters it loaded make room when the slots are full")


def sampling_defaults_setting(args: argparse.Namespace, model_dir: str | None
                              ) -> dict[str, Any]:
    """The GatewayConfig field of --generation-config / --override-generation-config, the
    model's directory (None: it has none, e.g. a GGUF file) read for "auto"."""
    from engine_api.generation_defaults import GenerationConfigError, resolve_sampling_defaults

    override: dict[str, object] | None = None
    if args.override_generation_config:
        try:
            parsed = json.loads(args.override_generation_config)
        except ValueError as err:
            raise GatewayConfigError(f"--override-generation-config: {err}") from None
        if not isinstance(parsed, dict):
            raise GatewayConfigError("--override-generation-config must be a JSON object")
        override = parsed
    try:
        defaults = resolve_sampling_defaults(args.generation_config, model_dir, override)
    except GenerationConfigError as err:
        raise GatewayConfigError(str(err)) from None
    return {"sampling_defaults": tuple(sorted(defaults.items()))}


def model_directory(source: str | None) -> str | None:
    """The directory a model source's generation_config.json would be in: the source itself
    when it is a directory, the one holding a tokenizer.json, else None (a GGUF file)."""
    if not source:
        return None
    if os.path.isdir(source):
        return source
    if os.path.basename(source) == "tokenizer.json":
        return os.path.dirname(source) or "."
    return None


def chat_settings(args: argparse.Namespace) -> dict[str, Any]:
    """GatewayConfig fields of `add_chat_args`' flags (the template file read and checked)."""
    from gateway.tokenization import load_chat_template

    template = None
    if args.chat_template:
        try:
            template = load_chat_template(args.chat_template)
        except ValueError as err:
            raise GatewayConfigError(str(err)) from None
    return {"chat_template": template, "tool_call_parser": args.tool_call_parser,
            "reasoning_parser": args.reasoning_parser,
            "trust_request_chat_template": args.trust_request_chat_template,
            "responses_store_max_entries": args.responses_store_max_entries,
            "responses_store_max_bytes": args.responses_store_max_bytes,
            "max_concurrent_requests": args.max_concurrent_requests,
            "allow_runtime_lora_updating": args.allow_runtime_lora_updating,
            "lora_resolver_dir": args.lora_resolver_dir}


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serving_log_args(parser: argparse.ArgumentParser, role: str = "") -> None:
    """vLLM's flags of request logging and uvicorn's log level, for every process that serves
    the REST API."""
    note = f"{role}: " if role else ""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                       default=GatewayConfig.__dataclass_fields__["log_requests"].default,
                       help=f"{note}log one line per request (id, prompt length, sampling)")
    group.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                       help=f"{note}log no line per request (the default)")
    parser.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS,
                        default=GatewayConfig.__dataclass_fields__["uvicorn_log_level"].default,
                        help=f"{note}uvicorn's log level (info: its access log)")


def add_public_security_args(parser: argparse.ArgumentParser, role: str = "") -> None:
    """The flags of the public ports' security, for every process that serves them (the gateway
    role and the colocated role's in-process gateway); `role` prefixes their help."""
    note = f"{role}: " if role else ""
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"{note}require 'Authorization: Bearer KEY' on /v1/* and as gRPC "
                             f"metadata on Generate (default: ${API_KEY_ENV}; the variable keeps "
                             f"the key out of `ps`)")
    parser.add_argument("--ssl-certfile", default=None,
                        help=f"{note}serve REST and gRPC over TLS with this PEM certificate "
                             f"(chain)")
    parser.add_argument("--ssl-keyfile", default=None, help=f"{note}the PEM key of --ssl-certfile")
    parser.add_argument("--ssl-ca-certs", default=None,
                        help=f"{note}require client certificates signed by this PEM CA (mutual "
                             f"TLS)")
