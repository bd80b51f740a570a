"""Real etcd servers for tests: a single member, a 3-member cluster, TLS, auth.

`EtcdCluster` runs etcd processes on free loopback ports with data in a temporary
directory, tuned for fast tests (short raft heartbeat and election on loopback), and
kills them by PID. The fixtures below are session-scoped, since an etcd start costs
about a second; tests that stop members get them restarted by the function-scoped
wrapper. Other test modules reuse `EtcdCluster` directly, e.g. to run agents against
`cluster.endpoints` and stop `cluster.leader_index()` mid-job.

Tests that need etcd are skipped when the binary is missing (`scripts/install_etcd.sh`
installs it).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pyetcd import etcdrpc

from tests.support.helpers import all_threads_stopped, wait_until

ETCD_BINARY = shutil.which("etcd")
#: Raft timings for members on one loopback interface (etcd's defaults: 100 and 1000).
#: Leases then have a minimum TTL of 1 s (1.5 election timeouts, rounded up).
HEARTBEAT_MS = 25
ELECTION_MS = 250
#: Bounds the wait for a member to become healthy or a leader to be elected.
READY_TIMEOUT = 20.0
#: The password of the `root` user of the `etcd_auth` server.
AUTH_USER, AUTH_PASSWORD = "root", "s3cret-Pa55word"

_PORT_RANGE = (20000, 32767)
_handed_out: set[int] = set()


def _free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    A member keeps its ports across a restart; a port from the ephemeral range could be
    taken meanwhile as the local port of some outgoing connection.
    """
    for _ in range(1000):
        port = random.randint(*_PORT_RANGE)
        if port in _handed_out:  # free now, but promised to a member not started yet
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORT_RANGE}")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: a CA, etcd's server certificate, a client certificate, another CA."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    #: a CA that signed nothing here: a client trusting it must fail the handshake
    other_ca_cert: str


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate a CA, a server certificate for 127.0.0.1, a client one, and a stranger CA."""
    # Imported here: the other fixtures of this plugin must load without it.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def key_pem(key: ec.EllipticCurvePrivateKey, name: str) -> str:
        path = directory / name
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return str(path)

    def issue(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
        name: str,
        *,
        server: bool = False,
    ) -> tuple[str, x509.Name]:
        subject_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        issuer_name, issuer_key = issuer if issuer else (subject_name, key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject_name)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), True)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        cert = builder.sign(issuer_key, hashes.SHA256())
        path = directory / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path), subject_name

    ca_key, other_key, server_key, client_key = (
        ec.generate_private_key(ec.SECP256R1()) for _ in range(4)
    )
    ca_cert, ca_name = issue("elasticrun test CA", ca_key, None, "ca.pem")
    other_ca_cert, _ = issue("some other CA", other_key, None, "other-ca.pem")
    server_cert, _ = issue("etcd", server_key, (ca_name, ca_key), "server.pem", server=True)
    client_cert, _ = issue("client", client_key, (ca_name, ca_key), "client.pem")
    return TlsFiles(
        ca_cert=ca_cert,
        server_cert=server_cert,
        server_key=key_pem(server_key, "server-key.pem"),
        client_cert=client_cert,
        client_key=key_pem(client_key, "client-key.pem"),
        other_ca_cert=other_ca_cert,
    )


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    metrics_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None


class EtcdCluster:
    """`size` etcd members on 127.0.0.1, started by `start()`, killed by `close()`.

    `tls` turns on TLS with client-certificate auth on the client port (peers and the
    health endpoint stay plain).
    """

    def __init__(self, size: int = 1, *, tls: TlsFiles | None = None) -> None:
        if ETCD_BINARY is None:
            raise RuntimeError("etcd is not installed: run scripts/install_etcd.sh")
        self.tls = tls
        # etcd fsyncs every write: memory-backed storage keeps the tests fast.
        shm = Path("/dev/shm")
        self._root = Path(
            tempfile.mkdtemp(prefix="etcd-test-", dir=shm if shm.is_dir() else None)
        )
        self._members = [
            _Member(
                name=f"m{i}",
                client_port=_free_port(),
                peer_port=_free_port(),
                metrics_port=_free_port(),
                data_dir=self._root / f"m{i}",
                log_path=self._root / f"m{i}.log",
            )
            for i in range(size)
        ]

    @property
    def endpoints(self) -> list[str]:
        """The client endpoints ("127.0.0.1:port"), member 0 first."""
        return [f"127.0.0.1:{m.client_port}" for m in self._members]

    def start(self) -> None:
        """Start every member and wait until the cluster serves requests."""
        for i in range(len(self._members)):
            self._spawn(i)
        for i in range(len(self._members)):
            self._wait_healthy(i)

    def stop_member(self, index: int) -> None:
        """Kill member `index` (SIGKILL: a crash, no goodbye to its peers) and reap it."""
        process = self._members[index].process
        if process is not None:
            process.send_signal(signal.SIGKILL)
            process.wait()
            self._members[index].process = None

    def start_member(self, index: int) -> None:
        """Restart a stopped member on its old ports and data; wait until it is healthy."""
        self._spawn(index)
        self._wait_healthy(index)

    def running(self) -> list[int]:
        return [i for i, m in enumerate(self._members) if m.process is not None]

    @contextlib.contextmanager
    def frozen(self, index: int) -> Iterator[None]:
        """Member `index` stopped (SIGSTOP) for the block, then resumed: slow, not gone."""
        process = self._members[index].process
        assert process is not None, f"member {index} is not running"
        process.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: all_threads_stopped(process.pid), READY_TIMEOUT, f"member {index} stopped")
            yield
        finally:
            process.send_signal(signal.SIGCONT)

    def streams_opened(self, index: int, method: str) -> int:
        """How many gRPC calls of `method` (e.g. "LeaseKeepAlive") member `index` started."""
        # read strictly: a scrape that failed, read as 0 streams, made one test pass
        # vacuously and (probably) another fail in CI for no fault of the client
        url = f"http://127.0.0.1:{self._members[index].metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=READY_TIMEOUT) as response:
            families = text_string_to_metric_families(response.read().decode())
        return sum(
            int(sample.value)
            for family in families
            if family.name == "grpc_server_started"
            for sample in family.samples
            if sample.labels.get("grpc_method") == method
        )

    def leader_index(self) -> int:
        """The index of the raft leader among running members, waiting for an election."""
        def leaders() -> list[int]:
            return [i for i in self.running() if "etcd_server_is_leader 1" in self._http(i, "/metrics")]

        try:
            return wait_until(leaders, READY_TIMEOUT, "an etcd leader")[0]
        except AssertionError:
            raise TimeoutError(f"no etcd leader among members {self.running()}: {self._log_tails()}") from None

    def enable_auth(self, user: str, password: str) -> None:
        """Create `user` with the root role and turn authentication on."""
        with self._channel(0) as channel:
            auth = etcdrpc.AuthStub(channel)
            auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=READY_TIMEOUT)
            auth.UserAdd(
                etcdrpc.AuthUserAddRequest(name=user, password=password), timeout=READY_TIMEOUT
            )
            auth.UserGrantRole(
                etcdrpc.AuthUserGrantRoleRequest(user=user, role="root"), timeout=READY_TIMEOUT
            )
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=READY_TIMEOUT)

    def compact(self) -> int:
        """Compact the history up to the current revision; return that revision."""
        with self._channel(self.running()[0]) as channel:
            kv = etcdrpc.KVStub(channel)
            current = kv.Range(etcdrpc.RangeRequest(key=b"\0"), timeout=READY_TIMEOUT)
            revision = int(current.header.revision)
            kv.Compact(
                etcdrpc.CompactionRequest(revision=revision, physical=True), timeout=READY_TIMEOUT
            )
        return revision

    def close(self) -> None:
        for i in range(len(self._members)):
            self.stop_member(i)
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---

    def _channel(self, index: int) -> grpc.Channel:
        """A plain channel for test setup (not for clusters with TLS)."""
        return grpc.insecure_channel(self.endpoints[index])

    def _spawn(self, index: int) -> None:
        member = self._members[index]
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://127.0.0.1:{member.client_port}"
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self._members)
        args = [
            ETCD_BINARY or "etcd",
            f"--name={member.name}",
            f"--data-dir={member.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls=http://127.0.0.1:{member.peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{member.peer_port}",
            f"--listen-metrics-urls=http://127.0.0.1:{member.metrics_port}",
            f"--initial-cluster={initial}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={self._root.name}",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
            "--logger=zap",
            "--log-level=warn",
        ]
        if self.tls:
            args += [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca_cert}",
                "--client-cert-auth",
            ]
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _wait_healthy(self, index: int) -> None:
        """Poll the member's /health (the one bounded poll: etcd offers no event)."""
        member = self._members[index]

        def healthy() -> bool:
            if member.process is None or member.process.poll() is not None:
                raise RuntimeError(f"etcd member {member.name} exited: {self._log_tails([index])}")
            return '"health":"true"' in self._http(index, "/health")

        try:
            wait_until(healthy, READY_TIMEOUT, f"etcd member {member.name} to be healthy")
        except AssertionError:
            raise TimeoutError(f"etcd member {member.name} not healthy: {self._log_tails([index])}") from None

    def _http(self, index: int, path: str) -> str:
        url = f"http://127.0.0.1:{self._members[index].metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return str(response.read().decode())
        except (urllib.error.URLError, OSError):
            return ""

    def _log_tails(self, indexes: list[int] | None = None) -> str:
        tails = []
        for i in range(len(self._members)) if indexes is None else indexes:
            m = self._members[i]
            text = m.log_path.read_text(errors="replace") if m.log_path.exists() else ""
            tails.append(f"--- {m.name} ---\n{text[-3000:]}")
        return "\n".join(tails)


# --- fixtures ------------------------------------------------------------------------

_ETCD_FIXTURES = frozenset({"etcd_server", "etcd_trio", "etcd_tls", "etcd_auth"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses an etcd fixture `etcd`, so `-m "not etcd"` skips them."""
    for item in items:
        if _ETCD_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.etcd)


def _started(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdCluster]:
    """One etcd member, shared by the session: tests use their own keys or wipe them."""
    if ETCD_BINARY is None:
        pytest.skip("etcd is not installed: run scripts/install_etcd.sh")
    yield from _started(EtcdCluster(1))


@pytest.fixture(scope="session")
def _etcd_trio_session() -> Iterator[EtcdCluster]:
    if ETCD_BINARY is None:
        pytest.skip("etcd is not installed: run scripts/install_etcd.sh")
    yield from _started(EtcdCluster(3))


@pytest.fixture
def etcd_trio(_etcd_trio_session: EtcdCluster) -> Iterator[EtcdCluster]:
    """A 3-member cluster; members a test stopped are restarted after it."""
    yield _etcd_trio_session
    for i in range(3):
        if i not in _etcd_trio_session.running():
            _etcd_trio_session.start_member(i)


@pytest.fixture(scope="session")
def etcd_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One member serving clients over TLS and requiring client certificates."""
    if ETCD_BINARY is None:
        pytest.skip("etcd is not installed: run scripts/install_etcd.sh")
    tls = make_tls_files(tmp_path_factory.mktemp("etcd-tls"))
    yield from _started(EtcdCluster(1, tls=tls))


@pytest.fixture(scope="session")
def etcd_auth() -> Iterator[EtcdCluster]:
    """One member with authentication on: user AUTH_USER, password AUTH_PASSWORD."""
    if ETCD_BINARY is None:
        pytest.skip("etcd is not installed: run scripts/install_etcd.sh")
    cluster = EtcdCluster(1)
    try:
        cluster.start()
        cluster.enable_auth(AUTH_USER, AUTH_PASSWORD)
        yield cluster
    finally:
        cluster.close()
