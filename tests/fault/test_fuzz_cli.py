"""Fuzzing the command line.

Arbitrary and adversarial argv — unknown flags, bad and huge numbers, NaN and infinity,
odd unicode (non-ASCII digits, surrogate escapes of undecodable bytes, control and
bidi characters), empty strings, every flag of the launcher and of every subcommand —
go through the real entry point `elasticrun.launcher.cli.main`, in this process, with
only the parts that would reach out stubbed: the launch itself (`run_launch` records
the checked config instead of starting agents), the store clients (they check their
endpoint as the real ones do, then report the store unreachable) and `store serve`'s
loop. Properties:

- never an exception out of `main` (a traceback): it returns 0, 1 or 2, or exits 0
  for --help/--version;
- exit 2 (and every error) prints exactly one line `elasticrun: error: ...`, with no
  control character in it, on stderr, and nothing else that is not a log record;
- a launch that passes every check carries a sane config: timings finite and
  positive, ranks and sizes in range, signals the agent can catch, a job id the store
  can encode, endpoint hosts that resolve without a codec error.

A smaller number of real `python -m elasticrun` runs check the same from outside
(exit code, one error line, no "Traceback"), and that nothing of the run is left: each
runs in its own session, and no process of that session outlives it.

Hypothesis runs derandomized with no example database, so CI sees the same examples
every time; every bug found so far is pinned as an explicit @example.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from elasticrun.errors import EXIT_INFRASTRUCTURE, EXIT_TRAINING_FAILED, EXIT_USAGE, StoreUnavailableError
from elasticrun.launcher import cli, launch
from elasticrun.launcher.commands import store as store_command
from elasticrun.launcher.config import LaunchConfig
from elasticrun.launcher.flags import launch_parser
from elasticrun.launcher.rdzv_conf import RDZV_CONF_ALIASES, RDZV_CONF_KEYS, RDZV_CONF_TORCHRUN_ONLY
from elasticrun.rendezvous.codec import encode
from elasticrun.store.client import dial as channel
from elasticrun.store.client import grpc_store
from elasticrun.store.etcd import backend as etcd_store
from elasticrun.store.interface import Store
from tests.support.helpers import ELASTICRUN, wait_until

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
#: the exit codes of a failure that says why in one line (docs/cli.md#exit-codes); a
#: signal's 128+N cannot happen here: nothing signals the launcher
FAILURES = (EXIT_TRAINING_FAILED, EXIT_USAGE, EXIT_INFRASTRUCTURE)

IN_PROCESS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
SUBPROCESS = settings(IN_PROCESS, max_examples=8)

# --- the inputs ------------------------------------------------------------------------

#: values that broke, or could break, a check somewhere: numbers argparse or int()/float()
#: take in surprising ways, unicode digits str.isdigit() accepts but int() does not, the
#: surrogate escapes of undecodable argv bytes, control and bidi characters, huge numbers
ODD = [
    "", " ", "-", "--", "=", ":", ",", "/", "0", "-0", "-1", "+1", "1.5", "1e309", "-1e309",
    "nan", "NaN", "inf", "-inf", "infinity", "1_000", "0x10", "²", "١", "٣:٤", "²:1", "𝟙",
    "9" * 30, "9" * 5000, "\udcff", "caf\udce9", "a\nb", "\r", "\x1b[31mred\x1b[0m", "\u202etxt",
    "\u200b", "ǅ", "ß", "İ", "\t1", "1 ", " 1", "a" * 300, "=x", "k=", "a..b", "-" * 3,
]
#: text as a terminal could send it: any character but NUL (argv cannot hold one)
any_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)
odd = st.one_of(st.sampled_from(ODD), any_text)

HOSTS = ["127.0.0.1", "localhost", "[::1]", "::1", "h", "a..b", "x" * 70, "ü.example", "h o", "\udcff", "", "[::1"]
PORTS = ["", ":29400", ":0", ":65536", ":-1", ":²", ":١", ":x", ":", ":99999999999999999999"]
endpoint = st.one_of(
    st.sampled_from(["127.0.0.1:29400", "localhost:1", "[::1]:29400", "h:2379", "ü.example:1"]),
    st.builds(lambda h, p: h + p, st.sampled_from(HOSTS), st.sampled_from(PORTS)),
    st.sampled_from(["h1:2379,h2:2379", "https://h:2379", "h:1,", ",", "h:1,,h:2"]),
    odd,
)
CONF_KEYS = [*RDZV_CONF_KEYS, *RDZV_CONF_ALIASES, *sorted(RDZV_CONF_TORCHRUN_ONLY), "password", "bogus", ""]
conf_value = st.one_of(st.sampled_from(["1", "0.5", "30", "0", "-1", "true", "false", "/nonexistent"]), odd)
conf_pair = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(CONF_KEYS), conf_value)
rdzv_conf = st.one_of(st.lists(conf_pair, max_size=3).map(",".join), odd)

#: per flag, values near the edge of what it accepts (plus `odd` for every flag)
NEAR = {
    "nnodes": ["1", "2", "1:1", "1:4", "4:2", "0", "0:1", "1:2:3", "1:", ":2", "1:١"],
    "nproc_per_node": ["1", "2", "cpu", "gpu", "auto", "0", "²", "١", "+1"],
    "rdzv_backend": ["c10d", "etcd", "etcd-v2", "static", "zookeeper", "C10D"],
    "rdzv_id": ["job", "a/b", "", "caf\udce9", "\U0001f600"],
    "max_restarts": ["0", "3", "-1"],
    "node_rank": ["0", "1", "-1", "7"],
    "master_port": ["29500", "0", "-1", "70000"],
    "redirects": ["0", "3", "4", "0:3,1:0", "²:1", "١:1", "0:", ":1", "0:3,,1:2", "x:1", " 0:1"],
    "tee": ["0", "2", "0:1", "²:3", "1:²"],
    "local_ranks_filter": ["0", "0,1", "-1", ",", "²"],
    "signals_to_handle": ["SIGTERM", "TERM,USR1", "SIGKILL", "STOP", "SIGFOO", "", ",", "ß"],
    "shutdown_timeout": ["0", "5", "-1", "nan", "inf", "1e309"],
    "health_interval": ["10", "0", "-3", "nan", "inf"],
    "health_check": ["true", "", "exit 1", "'"],
    "health_check_timeout": ["30", "0", "-3", "nan", "inf", "1e309"],
    "monitor_interval": ["0.1", "nan", "-1"],
    "start_method": ["spawn", "fork", "thread"],
    "numa_binding": ["node", "socket", "none"],
    "gpus": ["0", "0,1", "0,0", "-1", "", "x"],
    # subcommands
    "timeout": ["1", "0", "-1", "nan", "inf", "1e309"],
    "count": ["1", "0", "-2"],
    "tail": ["0", "20", "-5"],
    "rank": ["0", "-1"],
    "port": ["0", "29400", "-1", "65536", "99999999999"],
    "host": ["127.0.0.1", "::1", "", "\udcff", "a..b"],
    "token_file": ["/nonexistent", "", "/dev/null", "/"],
    "tls_cert": ["/nonexistent", "/dev/null"],
    "tls_key": ["/nonexistent", "/dev/null"],
}


@dataclass
class Flags:
    """The options of one parser: which take a value, which do not, by dest."""

    valued: dict[str, str] = field(default_factory=dict)  # option string -> dest
    bare: list[str] = field(default_factory=list)
    near: dict[str, list[str]] = field(default_factory=dict)  # dest -> values near its edge


def flags_of(parser) -> Flags:  # noqa: ANN001
    found = Flags()
    for action in parser._actions:
        if action.dest in ("help", "version") or not action.option_strings:
            continue
        for opt in action.option_strings:
            if action.nargs == 0:
                found.bare.append(opt)
            else:
                found.valued[opt] = action.dest
        found.near[action.dest] = NEAR.get(action.dest) or _near_by_kind(action)
    return found


def _near_by_kind(action) -> list[str]:  # noqa: ANN001
    """Edge values for a flag NEAR does not name (one added since), from its kind."""
    if action.choices:
        return [*map(str, action.choices), "bogus", ""]
    if action.type is float:
        return ["1", "0.5", "30", "0", "-1", "nan", "inf", "1e309"]
    if action.type is int:
        return ["0", "1", "2", "-1", "99999999999999999999"]
    return ["x", "trainer", "/tmp", "0", ""]


def _subparsers(parser) -> dict:  # noqa: ANN001
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return dict(action.choices)
    return {}


LAUNCH = flags_of(cli.launch_parser())
_SUBS = _subparsers(cli.subcommand_parser())
SUBCOMMANDS = {name: flags_of(p) for name, p in _SUBS.items() if name != "store"}
SUBCOMMANDS["store serve"] = flags_of(_subparsers(_SUBS["store"])["serve"])
UNKNOWN = ["--nnode", "--bogus", "-x", "-", "--", "---nnodes", "--nnodes-", "-mm", "--rdzv", "--n"]


def chance(draw, k: int, n: int) -> bool:  # noqa: ANN001
    """True k times in n. Hypothesis leans towards (and shrinks to) small integers, so
    the unusual branch sits at the top: plain command lines stay the common case."""
    return draw(st.integers(0, n - 1)) >= n - k


def flag_value(draw, flags: Flags, dest: str, wild: int) -> str:  # noqa: ANN001
    """Mostly values near the edge of what the flag takes (so the checks behind argparse
    are reached), `wild` times in 20 anything at all."""
    if chance(draw, wild, 20):
        return draw(odd)
    if dest == "rdzv_conf":
        return draw(rdzv_conf)
    if dest in ("rdzv_endpoint", "local_addr", "master_addr"):
        return draw(endpoint)
    return draw(st.sampled_from(flags.near[dest]))


def options(draw, flags: Flags, most: int, wild: int) -> list[str]:  # noqa: ANN001
    argv: list[str] = []
    for _ in range(draw(st.integers(0, most))):
        if chance(draw, wild // 4, 20):
            argv.append(draw(st.sampled_from(UNKNOWN)))
        elif flags.bare and chance(draw, 2, 20):
            argv.append(draw(st.sampled_from(flags.bare)))
        else:
            opt = draw(st.sampled_from(sorted(flags.valued)))
            value = flag_value(draw, flags, flags.valued[opt], wild)
            if chance(draw, wild // 4, 40):
                argv.append(opt)  # its value missing (or taken from what follows)
            elif opt.startswith("--") and draw(st.booleans()):
                argv.append(f"{opt}={value}")
            else:
                argv += [opt, value]
    return argv


@st.composite
def launcher_argv(draw, wild: int = 6) -> list[str]:  # noqa: ANN001
    """A launcher command line; `wild` (0-19) says how often a part is anything at all."""
    argv = options(draw, LAUNCH, 6, wild)
    if chance(draw, 1, 4):
        argv.append("--")
    if not chance(draw, 1, 10):
        argv.append(draw(st.one_of(st.just(str(SCRIPT)), st.sampled_from(["missing.py", "", "-", "sh", "true"]), odd)))
    argv += draw(st.lists(odd, max_size=3))
    return argv


@st.composite
def subcommand_argv(draw, wild: int = 6) -> list[str]:  # noqa: ANN001
    name = draw(st.sampled_from(sorted(SUBCOMMANDS)))
    flags = SUBCOMMANDS[name]
    argv = name.split()
    if name != "store serve" and not chance(draw, 1, 5):
        # mostly with the required flags, so the checks behind argparse are reached
        rdzv_id = draw(st.sampled_from(NEAR["rdzv_id"])) if not chance(draw, wild, 20) else draw(odd)
        argv += ["--rdzv-endpoint", draw(endpoint), "--rdzv-id", rdzv_id]
    argv += options(draw, flags, 4, wild)
    if chance(draw, wild // 3, 20):
        argv.append(draw(odd))  # a stray positional
    return argv


ENV_NAMES = [
    "PET_NNODES", "PET_NPROC_PER_NODE", "PET_MAX_RESTARTS", "PET_STANDALONE", "PET_RDZV_CONF",
    "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    "ELASTICRUN_STORE_TOKEN", "LOGLEVEL",
]
environment = st.dictionaries(
    st.sampled_from(ENV_NAMES), st.one_of(st.sampled_from(["1", "2:3", "c10d", "nan", "-1", ""]), odd), max_size=2
)

# --- running main() in this process ------------------------------------------------------

SCRIPT: Path  # set by the module fixture: an existing, do-nothing training script


class _NoStore(Store):
    """A store client that checks what the real one checks on creation, then is
    unreachable: job control ends with its one-line error (exit 1)."""

    def __init__(self, endpoint: object, **kw: object) -> None:
        if isinstance(endpoint, str):
            channel.grpc_target(endpoint)
        self.endpoint = str(endpoint)

    def _gone(self) -> StoreUnavailableError:
        return StoreUnavailableError(self.endpoint, "fuzz: no store here")

    async def get(self, key, **kw):  # noqa: ANN001, ANN201
        raise self._gone()

    get_prefix = put = compare_and_put = delete = delete_prefix = compare_and_delete = get
    grant_lease = keep_alive = revoke_lease = get

    async def watch(self, key, **kw):  # noqa: ANN001, ANN201
        raise self._gone()
        yield

    async def close(self) -> None:
        pass


@dataclass
class Outcome:
    code: object
    out: str
    err: str
    launched: list[LaunchConfig]
    served: list[store_command.ServeConfig]

    def explain(self, argv: Sequence[str]) -> str:
        return f"argv={list(argv)!r} -> {self.code!r}\nstderr:\n{self.err}\nstdout:\n{self.out[:2000]}"


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stub what would reach out (agents, stores, the server loop); no PET_* inherited."""
    global SCRIPT
    SCRIPT = tmp_path_factory.mktemp("fuzz_cli") / "train.py"
    SCRIPT.write_text("print('hello')\n")
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("PET_") or n in ENV_NAMES]:
            mp.delenv(name)
        mp.setattr(grpc_store, "GrpcStore", _NoStore)
        mp.setattr(etcd_store, "EtcdStore", _NoStore)
        yield


def run_main(argv: list[str], env: dict[str, str]) -> Outcome:
    launched: list[LaunchConfig] = []
    served: list[store_command.ServeConfig] = []

    def fake_launch(config: LaunchConfig) -> int:
        launched.append(config)
        return 0

    async def fake_serve(config: store_command.ServeConfig) -> int:
        served.append(config)
        return 0

    out, err = io.StringIO(), io.StringIO()
    children_before = _children()
    with mock.patch.dict(os.environ, env), mock.patch.object(launch, "run_launch", fake_launch), \
            mock.patch.object(store_command, "serve", fake_serve), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        cwd = os.getcwd()
        try:
            code: object = cli.main(argv)
        except SystemExit as e:  # argparse's --help / --version
            code = ("SystemExit", e.code)
        finally:
            os.chdir(cwd)  # `join` changes folder before it launches
    assert _children() <= children_before, "main() left a child process behind"
    return Outcome(code, out.getvalue(), err.getvalue(), launched, served)


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    found.add(int(entry))
    return found


def check_error_lines(outcome: Outcome, argv: Sequence[str]) -> None:
    """What a user sees on an error: one line `elasticrun: error: ...`, printable.

    Under `--log-format json` an error found once the flags are parsed is one JSON object
    at level ERROR instead, like every other line (log_format.error_line); argparse's own
    errors come before the format is known, as text."""
    lines = outcome.err.splitlines()
    errors = [line for line in lines if line.startswith("elasticrun: error: ")]
    if not errors and _asks_for_json(argv):
        errors = [line for line in lines if line.startswith("{") and json.loads(line).get("level") == "ERROR"]
    assert len(errors) == 1, outcome.explain(argv)
    others = [line for line in lines if line not in errors and not line.startswith(("[elasticrun ", "{"))]
    assert not others, outcome.explain(argv)
    message = errors[0]
    assert message.isprintable(), f"a control character in the error line {message!r}\n" + outcome.explain(argv)


def _asks_for_json(argv: Sequence[str]) -> bool:
    """Whether the launcher's own parser reads `--log-format json` (any spelling it takes) in `argv`."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = launch_parser().parse_known_args(list(argv))
    except SystemExit:
        return False
    return getattr(args, "log_format", "") == "json"


def check_sane(config: LaunchConfig, argv: Sequence[str]) -> None:
    """A launch that passed every check must be one the agent can run."""
    s, w = config.rdzv.settings, config.worker
    why = f"argv={list(argv)!r} gave {config!r}"
    for name in ("last_call", "join_timeout", "heartbeat_ttl", "closed_ttl", "keep_alive_interval"):
        value = getattr(s, name)
        assert math.isfinite(value) and value > 0, f"{name}={value}: {why}"
    assert s.keep_alive_interval < s.heartbeat_ttl, why
    assert 1 <= s.min_nodes <= s.max_nodes, why
    assert s.run_id and "/" not in s.run_id, why
    s.run_id.encode("utf-8")  # it becomes part of every store key (protobuf strings)
    assert w.nproc_per_node >= 1 and w.max_restarts >= 0, why
    assert math.isfinite(w.options.stop_grace) and w.options.stop_grace >= 0, why
    assert math.isfinite(config.agent.health_interval) and config.agent.health_interval > 0, why
    assert math.isfinite(config.agent.health_check_timeout) and config.agent.health_check_timeout > 0, why
    assert not {signal.SIGKILL, signal.SIGSTOP} & set(w.options.signals_to_handle), why
    assert all(rank >= 0 for rank in (*w.redirects, *w.tee)), why
    if "store_timeout" in config.rdzv.conf:
        timeout = float(config.rdzv.conf["store_timeout"])
        assert math.isfinite(timeout) and timeout > 0, why
    if config.rdzv.backend in ("c10d", "etcd"):
        for part in config.rdzv.endpoint.split(","):
            host = part.strip()
            if not host.startswith("["):  # (a bracketed IPv6 address needs no name lookup)
                host = host.rpartition(":")[0] if host.count(":") == 1 else host
                host.encode("idna")  # what resolving the name does first
    encode(config.job_spec)


# --- the in-process properties ---------------------------------------------------------------


@IN_PROCESS
@given(argv=st.one_of(launcher_argv(), launcher_argv(wild=1)), env=environment)
@example(argv=["--nproc-per-node=²", "SCRIPT"], env={})  # str.isdigit() but not int()
@example(argv=["--redirects=²:1", "SCRIPT"], env={})
@example(argv=["--rdzv-backend=c10d", "--rdzv-endpoint=h:²", "SCRIPT"], env={})
@example(argv=["--rdzv-backend=c10d", "--rdzv-endpoint=a..b:29400", "SCRIPT"], env={})  # idna
@example(argv=["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-conf=store_timeout=abc", "SCRIPT"], env={})
@example(argv=["--rdzv-conf=heartbeat_timeout=nan", "SCRIPT"], env={})
@example(argv=["--rdzv-conf=join_timeout=inf,last_call_timeout=1e309", "SCRIPT"], env={})
@example(argv=["--shutdown-timeout=nan", "--health-interval=inf", "SCRIPT"], env={})
@example(argv=["SCRIPT"], env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "nan"})
@example(argv=["--signals-to-handle=SIGTERM,KILL", "SCRIPT"], env={})
@example(argv=["--rdzv-id=caf\udce9", "SCRIPT"], env={})  # an undecodable argv byte
@example(argv=["--nnodes", "1\n2", "SCRIPT"], env={})
@example(argv=["--bogus\x1b[2J", "SCRIPT"], env={})
@example(argv=["missing\n.py"], env={})
def test_launcher_never_crashes(in_process: None, argv: list[str], env: dict[str, str]) -> None:
    argv = [str(SCRIPT) if a == "SCRIPT" else a for a in argv]
    outcome = run_main(argv, env)
    event(f"exit {outcome.code}: {outcome.err.partition('error: ')[2][:24]}")
    assert outcome.code in (0, *FAILURES, ("SystemExit", 0)), outcome.explain(argv)
    if outcome.code == 0:
        assert len(outcome.launched) == 1, outcome.explain(argv)
        check_sane(outcome.launched[0], argv)
    elif outcome.code != ("SystemExit", 0):
        check_error_lines(outcome, argv)
        assert not outcome.launched


@IN_PROCESS
@given(argv=st.one_of(subcommand_argv(), subcommand_argv(wild=1)), env=environment)
@example(argv=["status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j", "--rdzv-conf=store_timeout=abc"], env={})
@example(argv=["status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j", "--rdzv-conf=store_timeout=nan"], env={})
@example(argv=["logs", "--rdzv-endpoint=h:²", "--rdzv-id=j"], env={})
@example(argv=["stop", "--rdzv-endpoint=a..b:1", "--rdzv-id=j"], env={})
@example(argv=["drain", "--rdzv-endpoint=h:1", "--rdzv-id=caf\udce9", "--count=1"], env={})
@example(argv=["drain", "--rdzv-endpoint=h:1", "--rdzv-id=j", "--count=1", "--timeout=nan"], env={})
@example(argv=["join", "--rdzv-endpoint=h:1", "--rdzv-id=j", "--timeout=inf"], env={})
@example(argv=["store", "serve", "--port", "-1"], env={})
@example(argv=["store", "serve", "--token-file", "/"], env={})
@example(argv=["store"], env={})
@example(argv=["store", "serve", "--host", "\udcff"], env={})
def test_subcommands_never_crash(in_process: None, argv: list[str], env: dict[str, str]) -> None:
    outcome = run_main(argv, env)
    event(f"{argv[0]} exit {outcome.code}: {outcome.err.partition('error: ')[2][:24]}")
    assert outcome.code in (0, *FAILURES, ("SystemExit", 0)), outcome.explain(argv)
    if outcome.code in FAILURES:
        check_error_lines(outcome, argv)
    if outcome.code == 0 and argv[:1] == ["stop"]:  # nothing listens there: nothing to stop, said so
        assert outcome.out.startswith("nothing listens at ") and not outcome.err, outcome.explain(argv)
    elif outcome.code == 0:
        assert argv[:2] == ["store", "serve"] and len(outcome.served) == 1, outcome.explain(argv)
        config = outcome.served[0]
        assert 0 <= config.port < 65536, outcome.explain(argv)


#: what the fuzz found (each a traceback or a bad value let through before its fix), with
#: the one line each now gets
FOUND = [
    (["--nproc-per-node=²", "SCRIPT"], {}, "--nproc-per-node must be a positive number, cpu, gpu, xpu or auto"),
    (["--redirects=²:1", "SCRIPT"], {}, "--redirects must be N or RANK:N"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=h:²", "SCRIPT"], {}, "--rdzv-endpoint has a bad port"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=a..b:29400", "SCRIPT"], {}, "--rdzv-endpoint must be host:port"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-conf=store_timeout=abc", "SCRIPT"], {},
     "--rdzv-conf store_timeout must be a positive number of seconds"),
    (["status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j", "--rdzv-conf=store_timeout=abc"], {},
     "--rdzv-conf store_timeout must be a positive number of seconds"),
    (["--rdzv-conf=heartbeat_timeout=nan", "SCRIPT"], {}, "--rdzv-conf heartbeat_timeout must be a positive number"),
    (["--rdzv-conf=join_timeout=inf", "SCRIPT"], {}, "--rdzv-conf join_timeout must be a positive number"),
    (["--shutdown-timeout=nan", "SCRIPT"], {}, "--shutdown-timeout must be >= 0 seconds, got nan"),
    (["SCRIPT"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "nan"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be a positive number"),
    (["--health-interval=inf", "SCRIPT"], {}, "--health-interval must be a positive number of seconds, got inf"),
    (["--health-check-timeout=nan", "SCRIPT"], {}, "--health-check-timeout must be a positive number of seconds"),
    (["--signals-to-handle=SIGTERM,KILL", "SCRIPT"], {}, "--signals-to-handle: SIGKILL cannot be caught"),
    (["--rdzv-id=caf\udce9", "SCRIPT"], {}, "--rdzv-id must be UTF-8 text"),
    (["drain", "--rdzv-endpoint=h:1", "--rdzv-id=caf\udce9", "--count=1"], {}, "--rdzv-id must be UTF-8 text"),
    (["--nnodes=--", "SCRIPT"], {}, "--nnodes must be N or MIN:MAX, got '--'"),
    (["--rdzv-conf=--", "SCRIPT"], {}, "--rdzv-conf takes key=value pairs, got '--'"),
    (["join", "--rdzv-endpoint=--", "--rdzv-id=j"], {}, "malformed store endpoint '--'"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=[::1", "SCRIPT"], {}, "--rdzv-endpoint: malformed store endpoint '[::1'"),
    (["status", "--rdzv-endpoint=[::1", "--rdzv-id=j"], {}, "--rdzv-endpoint: malformed store endpoint '[::1'"),
    (["9" * 300], {}, "training script not found: 999"),
    (["--nnodes", "1\n2", "SCRIPT"], {}, "got '1\\n2'"),
    (["missing\n.py"], {}, "training script not found: missing\\n.py"),
    (["--bogus\x1b[2J", "SCRIPT"], {}, "unrecognized arguments: --bogus\\x1b[2J"),
    (["stop", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j", "--timeout=nan"], {},
     "--timeout must be a positive number of seconds, got nan"),
    (["drain", "--rdzv-endpoint=h:1", "--rdzv-id=j", "--count=1", "--timeout=inf"], {},
     "--timeout must be a positive number of seconds, got inf"),
    (["join", "--rdzv-endpoint=h:1", "--rdzv-id=j", "--timeout=-1"], {},
     "--timeout must be a positive number of seconds, got -1"),
]


def test_what_the_fuzz_found_stays_fixed(in_process: None, reliability) -> None:
    for argv, env, message in FOUND:
        argv = [str(SCRIPT) if a == "SCRIPT" else a for a in argv]
        outcome = run_main(argv, env)
        assert outcome.code == 2, outcome.explain(argv)
        check_error_lines(outcome, argv)
        assert message in outcome.err, f"{message!r} not in:\n" + outcome.explain(argv)
    reliability.record(
        scenario="CLI: fuzzed command lines",
        injected=f"{IN_PROCESS.max_examples} hypothesis command lines for the launcher and as many for the "
        f"subcommands (unknown flags, NaN/inf/huge numbers, unicode digits, undecodable bytes, control "
        f"characters, every flag of every command), {SUBPROCESS.max_examples} more as real processes",
        happened=f"{len(FOUND)} inputs that gave a traceback or were let through now get one printable "
        "error line and exit 2; no traceback, no process left",
        lost="nothing", fixed=len(FOUND),
    )


def test_help_and_version_of_every_command(in_process: None) -> None:
    for argv in (
        ["--help"], ["-h"], ["--version"],
        *([name, "--help"] for name in ("status", "logs", "join", "drain", "stop")),
        ["store", "serve", "--help"],
    ):
        outcome = run_main(list(argv), {})
        assert outcome.code == ("SystemExit", 0) and outcome.out and not outcome.err, outcome.explain(argv)


# --- real processes -------------------------------------------------------------------------


def _session_members(sid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: the session id
                    found.append(int(entry))
    return found


def run_real(argv: Sequence[str | bytes], cwd: Path, timeout: float = 40.0) -> subprocess.CompletedProcess[bytes]:
    """`python -m elasticrun argv` in its own session; fails if anything of it is left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k not in ENV_NAMES}
    # stores that do not answer and jobs that do not form are given up quickly
    env["PET_RDZV_CONF"] = "store_timeout=1,join_timeout=5,last_call_timeout=0.1"
    proc = subprocess.Popen(
        [*ELASTICRUN, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, cwd=cwd, env=env, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{argv!r} still running after {timeout:g}s")
    left = _session_members(proc.pid)
    if left:  # give a just-exiting worker a moment, then fail and clean up
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not _session_members(proc.pid), 5, "the session to empty")
        left = _session_members(proc.pid)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not left, f"{argv!r} left processes {left} behind"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def check_real(result: subprocess.CompletedProcess[bytes], argv: Sequence[object]) -> None:
    err = result.stderr.decode("utf-8", "replace")
    shown = f"argv={list(argv)!r} -> {result.returncode}\nstderr:\n{err[-3000:]}"
    assert b"Traceback" not in result.stderr, shown
    assert result.returncode in (0, *FAILURES), shown
    if result.returncode in FAILURES:
        errors = [line for line in err.splitlines() if line.startswith("elasticrun: error: ")]
        assert len(errors) == 1 and errors[0].isprintable(), shown


def _as_bytes(arg: str) -> bytes:
    return arg.encode("utf-8", "surrogateescape")  # what a terminal would have sent


@SUBPROCESS
@given(argv=st.one_of(launcher_argv(), subcommand_argv().filter(lambda a: a[:1] != ["store"])))
@example(argv=["--rdzv-backend=c10d", "--rdzv-endpoint=a..b:29400", "SCRIPT"])
@example(argv=["--signals-to-handle=KILL", "SCRIPT"])
@example(argv=["--nproc-per-node=²", "SCRIPT"])
@example(argv=["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=caf\udce9",
               "--rdzv-conf=is_host=false,store_timeout=0.5", "SCRIPT"])
@example(argv=["status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j", "--rdzv-conf=store_timeout=abc"])
@example(argv=["status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=caf\udce9", "--rdzv-conf=store_timeout=0.5"])
@example(argv=["--nnodes", "1\n2", "SCRIPT"])
@example(argv=["--standalone", "--nproc-per-node=2", "SCRIPT", "\udcff", ""])
def test_real_processes_never_crash_nor_leave_anything(in_process: None, argv: list[str]) -> None:
    argv = [str(SCRIPT) if a == "SCRIPT" else a for a in argv]
    if argv[:1] in (["status"], ["logs"], ["join"], ["drain"], ["stop"]):
        # an unreachable store is given up quickly (a fuzzed store_timeout repeats the key: one line, exit 2)
        argv = [argv[0], "--rdzv-conf=store_timeout=1", *argv[1:]]
    result = run_real([_as_bytes(a) for a in argv], cwd=SCRIPT.parent)
    check_real(result, argv)


@pytest.mark.parametrize("host", ["\udcff", "a..b", "999.1.1.1", "h o"])
def test_store_serve_refuses_a_host_it_cannot_bind(in_process: None, host: str) -> None:
    argv = ["store", "serve", "--host", host, "--port", "0"]
    result = run_real([_as_bytes(a) for a in argv], cwd=SCRIPT.parent)
    check_real(result, argv)
    assert result.returncode == 2 and b"cannot listen on" in result.stderr


def test_store_serve_runs_until_sigterm_and_leaves_nothing(in_process: None) -> None:
    proc = subprocess.Popen(
        [*ELASTICRUN, "store", "serve", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        line = proc.stdout.readline()  # bounded by the test's timeout
        assert b"serving on 127.0.0.1:" in line, line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert err == b"", err  # no traceback, and no token on loopback is no exposure: no warning
        assert not _session_members(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
