"""The files under deploy/ agree with the daemon they run.

Each workload's settings are resolved the way the daemon resolves them
(``ServerConfig.from_args`` over its arguments and environment); the fields that depend on
them (probe ports, grace periods, memory, the socket's host path) are checked against that.
Kubernetes manifests are also validated against the Kubernetes schemas (kubernetes-validate,
offline) and the compose file against the compose spec (check-jsonschema, offline).
"""

from __future__ import annotations

import configparser
import copy
import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path, PurePosixPath
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from episerve_server.config import ENV_PREFIX, ServerConfig, parse_bytes
from episerve_server.core.counters import Stats
from episerve_server.rpc.process.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CONFIG_ENV = frozenset(ENV_PREFIX + f.name.upper() for f in fields(ServerConfig))
# Native gRPC probes are GA from 1.27; also check the newest schemas bundled.
K8S_VERSIONS = ("1.27.0", "1.37.0")
MARGIN_S = 2  # between the end of the drain and the kill
BASELINE_BYTES = 256 * 2**20  # the least a memory budget may add to cache x 1.25


# -- helpers ----------------------------------------------------------------------------------


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, "no manifests under deploy/k8s"
    return docs


def quantity(text: str | int) -> int:
    """A Kubernetes memory quantity in bytes ("5632Mi", "6G", 1024)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTE]i?)?", str(text))
    assert m, f"not a quantity: {text!r}"
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    decimal = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    unit = m.group(2) or ""
    return int(float(m.group(1)) * (binary.get(unit) or decimal.get(unit) or 1))


def memory_floor(config: ServerConfig) -> int:
    return int(config.cache_bytes * 1.25) + BASELINE_BYTES


def seconds(text: str | int) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", str(text).strip())
    assert m, f"not a duration: {text!r}"
    return float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]


class Workload:
    """A DaemonSet or Deployment, with its ConfigMaps resolved as the container sees them."""

    def __init__(self, path: Path, doc: dict[str, Any],
                 configmaps: dict[str, dict[str, str]]) -> None:
        self.path, self.doc = path, doc
        self.pod = doc["spec"]["template"]["spec"]
        [self.container] = [c for c in self.pod["containers"] if c["name"] == "episerve"]
        env: dict[str, str] = {}
        for source in self.container.get("envFrom", ()):
            if "configMapRef" in source:
                env.update(configmaps[source["configMapRef"]["name"]])
        for var in self.container.get("env", ()):
            env[var["name"]] = var.get("value", f"from-{var['name'].lower()}")
        self.env = env
        args = self.container["args"]
        assert args[0] == "serve", args
        self.config = ServerConfig.from_args(args[1:], env)

    def __repr__(self) -> str:
        return f"{self.doc['kind']}({self.path.relative_to(REPO)})"

    def volume(self, mount_path: str) -> dict[str, Any]:
        [mount] = [m for m in self.container["volumeMounts"] if m["mountPath"] == mount_path]
        [volume] = [v for v in self.pod["volumes"] if v["name"] == mount["name"]]
        return dict(volume)

    def mounted_at(self, path: str) -> dict[str, Any] | None:
        """The container's mount that holds ``path``."""
        for m in self.container.get("volumeMounts", ()):
            if PurePosixPath(path).is_relative_to(m["mountPath"]):
                return dict(m)
        return None


def workloads() -> list[Workload]:
    docs = manifests()
    configmaps = {d["metadata"]["name"]: d["data"] for _, d in docs if d["kind"] == "ConfigMap"}
    return [Workload(p, d, configmaps) for p, d in docs
            if d["kind"] in ("DaemonSet", "Deployment")]


@pytest.fixture(params=["DaemonSet", "Deployment"])
def workload(request: pytest.FixtureRequest) -> Workload:
    [w] = [w for w in workloads() if w.doc["kind"] == request.param]
    return w


# -- Kubernetes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for path, doc in manifests():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{path.relative_to(REPO)} {doc['kind']}: {exc}")


def test_schema_check_catches_a_misspelt_field() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    [doc] = [d for _, d in manifests() if d["kind"] == "Deployment"]
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_both_variants_exist() -> None:
    kinds = {(p.parent.name, d["kind"]) for p, d in manifests()}
    assert {("node-local", "DaemonSet"), ("node-local", "ConfigMap"),
            ("replicas", "Deployment"), ("replicas", "Service"),
            ("replicas", "ConfigMap")} <= kinds


def test_configmap_keys_are_daemon_settings() -> None:
    for path, doc in manifests():
        if doc["kind"] != "ConfigMap":
            continue
        unknown = set(doc["data"]) - CONFIG_ENV
        assert not unknown, f"{path.name}: not EPISERVE_* settings of ServerConfig: {unknown}"
        assert all(isinstance(v, str) for v in doc["data"].values()), path
        ServerConfig.from_args([], doc["data"])  # every value parses


def test_container_env_names_are_daemon_settings(workload: Workload) -> None:
    named = {v["name"] for v in workload.container.get("env", ())}
    assert {n for n in named if n.startswith(ENV_PREFIX)} <= CONFIG_ENV


def test_probes_are_grpc_on_the_plaintext_health_port(workload: Workload) -> None:
    config, c = workload.config, workload.container
    assert config.health_port, f"{workload}: probes need EPISERVE_HEALTH_PORT"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == config.health_port, (workload, probe)
    ports = {p["containerPort"] for p in c["ports"]}
    assert {config.health_port, config.metrics_port} <= ports, workload
    if not config.unix:
        assert config.port in ports, workload
    assert config.host == "0.0.0.0", f"{workload}: the kubelet probes the pod IP"
    annotations = workload.doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert config.metrics_host == "0.0.0.0", f"{workload}: Prometheus scrapes the pod IP"


def test_grace_period_covers_prestop_and_drain(workload: Workload) -> None:
    pre_stop = workload.container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = float(pre_stop[1]) + workload.config.grace_s + MARGIN_S
    assert workload.pod["terminationGracePeriodSeconds"] >= needed, workload


def test_memory_is_sized_from_the_cache_budget(workload: Workload) -> None:
    resources = workload.container["resources"]
    request = quantity(resources["requests"]["memory"])
    assert request >= memory_floor(workload.config), workload
    assert request <= memory_floor(workload.config) + 2 * 2**30, f"{workload}: oversized"
    assert quantity(resources["limits"]["memory"]) >= request


def test_runs_as_non_root_with_a_read_only_root(workload: Workload) -> None:
    security = workload.pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert workload.container["securityContext"]["readOnlyRootFilesystem"] is True
    assert workload.container["securityContext"]["allowPrivilegeEscalation"] is False


def test_tls_files_come_from_a_mounted_secret(workload: Workload) -> None:
    config = workload.config
    for path in (config.tls_cert, config.tls_key, config.tls_client_ca):
        if path:
            mount = workload.mounted_at(path)
            assert mount, f"{workload}: {path} is on no volume"
            assert "secret" in workload.volume(mount["mountPath"])


def test_node_local_socket_sits_on_the_shared_host_path() -> None:
    [w] = [w for w in workloads() if w.doc["kind"] == "DaemonSet"]
    socket_dir = str(PurePosixPath(w.config.unix).parent)
    volume = w.volume(socket_dir)
    assert volume["hostPath"]["path"] == socket_dir, "training pods mount the same path"
    # The init container hands the folder to the daemon's user and group.
    [init] = w.pod["initContainers"]
    assert [m["name"] for m in init["volumeMounts"]] == [volume["name"]]
    uid = w.pod["securityContext"]["runAsUser"]
    assert f"chown {uid}:{w.pod['securityContext']['runAsGroup']} {socket_dir}" in init[
        "command"][-1]
    assert init["image"] == w.container["image"]
    if "://" not in w.config.root:
        mount = w.mounted_at(w.config.root)
        assert mount and mount.get("readOnly") is True, "the dataset is mounted read-only"


def test_replicas_sit_behind_a_headless_service() -> None:
    docs = {d["kind"]: d for p, d in manifests() if p.parent.name == "replicas"}
    [w] = [w for w in workloads() if w.doc["kind"] == "Deployment"]
    service, labels = docs["Service"], w.doc["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    named = {p["name"]: p["containerPort"] for p in w.container["ports"]}
    [port] = service["spec"]["ports"]
    assert named[port["targetPort"]] == w.config.port
    assert w.config.tls, "replicas take traffic across nodes: TLS on"
    assert w.env.get("EPISERVE_TOKEN", "").startswith("from-"), "the token comes from a Secret"
    assert w.pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]


# -- compose and Prometheus --------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "compose.yaml").read_text()))


@pytest.mark.slow
def test_compose_matches_the_compose_spec() -> None:
    pytest.importorskip("check_jsonschema")
    run = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(DEPLOY / "compose.yaml")], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr


def test_compose_daemon_and_prometheus_agree() -> None:
    services = compose()["services"]
    daemon = services["episerve"]
    assert daemon["command"][0] == "serve"
    config = ServerConfig.from_args(daemon["command"][1:], daemon["environment"])
    assert config.metrics_port and config.host == "0.0.0.0"
    assert config.metrics_host == "0.0.0.0"  # Prometheus runs in another container
    published = [p.rsplit(":", 2) for p in daemon["ports"]]
    assert [(host, int(inside)) for host, _, inside in published] == [("127.0.0.1", config.port)]
    assert seconds(daemon["stop_grace_period"]) >= config.grace_s + MARGIN_S
    assert quantity(daemon["mem_limit"].upper().rstrip("B")) >= memory_floor(config)
    assert (DEPLOY / daemon["build"]["context"] / daemon["build"]["dockerfile"]).is_file()
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    [job] = [j for j in scrape["scrape_configs"] if j["job_name"] == "episerve"]
    targets = [t for c in job["static_configs"] for t in c["targets"]]
    assert targets == [f"episerve:{config.metrics_port}"]
    [mount] = services["prometheus"]["volumes"]
    assert (DEPLOY / mount["source"]).resolve() == DEPLOY / "prometheus.yml"
    assert services["prometheus"]["depends_on"]["episerve"]["condition"] == "service_healthy"


# -- systemd --------------------------------------------------------------------------------------


def test_systemd_unit_serves_the_socket_in_its_runtime_directory() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "episerve.service").read_text())
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/episerve") and argv[1] == "serve"
    config = ServerConfig.from_args(argv[2:], {})
    assert PurePosixPath(config.unix).parent == PurePosixPath("/run") / service[
        "RuntimeDirectory"]
    assert service["User"] == service["Group"] == "episerve"
    assert service["Restart"] == "on-failure" and service["UMask"] == "0007"
    assert float(service["TimeoutStopSec"]) >= config.grace_s + MARGIN_S
    assert service["KillSignal"] == "SIGTERM"
    assert quantity(service["MemoryHigh"].replace("M", "Mi")) >= memory_floor(config)
    assert "StartLimitBurst" in unit["Unit"] and unit["Install"]["WantedBy"]


# -- the image ------------------------------------------------------------------------------------


def dockerfile() -> list[str]:
    """Instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_is_multi_stage_non_root_and_torch_free() -> None:
    lines = dockerfile()
    stages = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(stages) >= 2, "build and runtime stages"
    runtime = lines[stages[-1]:]
    [user] = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert user.split(":")[0] not in ("root", "0")
    installs = [line for line in lines if "pip install" in line]
    assert installs == ['RUN /opt/episerve/bin/pip install ".[server,s3]"']
    assert any('! /opt/episerve/bin/python -c "import torch"' in line for line in lines)
    [health] = [line for line in runtime if line.startswith("HEALTHCHECK ")]
    assert 'CMD ["episerve-healthcheck"]' in health
    env = " ".join(line for line in runtime if line.startswith("ENV "))
    assert "EPISERVE_PORT=50051" in env and "EXPOSE 50051" in runtime


def test_dockerfile_copies_only_what_the_context_sends() -> None:
    allowed = [line[1:].rstrip("/") for line in
               (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for line in dockerfile():
        if not line.startswith("COPY ") or "--from=" in line:
            continue
        sources = [w for w in line.split()[1:-1] if not w.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), source
            assert any(source == a or source.startswith(a + "/") for a in allowed), source
    for script in ("docker-entrypoint.sh", "healthcheck.py"):
        assert (DEPLOY / script).stat().st_mode & 0o111 or script.endswith(".py")
    entry = (DEPLOY / "docker-entrypoint.sh").read_text()
    assert entry.startswith("#!/bin/sh") and 'exec episerve "$@"' in entry


# -- the health check script ---------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("episerve_healthcheck",
                                                  DEPLOY / "healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("env", "target"), [
    ({}, "127.0.0.1:50051"),
    ({"EPISERVE_HOST": "0.0.0.0", "EPISERVE_PORT": "6000"}, "127.0.0.1:6000"),
    ({"EPISERVE_HOST": "::1"}, "[::1]:50051"),
    ({"EPISERVE_UNIX": "/run/episerve/episerve.sock"}, "unix:/run/episerve/episerve.sock"),
    ({"EPISERVE_UNIX": "/run/e.sock", "EPISERVE_HEALTH_PORT": "50052"}, "127.0.0.1:50052"),
    ({"EPISERVE_TLS_CERT": "/tls/tls.crt", "EPISERVE_HEALTH_PORT": "50052"}, "127.0.0.1:50052"),
])
def test_healthcheck_finds_the_daemon(healthcheck: ModuleType, env: dict[str, str],
                                      target: str) -> None:
    assert healthcheck.target(env) == target


def test_healthcheck_needs_the_health_port_under_tls(healthcheck: ModuleType) -> None:
    with pytest.raises(healthcheck.ProbeError, match="EPISERVE_HEALTH_PORT"):
        healthcheck.target({"EPISERVE_TLS_CERT": "/tls/tls.crt"})


# -- metrics, without a server ---------------------------------------------------------------


def _service() -> Any:
    """The parts of a EpiserveService that metrics read."""
    episodes = {"a": SimpleNamespace(problems={}), "b": SimpleNamespace(problems={}),
                "c": SimpleNamespace(problems={"x": "short"})}
    catalog = SimpleNamespace(episodes=episodes, broken={"d": "unreadable"})
    return SimpleNamespace(stats=Stats(), catalog=catalog, config=ServerConfig(),
                           admission=SimpleNamespace(inflight=2, draining=False),
                           on_batch=None)


def _samples(metrics: Metrics) -> Iterator[tuple[str, dict[str, str], float]]:
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value


def test_metrics_read_the_daemon_counters_at_scrape_time() -> None:
    service = _service()
    metrics = Metrics(service)
    stats = service.stats
    for size in (4, 64):
        stats.samples_read += size
        stats.read_rpcs += 1
        service.on_batch(size)  # what EpiserveService does after each successful Read
        metrics.observe("/episerve.v1.EpiServe/Read", "OK", 0.01)
    metrics.observe("/episerve.v1.EpiServe/Read", "NOT_FOUND", 0.002)
    metrics.observe("/grpc.health.v1.Health/Check", "OK", 0.0001)
    stats.chunks_fetched, stats.cache_hits, stats.read_ns = 7, 3, 2_500_000_000
    got = {(n, tuple(sorted(labels.items()))): v for n, labels, v in _samples(metrics)}

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    read = {"service": "episerve.v1.EpiServe", "method": "Read"}
    assert value("episerve_rpcs_total", code="OK", **read) == 2
    assert value("episerve_rpcs_total", code="NOT_FOUND", **read) == 1
    assert value("episerve_rpcs_total", code="OK", service="grpc.health.v1.Health",
                 method="Check") == 1
    assert value("episerve_read_batch_samples_count") == 2
    assert value("episerve_read_batch_samples_sum") == 68
    assert value("episerve_read_batch_samples_bucket", le="4.0") == 1
    assert value("episerve_read_rpcs_total") == 2
    assert value("episerve_chunks_fetched_total") == 7  # set after the last observe
    assert value("episerve_cache_hits_total") == 3
    assert value("episerve_read_seconds_total") == 2.5
    assert value("episerve_episodes_open") == 2 and value("episerve_episodes_broken") == 2
    assert value("episerve_reads_in_flight") == 2 and value("episerve_draining") == 0
    assert value("episerve_cache_budget_bytes") == parse_bytes("2GiB")
    [info] = [dict(labels) for name, labels in got if name == "episerve_info"]
    assert info["root"] == "data/demo" and info["tls"] == info["auth"] == "false"


def test_no_metrics_module_state_leaks_between_daemons() -> None:
    """Each daemon has its own registry: two in one process do not collide."""
    first, second = Metrics(_service()), Metrics(_service())
    first.observe("/episerve.v1.EpiServe/Read", "OK", 0.1)
    assert [n for n, _, _ in _samples(second) if n == "episerve_rpcs_total"] == []
