"""Static checks of the Kubernetes manifests under k8s/ (no cluster needed).

The raw base is checked directly (its configMapGenerator read as ConfigMaps); when `kubectl`
or `kustomize` is installed, every kustomization is also rendered and the rendered objects go
through the same checks (names rewritten with hashes, namespaces, patches applied).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"
BASE = K8S / "base"
OVERLAYS = K8S / "overlays"
COMPONENTS = K8S / "components"
MONITORING = K8S / "monitoring"
DASHBOARD = MONITORING / "splitserve-dashboard.json"

Obj = dict[str, Any]
WORKER_ROLES = ("prefill", "decode")
MIN_WORKER_STARTUP_S = 300       # model loading: probes must not kill a loading worker
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# -- loading ----------------------------------------------------------------------------------
def yaml_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def _generated_configmaps(kust: Obj) -> list[Obj]:
    """The configMapGenerator entries of one kustomization, as ConfigMap objects."""
    out: list[Obj] = []
    for gen in kust.get("configMapGenerator") or []:
        data = dict(lit.split("=", 1) for lit in gen.get("literals") or [])
        out.append({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": gen["name"]}, "data": data})
    return out


def raw_base() -> list[Obj]:
    """Base objects as written (no kustomize): resources + generated ConfigMaps."""
    kust = load_docs(BASE / "kustomization.yaml")[0]
    objs = [d for r in kust["resources"] for d in load_docs(BASE / r)]
    return objs + _generated_configmaps(kust)


def kustomize_tool() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(directory: Path) -> list[Obj]:
    tool = kustomize_tool()
    assert tool is not None
    proc = subprocess.run([*tool, str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(tool)} {directory} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


# -- object helpers ---------------------------------------------------------------------------
def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o.get("kind") == kind]


def name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


def pod_spec(dep: Obj) -> Obj:
    return dep["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def pod_labels(dep: Obj) -> dict[str, str]:
    return dep["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def component(dep: Obj) -> str:
    return pod_labels(dep)["app.kubernetes.io/component"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def containers(dep: Obj) -> list[Obj]:
    return pod_spec(dep)["containers"]  # type: ignore[no-any-return]


@dataclass
class Args:
    """A container's argv, split into flags (`--x=v` and `--x v`) and positionals."""

    flags: dict[str, list[str]] = field(default_factory=dict)
    positional: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, argv: list[str]) -> Args:
        out = cls()
        i = 0
        while i < len(argv):
            a = str(argv[i])
            if a.startswith("--") and "=" in a:
                key, value = a.split("=", 1)
                out.flags.setdefault(key, []).append(value)
            elif a.startswith("--") and i + 1 < len(argv) and not str(argv[i + 1]).startswith("--"):
                out.flags.setdefault(a, []).append(str(argv[i + 1]))
                i += 1
            elif a.startswith("--"):
                out.flags.setdefault(a, []).append("")
            else:
                out.positional.append(a)
            i += 1
        return out

    def one(self, flag: str) -> str:
        values = self.flags.get(flag, [])
        assert len(values) == 1, f"expected exactly one {flag}, got {values}"
        return values[0]

    def addresses(self, flag: str) -> list[str]:
        return [a for v in self.flags.get(flag, []) for a in v.split(",") if a]


def container_args(c: Obj) -> Args:
    return Args.parse([str(a) for a in c.get("command", []) + c.get("args", [])])


def listening_ports(args: Args) -> set[int]:
    """The ports the process binds according to its own arguments."""
    ports = {int(args.one("--port"))}
    if "--grpc-port" in args.flags:
        ports.add(int(args.one("--grpc-port")))
    if "--kv-data-port" in args.flags and args.one("--kv-data-port").lower() != "off":
        ports.add(int(args.one("--kv-data-port")))  # 0 (a free port) cannot be declared: fails
    if "--metrics-port" in args.flags:
        ports.add(int(args.one("--metrics-port")))
    return ports


def container_ports(c: Obj) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in c.get("ports", [])}


def resolve_port(port: int | str, c: Obj) -> int:
    if isinstance(port, int):
        return port
    named = container_ports(c)
    assert port in named, f"container {c['name']}: port name {port!r} not declared ({named})"
    return named[port]


def health_probe_address(probe: Obj) -> str | None:
    """The address of an exec probe running `splitserve health --address HOST:PORT` (the
    workers' probe under TLS), else None."""
    command = probe.get("exec", {}).get("command", [])
    if command[:2] != ["splitserve", "health"] or "--address" not in command:
        return None
    return str(command[command.index("--address") + 1])


def probe_port(probe: Obj, c: Obj) -> int:
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return resolve_port(probe[handler]["port"], c)
    address = health_probe_address(probe)
    if address is not None:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1", f"container {c['name']}: health probe dials {address}"
        return int(port)
    raise AssertionError(f"container {c['name']}: probe without a handler: {probe}")


TLS_VARS = ("SPLITSERVE_TLS_CERT", "SPLITSERVE_TLS_KEY", "SPLITSERVE_TLS_CA")


def tls_env(c: Obj) -> dict[str, str]:
    """The container's SPLITSERVE_TLS_* values (literal env entries)."""
    return {e["name"]: e.get("value", "") for e in c.get("env", []) if e["name"] in TLS_VARS}


def mounted_secret(path: str, dep: Obj, c: Obj) -> str | None:
    """The Secret whose read-only volume mount holds `path`, else None."""
    volumes = {v["name"]: v for v in pod_spec(dep).get("volumes", [])}
    for m in c.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/") and m.get("readOnly"):
            secret = volumes[m["name"]].get("secret")
            if secret:
                return str(secret["secretName"])
    return None


def env_names(c: Obj, objs: list[Obj]) -> set[str]:
    """Variables the container sees: env entries plus keys of envFrom ConfigMaps/Secrets."""
    names = {e["name"] for e in c.get("env", [])}
    for src in c.get("envFrom", []):
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in src:
                ref = src[key]["name"]
                found = [o for o in of_kind(objs, kind) if name(o) == ref]
                assert found, f"container {c['name']}: envFrom {kind} {ref!r} does not exist"
                names |= set(found[0].get("data", {}))
    return names


def services_for(dep: Obj, objs: list[Obj]) -> list[Obj]:
    return [s for s in of_kind(objs, "Service")
            if selects(s["spec"].get("selector", {}), pod_labels(dep))]


def gateway_deployment(objs: list[Obj]) -> Obj:
    found = [d for d in of_kind(objs, "Deployment") if component(d) == "gateway"]
    assert len(found) == 1, f"expected one gateway Deployment, found {len(found)}"
    return found[0]


def _number(node: ast.Constant) -> float:
    assert isinstance(node.value, int | float), f"expected a number, got {node.value!r}"
    return float(node.value)


def _gateway_shutdown_grace() -> float:
    tree = ast.parse((ROOT / "gateway" / "config.py").read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "shutdown_grace_s" and isinstance(node.value, ast.Constant)):
            return _number(node.value)
    raise AssertionError("gateway/config.py: no shutdown_grace_s default found")


def drain_seconds(role: str, c: Obj) -> float:
    """How long a pod of `role` may take to stop after SIGTERM: a worker's --drain-timeout
    (or its default) plus `WorkerHandle.drain`'s final stop; the gateway's from its defaults."""
    if role == "gateway":
        # GatewayServer.stop: uvicorn drains for shutdown_grace_s, then gRPC stop(grace).
        return 2 * _gateway_shutdown_grace()
    from worker.drain import DEFAULT_DRAIN_TIMEOUT_S

    args = container_args(c)
    timeout = (float(args.one("--drain-timeout")) if "--drain-timeout" in args.flags
               else DEFAULT_DRAIN_TIMEOUT_S)
    return timeout + 1.0 + 5.0  # stop(grace_s=1.0), then the engine thread's stop


def prestop_sleep(c: Obj) -> float:
    cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return float(cmd[1]) if len(cmd) == 2 and cmd[0] == "sleep" else 0.0


# -- checks shared by the raw base and every rendered kustomization ---------------------------
def check_deployment_ports(objs: list[Obj]) -> None:
    """Args, containerPorts, probes and Services agree on every port."""
    for dep in of_kind(objs, "Deployment"):
        for c in containers(dep):
            args = container_args(c)
            bound = listening_ports(args)
            declared = set(container_ports(c).values())
            assert declared == bound, (
                f"{name(dep)}/{c['name']}: containerPorts {sorted(declared)} != ports in args "
                f"{sorted(bound)}")
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert kind in c, f"{name(dep)}/{c['name']}: no {kind}"
                port = probe_port(c[kind], c)
                assert port in bound, f"{name(dep)}/{c['name']}: {kind} port {port} not bound"
            svcs = services_for(dep, objs)
            assert svcs, f"{name(dep)}: no Service selects its pods"
            for svc in svcs:
                for sp in svc["spec"]["ports"]:
                    target = resolve_port(sp.get("targetPort", sp["port"]), c)
                    assert target in bound, (
                        f"Service {name(svc)} port {sp['port']} -> {target}, which "
                        f"{name(dep)} does not bind ({sorted(bound)})")


def check_worker_probes(objs: list[Obj]) -> None:
    for dep in of_kind(objs, "Deployment"):
        for c in containers(dep):
            if component(dep) in WORKER_ROLES:
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    # Native gRPC, or `splitserve health` where the worker speaks TLS.
                    assert "grpc" in c[kind] or health_probe_address(c[kind]), (
                        f"{name(dep)}: {kind} must be a gRPC health probe")
                    if "exec" in c[kind]:
                        assert tls_env(c), f"{name(dep)}: exec health probe without TLS"
                sp = c["startupProbe"]
                budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
                assert budget >= MIN_WORKER_STARTUP_S, (
                    f"{name(dep)}: startupProbe allows {budget}s, model loading needs "
                    f">= {MIN_WORKER_STARTUP_S}s")
            else:
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert "httpGet" in c[kind], f"{name(dep)}: {kind} must be an HTTP probe"
                # Liveness on /health would restart every gateway during a decode outage.
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"
                assert c["livenessProbe"]["httpGet"]["path"] != "/health"


def check_gateway_routes(objs: list[Obj]) -> None:
    """--prefill/--decode name Services that reach pods of that role on the right port; a
    `dns:` target (each pod, gateway/discovery.py) names a headless Service."""
    from gateway.discovery import is_dns_target, parse_dns_target

    gw = gateway_deployment(objs)
    args = container_args(containers(gw)[0])
    for role in WORKER_ROLES:
        addresses = args.addresses(f"--{role}")
        assert addresses, f"gateway: no --{role} address"
        for addr in addresses:
            host, _, port = addr.rpartition(":")
            if is_dns_target(addr):
                dns_target = parse_dns_target(addr)
                host, port = dns_target.name, str(dns_target.port)
            svc = [s for s in of_kind(objs, "Service") if name(s) == host]
            assert svc, f"gateway --{role}={addr}: no Service named {host!r}"
            if is_dns_target(addr):
                assert svc[0]["spec"].get("clusterIP") == "None", (
                    f"gateway --{role}={addr}: {host} must be headless to list every pod")
            sp = [p for p in svc[0]["spec"]["ports"] if int(p["port"]) == int(port)]
            assert sp, f"gateway --{role}={addr}: Service {host} has no port {port}"
            deps = [d for d in of_kind(objs, "Deployment")
                    if selects(svc[0]["spec"]["selector"], pod_labels(d))]
            assert [component(d) for d in deps] == [role], (
                f"Service {host} must select exactly the {role} pool, selects "
                f"{[name(d) for d in deps]}")
            c = containers(deps[0])[0]
            assert container_args(c).one("--role") == role
            target = resolve_port(sp[0].get("targetPort", sp[0]["port"]), c)
            assert target == int(container_args(c).one("--port"))


def check_env_refs(objs: list[Obj]) -> None:
    """Every $(VAR) in args is defined, else Kubernetes passes the text through verbatim."""
    for dep in of_kind(objs, "Deployment"):
        for c in containers(dep):
            defined = env_names(c, objs)
            for arg in c.get("command", []) + c.get("args", []):
                for var in VAR_REF.findall(str(arg)):
                    assert var in defined, f"{name(dep)}/{c['name']}: $({var}) in {arg!r} is undefined"


def check_prefill_advertise(objs: list[Obj]) -> None:
    for dep in of_kind(objs, "Deployment"):
        if component(dep) != "prefill":
            continue
        c = containers(dep)[0]
        args = container_args(c)
        host, _, port = args.one("--advertise").rpartition(":")
        assert port == args.one("--port"), "prefill --advertise port differs from --port"
        assert host == "$(POD_IP)", f"prefill must advertise its pod IP, got {host!r}"
        pod_ip = [e for e in c.get("env", []) if e["name"] == "POD_IP"]
        assert pod_ip and pod_ip[0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def check_api_key(objs: list[Obj]) -> None:
    c = containers(gateway_deployment(objs))[0]
    assert container_args(c).one("--api-key") == "$(SPLITSERVE_API_KEY)"
    env = [e for e in c.get("env", []) if e["name"] == "SPLITSERVE_API_KEY"]
    assert env, "gateway: SPLITSERVE_API_KEY env missing"
    ref = env[0]["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional", False), "an optional key would pass '$(SPLITSERVE_API_KEY)' literally"


def check_internal_token(objs: list[Obj]) -> None:
    """Every pod gets the cluster secret of internal calls from one required Secret key."""
    for dep in of_kind(objs, "Deployment"):
        env = [e for e in containers(dep)[0].get("env", [])
               if e["name"] == "SPLITSERVE_INTERNAL_TOKEN"]
        assert env, f"{name(dep)}: SPLITSERVE_INTERNAL_TOKEN env missing"
        ref = env[0]["valueFrom"]["secretKeyRef"]
        assert ref["name"].startswith("splitserve-internal-token") and ref["key"] == "token"
        assert not ref.get("optional", False), f"{name(dep)}: an optional secret runs unauthenticated"


# Which components may connect to each worker role's ports, by port name (everything else is
# refused): the KV data port serves raw KV to ticket holders, who are decode pods only.
# Prometheus (any namespace, its pods labelled app.kubernetes.io/name=prometheus) scrapes the
# workers' /metrics.
ALLOWED_CALLERS = {"prefill": {"grpc": {"gateway", "decode"}, "kv-data": {"decode"},
                               "metrics": {"prometheus"}},
                   "decode": {"grpc": {"gateway"}, "metrics": {"prometheus"}}}


def _caller(peer: Obj) -> str:
    """A NetworkPolicy peer as a caller name: a splitserve component, or `prometheus`."""
    labels = peer["podSelector"]["matchLabels"]
    if "namespaceSelector" in peer:
        assert labels == {"app.kubernetes.io/name": "prometheus"}, peer
        return "prometheus"
    assert "ipBlock" not in peer, peer
    return str(labels["app.kubernetes.io/component"])


def check_network_policies(objs: list[Obj]) -> None:
    """Each worker pool is selected by one ingress policy that admits, on each port the
    container serves, only that port's callers; the data port is the one the worker binds."""
    policies = of_kind(objs, "NetworkPolicy")
    for dep in of_kind(objs, "Deployment"):
        role = component(dep)
        covering = [p for p in policies
                    if selects(p["spec"]["podSelector"]["matchLabels"], pod_labels(dep))]
        if role not in ALLOWED_CALLERS:
            assert not covering, f"{name(dep)}: the public gateway must stay reachable"
            continue
        assert len(covering) == 1, f"{name(dep)}: expected one NetworkPolicy"
        spec = covering[0]["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        admitted: dict[int, set[str]] = {}
        for rule in spec["ingress"]:
            callers = {_caller(peer) for peer in rule["from"]}
            for port in rule["ports"]:
                admitted.setdefault(int(port["port"]), set()).update(callers)
        served = {p["name"]: int(p["containerPort"])
                  for c in containers(dep) for p in c.get("ports", [])}
        assert set(served) == set(ALLOWED_CALLERS[role]), f"{name(dep)}: ports {served}"
        expected = {served[port]: callers for port, callers in ALLOWED_CALLERS[role].items()}
        assert admitted == expected, f"{name(dep)}: admitted {admitted}, expected {expected}"
        if "kv-data" in served:
            args = container_args(containers(dep)[0])
            assert int(args.one("--kv-data-port")) == served["kv-data"], name(dep)


def check_shared_engine_flags(objs: list[Obj]) -> None:
    """Flags bound into the model fingerprint come from one ConfigMap in every pool."""
    by_role = {component(d): container_args(containers(d)[0]) for d in of_kind(objs, "Deployment")}
    for flag in ("--model", "--dtype", "--block-size", "--load-format", "--max-model-len",
                 "--quantization", "--kv-cache-dtype"):
        assert by_role["prefill"].one(flag) == by_role["decode"].one(flag), flag
        assert VAR_REF.fullmatch(by_role["prefill"].one(flag)), f"{flag} must come from the ConfigMap"
    assert by_role["gateway"].one("--model") == by_role["decode"].one("--model")
    assert by_role["gateway"].one("--max-model-len") == by_role["decode"].one("--max-model-len")


def check_security(objs: list[Obj]) -> None:
    for dep in of_kind(objs, "Deployment"):
        pod = pod_spec(dep)
        psc = pod.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, f"{name(dep)}: runAsNonRoot must be true"
        assert psc.get("runAsUser", 0) != 0, f"{name(dep)}: runAsUser must be a non-zero UID"
        assert pod.get("automountServiceAccountToken") is False, name(dep)
        for c in containers(dep):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{name(dep)}/{c['name']}"
            assert sc.get("readOnlyRootFilesystem") is True, f"{name(dep)}/{c['name']}"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name(dep)}/{c['name']}"
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{name(dep)}: read-only root needs a writable /tmp"
            assert mounts.get("/models", {}).get("readOnly") is True, f"{name(dep)}: /models read-only"


def check_resources_and_lifecycle(objs: list[Obj], expect_gpu: bool) -> None:
    for dep in of_kind(objs, "Deployment"):
        role = component(dep)
        pod = pod_spec(dep)
        for c in containers(dep):
            res = c.get("resources", {})
            assert "memory" in res.get("requests", {}) and "memory" in res.get("limits", {}), (
                f"{name(dep)}: memory requests and limits required")
            has_gpu = "nvidia.com/gpu" in res.get("limits", {})
            assert has_gpu == (expect_gpu and role in WORKER_ROLES), (
                f"{name(dep)}: nvidia.com/gpu {'missing' if not has_gpu else 'unexpected'}")
            needed = prestop_sleep(c) + drain_seconds(role, c)
            grace = pod.get("terminationGracePeriodSeconds", 30)
            assert grace > needed, f"{name(dep)}: terminationGracePeriodSeconds {grace} <= drain {needed}"
        for vol in pod.get("volumes", []):
            sources = set(vol) - {"name"}
            assert len(sources) == 1, f"{name(dep)}: volume {vol['name']} has sources {sources}"


def check_pdbs(objs: list[Obj]) -> None:
    pdbs = of_kind(objs, "PodDisruptionBudget")
    for dep in of_kind(objs, "Deployment"):
        covering = [p for p in pdbs if selects(p["spec"]["selector"]["matchLabels"], pod_labels(dep))]
        assert len(covering) == 1, f"{name(dep)}: expected one PodDisruptionBudget"
        # minAvailable: 1 on a one-replica pool would block every node drain.
        assert "maxUnavailable" in covering[0]["spec"], name(covering[0])


def check_images(objs: list[Obj]) -> None:
    for dep in of_kind(objs, "Deployment"):
        for c in containers(dep):
            image = str(c["image"])
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            assert tag and tag != "latest", f"{name(dep)}: image {image!r} needs a fixed tag"


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command/args (defined variables only)."""
    return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def pod_env(c: Obj, objs: list[Obj]) -> dict[str, str]:
    """Values the container would see; downward-API and Secret values are stand-ins."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        env |= next(o for o in of_kind(objs, "ConfigMap") if name(o) == ref)["data"]
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", "10.1.2.3" if e["name"] == "POD_IP" else "test-secret")
    return env


def check_args_parse(objs: list[Obj]) -> None:
    """The expanded args are accepted by the real CLI parsers and give valid configs."""
    from engine.cli_args import engine_config_from_args
    from gateway.server import build_parser as gateway_parser
    from gateway.server import config_from_args
    from splitserve.serve import build_parser as worker_parser
    from worker.cli_args import tier_config_from_args

    for dep in of_kind(objs, "Deployment"):
        c = containers(dep)[0]
        env = pod_env(c, objs)
        argv = [expand(str(a), env) for a in c.get("command", []) + c.get("args", [])]
        assert argv[0] == "serve", f"{name(dep)}: args must start with the `serve` subcommand"
        role = component(dep)
        # `splitserve serve` dispatches the gateway on the two tokens `--role gateway`.
        assert argv[1:3] == ["--role", role], f"{name(dep)}: write `--role`, `{role}` as two args"
        if role == "gateway":
            parsed = gateway_parser().parse_args(argv[3:])
            # TLS files live in the pod's mounted Secrets: check where, then build the config
            # without them (they do not exist here).
            for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
                path = getattr(parsed, flag)
                if path is not None:
                    assert mounted_secret(path, dep, c), f"{name(dep)}: {flag} {path} not mounted"
                    setattr(parsed, flag, None)
            gw = config_from_args(parsed)
            assert gw.api_key == "test-secret" and gw.decode_addresses and gw.prefill_addresses
        else:
            args = worker_parser().parse_args(argv[1:])
            config = engine_config_from_args(args, role=role)
            config.cache.validate()  # block size a power of two (the engine checks it at load)
            assert config.scheduler.role == role
            tiers = tier_config_from_args(args)  # raises on a negative size or min-blocks < 1
            if role == "prefill":
                assert "--kv-tier-cpu-mb" in container_args(c).flags, (
                    f"{name(dep)}: the prefill pool's CPU tier must be set from the ConfigMap")
            else:
                assert not tiers.enabled, f"{name(dep)}: only the prefill role uses the tiers"
            if role == "prefill":
                assert args.advertise == "10.1.2.3:" + str(args.port)


SERVING_CHECKS = (check_deployment_ports, check_worker_probes, check_gateway_routes,
                  check_env_refs, check_prefill_advertise, check_api_key, check_internal_token,
                  check_network_policies,
                  check_shared_engine_flags, check_security, check_pdbs, check_args_parse)


# -- tests: files -----------------------------------------------------------------------------
def test_every_yaml_parses_into_kubernetes_objects() -> None:
    files = yaml_files()
    assert len(files) >= 10, f"expected the base, overlays and monitoring, found {files}"
    for path in files:
        docs = load_docs(path)
        assert docs, f"{path}: empty"
        for doc in docs:
            assert isinstance(doc, dict), f"{path}: a document is not a mapping"
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: apiVersion/kind missing"
            if doc["kind"] not in ("Kustomization", "Component"):
                assert doc.get("metadata", {}).get("name"), f"{path}: metadata.name missing"


def test_kustomization_references_exist() -> None:
    dirs = kustomization_dirs()
    assert {BASE, OVERLAYS / "cpu-dev", OVERLAYS / "gpu", OVERLAYS / "gpu-tls", MONITORING,
            COMPONENTS / "tls"} <= set(dirs)
    for d in dirs:
        kust = load_docs(d / "kustomization.yaml")[0]
        refs = list(kust.get("resources", [])) + list(kust.get("components", []))
        refs += [p["path"] for p in kust.get("patches", []) if "path" in p]
        refs += [f.split("=", 1)[-1] for g in kust.get("configMapGenerator", []) for f in g.get("files", [])]
        for ref in refs:
            target = (d / ref).resolve()
            assert target.exists(), f"{d}/kustomization.yaml: {ref} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").exists(), f"{d}: {ref} is no kustomization"


def test_base_is_namespace_less_and_cpu_only() -> None:
    kust = load_docs(BASE / "kustomization.yaml")[0]
    assert "namespace" not in kust
    for obj in raw_base():
        assert "namespace" not in obj["metadata"], f"{name(obj)}: base objects carry no namespace"
    check_resources_and_lifecycle(raw_base(), expect_gpu=False)


@pytest.mark.parametrize("check", SERVING_CHECKS, ids=lambda f: f.__name__)
def test_raw_base(check: Any) -> None:
    check(raw_base())


def test_overlays_pin_image_tags() -> None:
    for d in [BASE, *sorted(p for p in OVERLAYS.iterdir() if p.is_dir())]:
        kust = load_docs(d / "kustomization.yaml")[0]
        images = kust.get("images", [])
        assert images, f"{d}: set the image tag explicitly"
        for img in images:
            tag = str(img.get("newTag", ""))
            assert tag and tag != "latest", f"{d}: image {img['name']} tag {tag!r}"
    for path in OVERLAYS.rglob("*.yaml"):
        assert not re.search(r"image:\s*\S+:latest\b", path.read_text()), f"{path}: :latest image"


def test_gateway_serves_the_probed_paths() -> None:
    """The HTTP paths probed and scraped exist as routes in the gateway."""
    source = (ROOT / "gateway" / "openai_api.py").read_text()
    routes = set(re.findall(r'@app\.get\("([^"]+)"\)', source))
    c = containers(gateway_deployment(raw_base()))[0]
    paths = {c[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    monitor = load_docs(MONITORING / "servicemonitor.yaml")[0]
    paths |= {e["path"] for e in monitor["spec"]["endpoints"]}
    assert paths <= routes, f"paths {sorted(paths - routes)} are not gateway routes {sorted(routes)}"


def test_servicemonitor_targets_gateway_service() -> None:
    monitor = load_docs(MONITORING / "servicemonitor.yaml")[0]
    svcs = [s for s in of_kind(raw_base(), "Service")
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert [name(s) for s in svcs] == ["splitserve-gateway"]
    port_names = {p["name"] for p in svcs[0]["spec"]["ports"]}
    for ep in monitor["spec"]["endpoints"]:
        assert ep["port"] in port_names


# -- tests: dashboard -------------------------------------------------------------------------
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
             "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created")}


def exported_series() -> set[str]:
    """Series names the gateway exports, read from a live `GatewayMetrics` registry: its own
    metrics and the per-worker families of its custom collector (present with no worker yet)."""
    families = [m for m in GatewayMetrics().registry.collect()
                if m.name.startswith("splitserve:")]
    assert families, "gateway/metrics.py: no splitserve: metrics found"
    return {m.name + s for m in families for s in _SUFFIXES[m.type]}


def dashboard_exprs(dash: Obj) -> Iterator[str]:
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield str(target["expr"])
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            yield str(var["definition"])


def test_dashboard_uses_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    series = exported_series()
    exprs = list(dashboard_exprs(dash))
    assert exprs
    for expr in exprs:
        used = re.findall(r"splitserve:[A-Za-z0-9_:]+", expr)
        assert used, f"dashboard query uses no splitserve metric: {expr}"
        unknown = set(used) - series
        assert not unknown, f"dashboard query uses {sorted(unknown)}, not exported: {expr}"
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and "le" in expr, f"histogram_quantile needs buckets by le: {expr}"


def test_dashboard_has_required_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    joined = "\n".join(dashboard_exprs(dash))
    for metric in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "requests_received_total"):
        assert f"splitserve:{metric}" in joined, metric
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(splitserve:time_to_first_token" in joined
    panels = {p["title"]: p for p in dash["panels"]}
    kv_exprs = [t["expr"] for t in panels["KV cache usage"]["targets"]]
    assert any("splitserve:kv_cache_usage_perc" in e for e in kv_exprs), kv_exprs
    # Hit rate is a ratio of rates (hits / queries), per worker; both counters must be used.
    assert re.search(r"rate\(splitserve:prefix_cache_hits_total[^/]+/.*"
                     r"rate\(splitserve:prefix_cache_queries_total", joined), "prefix-cache hit rate"
    for metric in ("num_requests_running", "num_requests_waiting"):
        assert re.search(rf"by \(role, worker\) \(splitserve:{metric}\b", joined), metric
    assert all(p["type"] != "text" for p in dash["panels"]), "placeholder panel left"


def test_dashboard_configmap_is_generated_from_the_json() -> None:
    kust = load_docs(MONITORING / "kustomization.yaml")[0]
    gens = kust["configMapGenerator"]
    assert any(DASHBOARD.name in f for g in gens for f in g.get("files", []))
    assert all(g["options"]["labels"].get("grafana_dashboard") == "1" for g in gens)


# -- tests: rendered with kustomize (when a binary is installed) -------------------------------
needs_kustomize = pytest.mark.skipif(kustomize_tool() is None,
                                     reason="neither kubectl nor kustomize is installed")


@needs_kustomize
@pytest.mark.parametrize("overlay", ["cpu-dev", "gpu", "gpu-tls", "gpu-fp8"])
def test_rendered_overlay(overlay: str) -> None:
    objs = render(OVERLAYS / overlay)
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces, f"{overlay}: namespaces {namespaces}"
    for check in SERVING_CHECKS:
        check(objs)
    check_images(objs)
    check_resources_and_lifecycle(objs, expect_gpu=overlay.startswith("gpu"))
    assert [component(d) for d in of_kind(objs, "Deployment")].count("prefill") == 1


@needs_kustomize
def test_rendered_gpu_overlay_mounts_the_model_pvc() -> None:
    objs = render(OVERLAYS / "gpu")
    claims = {name(p) for p in of_kind(objs, "PersistentVolumeClaim")}
    model = of_kind(objs, "ConfigMap")[0]["data"]["SPLITSERVE_MODEL"]
    assert model.startswith("/models/")
    for dep in of_kind(objs, "Deployment"):
        vols = {v["name"]: v for v in pod_spec(dep)["volumes"]}
        pvc = vols["models"].get("persistentVolumeClaim")
        assert pvc and pvc["claimName"] in claims and pvc["readOnly"] is True, name(dep)
        if component(dep) in WORKER_ROLES:
            assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(dep)["tolerations"])


@needs_kustomize
@pytest.mark.parametrize(("overlay", "parser"), [("cpu-dev", None), ("gpu", "llama3_json"),
                                                 ("gpu-tls", "llama3_json"),
                                                 ("gpu-fp8", "llama3_json")])
def test_rendered_gateway_tool_call_parser(overlay: str, parser: str | None) -> None:
    """The GPU overlays (Llama-3.1-8B-Instruct, whose template shows tools) parse its JSON tool
    calls for tool_choice "auto"; SmolLM2's template does not show tools: none in cpu-dev."""
    from gateway.server import build_parser as gateway_parser

    objs = render(OVERLAYS / overlay)
    gateway = next(d for d in of_kind(objs, "Deployment") if component(d) == "gateway")
    c = containers(gateway)[0]
    argv = [expand(str(a), pod_env(c, objs)) for a in c.get("args", [])]
    assert gateway_parser().parse_args(argv[3:]).tool_call_parser == parser


def worker_engine_configs(objs: list[Obj]) -> dict[str, Any]:
    """Each worker pool's engine config, from its expanded args through the real parser."""
    from engine.cli_args import engine_config_from_args
    from splitserve.serve import build_parser as worker_parser

    out = {}
    for dep in of_kind(objs, "Deployment"):
        role = component(dep)
        if role in WORKER_ROLES:
            c = containers(dep)[0]
            env = pod_env(c, objs)
            argv = [expand(str(a), env) for a in c.get("args", [])]
            out[role] = engine_config_from_args(worker_parser().parse_args(argv[1:]), role=role)
    return out


@needs_kustomize
@pytest.mark.parametrize(("overlay", "quantization", "kv_dtype"),
                         [("gpu", "none", "auto"), ("gpu-fp8", "fp8", "fp8")])
def test_rendered_overlay_quantization(overlay: str, quantization: str, kv_dtype: str) -> None:
    """Both worker pools run the overlay's weight quantization and KV dtype (they are part of
    the KV's fingerprint): bf16 in `gpu`, fp8 W8A8 with an fp8 cache in `gpu-fp8`."""
    configs = worker_engine_configs(render(OVERLAYS / overlay))
    assert set(configs) == set(WORKER_ROLES)
    for role, config in configs.items():
        assert config.runner.quantization == quantization, role
        assert config.cache.kv_cache_dtype == kv_dtype, role


@needs_kustomize
def test_rendered_monitoring() -> None:
    objs = render(MONITORING)
    assert {o["kind"] for o in objs} == {"ServiceMonitor", "PodMonitor", "PrometheusRule",
                                         "ConfigMap"}
    cm = of_kind(objs, "ConfigMap")[0]
    assert json.loads(cm["data"][DASHBOARD.name]) == json.loads(DASHBOARD.read_text())


@needs_kustomize
def test_rendered_tls_overlay_encrypts_every_hop() -> None:
    """gpu-tls: every process has its internal certificate, key and CA from the mounted Secret
    `splitserve-internal-tls`; the workers are probed with `splitserve health` on their own
    port; the gateway serves its public ports with the certificate of `splitserve-gateway-tls`
    and probes them over HTTPS; no Service port still announces cleartext HTTP/2."""
    objs = render(OVERLAYS / "gpu-tls")
    deployments = of_kind(objs, "Deployment")
    assert {component(d) for d in deployments} == {"gateway", "prefill", "decode"}
    for dep in deployments:
        c = containers(dep)[0]
        env = tls_env(c)
        assert set(env) == set(TLS_VARS), f"{name(dep)}: TLS variables {sorted(env)}"
        for path in env.values():
            assert mounted_secret(path, dep, c) == "splitserve-internal-tls", (name(dep), path)
        args = container_args(c)
        if component(dep) == "gateway":
            for flag in ("--ssl-certfile", "--ssl-keyfile"):
                assert mounted_secret(args.one(flag), dep, c) == "splitserve-gateway-tls"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[kind]["httpGet"]["scheme"] == "HTTPS", f"gateway {kind}"
        else:
            port = int(args.one("--port"))
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert "grpc" not in c[kind], f"{name(dep)}: native gRPC probe left under TLS"
                assert health_probe_address(c[kind]) == f"127.0.0.1:{port}", (name(dep), kind)
    for svc in of_kind(objs, "Service"):
        for sp in svc["spec"]["ports"]:
            assert sp.get("appProtocol") != "kubernetes.io/h2c", f"{name(svc)}: h2c under TLS"
