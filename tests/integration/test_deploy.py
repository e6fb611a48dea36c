"""Running episerve as deployed: object storage, TLS and tokens, replicas, metrics.

Every server here listens on loopback: the S3 store is moto's standalone server, the
certificates are made by the test, and replicas are daemons on 127.0.0.1.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from episerve_client import TLS, Client, errors
from episerve_client._routes import Router
from episerve_client.read_answer import ReadResult
from tests.support import ramp
from tests.support.keymaps import KEYMAPS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MECKA = KEYMAPS["mecka_keypoints_k4"]
KEYPOINTS = {"k": {"zarr_key": "left.obs_keypoints", "key_type": "proprio_keys"}}
# Every episode, both ends, chunk edges and a frame read twice.
SAMPLES = [("ep000a", 0), ("ep000a", 36), ("ep001b", 99), ("ep002c", 100), ("ep003d", 0),
           ("ep003d", 99), ("ep003d", 100), ("ep003d", 256), ("ep002c", 7), ("ep000a", 36)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_same_result(got: ReadResult, want: ReadResult) -> None:
    assert got.episodes == want.episodes
    assert got.embodiments == want.embodiments
    assert np.array_equal(got.frame_index, want.frame_index)
    assert np.array_equal(got.fps, want.fps)
    assert got.arrays.keys() == want.arrays.keys()
    for name, value in want.arrays.items():
        assert got.arrays[name].dtype == value.dtype, name
        assert np.array_equal(got.arrays[name], value), name
    assert got.texts == want.texts
    assert got.images.keys() == want.images.keys()
    for name, (source, index) in want.images.items():
        got_source, got_index = got.images[name]
        frames = [got.frames[got_source][k] for k in got_index.ravel()]
        assert frames == [want.frames[source][k] for k in index.ravel()], name


@pytest.fixture(scope="module")
def ramp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The standard ramped dataset, sharded (``tests/ramp.py``)."""
    root = tmp_path_factory.mktemp("ramp") / "sharded"
    ramp.write_ramp_dataset(root)
    return root


# -- object storage -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(ramp_root: Path) -> Iterator[dict[str, Any]]:
    """moto's S3 on loopback, holding the sharded ramp dataset under ``s3://ramp/sharded``."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    upload = _uploader(endpoint, env)
    upload(ramp_root, "ramp", "sharded")
    yield {"endpoint": endpoint, "env": env, "upload": upload}
    server.stop()


def _uploader(endpoint: str, env: dict[str, str]) -> Callable[[Path, str, str], None]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name=env["AWS_DEFAULT_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    buckets: set[str] = set()

    def upload(folder: Path, bucket: str, prefix: str) -> None:
        """Put every file under ``folder`` at ``s3://bucket/prefix/<relative path>``."""
        if bucket not in buckets:
            client.create_bucket(Bucket=bucket)
            buckets.add(bucket)
        base = folder.parent if folder.name.endswith(".zarr") else folder
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                key = f"{prefix}/{path.relative_to(base).as_posix()}"
                client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

    return upload


def test_s3_root_reads_equal_local_disk(s3: dict[str, Any], ramp_root: Path,
                                        start_daemon: Any) -> None:
    """Same results, and the same store traffic (chunks, metadata) as on local disk."""
    nocache = ("--cache-bytes", "0")
    local = start_daemon(ramp_root, *nocache)
    remote = start_daemon("s3://ramp/sharded", *nocache,
                          env={**s3["env"], "AWS_ENDPOINT_URL": s3["endpoint"]})
    results, stats = {}, {}
    for side, d in (("local", local), ("s3", remote)):
        with Client(d.target) as c:
            listing = c.list_episodes()
            results[side] = [c.read(MECKA, SAMPLES, annotation_cutoff=True) for _ in range(2)]
            stats[side] = c.stats()
            assert [e.hash for e in listing.episodes] == ["ep000a", "ep001b", "ep002c",
                                                          "ep003d"]
    for got in results["s3"]:
        assert_same_result(got, results["local"][0])
    counted = ("chunks_fetched", "store_reads", "metadata_requests", "episodes")
    assert {k: stats["s3"][k] for k in counted} == {k: stats["local"][k] for k in counted}
    assert stats["s3"]["chunks_fetched"] > 0


def test_s3_rescan_sees_episodes_uploaded_later(s3: dict[str, Any], ramp_root: Path,
                                                start_daemon: Any) -> None:
    """The endpoint comes from --s3-endpoint here; fsspec's listings cache must not hide
    an episode uploaded after the first listing."""
    s3["upload"](ramp_root / "ep000a.zarr", "late", "pre")
    d = start_daemon("s3://late/pre", "--s3-endpoint", s3["endpoint"], env=s3["env"])
    with Client(d.target) as c:
        assert [e.hash for e in c.list_episodes().episodes] == ["ep000a"]
        s3["upload"](ramp_root / "ep001b.zarr", "late", "pre")
        result = c.read(KEYPOINTS, [("ep001b", 99)])  # an unknown id rescans the root
        assert [e.hash for e in c.list_episodes().episodes] == ["ep000a", "ep001b"]
    assert np.array_equal(result.arrays["k"][0], ramp.ramp_row(1, "left.obs_keypoints", 99))


# -- TLS and tokens -------------------------------------------------------------------------


def _pki(out: Path) -> dict[str, str]:
    """PEM files: a CA, a server cert for 127.0.0.1/localhost, a client cert, and an
    unrelated CA with its own client cert."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    files: dict[str, str] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def save(label: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        (out / f"{label}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        (out / f"{label}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[label] = str(out / f"{label}.crt")
        files[f"{label}_key"] = str(out / f"{label}.key")

    def issue(cn: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, *,
              usage: x509.ObjectIdentifier | None = None,
              san: list[x509.GeneralName] | None = None,
              ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        issuer_name, issuer_key = issuer if issuer else (name(cn), key)
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1)))
        builder = builder.add_extension(
            x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return key, builder.sign(issuer_key, hashes.SHA256())

    for prefix in ("", "other_"):
        ca_key, ca = issue(f"{prefix}episerve test CA", None)
        save(f"{prefix}ca", ca_key, ca)
        client_key, client = issue(f"{prefix}trainer", (ca.subject, ca_key),
                                   usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        save(f"{prefix}client", client_key, client)
        if not prefix:
            server_key, server = issue("episerve", (ca.subject, ca_key),
                                       usage=ExtendedKeyUsageOID.SERVER_AUTH, san=[
                                           x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                           x509.DNSName("localhost")])
            save("server", server_key, server)
            named_key, named = issue("episerve.internal", (ca.subject, ca_key),
                                     usage=ExtendedKeyUsageOID.SERVER_AUTH,
                                     san=[x509.DNSName("episerve.internal")])
            save("named", named_key, named)
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _pki(tmp_path_factory.mktemp("pki"))


def _refused(target: str, tls: TLS) -> None:
    """A client that will not be talked to: its first call fails fast (no wait_for_ready),
    and an ``episerve_client.Client`` gives up with a typed error."""
    with grpc.secure_channel(target, tls.credentials()) as ch, \
            pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with Client(target, timeout_s=1, tls=tls) as c, \
            pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
        c.read(KEYPOINTS, [("ep000a", 0)])


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


def test_tls_right_ca_reads_wrong_ca_fails(pki: dict[str, str], ramp_root: Path,
                                           start_daemon: Any) -> None:
    health_port = free_port()
    d = start_daemon(ramp_root, "--tls-cert", pki["server"], "--tls-key",
                     pki["server_key"], "--health-port", str(health_port))
    with Client(d.target, tls=TLS(ca=pki["ca"])) as c:
        assert c.read(KEYPOINTS, [("ep000a", 3)]).arrays["k"][0, 0] == ramp.ramp_row(
            0, "left.obs_keypoints", 3)[0]
    # A client that trusts another CA fails the handshake; plaintext gets no answer.
    _refused(d.target, TLS(ca=pki["other_ca"]))
    with grpc.insecure_channel(d.target) as ch, pytest.raises(grpc.RpcError) as info:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Probes (kubelet, the container HEALTHCHECK) use the plaintext health port.
    assert _health(f"127.0.0.1:{health_port}") == health_pb2.HealthCheckResponse.SERVING
    probe = _run_healthcheck({"EPISERVE_HEALTH_PORT": str(health_port),
                              "EPISERVE_TLS_CERT": pki["server"]})
    assert probe.returncode == 0, probe.stderr
    no_port = _run_healthcheck({"EPISERVE_TLS_CERT": pki["server"]})
    assert no_port.returncode == 1 and "EPISERVE_HEALTH_PORT" in no_port.stderr


def test_tls_server_name_overrides_the_target_host(pki: dict[str, str],
                                                   ramp_root: Path,
                                                   start_daemon: Any) -> None:
    d = start_daemon(ramp_root, "--tls-cert", pki["named"], "--tls-key",
                     pki["named_key"])
    with Client(d.target, timeout_s=1,
                tls=TLS(ca=pki["ca"], server_name="episerve.internal")) as c:
        assert len(c.read(KEYPOINTS, [("ep000a", 3)])) == 1


def test_mutual_tls_refuses_clients_without_a_trusted_cert(
        pki: dict[str, str], ramp_root: Path, start_daemon: Any) -> None:
    d = start_daemon(ramp_root, "--tls-cert", pki["server"], "--tls-key",
                     pki["server_key"], "--tls-client-ca", pki["ca"])
    mine = TLS(ca=pki["ca"], cert=pki["client"], key=pki["client_key"])
    with Client(d.target, tls=mine) as c:
        assert len(c.read(KEYPOINTS, [("ep001b", 0)])) == 1
    _refused(d.target, TLS(ca=pki["ca"]))
    _refused(d.target, TLS(ca=pki["ca"], cert=pki["other_client"], key=pki["other_client_key"]))


def test_tls_and_token_with_workers(pki: dict[str, str], ramp_root: Path,
                                    start_daemon: Any) -> None:
    """``--workers 2`` behind mutual TLS and a token: a trusted client routes to the
    workers (plaintext unix sockets in a folder only the daemon's user may open, token
    still required); an untrusted one is refused at the front as before."""
    d = start_daemon(ramp_root, "--tls-cert", pki["server"], "--tls-key", pki["server_key"],
                     "--tls-client-ca", pki["ca"], "--token", "s3cret-token", workers=2)
    mine = TLS(ca=pki["ca"], cert=pki["client"], key=pki["client_key"])
    samples = [("ep000a", 3), ("ep001b", 5), ("ep002c", 7), ("ep003d", 9)]
    with Client(d.target, tls=mine, token="s3cret-token") as c:
        result = c.read(KEYPOINTS, samples)
        workers = c.workers.of[d.target]
        assert len(workers) == 2
        assert c.stats()["read_rpcs"] == 2  # one Read per worker, none through the front
    for b, (episode, frame) in enumerate(samples):
        no = int(episode[2:5])
        assert np.array_equal(result.arrays["k"][b], ramp.ramp_row(no, "left.obs_keypoints",
                                                                   frame))
    folder = Path(workers[0].removeprefix("unix://")).parent
    assert folder.stat().st_mode & 0o777 == 0o700
    with Client(workers[0]) as anonymous, pytest.raises(errors.Unauthenticated):
        anonymous.read(KEYPOINTS, samples[:1])
    _refused(d.target, TLS(ca=pki["ca"]))


def test_token_and_allow_list_limit_access(ramp_root: Path, start_daemon: Any) -> None:
    d = start_daemon(ramp_root, "--allow", "ep00[01]*", env={"EPISERVE_TOKEN": "s3cret-token"})
    with Client(d.target) as c, pytest.raises(errors.Unauthenticated, match="missing"):
        c.read(KEYPOINTS, [("ep000a", 0)])
    with Client(d.target, token="guess", plaintext_token_ok=True) as c, \
            pytest.raises(errors.Unauthenticated, match="wrong"):
        c.read(KEYPOINTS, [("ep000a", 0)])
    with Client(d.target, token="s3cret-token", plaintext_token_ok=True) as c:
        assert len(c.read(KEYPOINTS, [("ep000a", 0), ("ep001b", 5)])) == 2
        # --allow: the other episodes are not served, as if they were not there.
        assert [e.hash for e in c.list_episodes().episodes] == ["ep000a", "ep001b"]
        with pytest.raises(errors.EpisodeNotFound, match="ep003d"):
            c.read(KEYPOINTS, [("ep003d", 0)])
    assert _health(d.target) == health_pb2.HealthCheckResponse.SERVING  # probes need no token


def test_client_refuses_a_plaintext_token_to_a_remote_target() -> None:
    """Checked when the client is built: nothing is sent anywhere."""
    for target in ("10.1.2.3:50051", "episerve.example:50051", ["127.0.0.1:1", "10.1.2.3:1"]):
        with pytest.raises(errors.InvalidArgument, match="plaintext"):
            Client(target, token="s3cret-token")
    Client("10.1.2.3:50051", token="s3cret-token", tls=TLS(ca="ca.pem")).close()


def _run_healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPISERVE_")}
    return subprocess.run([sys.executable, str(REPO / "deploy/healthcheck.py")],
                          env={**clean, **env}, capture_output=True, text=True, timeout=30,
                          check=False)


# -- replicas ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_episodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve short ramped episodes, so that three replicas each own several."""
    root = tmp_path_factory.mktemp("replicas")
    for no in range(12):
        ramp.write_ramp_episode(root, f"rep{no:02d}", episode_no=no, total_frames=20 + 2 * no)
    return root


def test_replicas_split_episodes_and_fail_over(many_episodes: Path, start_daemon: Any) -> None:
    import torch
    from torch.utils.data import DataLoader

    from episerve_client import WindowDataset, collate

    replicas = [start_daemon(many_episodes) for _ in range(3)]
    targets = [d.target for d in replicas]
    ds = WindowDataset(targets, MECKA)
    router = Router(tuple(targets), down_s=1.0)
    share = {t: {e.hash for e in ds.episodes if router.order(e.hash)[0] == t} for t in targets}

    # A pass over everything: each replica serves exactly its share, so caches are disjoint.
    for start in range(0, len(ds), 64):
        ds.__getitems__(list(range(start, min(start + 64, len(ds)))))
    assert {t: set(_stats(t)["episodes"]) for t in targets} == share

    # An epoch through DataLoader workers, with one replica killed (no drain) a third in:
    # the one owning the most episodes (ports are random, so the shares vary).
    victim = max(targets, key=lambda t: len(share[t]))
    survivors = [t for t in targets if t != victim]
    where = {ds.locate(g): g for g in range(len(ds))}
    # spawn: this process has used gRPC above, and gRPC does not survive a fork.
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, collate_fn=collate,
                        generator=torch.Generator().manual_seed(0),
                        multiprocessing_context="spawn")
    seen: Counter[int] = Counter()
    for n, batch in enumerate(loader):
        if n == len(loader) // 3:
            replicas[targets.index(victim)].kill()
        seen.update(where[(h, int(f))] for h, f in zip(batch["episode_hash"],
                                                        batch["frame_index"].tolist()))
    assert seen == Counter(range(len(ds))), "an index was lost or delivered twice"
    took_over = set().union(*(_stats(t)["episodes"] for t in survivors))
    assert share[victim] <= took_over, "the dead replica's episodes were not failed over"


def _stats(target: str) -> dict[str, Any]:
    with Client(target) as c:
        return dict(c.stats())


# -- metrics ------------------------------------------------------------------------------------


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_endpoint_reports_the_daemon_counters(ramp_root: Path,
                                                      start_daemon: Any) -> None:
    port = free_port()
    d = start_daemon(ramp_root, "--metrics-port", str(port))
    sizes = [1, 5, 16, 3]
    with Client(d.target) as c:
        for n in sizes:
            c.read(MECKA, [("ep003d", f) for f in range(0, 10 * n, 10)])
        with pytest.raises(errors.EpisodeNotFound):
            c.read(KEYPOINTS, [("nope", 0)])
        stats = c.stats()
    m = _scrape(port)

    def value(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    read = {"service": "episerve.v1.EpiServe", "method": "Read"}
    assert value("episerve_rpcs_total", code="OK", **read) == len(sizes)
    assert value("episerve_rpcs_total", code="NOT_FOUND", **read) == 1
    assert value("episerve_rpc_duration_seconds_count", **read) == len(sizes) + 1
    assert 0 < value("episerve_rpc_duration_seconds_sum", **read) < 60
    assert value("episerve_read_batch_samples_count") == len(sizes)
    assert value("episerve_read_batch_samples_sum") == sum(sizes)
    assert value("episerve_read_batch_samples_bucket", le="4.0") == 2  # 1 and 3
    # The same counters as GetStats: one source of truth.
    for name in ("read_rpcs", "samples_read", "chunks_fetched", "store_reads", "cache_hits",
                 "cache_misses", "cache_evictions", "metadata_requests", "bytes_sent"):
        assert value(f"episerve_{name}_total") == stats[name], name
    assert value("episerve_read_rpcs_total") == len(sizes)
    assert value("episerve_chunks_fetched_total") > 0
    assert value("episerve_cache_hits_total") > 0  # ep003d's chunks, read again
    assert value("episerve_cache_bytes") == stats["cache_bytes"] > 0
    assert value("episerve_cache_budget_bytes") == 2 * 2**30
    assert value("episerve_episodes_open") == 4
    assert value("episerve_episodes_broken") == 0
    assert value("episerve_reads_in_flight") == 0
    assert value("process_resident_memory_bytes") > 10 * 2**20
