"""`elasticrun join` executes only what its operator gave it.

Whoever can write the store (any worker of any job holding the token, anyone at all on a
loopback store without one) can put a job spec under an id. These tests do that on a
real `elasticrun store serve` without a token, as such a writer would: a command that
writes `pwned` (`--no-python /bin/sh -c 'id > pwned'`), a working folder, flags of the
"first node" that name files and code, and rendezvous settings that name files. A real
`elasticrun join` then refuses, in one line, and nothing planted runs or is written:
without a command it shows the job's and asks for it; with another it names both; the
stored settings that name files are refused; the stored flags that name files or code
are not repeated, and the working folder is the operator's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticrun.rendezvous.codec import encode
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.records import JobLaunch, JobSpec
from elasticrun.store.client.grpc_store import GrpcStore
from tests.support.elastic_cluster import TAG_VAR, Proc
from tests.support.helpers import ELASTICRUN, free_port

pytestmark = pytest.mark.timeout(90)

PLANTED = ("/bin/sh", "-c", "id > pwned")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A loopback store without a token, as `store serve --host 127.0.0.1` runs it (one
    for the module: each test plants its own job ids)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (TAG_VAR, "ELASTICRUN_STORE_TOKEN")}
    proc = Proc("store", [*ELASTICRUN, "store", "serve", "--host", "127.0.0.1",
                          "--port", str(port)], tmp_path_factory.mktemp("store") / "store.log", env)
    try:
        proc.wait_for(r"serving on")
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()


def plant(endpoint: str, run_id: str, spec: JobSpec, launch: JobLaunch) -> None:
    """Write a job's spec and launch records, as anyone who reaches the store can."""
    async def write() -> None:
        async with GrpcStore(endpoint, timeout=10) as store:
            keys = Keys(run_id)
            await store.put(keys.spec, encode(spec))
            await store.put(keys.launch, encode(launch))

    asyncio.run(write())


def start_join(endpoint: str, run_id: str, *command: str, cwd: Path) -> subprocess.Popen[str]:
    argv = [
        *ELASTICRUN, "join", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}", "--timeout=20", "--rdzv-conf=is_host=false,store_timeout=5", *command,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k != "ELASTICRUN_STORE_TOKEN"}
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def join(endpoint: str, run_id: str, *command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return finished(start_join(endpoint, run_id, *command, cwd=cwd))


def one_error(done: subprocess.CompletedProcess[str]) -> str:
    """The run exited 2 with exactly one line, an error, and no traceback."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert lines[0].startswith("elasticrun: error: ") and "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """The folder the planted records name, and the operator's own."""
    first, here = tmp_path / "first-node", tmp_path / "operator"
    first.mkdir()
    here.mkdir()
    return first, here


def test_a_command_planted_in_the_store_never_runs(store: str, folders: tuple[Path, Path], tmp_path: Path) -> None:
    first, here = folders
    planted_logs = tmp_path / "planted-logs"
    plant(store, "pwn", JobSpec(command=PLANTED, no_python=True), JobLaunch(
        cwd=str(first), created_at=time.time(), created_by="attacker",
        flags=(f"--log-dir={planted_logs}", "--event-log-handler=console"),
    ))

    asked = one_error(join(store, "pwn", cwd=here))
    assert "--no-python /bin/sh -c 'id > pwned'" in asked and "repeat it" in asked, asked

    other = one_error(join(store, "pwn", "--no-python", "/bin/true", cwd=here))
    assert "`--no-python /bin/true`" in other and "`--no-python /bin/sh -c 'id > pwned'`" in other, other

    for folder in (first, here, Path.cwd()):
        assert not (folder / "pwned").exists(), f"the planted command ran in {folder}"
    assert not planted_logs.exists()


def test_stored_settings_that_name_files_are_refused(store: str, folders: tuple[Path, Path]) -> None:
    """A stored --rdzv-conf key beyond the shared timings, a timing that smuggles another
    pair in after a comma, or a NUL character (which no command line holds, and which
    would fail deep in the agent) stops join before any agent starts."""
    _, here = folders
    script = here / "train.py"
    script.write_text("open('ran', 'w').close()\n")
    cases = {
        "conf-file": (JobSpec(command=("train.py",), rdzv_conf={"heartbeat_timeout": "5", "token_file": "/dev/zero"}),
                      "does not take from the store"),
        "conf-comma": (JobSpec(command=("train.py",), rdzv_conf={"heartbeat_timeout": "5,tls_ca=/dev/zero"}),
                       "does not take from the store"),
        "nul": (JobSpec(command=("train.py",), role="a\0b"), "a NUL character in its stored spec"),
    }
    for run_id, (spec, _) in cases.items():
        plant(store, run_id, spec, JobLaunch(cwd=str(here), created_at=time.time(), created_by="attacker"))
    joins = {run_id: start_join(store, run_id, "train.py", cwd=here) for run_id in cases}
    for run_id, proc in joins.items():
        line = one_error(finished(proc))
        assert cases[run_id][1] in line and f"job '{run_id}'" in line, line
    assert not (here / "ran").exists()


def test_the_operators_command_runs_in_the_operators_folder(store: str, folders: tuple[Path, Path]) -> None:
    """Given the job's command, join runs it, in its own working folder (not the one the
    store names)."""
    first, here = folders
    command = ("/bin/sh", "-c", "pwd > where")
    plant(store, "mine", JobSpec(command=command, no_python=True),
          JobLaunch(cwd=str(first), created_at=time.time(), created_by="first"))
    done = join(store, "mine", "--no-python", "--", *command, cwd=here)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (here / "where").read_text().strip() == str(here)
    assert not (first / "where").exists()
