"""The flags every engine worker takes (prefill, decode and colocated roles), and the shared way a
worker process turns a start-up failure into an exit code. Each service's entry point
(prefill_service/main.py, decode_service/main.py, `splitserve serve`) builds on these."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from engine.cli_args import add_engine_args
from engine_api.model_name import served_model_name_for
from kv_transfer import DEFAULT_TCP_STREAMS, MAX_TCP_STREAMS
from kv_transfer.peers import KvPeers
from rpc.auth import AuthConfigError
from rpc.servers import PortBindError
from rpc.tls import tls_from_env
from rpc.tracing import setup_tracing
from worker.drain import DEFAULT_DRAIN_TIMEOUT_S

if TYPE_CHECKING:
    from worker.server import MetricsOptions
    from worker.tier_cache import TierConfig

logger = logging.getLogger("splitserve.serve")

KV_TRANSPORTS = ("ipc", "tcp", "shm", "stream")


def _kv_transports(text: str) -> tuple[str, ...]:
    chosen = {t.strip() for t in text.split(",") if t.strip()}
    unknown = chosen - set(KV_TRANSPORTS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown KV transport(s) {sorted(unknown)}; choose "
                                         f"from {', '.join(KV_TRANSPORTS)}")
    return tuple(t for t in KV_TRANSPORTS if t in chosen or t == "stream")


def _tcp_streams(text: str) -> int:
    try:
        streams = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kv-tcp-streams takes a number, not {text!r}") from None
    if not 1 <= streams <= MAX_TCP_STREAMS:
        raise argparse.ArgumentTypeError(f"--kv-tcp-streams must be in 1..{MAX_TCP_STREAMS}")
    return streams


def _kv_peers(text: str) -> KvPeers:
    try:
        return KvPeers(text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--kv-peers: {exc}") from None


def _port(flag: str, off: bool = False) -> Callable[[str], int | None]:
    """A flag type for a port (0: a free one), or 'off' (None) where `off` allows it."""
    def parse(text: str) -> int | None:
        if off and text.strip().lower() == "off":
            return None
        try:
            port = int(text)
        except ValueError:
            what = "a port or 'off'" if off else "a port"
            raise argparse.ArgumentTypeError(f"{flag} takes {what}, not {text!r}") from None
        if not 0 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"{flag} {port} is outside 0..65535")
        return port
    return parse


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if not 0 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{seconds} is outside 0..3600 seconds")
    return seconds


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Bind address and port, KV transfer and prefix tier flags, then the engine's own."""
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address: a worker's gRPC port; the REST and gRPC ports of the "
                        "colocated role (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=None,
                   help="gRPC port of a worker (prefill 50061, decode 50062); REST port of "
                        "gateway/colocated (8000)")
    p.add_argument("--advertise", default=None,
                   help="host:port that decode workers use to reach this prefill worker's KV")
    p.add_argument("--log-level", default="info")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export traces over OTLP to URL (default: $OTEL_EXPORTER_OTLP_ENDPOINT "
                        "if set; needs the otlp extra)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (colocated) and in /metrics' model_name "
                        "label (default: --model as given, or the embedded SmolLM2's name)")
    p.add_argument("--metrics-port", type=_port("--metrics-port"), default=None,
                   help="prefill and decode roles: serve Prometheus /metrics on this port of "
                        "--host (HTTPS with the internal TLS files; 0: a free port; default: "
                        "none)")
    p.add_argument("--drain-timeout", type=_seconds, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM, seconds to let calls in progress finish and leases be "
                        "pulled (new requests are refused at once) before exiting; keep a "
                        "pod's terminationGracePeriodSeconds above it "
                        f"(default: {DEFAULT_DRAIN_TIMEOUT_S:.0f})")
    p.add_argument("--kv-transports", type=_kv_transports, default=KV_TRANSPORTS,
                   help="decode role: the ways KV may come from a prefill worker, tried in the "
                        "order ipc (CUDA IPC, same GPU), tcp (the prefill worker's KV data port, "
                        "any host), shm (shared memory, same host), stream (gRPC, anywhere); "
                        f"comma list, stream always included (default: {','.join(KV_TRANSPORTS)})")
    p.add_argument("--kv-tcp-streams", type=_tcp_streams, default=DEFAULT_TCP_STREAMS,
                   help="decode role: connections one pull over the prefill worker's data port "
                        f"opens at once, 1..{MAX_TCP_STREAMS} (default: {DEFAULT_TCP_STREAMS})")
    p.add_argument("--kv-peers", type=_kv_peers, default=None, metavar="LIST",
                   help="decode role: the only prefill workers KV may be pulled from, a comma "
                        "list of HOST:PORT, HOST (any port), CIDR or dns:NAME:PORT (the "
                        "gateway's --prefill entries fit); a KV handle naming another address "
                        "is refused before any connection (default: any address a handle "
                        "names)")
    p.add_argument("--kv-data-port", type=_port("--kv-data-port", off=True), default=0,
                   help="prefill role: the port on --host that serves KV blocks raw to decode "
                        "workers (their 'tcp' way; same TLS as the gRPC port); 0 picks a free "
                        "one (default), 'off' serves none")
    tiers = p.add_argument_group("prefix tiers (every role): GPU -> CPU -> Redis")
    tiers.add_argument("--kv-tier-cpu-mb", type=int, default=0,
                       help="CPU tier of encoded KV blocks, in MiB (0: none)")
    tiers.add_argument("--kv-tier-redis-url", default=None,
                       help="cluster-wide Redis tier, e.g. redis://redis:6379/0 (default: none)")
    tiers.add_argument("--kv-tier-redis-ttl-s", type=int, default=3600,
                       help="expiry of each block in Redis")
    tiers.add_argument("--kv-tier-redis-max-mb", type=int, default=0,
                       help="stop writing to Redis while its used memory would pass this many "
                            "MiB (0: no bound of the tier's own; see docs/deploy.md for "
                            "Redis' maxmemory)")
    tiers.add_argument("--kv-tier-min-blocks", type=int, default=1,
                       help="fetch from the tiers only when they extend the GPU hit by this "
                            "many blocks")
    add_engine_args(p)


def parse_worker_args(prog: str, description: str | None,
                      argv: Sequence[str] | None) -> argparse.Namespace:
    """A single-role worker's command line (`python -m prefill_service ...`)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_worker_args(p)
    return p.parse_args(argv)


def tier_config_from_args(args: argparse.Namespace) -> TierConfig:
    """Raises ValueError for a negative size or a min-blocks below 1."""
    from worker.tier_cache import TierConfig  # torch and redis: not at the CLI's import

    return TierConfig(cpu_bytes=args.kv_tier_cpu_mb << 20, redis_url=args.kv_tier_redis_url,
                      redis_ttl_s=args.kv_tier_redis_ttl_s,
                      redis_max_bytes=args.kv_tier_redis_max_mb << 20,
                      min_blocks=args.kv_tier_min_blocks)


def metrics_options(args: argparse.Namespace) -> MetricsOptions | None:
    """Where the worker serves /metrics (--metrics-port), or None."""
    from worker.server import MetricsOptions  # torch: not at the CLI's import

    if args.metrics_port is None:
        return None
    return MetricsOptions(args.host, args.metrics_port,
                          served_model_name_for(args.model, args.served_model_name))


def run_worker_process(args: argparse.Namespace, role: str,
                       serve: Callable[[], Coroutine[Any, Any, None]],
                       precheck: Callable[[], None] | None = None) -> int:
    """Set up logging and tracing, check TLS (and `precheck`) before the model loads, run
    `serve` to the end; a start-up failure is a logged line and an exit code, not a traceback:
    1 for an engine that failed to load, 2 for bad options or credentials."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A no-op unless an endpoint is given or set in the environment.
    setup_tracing(f"splitserve-{role}", endpoint=args.otlp_traces_endpoint)
    try:
        tls_from_env()  # a broken TLS set-up fails now, not after the model loaded
        if precheck is not None:
            precheck()
        asyncio.run(serve())
    except RuntimeError as e:
        logger.error("%s: %s", e, e.__cause__)
        return 1
    except AuthConfigError as e:  # the message names the variable
        logger.error("%s", e)
        return 2
    except ValueError as e:  # a bad option value (e.g. --kv-tier-min-blocks 0), TLS files
        logger.error("%s", e)
        return 2
    except PortBindError as e:  # the port is taken: one line, not a traceback
        logger.error("%s", e)
        return 1
    return 0
