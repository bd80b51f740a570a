"""Helpers for end-to-end elastic tests: real agents (`python -m elasticrun`), real
store servers, logs waited on by regex, and a check that nothing of a test is left.

Every process a test starts carries ELASTICRUN_TEST_TAG=<tag> in its environment (the
workers inherit it from their agent), so `tagged_pids(tag)` finds whatever is still
alive of a test — agents and workers alike — by reading /proc, and the cleanup kills
exactly those, by PID.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.helpers import ELASTICRUN, free_port, wait_until

WORKER = Path(__file__).resolve().parents[1] / "workers" / "train_worker.py"
TAG_VAR = "ELASTICRUN_TEST_TAG"
#: short rendezvous settings for tests
RDZV_CONF = "heartbeat_timeout=2,last_call_timeout=0.5,join_timeout=60"
#: how long one wait for a log line may take (a bound, not an expected time)
WAIT = 60.0


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def tagged_pids(tag: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment holds ELASTICRUN_TEST_TAG=tag."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and pid_alive(int(entry)):
            found.append(int(entry))
    return found


class Proc:
    """A child process with its combined output in a log file, waited on by regex.

    A reader thread copies the output to the log and wakes whoever waits for a line,
    so `wait_for` returns the moment the line is written.
    """

    def __init__(self, name: str, argv: Sequence[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        self._data = bytearray()
        self._done = False  # the output has ended and the process has exited
        self._changed = threading.Condition()
        self.popen = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        self.pid = self.popen.pid
        self.tagged = True
        threading.Thread(target=self._pump, name=f"output of {name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log, "wb") as out, self.popen.stdout as pipe:
            while chunk := pipe.read1(1 << 16):
                out.write(chunk)
                out.flush()
                with self._changed:
                    self._data += chunk
                    self._changed.notify_all()
        self.popen.wait()  # the output ends as the process exits
        with self._changed:
            self._done = True
            self._changed.notify_all()

    def text(self) -> str:
        with self._changed:
            return self._data.decode(errors="replace")

    def wait_for(self, pattern: str, *, count: int = 1, start: int = 0, timeout: float = WAIT) -> re.Match[str]:
        """The `count`-th match of `pattern` (a multiline regex) in the output after `start`.

        Fails (with the output) when the deadline passes or the process exits first.
        """
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                text = self._data.decode(errors="replace")
                matches = list(regex.finditer(text, start))
                if len(matches) >= count:
                    return matches[count - 1]
                left = deadline - time.monotonic()
                if self._done or left <= 0:
                    why = f"exited with {self.popen.returncode}" if self._done else f"timed out after {timeout:g}s"
                    raise AssertionError(
                        f"{self.name} {why} before {count} x /{pattern}/; its output:\n{text[-6000:]}"
                    )
                self._changed.wait(left)

    def mark(self) -> int:
        """The current end of the output: `wait_for(..., start=mark)` sees only what follows."""
        return len(self.text())

    def wait_exit(self, timeout: float = WAIT) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout:g}s; output:\n{self.text()[-6000:]}"
            ) from None

    def signal(self, sig: signal.Signals) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait()


def start_store_server(port: int, log: Path) -> Proc:
    """`elasticrun store serve` on 127.0.0.1:port, once it serves. Not tagged: the
    store outlives agents; whoever starts it kills it (`Proc.kill`)."""
    env = {k: v for k, v in os.environ.items() if k != TAG_VAR}
    proc = Proc(
        "store",
        [*ELASTICRUN, "store", "serve", "--host", "127.0.0.1", "--port", str(port)],
        log,
        env,
    )
    proc.tagged = False
    try:
        proc.wait_for(r"serving on")
    except BaseException:
        proc.kill()
        raise
    return proc


#: the flag of a test whose agents keep standby workers, as by default (Cluster turns them off)
WARM = "--warm-imports=torch"


class Cluster:
    """The agents of one test (and so their workers): all tagged, all cleaned up."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.tag = uuid.uuid4().hex
        self.procs: list[Proc] = []
        self.stop_file = tmp_path / "stop"
        # LOGLEVEL=INFO: the tests wait for the agents' detailed lines (who leads, what a
        # node waits for, the leader's rounds), which a default run does not show.
        # The training workers sum over plain sockets unless ELASTICRUN_TEST_COLLECTIVE=gloo
        # says otherwise: why, in tests/workers/collective.py.
        # No standby workers (--warm-imports=off, as PET_WARM_IMPORTS) unless a test asks
        # for them: each agent's standby imports torch whatever its workers run, a fifth of
        # the CPU of a file of torch jobs (tests/test_state_buddy.py: 86 -> 68 CPU-s), which
        # two cores cannot spare. The tests of standbys ask (WARM).
        self._env = dict(
            os.environ, **{TAG_VAR: self.tag, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}
        )
        self._env.setdefault("ELASTICRUN_TEST_COLLECTIVE", "tcp")
        self._env.setdefault("PET_WARM_IMPORTS", "off")

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        """Start a tagged process (it and its descendants count as the test's own), with
        `env` added to the cluster's environment."""
        proc = Proc(name, argv, self.tmp / f"{name}.log", {**self._env, **(env or {})})
        self.procs.append(proc)
        return proc

    def launch(
        self, name: str, *flags: str, env: dict[str, str] | None = None, prefix: Sequence[str] = ()
    ) -> Proc:
        """`python -m elasticrun <flags>` as one of the test's processes: an agent, `join`,
        `store serve`; `prefix` runs it under e.g. `ip netns exec NS` (which execs, so the
        PID is the launcher's). The one way the tests start the launcher."""
        return self.start(name, [*prefix, *ELASTICRUN, *flags], env)

    def control(
        self, *argv: str, timeout: float = WAIT, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `python -m elasticrun <argv>` (status, drain, stop, ...) to its end, in the
        cluster's environment (`env` added)."""
        return subprocess.run(
            [*ELASTICRUN, *argv], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
            env={**self._env, **(env or {})},
        )

    def agent(
        self,
        name: str,
        *,
        backend: str,
        endpoint: str,
        run_id: str,
        local_addr: str,
        nnodes: str,
        max_restarts: int = 0,
        conf: str = RDZV_CONF,
        worker_args: Sequence[str] = (),
        extra: Sequence[str] = (),
        worker: Path = WORKER,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """An agent running `worker` (with --stop-file); `env` adds to the cluster's environment."""
        return self.launch(
            name,
            f"--nnodes={nnodes}", "--nproc-per-node=1",
            f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}", f"--local-addr={local_addr}",
            f"--max-restarts={max_restarts}", "--shutdown-timeout=5",
            f"--log-dir={self.tmp / 'logs'}", *extra,
            str(worker), "--stop-file", str(self.stop_file), *worker_args,
            env=env,
        )

    def stop_training(self) -> None:
        self.stop_file.touch()

    def alive(self) -> list[int]:
        return tagged_pids(self.tag)

    def assert_no_orphans(self, timeout: float = 30.0) -> None:
        """No agent or worker of this test is left (waits a bounded time for them to go)."""
        for proc in self.procs:
            if proc.tagged and proc.popen.poll() is None:
                raise AssertionError(f"{proc.name} is still running:\n{proc.text()[-3000:]}")
        wait_until(lambda: not self.alive(), timeout, f"the end of the test's processes {self.alive()}")

    def close(self) -> None:
        """Kill whatever is left, by PID: agents first, then tagged stragglers."""
        for proc in reversed(self.procs):
            proc.kill()
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- fixtures (a pytest plugin, see tests/conftest.py) -----------------------------------


@dataclass(frozen=True)
class Rdzv:
    """Where the agents of one test meet."""

    backend: str
    endpoint: str
    conf: str
    run_id: str


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def run_id() -> str:
    return "e2e-" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def c10d_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone store server for this module's c10d tests (each uses its own run id):
    no agent hosts it, so killing an agent never kills the store."""
    port = free_port()
    proc = start_store_server(port, tmp_path_factory.mktemp("store") / "store.log")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()


#: for a test over both stores whose etcd run is long: that run goes to the slow pass
#: (`slow`, pyproject.toml), the built-in store's stays in the README's test command
etcd_run_is_slow = pytest.mark.parametrize(
    "rdzv", ["c10d", pytest.param("etcd", marks=[pytest.mark.etcd, pytest.mark.slow])], indirect=True
)


@pytest.fixture(params=["c10d", pytest.param("etcd", marks=pytest.mark.etcd)])
def rdzv(request: pytest.FixtureRequest, cluster: Cluster) -> Rdzv:
    if request.param == "c10d":
        endpoint = request.getfixturevalue("c10d_store")
        return Rdzv("c10d", endpoint, RDZV_CONF + ",is_host=false", run_id())
    etcd = request.getfixturevalue("etcd_server")
    return Rdzv("etcd", etcd.endpoints[0], RDZV_CONF, run_id())


