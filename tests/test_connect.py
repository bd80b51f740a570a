"""Reaching a store: every command answers in a second when nothing can be reached,
says what it connects to when that takes longer, and knows an etcd server or another
program at a c10d endpoint for what it is; an agent whose store port on this host is
held by another program says so.

The one-second bound is asserted here (on the first contact
itself, without the interpreter's start-up); names under the reserved `.invalid` TLD
resolve nowhere. Everything a user sees is checked on real `python -m elasticrun`
processes, line for line.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticrun.errors import StoreUnavailableError
from elasticrun.store.client.first_contact import first_contact
from elasticrun.store.client.grpc_store import GrpcStore
from tests.support.elastic_cluster import Cluster, start_store_server
from tests.support.helpers import free_port
from tests.test_cli import clean_env, run_cli, start_cli

pytestmark = pytest.mark.timeout(60)

TICKER = Path(__file__).resolve().parent / "workers" / "tick_worker.py"
UNRESOLVABLE = "store.elasticrun.invalid"
CHECK = "check --rdzv-endpoint, and that the store is up (the agent on that host, or elasticrun store serve)"
#: the errors of the commands, as printed; `endpoint` and `port` filled in
REFUSED = (
    "elasticrun: error: store at 127.0.0.1:{port} is unreachable: connection refused: nothing listens on "
    f"port {{port}} of 127.0.0.1; {CHECK}"
)
NO_NAME = (
    f"elasticrun: error: store at {UNRESOLVABLE}:29400 is unreachable: cannot resolve the host name "
    f"'{UNRESOLVABLE}' ({{reason}}); {CHECK}"
)


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port of 127.0.0.1 that nothing listens on: bound (so nobody else takes it), never listening."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) and never says a word."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


@pytest.fixture
def http_port() -> Iterator[int]:
    """An HTTP/1 server: a program that does not speak gRPC."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _first_contact_seconds(endpoint: str) -> tuple[float, StoreUnavailableError]:
    """How long a job-control command's first contact with `endpoint` takes to fail."""

    async def contact() -> StoreUnavailableError:
        async with GrpcStore(endpoint, timeout=10.0) as store:
            with pytest.raises(StoreUnavailableError) as failed:
                await first_contact(store, (endpoint,), 10.0, "/elasticrun/", patient=False, say=print)
        return failed.value

    start = time.monotonic()
    error = asyncio.run(contact())
    return time.monotonic() - start, error


def _reason(name: str) -> str:
    try:
        socket.getaddrinfo(name, 29400)
    except socket.gaierror as e:
        return str(e.strerror)
    pytest.skip(f"{name} resolves here")


# --- nothing there: an answer within a second -----------------------------------------------


def test_a_refused_port_and_an_unknown_name_are_answered_within_a_second(refused_port: int) -> None:
    """The one-second bound, with a store timeout of 10 s that the old client waited out."""
    took, error = _first_contact_seconds(f"127.0.0.1:{refused_port}")
    assert took < 1.0 and "connection refused" in str(error)
    took, error = _first_contact_seconds(f"{UNRESOLVABLE}:29400")
    assert took < 1.0 and "cannot resolve the host name" in str(error)


def test_every_job_control_command_says_what_it_tried(refused_port: int) -> None:
    store = [f"--rdzv-endpoint=127.0.0.1:{refused_port}"]
    job = [*store, "--rdzv-id=job"]
    commands = {
        "status": ["status", *job], "list": ["list", *store], "logs": ["logs", *job],
        "drain": ["drain", *job, "--count=1"], "join": ["join", *job], "stop": ["stop", *job],
    }
    started = {name: start_cli(argv) for name, argv in commands.items()}  # at once: a second, not six
    for name, proc in started.items():
        out, err = proc.communicate(timeout=30)
        if name == "stop":  # nothing runs there, so there is nothing to stop: done, and said so
            assert (proc.returncode, err) == (0, ""), err
            assert out == (
                f"nothing listens at 127.0.0.1:{refused_port}: no job runs on a store there (a store an agent "
                "hosted ends with its job); nothing to stop. Check --rdzv-endpoint if the job should be running\n"
            )
            continue
        assert (proc.returncode, out, err) == (200, "", REFUSED.format(port=refused_port) + "\n"), name


def test_a_name_that_does_not_resolve() -> None:
    done = run_cli(["list", f"--rdzv-endpoint={UNRESOLVABLE}"])
    assert (done.returncode, done.stdout) == (200, "")
    assert done.stderr == NO_NAME.format(reason=_reason(UNRESOLVABLE)) + "\n"


def test_etcd_endpoints_are_all_named(refused_port: int) -> None:
    done = run_cli(["list", "--rdzv-backend=etcd", f"--rdzv-endpoint={UNRESOLVABLE}:2379,127.0.0.1:{refused_port}"])
    assert done.returncode == 200
    assert done.stderr == (
        f"elasticrun: error: store at {UNRESOLVABLE}:2379,127.0.0.1:{refused_port} is unreachable: "
        f"{UNRESOLVABLE}:2379: cannot resolve the host name '{UNRESOLVABLE}' ({_reason(UNRESOLVABLE)}); "
        f"127.0.0.1:{refused_port}: connection refused: nothing listens on port {refused_port} of 127.0.0.1; "
        f"{CHECK}\n"
    )


# --- something there that answers slowly, or is no store ------------------------------------


def test_a_slow_answer_is_announced_after_a_second(silent_port: int) -> None:
    endpoint = f"127.0.0.1:{silent_port}"
    done = run_cli(["status", f"--rdzv-endpoint={endpoint}", "--rdzv-id=job", "--rdzv-conf=store_timeout=2"])
    assert done.returncode == 200
    assert done.stderr.splitlines() == [
        f"elasticrun: connecting to the store at {endpoint}...",
        f"elasticrun: error: store at {endpoint} is unreachable: connections open, but nothing answers as a "
        "gRPC server there (gave up after 2 s)",
    ]


def test_a_silent_program_at_an_etcd_endpoint_is_named_in_the_same_words(silent_port: int) -> None:
    endpoint = f"127.0.0.1:{silent_port}"
    done = run_cli(["list", "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}", "--rdzv-conf=store_timeout=2"])
    assert done.returncode == 200
    assert done.stderr.splitlines()[-1] == (
        f"elasticrun: error: store at {endpoint} is unreachable: {endpoint}: connections open, but nothing "
        "answers as a gRPC server there"
    )


def test_a_program_that_does_not_speak_grpc(http_port: int) -> None:
    done = run_cli(["status", f"--rdzv-endpoint=127.0.0.1:{http_port}", "--rdzv-id=job"])
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"elasticrun: error: 127.0.0.1:{http_port} is a program that does not speak gRPC, not the built-in store: "
        "check --rdzv-endpoint (the host and port of the agent that hosts the store, or of elasticrun store serve)\n"
    )


@pytest.mark.etcd
def test_an_etcd_server_at_a_c10d_endpoint(etcd_server, tmp_path: Path) -> None:
    endpoint = etcd_server.endpoints[0]
    done = run_cli(["list", f"--rdzv-endpoint={endpoint}"])
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"elasticrun: error: {endpoint} is an etcd server, not the built-in store: give --rdzv-backend=etcd, "
        "or the built-in store's endpoint\n"
    )
    # An agent on the endpoint's host finds the port taken, and by whom.
    agent = run_cli(_agent_argv(endpoint, tmp_path))
    assert agent.returncode == 2
    assert agent.stderr.splitlines()[-1] == (
        f"elasticrun: error: the store's port {endpoint} on this host is taken by another program (an etcd "
        "server): stop it, or give the job another port in --rdzv-endpoint"
    )


# --- the agent ----------------------------------------------------------------------------------


def _agent_argv(endpoint: str, tmp_path: Path, conf: str = "") -> list[str]:
    return [
        "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=connect",
        f"--rdzv-conf=last_call_timeout=0.1{conf}", str(TICKER), "--stop-file", str(tmp_path),
    ]


def test_an_agent_whose_store_port_is_held_by_a_silent_program(silent_port: int, tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{silent_port}"
    done = run_cli(_agent_argv(endpoint, tmp_path, ",store_timeout=1"))
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"elasticrun: error: the store's port {endpoint} on this host is taken by another program (it did not "
        "answer as a store within 1 s): stop it, or give the job another port in --rdzv-endpoint"
    )


def test_an_agent_whose_store_port_is_held_by_a_store_uses_it(cluster: Cluster, tmp_path: Path) -> None:
    """`store serve` (or another agent of the job) on this host: the agent is its client."""
    port = free_port()
    store = start_store_server(port, tmp_path / "store.log")
    try:
        (tmp_path / "stop").touch()  # the ticker ends at once
        done = run_cli(_agent_argv(f"127.0.0.1:{port}", tmp_path / "stop"))
        assert done.returncode == 0, done.stderr
        assert "hosting the rendezvous store" not in done.stderr
    finally:
        store.kill()


def test_an_agent_waits_for_a_store_that_starts_late_and_says_so(cluster: Cluster, tmp_path: Path) -> None:
    """The agent keeps its patience (the store may be starting), but never waits in silence."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    (tmp_path / "stop").touch()
    argv = _agent_argv(endpoint, tmp_path / "stop", ",is_host=false,store_timeout=30")
    agent = cluster.launch("agent", *argv)
    agent.wait_for(
        rf"connecting to the store at {endpoint} \(connection refused: nothing listens on port {port} of "
        r"127\.0\.0\.1\); trying again until store_timeout \(30 s\)$"
    )
    store = start_store_server(port, tmp_path / "store.log")
    try:
        assert agent.wait_exit() == 0, agent.text()
    finally:
        store.kill()


def test_an_agent_gives_up_after_store_timeout(refused_port: int, tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{refused_port}"
    done = run_cli(_agent_argv(endpoint, tmp_path, ",is_host=false,store_timeout=1.5"), env=clean_env())
    assert done.returncode == 200
    lines = done.stderr.splitlines()
    assert lines[-1] == (
        f"elasticrun: error: store at {endpoint} is unreachable: connection refused: nothing listens on port "
        f"{refused_port} of 127.0.0.1 (gave up after 1.5 s)"
    )
    assert any(line.endswith(f"] connecting to the store at {endpoint} (connection refused: nothing listens on port "
                             f"{refused_port} of 127.0.0.1); trying again until store_timeout (1.5 s)")
               for line in lines)
