"""The command line: torchrun's flags in both spellings, PET_* defaults, bad input, output.

Parsing is tested in-process through `launch_parser()` and `build_config()`; everything a
user sees (exit codes, the one error line, console prefixes, log files) through real
`python -m elasticrun` processes with plain-python workers from tests/workers/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from elasticrun.agent.spec import Std
from elasticrun.errors import UsageError
from elasticrun.launcher.assemble import assemble, build_config
from elasticrun.launcher.cli import launch_parser
from elasticrun.launcher.config import LaunchConfig
from elasticrun.launcher.discover import HostFacts, discover
from elasticrun.launcher.parsing import parse_launch
from elasticrun.launcher.rdzv_conf import RDZV_CONF, ConfKey, parse_rdzv_conf, torchrun_spelling
from tests.support.helpers import ELASTICRUN, free_port, wait_until

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"
SPEAK = WORKERS / "cli_speak.py"
PROBE = WORKERS / "cli_env_probe.py"
HOLD_PORT = WORKERS / "cli_hold_port.py"

pytestmark = pytest.mark.timeout(60)


# --- helpers (also used by test_torchrun_parity.py) ---------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without PET_*, TORCHELASTIC_*, LOGLEVEL or a store token, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in ("LOGLEVEL", "ELASTICRUN_STORE_TOKEN")
    }
    env.update(extra)
    return env


def start_cli(
    args: Sequence[object], *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
    module: str = "elasticrun",
) -> subprocess.Popen[str]:
    """`python -m <module> args` in its own session (so its pid is its group id)."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env) if env is not None else clean_env(),
        cwd=cwd,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[str]) -> None:
    """Stop a process we started, by its pid: SIGTERM to its group, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def finish(proc: subprocess.Popen[str], timeout: float = 45.0) -> subprocess.CompletedProcess[str]:
    """Wait for a started CLI; on timeout stop it by pid and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout} s; stderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(
    args: Sequence[object], *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
    module: str = "elasticrun", timeout: float = 45.0,
) -> subprocess.CompletedProcess[str]:
    return finish(start_cli(args, env=env, cwd=cwd, module=module), timeout)


def wait_for_file(path: Path, proc: subprocess.Popen[str], timeout: float = 30.0) -> str:
    """The content of `path` once it exists; fails early if `proc` ends first."""

    def appeared() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited {proc.returncode} before {path} appeared:\n"
                        f"{proc.stderr.read() if proc.stderr else ''}")
        return path.exists()

    wait_until(appeared, timeout, f"{path} to appear", interval=0.02)
    return path.read_text()


def read_probes(out: Path) -> dict[int, dict[str, str]]:
    """rank -> environment, as cli_env_probe.py wrote them."""
    return {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text())
        for p in sorted(out.glob("rank*.json"))
    }


def gpu_count() -> int:
    """GPUs NVML sees on this host (0 without the library, the driver or a GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture(autouse=True)
def _no_pet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing reads PET_* from this process: start every test without any."""
    for key in list(os.environ):
        if key.startswith("PET_"):
            monkeypatch.delenv(key)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; whatever is still running at the end is stopped."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        stop(proc)


def parse(*argv: str) -> argparse.Namespace:
    return launch_parser().parse_args(list(argv))


def config(*argv: str) -> LaunchConfig:
    return build_config(parse(*argv), os.environ)


# --- every torchrun flag, in both spellings -----------------------------------------------

#: torchrun dest -> (a value to pass, what our parser must store). None: a boolean flag.
SAMPLES: dict[str, tuple[str | None, object]] = {
    "nnodes": ("2:4", "2:4"),
    "nproc_per_node": ("3", "3"),
    "rdzv_backend": ("c10d", "c10d"),
    "rdzv_endpoint": ("host0:29400", "host0:29400"),
    "rdzv_id": ("job42", "job42"),
    "rdzv_conf": ("join_timeout=5,last_call_timeout=2", ["join_timeout=5,last_call_timeout=2"]),
    "standalone": (None, True),
    "max_restarts": ("4", 4),
    "monitor_interval": ("0.5", 0.5),
    "start_method": ("fork", "fork"),
    "event_log_handler": ("console", "console"),
    "role": ("trainer", "trainer"),
    "module": (None, True),
    "no_python": (None, True),
    "run_path": (None, True),
    "log_dir": ("/tmp/logs", "/tmp/logs"),
    "redirects": ("0:3,1:1", "0:3,1:1"),
    "tee": ("2", "2"),
    "local_ranks_filter": ("0,1", "0,1"),
    "duplicate_stdout_filters": ("loss", "loss"),
    "duplicate_stderr_filters": ("warn", "warn"),
    "node_rank": ("1", 1),
    "master_addr": ("10.0.0.1", "10.0.0.1"),
    "master_port": ("29555", 29555),
    "local_addr": ("10.0.0.2", "10.0.0.2"),
    "logs_specs": ("mylogs", "mylogs"),
    "numa_binding": ("socket", "socket"),
    "signals_to_handle": ("SIGTERM,SIGUSR1", "SIGTERM,SIGUSR1"),
    "shutdown_timeout": ("7", 7.0),
    "virtual_local_rank": (None, True),
}


def torchrun_options() -> list[tuple[str, str]]:
    """(option string, dest) for every flag of torchrun 2.13's own parser."""
    from torch.distributed.run import get_args_parser

    return [
        (option, action.dest)
        for action in get_args_parser()._actions
        for option in action.option_strings
        if action.dest != "help"
    ]


def test_every_torchrun_flag_spelling_is_accepted_and_stored_under_torchrun_dest() -> None:
    options = torchrun_options()
    dests = {dest for _, dest in options}
    assert dests == SAMPLES.keys(), "torchrun's flags changed: update SAMPLES"
    spellings = {option for option, _ in options}
    # both spellings exist wherever torchrun has them (its -m/-r/-t short forms too)
    assert {"--nproc-per-node", "--nproc_per_node", "--rdzv-conf", "--rdzv_conf", "-m",
            "--module", "-r", "-t", "--max_restarts", "--no_python"} <= spellings
    for option, dest in options:
        value, expected = SAMPLES[dest]
        argv = [option] if value is None else [option, value]
        args = parse(*argv, "train.py", "--lr", "0.1")
        assert getattr(args, dest) == expected, option
        assert args.training_script == "train.py", option
        assert args.training_script_args == ["--lr", "0.1"], option


def test_equals_form_and_script_arguments_that_look_like_flags() -> None:
    args = parse("--nproc_per_node=2", "--rdzv-id=x", "train.py", "--nproc-per-node", "9", "-m")
    assert args.nproc_per_node == "2" and args.rdzv_id == "x"
    assert args.training_script_args == ["--nproc-per-node", "9", "-m"]
    assert args.module is False


def test_a_torchrun_command_line_with_underscores_builds_the_whole_config(tmp_path: Path) -> None:
    cfg = config(
        "--nnodes=1:3", "--nproc_per_node=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:29411", "--rdzv_id=job9", "--max_restarts=3",
        "--rdzv_conf=join_timeout=9,heartbeat_timeout=4", "--role=trainer",
        f"--log_dir={tmp_path}", "--redirects=0:3,1:1", "--tee=2", "--local_ranks_filter=0",
        "--shutdown_timeout=4", "--signals_to_handle=SIGTERM,SIGUSR1",
        str(SPEAK), "--epochs", "3",
    )
    assert cfg.rdzv.backend == "c10d"
    assert cfg.rdzv.endpoint == "127.0.0.1:29411"
    assert cfg.rdzv.local_addr == "127.0.0.1"
    s = cfg.rdzv.settings
    assert (s.run_id, s.min_nodes, s.max_nodes) == ("job9", 1, 3)
    assert (s.join_timeout, s.heartbeat_ttl) == (9.0, 4.0)
    w = cfg.worker
    assert w.entrypoint == (sys.executable, "-u", str(SPEAK), "--epochs", "3")
    assert (w.nproc_per_node, w.max_restarts, w.role, w.options.stop_grace) == (2, 3, "trainer", 4.0)
    assert w.redirects == {0: Std.ALL, 1: Std.OUT}
    assert w.tee == {0: Std.ERR, 1: Std.ERR}
    assert w.options.local_ranks_filter == frozenset({0})
    assert w.options.log_dir == tmp_path
    assert [s.name for s in w.options.signals_to_handle] == ["SIGTERM", "SIGUSR1"]
    assert cfg.job_spec.command == (str(SPEAK), "--epochs", "3")
    assert cfg.job_spec.nnodes == "1:3"


def test_static_is_the_default_backend_with_torchruns_master_defaults() -> None:
    cfg = config("--nnodes", "2", "--node_rank", "1", str(SPEAK))
    assert cfg.rdzv.backend == "static"
    rdzv = cfg.rdzv
    assert (rdzv.node_rank, rdzv.master_addr, rdzv.master_port) == (1, "127.0.0.1", 29500)
    assert cfg.rdzv.settings.run_id == "none"
    # as torchrun: a static --rdzv-endpoint names the master, over --master-addr/port
    cfg = config("--nnodes", "2", "--master-port", "1234", "--rdzv_endpoint", "10.0.0.5:29777",
                 str(SPEAK))
    assert (cfg.rdzv.master_addr, cfg.rdzv.master_port) == ("10.0.0.5", 29777)


# --- PET_* environment defaults -----------------------------------------------------------


def test_pet_environment_gives_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=11,last_call_timeout=2")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_ROLE", "trainer")
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "6")
    cfg = config(str(SPEAK))
    assert cfg.rdzv.backend == "standalone"
    assert cfg.worker.nproc_per_node == 3
    assert cfg.rdzv.settings.join_timeout == 11.0
    assert cfg.rdzv.settings.last_call == 2.0
    assert cfg.worker.max_restarts == 2
    assert cfg.worker.role == "trainer"
    assert cfg.worker.options.stop_grace == 6.0


def test_flags_override_pet_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=11,last_call_timeout=2")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "127.0.0.1:29412")
    cfg = config("--nproc-per-node", "2", "--max_restarts", "0", "--rdzv-conf", "join_timeout=4",
                 "--rdzv_backend", "static", str(SPEAK))
    assert cfg.worker.nproc_per_node == 2
    assert cfg.worker.max_restarts == 0
    assert cfg.rdzv.backend == "static"
    # --rdzv-conf merges with PET_RDZV_CONF: the flag wins where both name a key
    assert cfg.rdzv.conf == {"join_timeout": "4", "last_call_timeout": "2"}
    assert cfg.rdzv.settings.join_timeout == 4.0


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), ("", False)])
def test_pet_boolean_flags(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    for name in ("PET_STANDALONE", "PET_MODULE", "PET_VIRTUAL_LOCAL_RANK"):
        monkeypatch.setenv(name, value)
    args = parse("pkg.train")
    assert (args.standalone, args.module, args.virtual_local_rank) == (expected,) * 3


def test_pet_environment_through_the_real_command(tmp_path: Path) -> None:
    env = clean_env(PET_NPROC_PER_NODE="3", PET_STANDALONE="1", PET_ROLE="trainer")
    result = run_cli([PROBE, tmp_path], env=env)
    assert result.returncode == 0, result.stderr
    probes = read_probes(tmp_path)
    assert sorted(probes) == [0, 1, 2]
    assert {p["WORLD_SIZE"] for p in probes.values()} == {"3"}
    assert {p["ROLE_NAME"] for p in probes.values()} == {"trainer"}


def test_repeated_rdzv_conf_flags_merge_and_a_key_is_given_once() -> None:
    cfg = config("--standalone", "--rdzv-conf", "join_timeout=5,heartbeat_timeout=3",
                 "--rdzv-conf", "closed_ttl=9", str(SPEAK))
    assert cfg.rdzv.conf == {"join_timeout": "5", "heartbeat_timeout": "3", "closed_ttl": "9"}
    s = cfg.rdzv.settings
    assert (s.join_timeout, s.heartbeat_ttl, s.closed_ttl) == (5.0, 3.0, 9.0)
    # twice by one name, in one flag or two: which value was meant is the user's to say
    for twice in (["join_timeout=5", "join_timeout=7"], ["join_timeout=5,join_timeout=5"], ["timeout=5,timeout=5"]):
        with pytest.raises(UsageError, match="--rdzv-conf names join_timeout twice"):
            config("--standalone", *(f"--rdzv-conf={v}" for v in twice), str(SPEAK))


def test_a_rdzv_conf_key_and_its_torchrun_name_take_torchruns_choice(caplog: pytest.LogCaptureFixture) -> None:
    """PyTorch's own launcher tests write a key and its torchrun alias with one
    value; with two, torchrun's backend reads one of them, and so does elasticrun."""
    issue = config("--standalone", "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", str(SPEAK))
    assert issue.rdzv.conf == {"join_timeout": "5", "last_call_timeout": "1"} and not caplog.records
    cases = {  # (backend, --rdzv-conf) -> the value taken
        ("c10d", "join_timeout=5,timeout=7"): ("join_timeout", "5"),  # its dynamic rendezvous reads join_timeout
        ("c10d", "timeout=7,join_timeout=5"): ("join_timeout", "5"),
        ("etcd", "join_timeout=5,timeout=7"): ("join_timeout", "7"),  # its etcd (v1) rendezvous reads timeout
        ("c10d", "store_timeout=3,read_timeout=4"): ("store_timeout", "4"),
        ("etcd-v2", "client_cert=a.pem,ssl_cert=b.pem"): ("client_cert", "b.pem"),
        ("etcd", "client_cert=a.pem,cert=b.pem"): ("client_cert", "b.pem"),
        ("etcd", "ca_cert=a.pem,cacert=b.pem"): ("ca_cert", "b.pem"),
    }
    for (backend, conf), (key, value) in cases.items():
        caplog.clear()
        assert parse_rdzv_conf([conf], backend)[key] == value, (backend, conf)
        (warning,) = [r.getMessage() for r in caplog.records]
        assert f"taking {torchrun_spelling(key, backend)}={value}, as torchrun would" in warning, warning


def test_a_rdzv_conf_key_of_pet_rdzv_conf_is_overridden_once_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=11,join_timeout=12")
    with pytest.raises(UsageError, match="names join_timeout twice"):
        config("--standalone", str(SPEAK))
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=11")
    assert config("--standalone", "--rdzv-conf=join_timeout=4", str(SPEAK)).rdzv.conf == {"join_timeout": "4"}


def test_the_lease_ttl_grows_with_the_jobs_max_past_2000_nodes() -> None:
    """3 renewals per TTL per node: MAX / 400 s keeps a large job's near 1,200 a second."""
    def ttl(*flags: str) -> float:
        cfg = config("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:1", "--rdzv-id=j", *flags, str(SPEAK))
        return cfg.rdzv.settings.heartbeat_ttl

    assert (ttl("--nnodes=1:4"), ttl("--nnodes=2000"), ttl("--nnodes=1:10000")) == (5.0, 5.0, 25.0)
    assert ttl("--nnodes=1:10000", "--rdzv-conf", "heartbeat_timeout=8") == 8.0  # given: as given


def test_the_straggler_check_is_on_by_default_its_keys_are_shared_and_off_times_nothing() -> None:
    base = ("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:1", "--rdzv-id=j", "--nnodes=2")
    default = config(*base, str(SPEAK))
    assert default.rdzv.settings.straggler == "report" and default.worker.step_timing
    s = default.rdzv.settings
    assert (s.straggler_relative, s.straggler_after, s.straggler_interval) == (1.25, 3, 5.0)
    tuned = config(*base, "--straggler=replace", "--rdzv-conf",
                   "straggler_relative=1.5,straggler_after=2,straggler_interval=1", str(SPEAK))
    t = tuned.rdzv.settings
    assert (t.straggler, t.straggler_relative, t.straggler_after, t.straggler_interval) == ("replace", 1.5, 2, 1.0)
    assert tuned.job_spec.straggler == "replace"  # every node of the job must agree
    assert set(tuned.job_spec.rdzv_conf) == {"straggler_relative", "straggler_after", "straggler_interval"}
    assert not config(*base, "--straggler=off", str(SPEAK)).worker.step_timing
    for bad, message in (("straggler_relative=1", "must be a number above 1"),
                         ("straggler_relative=nan", "must be a number above 1"),
                         ("straggler_after=0", "must be a whole number >= 1"),
                         ("straggler_interval=-1", "must be a positive number of seconds")):
        with pytest.raises(UsageError, match=message):
            config(*base, "--rdzv-conf", bad, str(SPEAK))


@pytest.mark.parametrize("key", [k for k in RDZV_CONF if k.field is not None], ids=lambda k: k.name)
def test_each_rdzv_conf_key_sets_its_settings_field_and_defaults_to_it(key: ConfKey) -> None:
    """The key table is what parsing reads: a key given sets the field it names; not
    given, the field has the default the table shows (heartbeat_timeout's grows with MAX)."""
    assert key.field is not None
    given = config("--standalone", "--rdzv-conf", f"{key.name}=2", str(SPEAK)).rdzv.settings
    assert getattr(given, key.field) == 2
    plain = config("--rdzv-backend=c10d", "--rdzv-endpoint=localhost:1", "--nnodes=1:4000", str(SPEAK)).rdzv.settings
    if key.name == "heartbeat_timeout":
        assert plain.heartbeat_ttl == 4000 / 400
    elif key.plain_default is not None:
        assert f"{getattr(plain, key.field):g}" == key.plain_default
    else:  # heartbeat_interval: 0, a third of the TTL
        assert (getattr(plain, key.field), key.shown) == (0.0, "a third of heartbeat_timeout")


def test_torchruns_own_rdzv_conf_keys_are_accepted(caplog: pytest.LogCaptureFixture) -> None:
    """torchrun command lines run unchanged: keys we have no counterpart for only warn."""
    cfg = config("--standalone", "--rdzv-conf", "close_timeout=10,store_type=tcp,protocol=http",
                 "--rdzv_conf", "use_libuv=1,join_timeout=8", str(SPEAK))
    assert cfg.rdzv.conf == {"join_timeout": "8"}
    for key in ("close_timeout", "store_type", "use_libuv", "protocol"):
        assert f"--rdzv-conf {key} is accepted for torchrun compatibility" in caplog.text


def test_torchruns_rdzv_conf_names_are_our_keys() -> None:
    """timeout, read_timeout and torchrun's keep-alive mean what they mean there."""
    cfg = config("--standalone", "--rdzv-conf", "timeout=9,read_timeout=4,keep_alive_interval=2", str(SPEAK))
    assert cfg.rdzv.conf == {
        "join_timeout": "9", "store_timeout": "4", "heartbeat_interval": "2",
        # torchrun drops a node after keep_alive_max_attempt (3) missed keep-alives
        "heartbeat_timeout": "6",
    }
    s = cfg.rdzv.settings
    assert (s.join_timeout, s.keep_alive_interval, s.heartbeat_ttl) == (9.0, 2.0, 6.0)
    # torchrun's defaults, 5 s x 3, when only the attempts are given
    cfg = config("--standalone", "--rdzv-conf", "keep_alive_max_attempt=4", str(SPEAK))
    assert (cfg.rdzv.settings.keep_alive_interval, cfg.rdzv.settings.heartbeat_ttl) == (5.0, 20.0)
    # our own keys alone keep our defaults
    assert config("--standalone", "--rdzv-conf", "heartbeat_interval=1", str(SPEAK)).rdzv.settings.heartbeat_ttl == 5.0
    with pytest.raises(UsageError, match="keep_alive_max_attempt must be a whole number"):
        config("--standalone", "--rdzv-conf", "keep_alive_max_attempt=0", str(SPEAK))


@pytest.mark.parametrize("quote", ["'", '"'])
def test_rdzv_conf_in_one_pair_of_quotes(quote: str) -> None:
    """As PyTorch's launcher tests and manifests without a shell write it."""
    value = f"{quote}join_timeout=5,last_call_timeout=1,read_timeout=6{quote}"
    assert config("--standalone", f"--rdzv-conf={value}", str(SPEAK)).rdzv.conf == {
        "join_timeout": "5", "last_call_timeout": "1", "store_timeout": "6",
    }
    # only a matching pair around the whole value
    with pytest.raises(UsageError, match="unknown key"):
        config("--standalone", f"--rdzv-conf={quote}join_timeout=5", str(SPEAK))


    # torchrun's etcd backends name their TLS files differently: same meaning here
    request = parse_launch(parse("--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf",
                                 "protocol=https,cacert=ca.pem,ssl_cert=c.pem,ssl_cert_key=k.pem", str(SPEAK)), {})
    assert request.rdzv.backend == "etcd"
    assert request.rdzv.conf == {"ca_cert": "ca.pem", "client_cert": "c.pem", "client_key": "k.pem"}


# --- entrypoints --------------------------------------------------------------------------


def test_module_mode_runs_python_dash_m() -> None:
    for flag in ("-m", "--module"):
        cfg = config("--standalone", flag, "mypkg.train", "--lr", "1")
        assert cfg.worker.entrypoint == (sys.executable, "-u", "-m", "mypkg.train", "--lr", "1")
        assert cfg.job_spec.command == ("-m", "mypkg.train", "--lr", "1")
        assert cfg.job_spec.no_python is False


def test_no_python_runs_the_command_itself() -> None:
    sh = shutil.which("sh")
    assert sh is not None
    cfg = config("--standalone", "--no-python", "sh", "-c", "exit 0")
    assert cfg.worker.entrypoint == ("sh", "-c", "exit 0")
    assert cfg.job_spec.command == ("sh", "-c", "exit 0")
    assert cfg.job_spec.no_python is True
    # the interpreter as a --no-python command keeps its script in the job spec
    cfg = config("--standalone", "--no_python", sys.executable, str(SPEAK))
    assert cfg.worker.entrypoint == (sys.executable, str(SPEAK))
    assert cfg.job_spec.command == (sys.executable, str(SPEAK))


def test_module_and_no_python_run_for_real(tmp_path: Path) -> None:
    mod_out, cmd_out = tmp_path / "module", tmp_path / "nopython"
    mod_out.mkdir()
    cmd_out.mkdir()
    module = run_cli(["--standalone", "--nproc-per-node", "2", "-m", "tests.workers.cli_env_probe",
                      mod_out], cwd=REPO)
    assert module.returncode == 0, module.stderr
    command = run_cli(["--standalone", "--nproc_per_node", "2", "--no-python", sys.executable,
                       PROBE, cmd_out])
    assert command.returncode == 0, command.stderr
    assert sorted(read_probes(mod_out)) == sorted(read_probes(cmd_out)) == [0, 1]


def test_parsing_asks_nothing_of_the_host_and_discovery_comes_apart() -> None:
    # a script that is not here and GPUs this machine may not have: parsing takes them
    argv = ("--nproc-per-node=gpu", "--rdzv-backend=c10d", "--rdzv-endpoint=store.example:29400",
            "--rdzv-id=job", "--redirects=3", "no_such_train.py")
    request = parse_launch(parse(*argv), {})
    assert request.rdzv.local_addr == "" and request.job_spec.command == ("no_such_train.py",)
    with pytest.raises(UsageError, match="training script not found"):
        discover(request, {})
    host = HostFacts(node_id="n1", run_id="job", local_addr="10.0.0.9", nproc=2, gpu_devices=(0, 1),
                     gpu_names=("H100", "H100"))
    cfg = assemble(request, host)
    assert (cfg.rdzv.local_addr, cfg.worker.node_id, cfg.worker.gpu_devices) == ("10.0.0.9", "n1", (0, 1))
    assert cfg.worker.redirects == {0: Std.ALL, 1: Std.ALL}


# --- --nproc-per-node cpu / auto / gpu ----------------------------------------------------


def test_nproc_per_node_cpu_is_the_cpu_count() -> None:
    cfg = config("--standalone", "--nproc-per-node=cpu", str(SPEAK))
    assert cfg.worker.nproc_per_node == os.cpu_count()


def test_nproc_per_node_auto_is_the_gpu_count_else_the_cpu_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = config("--standalone", "--nproc_per_node", "auto", str(SPEAK))
    assert cfg.worker.nproc_per_node == (gpu_count() or os.cpu_count())
    assert cfg.nproc_request == "auto"


def test_nproc_per_node_gpu_is_the_gpu_count_or_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = gpu_count()
    if gpus:
        cfg = config("--standalone", "--nproc-per-node", "gpu", str(SPEAK))
        assert cfg.worker.nproc_per_node == gpus
        return
    with pytest.raises(UsageError, match="--nproc-per-node=gpu needs a GPU"):
        config("--standalone", "--nproc-per-node", "gpu", str(SPEAK))
    result = run_cli(["--standalone", "--nproc-per-node", "gpu", SPEAK])
    assert_one_line_usage_error(result, "--nproc-per-node=gpu needs a GPU", "auto, cpu")


def test_gpus_hidden_by_cuda_visible_devices_make_gpu_a_usage_error() -> None:
    """With every GPU hidden (as CUDA reads "-1"), `gpu` fails even on a GPU host."""
    result = run_cli(["--standalone", "--nproc-per-node", "gpu", SPEAK],
                     env=clean_env(CUDA_VISIBLE_DEVICES="-1"))
    assert_one_line_usage_error(result, "--nproc-per-node=gpu needs a GPU")


# --- --standalone: a free port per job ----------------------------------------------------


def test_two_standalone_jobs_at_once_get_different_ports_and_both_succeed(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    go = tmp_path / "go"
    for name in ("a", "b"):
        procs.append(start_cli(["--standalone", "--nproc-per-node", "1", HOLD_PORT,
                                tmp_path / f"ready_{name}", go]))
    # each job's rank 0 listens on its MASTER_PORT while the other job is running
    ports = {wait_for_file(tmp_path / f"ready_{n}", p) for n, p in zip("ab", procs, strict=True)}
    assert len(ports) == 2, ports
    go.touch()
    for proc in procs:
        result = finish(proc)
        assert result.returncode == 0, result.stderr


# --- bad input: exit 2 and one line -------------------------------------------------------


def assert_one_line_usage_error(result: subprocess.CompletedProcess[str], *needles: str,
                                code: int = 2) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("elasticrun: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0]
    assert result.returncode == code, result.stderr


S = str(SPEAK)
BAD_INPUT = {
    "nnodes zero": (["--nnodes", "0", S], ["--nnodes", "'0'"]),
    "nnodes min above max": (["--nnodes", "3:2", S], ["--nnodes", "'3:2'"]),
    "nnodes not numbers": (["--nnodes", "a:b", S], ["--nnodes", "'a:b'"]),
    "nnodes three parts": (["--nnodes", "1:2:3", S], ["--nnodes", "'1:2:3'"]),
    "unknown backend": (["--rdzv-backend", "zookeeper", S], ["--rdzv-backend", "zookeeper"]),
    "endpoint port not a number": (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:abc", S],
                                   ["--rdzv-endpoint", "host:abc"]),
    "endpoint port zero": (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:0", S],
                           ["--rdzv-endpoint", "host:0"]),
    "endpoint without host": (["--rdzv-backend", "c10d", "--rdzv-endpoint", ":29400", S],
                              ["--rdzv-endpoint", ":29400"]),
    "etcd endpoint list with a bad port": (
        ["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379,h2:x", S], ["--rdzv-endpoint"]),
    "endpoint with two ports": (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:1:2", S],
                                ["--rdzv-endpoint", "host:1:2"]),
    "c10d endpoint list with a bad port": (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h1:29400,h2:x", S], ["--rdzv-endpoint"]),
    "static endpoint without port": (["--rdzv-endpoint", "localhost", S],
                                     ["--rdzv-endpoint", "'localhost'", "host:port"]),
    "c10d without endpoint": (["--rdzv-backend", "c10d", S], ["--rdzv-endpoint"]),
    "etcd without endpoint": (["--rdzv-backend=etcd", S], ["--rdzv-endpoint"]),
    "missing script": (["--standalone", "no_such_train.py"], ["no_such_train.py", "not found"]),
    "no script at all": (["--standalone"], ["no training script"]),
    "no-python missing command": (["--no-python", "no-such-command-xyz"],
                                  ["no-such-command-xyz", "not found"]),
    "module with no-python": (["-m", "--no-python", "pkg.train"], ["--module", "--no-python"]),
    "unknown rdzv-conf key": (["--standalone", "--rdzv-conf", "join_timeot=5", S],
                              ["join_timeot", "join_timeout"]),
    "rdzv-conf without value": (["--standalone", "--rdzv-conf", "join_timeout", S],
                                ["--rdzv-conf", "key=value"]),
    "rdzv-conf without key": (["--standalone", "--rdzv-conf", "=5", S], ["--rdzv-conf"]),
    "rdzv-conf negative timeout": (["--standalone", "--rdzv-conf", "join_timeout=-1", S],
                                   ["join_timeout", "'-1'"]),
    "redirects out of range": (["--redirects", "4", S], ["--redirects", "'4'"]),
    "redirects not a number": (["-r", "all", S], ["--redirects", "'all'"]),
    "redirects per rank bad": (["--redirects", "0:9", S], ["--redirects", "'0:9'"]),
    "tee out of range": (["--tee", "7", S], ["--tee", "'7'"]),
    "tee bad rank": (["-t", "a:1", S], ["--tee", "'a:1'"]),
    "local-ranks-filter not numbers": (["--local-ranks-filter", "a,b", S],
                                       ["--local-ranks-filter", "'a,b'"]),
    "local-ranks-filter empty item": (["--local_ranks_filter", "0,,1", S],
                                      ["--local-ranks-filter"]),
    "local-ranks-filter negative": (["--local-ranks-filter=-1", S], ["--local-ranks-filter"]),
    "negative max-restarts": (["--max-restarts", "-1", S], ["--max-restarts", "-1"]),
    "max-restarts not a number": (["--max-restarts", "x", S], ["--max-restarts", "'x'"]),
    "node-rank out of range": (["--nnodes", "2", "--node-rank", "2", S], ["--node-rank", "0..1"]),
    "static elastic nnodes": (["--nnodes", "1:2", S], ["static", "--nnodes"]),
    "standalone with several nodes": (["--standalone", "--nnodes=2:4", S], ["--standalone"]),
    "nproc-per-node zero": (["--nproc-per-node", "0", S], ["--nproc-per-node", "'0'"]),
    "nproc-per-node word": (["--nproc-per-node", "many", S], ["--nproc-per-node", "'many'"]),
    "unknown start method": (["--start-method", "thread", S], ["--start-method", "thread"]),
    "unknown signal": (["--signals-to-handle", "SIGNOPE", S], ["--signals-to-handle", "SIGNOPE"]),
    "negative shutdown timeout": (["--shutdown-timeout", "-1", S], ["--shutdown-timeout", "-1"]),
    "state-memory not a size": (["--state-memory", "8GB", S], ["--state-memory must be a size", "'8GB'"]),
    "bad master port": (["--master-port", "70000", S], ["--master-port"]),
    "rdzv-id with slash": (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
                            "--rdzv-id", "a/b", S], ["--rdzv-id", "'a/b'"]),
    "unknown flag": (["--nproc-per-nodes", "2", S], ["--nproc-per-nodes"]),
    "store serve tls cert without key": (["store", "serve", "--tls-cert", "cert.pem"],
                                         ["--tls-cert", "--tls-key"]),
    "store serve tls key without cert": (["store", "serve", "--tls-key", "key.pem"],
                                         ["--tls-cert", "--tls-key"]),
    "store serve bad port": (["store", "serve", "--port", "70000"], ["--port", "70000"]),
    "store without a command": (["store"], ["elasticrun store serve"]),
    # require_token with no token anywhere: refused before anything starts, naming the flags
    "agent requiring a token it lacks": (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "require_token=true", S],
        ["--rdzv-conf require_token, --rdzv-conf token_file: no store token is set", "$ELASTICRUN_STORE_TOKEN"]),
    "job control requiring a token it lacks": (
        ["status", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j", "--rdzv-conf", "require_token=1"],
        ["--rdzv-conf require_token, --rdzv-conf token_file: no store token is set"]),
    "store serve requiring a token it lacks": (
        ["store", "serve", "--host", "127.0.0.1", "--port", "0", "--require-token"],
        ["--require-token, --token-file: no store token is set"]),
    # Past a sane bound, refused at the edge instead of failing deep (or after the job)
    "nproc-per-node past the bound": (["--nproc-per-node", "999999999999", S],
                                      ["--nproc-per-node", "at most 1024", "'999999999999'"]),
    "nnodes past the bound": (["--nnodes", "1:100000000000000000000", S], ["--nnodes", "at most 100000"]),
    "nnodes with a sign": (["--nnodes", "+1:2", S], ["--nnodes must be N or MIN:MAX"]),
    "heartbeat_timeout past etcd's lease limit": (
        ["--standalone", "--rdzv-conf", "heartbeat_timeout=1e308", S],
        ["--rdzv-conf heartbeat_timeout must be at most 9000000000 seconds", "'1e308'"]),
    "closed_ttl past etcd's lease limit": (
        ["--standalone", "--rdzv-conf", "closed_ttl=1e300", S], ["--rdzv-conf closed_ttl", "at most"]),
    "shutdown-timeout past the bound": (["--shutdown-timeout", "1e300", S], ["--shutdown-timeout", "at most"]),
    "progress-timeout past the bound": (["--progress-timeout", "1e12", S], ["--progress-timeout", "at most"]),
    "a rdzv-conf key twice": (["--standalone", "--rdzv-conf", "closed_ttl=5", "--rdzv-conf", "closed_ttl=6", S],
                              ["--rdzv-conf names closed_ttl twice", "give each key once"]),
    "token file that never ends": (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "token_file=/dev/zero", S],
        ["--rdzv-conf token_file", "/dev/zero is larger than 1 MiB"]),
    "job control with a token file that never ends": (
        ["status", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j", "--rdzv-conf", "token_file=/dev/zero"],
        ["--rdzv-conf token_file", "larger than 1 MiB"]),
    "store serve with a token file that never ends": (
        ["store", "serve", "--host", "127.0.0.1", "--port", "0", "--token-file", "/dev/zero"],
        ["--token-file", "larger than 1 MiB"]),
    "join timeout past the bound": (
        ["join", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j", "--timeout", "1e300"], ["--timeout", "at most"]),
    "require_token not a boolean": (
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "require_token=maybe", S],
        ["--rdzv-conf require_token: must be true or false", "'maybe'"]),
}


@pytest.fixture(scope="module")
def bad_input_results() -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every BAD_INPUT case run once, several at a time (each is a short process)."""
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    cases = list(BAD_INPUT.items())
    running: list[subprocess.Popen[str]] = []
    try:
        for start in range(0, len(cases), 6):
            batch = cases[start:start + 6]
            running = [start_cli(argv) for _, (argv, _) in batch]
            for (name, _), proc in zip(batch, running, strict=True):
                results[name] = finish(proc, timeout=30)
        yield results
    finally:
        for proc in running:
            stop(proc)


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(
    case: str, bad_input_results: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    _, needles = BAD_INPUT[case]
    assert_one_line_usage_error(bad_input_results[case], *needles)


def test_store_serve_on_a_port_in_use_exits_2_naming_it(procs: list[subprocess.Popen[str]]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = start_cli(["store", "serve", "--host", "127.0.0.1", "--port", port])
        procs.append(proc)
        result = finish(proc, timeout=20)
    assert_one_line_usage_error(result, f"127.0.0.1:{port}", "in use")


def test_unreachable_store_exits_nonzero_with_one_line_naming_it() -> None:
    port = free_port()  # nobody listens there
    result = run_cli(
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-conf", "is_host=false,store_timeout=2", SPEAK],
        env=clean_env(LOGLEVEL="WARNING"),
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("elasticrun: error:")]
    assert len(errors) == 1, result.stderr
    assert f"127.0.0.1:{port}" in errors[0] and "unreachable" in errors[0]
    # with the agent's INFO log off, that line is all there is
    assert result.stderr.splitlines() == errors


# --- worker output through the CLI --------------------------------------------------------


def test_console_lines_carry_rank_and_stream() -> None:
    result = run_cli(["--standalone", "--nproc-per-node", "2", SPEAK])
    assert result.returncode == 0, result.stderr
    out, err = result.stdout.splitlines(), result.stderr.splitlines()
    for rank in (0, 1):
        assert f"[{rank}]<stdout>: out rank={rank} attempt=0" in out
        assert f"[{rank}]<stderr>: err rank={rank} attempt=0" in err
    assert not any("<stderr>" in line for line in out)
    assert not any("<stdout>" in line for line in err)


def test_tee_with_log_dir_writes_one_folder_per_attempt(tmp_path: Path) -> None:
    logs, marks = tmp_path / "logs", tmp_path / "marks"
    marks.mkdir()
    result = run_cli(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      "--tee", "3", "--log-dir", logs, SPEAK, "fail-first", marks])
    assert result.returncode == 0, result.stderr
    # tee: the console still has every line
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"[{rank}]<stdout>: out rank={rank} attempt={attempt}" in result.stdout
    (run_dir,) = logs.iterdir()
    assert sorted(p.name for p in run_dir.glob("attempt_*")) == ["attempt_0", "attempt_1"]
    for attempt in (0, 1):
        for rank in (0, 1):
            worker_dir = run_dir / f"attempt_{attempt}" / str(rank)
            assert (worker_dir / "stdout.log").read_text() == f"out rank={rank} attempt={attempt}\n"
            assert (worker_dir / "stderr.log").read_text() == f"err rank={rank} attempt={attempt}\n"


def test_local_ranks_filter_hides_other_ranks_on_the_console(tmp_path: Path) -> None:
    result = run_cli(["--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "0",
                      "--tee", "3", "--log-dir", tmp_path, SPEAK])
    assert result.returncode == 0, result.stderr
    assert "[0]<stdout>: out rank=0 attempt=0" in result.stdout.splitlines()
    assert "[0]<stderr>: err rank=0 attempt=0" in result.stderr.splitlines()
    assert "rank=1" not in result.stdout + result.stderr
    # hidden from the console, not from its files
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "attempt_0" / "1" / "stdout.log").read_text() == "out rank=1 attempt=0\n"


def test_redirects_keep_the_console_clean(tmp_path: Path) -> None:
    result = run_cli(["--standalone", "--nproc-per-node", "2", "--redirects", "3",
                      "--log-dir", tmp_path, SPEAK])
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "rank=" not in result.stderr
    (run_dir,) = tmp_path.iterdir()
    for rank in (0, 1):
        worker_dir = run_dir / "attempt_0" / str(rank)
        assert (worker_dir / "stdout.log").read_text() == f"out rank={rank} attempt=0\n"
        assert (worker_dir / "stderr.log").read_text() == f"err rank={rank} attempt=0\n"


# --- exit codes for schedulers (docs/cli.md#exit-codes) ----------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_an_agent_stopped_by_a_signal_exits_128_plus_its_number(tmp_path: Path, sig: signal.Signals) -> None:
    """Retryable under Kubernetes' ExitCode policy (128-255), unlike a training failure."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = start_cli(["--standalone", HOLD_PORT, ready, go])
    try:
        wait_for_file(ready, proc)
        os.kill(proc.pid, sig)  # the agent alone: it forwards the signal to its worker
        result = finish(proc)
    finally:
        stop(proc)
    assert result.returncode == 128 + sig, result.stderr
    assert f"received {sig.name}" in result.stderr


@pytest.mark.parametrize(("nnodes", "conf", "told"), [
    ("1", "is_host=false,store_timeout=1", "is unreachable"),
    ("2", "join_timeout=1", "join"),
])
def test_an_infrastructure_failure_has_its_own_exit_code(nnodes: str, conf: str, told: str) -> None:
    """The store unreachable, or no round within join_timeout: neither 1 (training) nor 2 (usage)."""
    from elasticrun.errors import EXIT_INFRASTRUCTURE

    result = run_cli(["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                      "--rdzv-id", "infra", "--rdzv-conf", conf, SPEAK])
    assert result.returncode == EXIT_INFRASTRUCTURE, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("elasticrun: error: ")]
    assert len(errors) == 1 and told in errors[0], result.stderr


# --- torchrun's flags and variables that change how workers start ------------------------


def test_torchruns_defaults_of_those_flags_are_taken() -> None:
    """What torchrun passes by default, or a job manifest spells out, still runs."""
    cfg = config("--standalone", "--event-log-handler", "null", "--duplicate-stdout-filters", "", str(SPEAK))
    assert cfg.worker.nproc_per_node == 1


def test_python_exec_names_the_interpreter(tmp_path: Path) -> None:
    cfg = build_config(parse("--standalone", str(SPEAK)), {**os.environ, "PYTHON_EXEC": sys.executable})
    assert cfg.worker.entrypoint[:2] == (sys.executable, "-u")
    with pytest.raises(UsageError, match="PYTHON_EXEC: interpreter not found: /no/such/python"):
        build_config(parse("--standalone", str(SPEAK)), {**os.environ, "PYTHON_EXEC": "/no/such/python"})
    # --run-path runs in this interpreter, as torchrun's (a function in multiprocessing)
    cfg = build_config(parse("--standalone", "--run-path", str(SPEAK)), {**os.environ, "PYTHON_EXEC": "/no/such"})
    assert cfg.worker.entrypoint[:4] == (sys.executable, "-u", "-m", "elasticrun.worker.run_path")
    with pytest.raises(UsageError, match="--run-path: training script not found"):
        config("--standalone", "--run-path", str(tmp_path / "missing.py"))


# --- console prefixes: torchrun's template; a progress bar on a terminal ------------------


def test_a_progress_bar_redrawn_with_cr_is_live_on_a_terminal(tmp_path: Path) -> None:
    """Each frame shows when drawn, over the last, under the rank's prefix; not the whole
    line only once it ends."""
    import pty

    leader, follower = pty.openpty()
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [*ELASTICRUN, "--standalone", str(WORKERS / "cli_progress_bar.py"), str(go)],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=clean_env(), start_new_session=True,
    )
    os.close(follower)
    seen = b""
    try:
        def shown(text: bytes) -> bool:
            nonlocal seen
            import select

            while select.select([leader], [], [], 0.05)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:  # the terminal closed: every process on it is gone
                    break
            return text in seen

        wait_until(lambda: shown(b"[0]<stderr>: step 1/2 [#    ]"), 30, "the first frame", interval=0.02)
        assert b"step 1/2 [#    ]\x1b[K" in seen and b"step 1/2 [#    ]\x1b[K\r\n" not in seen  # the line is open
        go.touch()
        wait_until(lambda: shown(b"[0]<stdout>: done"), 30, "the end", interval=0.02)
        assert proc.wait(30) == 0
    finally:
        stop(proc)
        os.close(leader)
    # the second frame replaces the first on the same line, then the line ends
    assert b"\r[0]<stderr>: step 2/2 [#####]\x1b[K\r\n" in seen, seen


def test_an_empty_prefix_template_prints_the_workers_lines_raw() -> None:
    """For log scrapers that read what torchrun passes through unprefixed (docs/migration.md)."""
    result = run_cli(
        ["--standalone", "--nproc-per-node", "2", SPEAK], env=clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="")
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["out rank=0 attempt=0", "out rank=1 attempt=0"]


def test_the_prefix_template_of_torchrun() -> None:
    env = clean_env(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<${role_name}:${rank}/${local_rank}> ")
    result = run_cli(["--standalone", "--nproc-per-node", "2", "--role", "trainer", SPEAK], env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "<trainer:0/0> out rank=0 attempt=0", "<trainer:1/1> out rank=1 attempt=0",
    ]


def test_warm_imports_are_off_where_no_standby_can_be() -> None:
    """--warm-imports: torch by default; off as asked, for --no-python and in in-process mode."""
    assert config("--standalone", str(SPEAK)).worker.options.warm_imports == ("torch",)
    assert config("--standalone", "--warm-imports=torch, numpy", str(SPEAK)).worker.options.warm_imports == (
        "torch", "numpy"
    )
    assert config("--standalone", "--warm-imports=off", str(SPEAK)).worker.options.warm_imports == ()
    assert config("--standalone", "--no-python", sys.executable, str(SPEAK)).worker.options.warm_imports == ()
    inprocess = config("--standalone", "--elastic-mode=in-process", str(SPEAK))
    assert inprocess.worker.options.warm_imports == ()
