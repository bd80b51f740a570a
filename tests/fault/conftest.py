"""Fixtures of the fault-injection suite (tests/fault/).

The `reliability` fixture (tests/support/reliability_rows.py) records each scenario for
RELIABILITY.md.

Markers: `soak` marks a long run excluded by default; run it with
`ELASTICRUN_SOAK=1 python -m pytest tests/fault -m soak` (or `-m soak` alone).
"""

from __future__ import annotations

import itertools
import os
import random
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.elastic_cluster import RDZV_CONF, TAG_VAR, Cluster, Proc
from tests.support.helpers import ELASTICRUN

SOAK_VAR = "ELASTICRUN_SOAK"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"soak: a long fault soak, skipped unless {SOAK_VAR}=1 or -m soak")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(SOAK_VAR) == "1" or "soak" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason=f"soak test: set {SOAK_VAR}=1 or pass -m soak")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


# --- real agents running the fault worker ------------------------------------------------

FAULT_WORKER = Path(__file__).resolve().parents[1] / "workers" / "fault_worker.py"

#: one step of the fault worker (tests/workers/fault_worker.py)
STEP_RE = re.compile(
    r"step=(?P<step>\d+) rank=(?P<rank>\d+) world=(?P<world>\d+) group_rank=(?P<group_rank>\d+) "
    r"restart=(?P<restart>\d+) round=(?P<round>\d+) pid=(?P<pid>\d+) t=(?P<t>[\d.]+) sum=(?P<sum>\d+)"
)


def step_pattern(world: int | str = r"\d+", **groups: object) -> str:
    """A regex for one step line at `world`, with other fields pinned as given."""
    pattern = STEP_RE.pattern.replace(r"(?P<world>\d+)", f"(?P<world>{world})")
    for key, value in groups.items():
        pattern = pattern.replace(rf"(?P<{key}>\d+)", rf"(?P<{key}>{value})")
    return pattern


def steps_in(text: str) -> list[dict[str, Any]]:
    """Every step line in `text`, as dicts of ints (and `t` as a float)."""
    rows = []
    for m in STEP_RE.finditer(text):
        row: dict[str, Any] = {k: int(v) for k, v in m.groupdict().items() if k != "t"}
        row["t"] = float(m["t"])
        rows.append(row)
    return rows


class FaultCluster(Cluster):
    """A `Cluster` whose agents run tests/workers/fault_worker.py with a shared checkpoint,
    numbered lines and per-attempt log files (`--tee=3` under `self.logs`)."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.logs = tmp_path / "logs"
        self.ckpt = tmp_path / "ckpt.json"
        self.seq_dir = tmp_path / "seq"

    def agent(  # type: ignore[override]
        self,
        name: str,
        *,
        endpoint: str,
        run_id: str,
        local_addr: str,
        nnodes: str,
        conf: str | None = None,
        backend: str = "c10d",
        max_restarts: int = 0,
        extra: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> Proc:
        """An agent on `local_addr` (c10d by default, never hosting the store unless
        `conf` says so); `prefix` runs it under e.g. `ip netns exec NS` (which execs, so
        the PID is the agent's)."""
        if conf is None:
            conf = RDZV_CONF + (",is_host=false" if backend == "c10d" else "")
        return self.launch(
            name,
            f"--nnodes={nnodes}", "--nproc-per-node=1",
            f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}", f"--local-addr={local_addr}",
            f"--max-restarts={max_restarts}", "--shutdown-timeout=5", "--tee=3",
            f"--log-dir={self.logs}", *extra,
            str(FAULT_WORKER), "--stop-file", str(self.stop_file), "--ckpt", str(self.ckpt),
            "--seq-dir", str(self.seq_dir), *worker_args,
            env=env, prefix=prefix,
        )

    def attempts(self) -> list[Path]:
        """Every attempt's stdout log under --log-dir."""
        return sorted(self.logs.glob("*/attempt_*/0/stdout.log"))

    def worker_steps(self) -> list[dict[str, Any]]:
        """Every step of every worker, from the attempt logs."""
        return [row for log in self.attempts() for row in steps_in(log.read_text(errors="replace"))]


def serve_store(host: str, log: Path, *, port: int = 0, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    """`elasticrun store serve` on host (port 0: a free one), once it serves, and its
    endpoint. Untagged unless `env` carries the test tag: whoever starts it kills it."""
    proc = Proc(
        "store",
        [*ELASTICRUN, "store", "serve", "--host", host, "--port", str(port)],
        log,
        env if env is not None else {k: v for k, v in os.environ.items() if k != TAG_VAR},
    )
    proc.tagged = env is not None
    try:
        endpoint = proc.wait_for(r"serving on (\S+)")[1]
    except BaseException:
        proc.kill()
        raise
    return proc, endpoint


@pytest.fixture
def fault_cluster(tmp_path: Path) -> Iterator[FaultCluster]:
    c = FaultCluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


# --- after-the-fact checks ---------------------------------------------------------------

SEQ_RE = re.compile(r" seq=(\d+)$", re.MULTILINE)


def check_no_line_lost(cluster: FaultCluster) -> dict[str, int]:
    """Every attempt's log holds every numbered line its worker printed.

    A worker prints lines numbered 0, 1, ... and keeps the count printed so far in
    <seq-dir>/<pid>; its attempt's stdout.log (one worker per attempt: --nproc-per-node=1)
    must hold every number below that count: none missing, not even the last ones. That
    holds where the agent was SIGKILLed too: the worker writes its log file itself.
    """
    attempts = cluster.attempts()
    assert attempts, f"no attempt logs under {cluster.logs}"
    lines = 0
    for log in attempts:
        text = log.read_text(errors="replace")
        pids = set(re.findall(r"^worker started .* pid=(\d+)", text, re.MULTILINE))
        if not pids:
            # the worker was stopped before it said anything (e.g. during torch's import)
            continue
        assert len(pids) == 1, f"{log}: more than one worker {pids}"
        pid = pids.pop()
        seqs = {int(s) for s in SEQ_RE.findall(text)}
        side = cluster.seq_dir / pid
        printed = int(side.read_text()) if side.exists() else 0
        logged = max(seqs, default=-1) + 1
        gaps = sorted(set(range(logged)) - seqs)
        assert not gaps, f"{log}: lines {gaps[:20]} of worker {pid} are lost (a gap)"
        assert printed <= logged, f"{log}: lines {logged}..{printed - 1} of worker {pid} are lost ({printed} printed)"
        lines += len(seqs)
    return {"attempt_logs": len(attempts), "lines": lines}


def _agent_pid(attempt_log: Path) -> int:
    """The PID of the agent that wrote <log-dir>/<run id>_<host>_<pid>/attempt_n/0/stdout.log."""
    return int(attempt_log.parts[-4].rsplit("_", 1)[1])


def agent_of(cluster: FaultCluster, agent_pid: int) -> list[Path]:
    """The attempt logs of one agent."""
    return [log for log in cluster.attempts() if _agent_pid(log) == agent_pid]


CKPT_RE = re.compile(r"^ckpt step=(\d+) at=([\d.]+)", re.MULTILINE)
RESUME_RE = re.compile(r"^worker started .* pid=(\d+) resume=(\d+) read_at=([\d.]+)", re.MULTILINE)


def check_steps_never_go_back(cluster: FaultCluster) -> dict[str, int]:
    """The step counter never goes back past a checkpoint, and the ranks agree on it.

    Every worker resumes after the newest checkpoint on disk before it read the file
    (or later); within one worker steps go up by one; each step's all_reduce sum is
    step * world, so no rank of a group ran at another step. Returns figures.
    """
    saved: list[tuple[float, int]] = []
    starts: list[tuple[float, int, str]] = []
    for log in cluster.attempts():
        text = log.read_text(errors="replace")
        saved += [(float(at), int(s)) for s, at in CKPT_RE.findall(text)]
        starts += [(float(at), int(r), f"{log} pid {pid}") for pid, r, at in RESUME_RE.findall(text)]
        rows = steps_in(text)
        for before, after in itertools.pairwise(rows):
            assert after["step"] == before["step"] + 1, f"{log}: step {before['step']} then {after['step']}"
        for row in rows:
            assert row["sum"] == row["step"] * row["world"], f"{log}: ranks disagree on the step: {row}"
    assert starts, "no worker started"
    done = [(r["t"], r["step"]) for r in cluster.worker_steps()]
    redone = 0
    for read_at, resume, who in starts:
        newest = max((s for at, s in saved if at < read_at), default=-1)
        assert resume >= newest + 1, f"{who} resumed at step {resume}, but step {newest} was saved before"
        reached = max((s for t, s in done if t < read_at), default=-1)
        redone = max(redone, reached - resume + 1)
    return {
        "workers": len(starts),
        "checkpoints": len(saved),
        "max_step": max((s for _, s in done), default=0),
        "steps_redone_max": redone,
    }


def redone(n: int) -> str:
    """'N steps redone ...' for the Lost column: steps done again after a resume."""
    return f"{n} step{'' if n == 1 else 's'} redone since the last checkpoint"


def proc_sample(pid: int) -> dict[str, int]:
    """Open file descriptors and resident memory (KiB) of process `pid`."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)[1])
    return {"fds": fds, "rss_kib": rss}


# --- a node behind a veth pair in its own network namespace ------------------------------


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30, check=check)


class Netns:
    """A network namespace joined to the host by one veth pair with private /30 addresses
    (10.213.x.y: nothing routes anywhere else). `cut()` takes the host end down (packets
    to and from the namespace vanish, as on a pulled cable); `heal()` brings it back."""

    def __init__(self) -> None:
        suffix = uuid.uuid4().hex[:6]
        self.name = f"ertf-{suffix}"
        self.host_if, self.ns_if = f"ertf{suffix}h", f"ertf{suffix}n"
        used = _ip("-o", "-4", "addr", "show").stdout
        for _ in range(100):
            net = random.randrange(0, 1 << 14) << 2  # a free /30 in 10.213.0.0/16
            a, b = (f"10.213.{(net + i) >> 8}.{(net + i) & 255}" for i in (1, 2))
            if f" {a}/" not in used and f" {b}/" not in used:
                break
        self.host_ip, self.ns_ip = a, b
        self.created = False

    @property
    def prefix(self) -> list[str]:
        """Run a command inside the namespace (`ip netns exec` execs: same PID)."""
        return ["ip", "netns", "exec", self.name]

    def create(self) -> None:
        _ip("netns", "add", self.name)
        self.created = True
        _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("link", "set", self.ns_if, "netns", self.name)
        _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        _ip("link", "set", self.host_if, "up")
        _ip("-n", self.name, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        _ip("-n", self.name, "link", "set", self.ns_if, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")

    def cut(self) -> None:
        _ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def remove(self) -> None:
        if self.created:
            _ip("netns", "del", self.name, check=False)  # takes the veth pair with it
        _ip("link", "del", self.host_if, check=False)
        self.created = False


def netns_available() -> str:
    """Why namespaces cannot be made here, or '' when they can."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return ""


@pytest.fixture
def netns() -> Iterator[Netns]:
    """A fresh namespace + veth pair, always removed at the end (request it before the
    cluster fixture, so the processes inside are killed first)."""
    why = netns_available()
    if why:
        pytest.skip(why)
    ns = Netns()
    try:
        ns.create()
        yield ns
    finally:
        ns.remove()
