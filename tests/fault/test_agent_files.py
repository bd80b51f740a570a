"""The files an agent writes are private and never follow a link.

- A link planted where a worker's log or the event log goes: the agent refuses to start
  (a UsageError in one line naming the path), and what the link points at is untouched.
- A run folder that belongs to another user: refused in one line, no worker started.
- The run folder and the folders in it are made 0700 (an existing one of this user's is
  made private), the files 0600.
- The token file for the workers is made fresh (O_EXCL) in the run folder: a file or a
  link a killed agent left there is replaced, never written into.
- A real agent (CLI, hosted token-protected store): its warden's environment holds no
  secret, and once the agent is SIGKILLed the warden removes the token file at once.
- TORCHELASTIC_TIMER_FILE naming an existing file: exit 2, one line, the file intact.

The in-process agents run on the static rendezvous with plain Python workers: seconds.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from pathlib import Path

import pytest

from elasticrun.agent.agent import Agent
from elasticrun.agent.spec import Std, WorkerState
from elasticrun.errors import UsageError
from elasticrun.store.credentials import Role, grant_of_token, worker_credential
from tests.support.agent_helpers import make_spec, static_for, write_script
from tests.support.elastic_cluster import RDZV_CONF, Cluster
from tests.support.helpers import free_port, wait_until
from tests.support.reliability_rows import Reliability

pytestmark = [pytest.mark.timeout(120), pytest.mark.security]

#: another user's uid (nobody's, on Debian)
OTHER_UID = 65534


def _agent(tmp_path: Path, code: str = "print('ran', flush=True)\n", **spec: object) -> Agent:
    script = write_script(tmp_path, "worker.py", code)
    worker_spec = make_spec(script, log_dir=tmp_path / "logs", **spec)
    return Agent(worker_spec, static_for(worker_spec, master_port=free_port()))


def _target(tmp_path: Path) -> Path:
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    return target


def _one_line(error: pytest.ExceptionInfo[UsageError], *needles: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


async def test_a_link_where_a_worker_log_goes_is_refused_and_not_followed(tmp_path: Path) -> None:
    agent = _agent(tmp_path, redirects={0: Std.ALL})
    worker_dir = agent.run_dir / "attempt_0" / "0"
    worker_dir.mkdir(parents=True)
    target = _target(tmp_path)
    (worker_dir / "stdout.log").symlink_to(target)
    with pytest.raises(UsageError) as refused:
        await agent.run()
    _one_line(refused, f"cannot write the log file {worker_dir / 'stdout.log'}", "symbolic link")
    assert target.read_text() == "keep me\n"
    assert os.readlink(worker_dir / "stdout.log") == str(target)


async def test_a_link_where_the_event_log_goes_is_refused_before_any_worker(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    agent = _agent(tmp_path, f"open({str(ran)!r}, 'w').close()\n")
    agent.run_dir.mkdir(parents=True)
    target = _target(tmp_path)
    (agent.run_dir / "events.jsonl").symlink_to(target)
    with pytest.raises(UsageError) as refused:
        await agent.run()
    _one_line(refused, str(agent.run_dir / "events.jsonl"), "symbolic link")
    assert target.read_text() == "keep me\n"
    assert not ran.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root (CI runs as root)")
async def test_a_run_folder_of_another_user_is_refused(tmp_path: Path, reliability: Reliability) -> None:
    ran = tmp_path / "ran"
    agent = _agent(tmp_path, f"open({str(ran)!r}, 'w').close()\n")
    agent.run_dir.mkdir(parents=True, mode=0o777)
    os.chown(agent.run_dir, OTHER_UID, OTHER_UID)
    with pytest.raises(UsageError) as refused:
        await agent.run()
    message = _one_line(refused, str(agent.run_dir), f"belongs to uid {OTHER_UID}", "--log-dir")
    assert not ran.exists()
    assert os.listdir(agent.run_dir) == []
    reliability.record(
        part="security",
        scenario="a run folder planted by another user",
        injected=f"<log-dir>/<run id>_<node id> made beforehand, 0777, owned by uid {OTHER_UID}",
        happened=f"the agent refused to start, in one line: {message}",
        lost="nothing (no worker started, nothing written there)",
    )


async def test_the_run_folder_is_private_and_its_files_too(tmp_path: Path) -> None:
    agent = _agent(tmp_path, redirects={0: Std.ALL})
    agent.run_dir.mkdir(parents=True, mode=0o755)  # an earlier run's, before this change
    os.chmod(agent.run_dir, 0o755)
    result = await agent.run()
    assert result.state is WorkerState.SUCCEEDED, result
    worker_dir = agent.run_dir / "attempt_0" / "0"
    for folder in (agent.run_dir, agent.run_dir / "attempt_0", worker_dir):
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700, folder
    for file in (agent.run_dir / "events.jsonl", worker_dir / "stdout.log", worker_dir / "stderr.log"):
        assert stat.S_IMODE(os.lstat(file).st_mode) == 0o600, file
    assert (worker_dir / "stdout.log").read_text() == "ran\n"


@pytest.mark.parametrize("left", ["file", "link"])
async def test_the_token_file_is_made_fresh_never_written_into(tmp_path: Path, left: str) -> None:
    """A token file a killed agent left (or a link someone put there) is replaced: the
    workers get a new 0600 file with this agent's worker credential (derived from its
    token, never the token itself), what a link points at is untouched."""
    token = "store-token-" + secrets.token_hex(8)
    report = tmp_path / "report"
    code = f"""
import os, stat
path = os.environ["ELASTICRUN_STORE_TOKEN_FILE"]
info = os.lstat(path)
with open({str(report)!r}, "w") as f:
    f.write(f"{{stat.S_ISREG(info.st_mode)}} {{stat.S_IMODE(info.st_mode):o}} {{open(path).read()}}")
"""
    agent = _agent(tmp_path, code, store_token=token)
    agent.run_dir.mkdir(parents=True)
    target = _target(tmp_path)
    stale = agent.run_dir / "store_token"
    if left == "file":
        target.write_text("an old token\n")
        os.link(target, stale)  # the same file under two names: writing into it shows in both
    else:
        stale.symlink_to(target)
    result = await agent.run()
    assert result.state is WorkerState.SUCCEEDED, result
    assert report.read_text() == f"True 600 {worker_credential(token, agent.spec.run_id)}"
    assert target.read_text() == ("an old token\n" if left == "file" else "keep me\n")
    assert not stale.exists() and not stale.is_symlink()  # removed when the agent ended


async def test_a_relative_log_dir_gives_workers_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a relative --log-dir the token file's path was relative too, wrong
    for a worker that changes its directory."""
    report = tmp_path / "report"
    code = f"""
import os
os.chdir("/")
with open({str(report)!r}, "w") as f:
    f.write(os.environ["ELASTICRUN_STORE_TOKEN_FILE"] + " " + open(os.environ["ELASTICRUN_STORE_TOKEN_FILE"]).read())
"""
    monkeypatch.chdir(tmp_path)
    spec = make_spec(write_script(tmp_path, "worker.py", code), log_dir=Path("logs"),
                     store_token="store-token-" + secrets.token_hex(8))
    agent = Agent(spec, static_for(spec, master_port=free_port()))
    result = await agent.run()
    assert result.state is WorkerState.SUCCEEDED, result
    path, credential = report.read_text().split(" ")
    assert Path(path).is_absolute() and Path(path).is_relative_to(tmp_path / "logs"), path
    assert credential.startswith("erw2."), credential  # read from there, after the chdir


def _warden_of(agent_pid: int) -> int:
    """The pid of the agent's warden (its child running elasticrun.agent.warden)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if ppid == agent_pid and b"elasticrun.agent.warden" in cmdline:
            return int(entry)
    raise AssertionError(f"agent {agent_pid} has no warden")


#: prints the token file it was given, then runs until killed
HOLDER = """\
import os, time
print("token file " + os.environ["ELASTICRUN_STORE_TOKEN_FILE"], flush=True)
time.sleep(300)
"""


def test_the_warden_holds_no_secret_and_removes_the_token_file_when_the_agent_is_killed(
    cluster: Cluster, tmp_path: Path, reliability: Reliability
) -> None:
    token = "store-token-" + secrets.token_hex(12)
    password = "etcd-password-" + secrets.token_hex(12)
    cluster._env.update(ELASTICRUN_STORE_TOKEN=token, TRAIN_DB_PASSWORD=password)
    script = write_script(tmp_path, "holder.py", HOLDER)
    run_id = f"files-{secrets.token_hex(4)}"
    agent = cluster.launch(
        "agent",
        "--nnodes=1", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={RDZV_CONF},password_env=TRAIN_DB_PASSWORD", "--local-addr=127.0.0.1",
        f"--log-dir={tmp_path / 'logs'}", str(script),
    )
    token_file = Path(agent.wait_for(r"<stdout>: token file (\S+)$").group(1))
    grant = grant_of_token(token_file.read_text(), token)  # a worker's of this job's run
    assert grant is not None and grant.role is Role.WORKER and grant.job == run_id and grant.run, grant
    warden = _warden_of(agent.pid)
    environ = Path(f"/proc/{warden}/environ").read_bytes()
    assert token.encode() not in environ and password.encode() not in environ
    assert b"ELASTICRUN_STORE_TOKEN=" not in environ and b"TRAIN_DB_PASSWORD=" not in environ
    agent.kill()  # SIGKILL: no cleanup of its own
    wait_until(lambda: not token_file.exists(), 10, "the warden to remove the token file")
    cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="an agent SIGKILLed while its workers hold the store's token file",
        injected="an agent with $ELASTICRUN_STORE_TOKEN and an etcd password_env variable, hosting a "
        "token-protected store; its worker running; then the agent got SIGKILL",
        happened="the agent's warden had neither secret in its environment; when the agent died it removed "
        "the token file (the worker's credential) and killed the worker's tree",
        lost="nothing (no token file or process left)",
    )


def test_a_timer_file_that_exists_is_refused_in_one_line(cluster: Cluster, tmp_path: Path) -> None:
    existing = _target(tmp_path)
    cluster._env.update(TORCHELASTIC_ENABLE_FILE_TIMER="1", TORCHELASTIC_TIMER_FILE=str(existing))
    script = write_script(tmp_path, "worker.py", "print('ran', flush=True)\n")
    agent = cluster.launch(
        "agent", "--standalone", f"--log-dir={tmp_path / 'logs'}", str(script)
    )
    assert agent.wait_exit() == 2, agent.text()
    errors = [line for line in agent.text().splitlines() if line.startswith("elasticrun: error:")]
    assert len(errors) == 1 and "Traceback" not in agent.text(), agent.text()
    assert re.search(rf"TORCHELASTIC_TIMER_FILE={re.escape(str(existing))}: a regular file is there already", errors[0])
    assert "ran" not in agent.text()
    assert existing.read_text() == "keep me\n"
