"""Every mistake answered in a line: misspelt subcommands, flags and choices get a
"did you mean" (an `--rdzv-conf` key too), `elasticrun store` alone says what it takes, `logs --rank` names a rank
that is not there (or says it has printed nothing yet), `--nproc-per-node=xpu` works as
under torchrun, and `--help` lists every `--rdzv-conf` key. Run as real processes, with
their exact output checked."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest

from elasticrun.agent.xpu import intel_xpus
from elasticrun.launcher.cli import subcommand_parser
from elasticrun.launcher.control import ACCESS_KEYS
from elasticrun.launcher.flags import launch_parser
from elasticrun.launcher.rdzv_conf import RDZV_CONF_KEYS
from tests.support.elastic_cluster import Cluster, run_id
from tests.support.helpers import wait_until
from tests.test_cli import SPEAK, clean_env, finish, run_cli, start_cli

pytestmark = pytest.mark.timeout(60)


MISTAKES = [
    (["stauts", "--rdzv-id=x"],
     "'stauts' is neither a subcommand nor a training script here; did you mean elasticrun status?"),
    (["--nproc-per-node=1", "--npoc-per-node=2", "train.py"],
     "unrecognized arguments: --npoc-per-node=2; did you mean --nproc-per-node? (see --help)"),
    (["status", "--rdzv-endpont=h:1", "--rdzv-id=x"],
     "unrecognized arguments: --rdzv-endpont=h:1; did you mean --rdzv-endpoint? (see --help)"),
    (["drain", "--rdzv-endpoint=h:1", "--rdzv-id=x", "--cuont=1"],
     "unrecognized arguments: --cuont=1; did you mean --count? (see --help)"),
    (["--elastic-mode=inprocess", "train.py"],
     "argument --elastic-mode/--elastic_mode: invalid choice: 'inprocess' (choose from 'restart', 'in-process'); "
     "did you mean in-process? (see --help)"),
    (["store", "serv"],
     "argument COMMAND: invalid choice: 'serv' (choose from 'serve', 'credential', 'etcd-roles'); "
     "did you mean serve? (see --help)"),
    (["store"],
     "elasticrun store takes a command: serve (run the store on its own), credential (print a worker "
     "or reader credential) or etcd-roles (set up etcd's users); see elasticrun store serve --help"),
    (["--standalone", "--rdzv-conf=join_timout=5", "train.py"],
     "--rdzv-conf: unknown key 'join_timout'; did you mean join_timeout?"),
    (["--standalone", "--rdzv-conf=read_timeot=5", "train.py"],  # torchrun's spelling counts too
     "--rdzv-conf: unknown key 'read_timeot'; did you mean read_timeout?"),
    (["--standalone", "--warm-imports=torch,my-lib", str(SPEAK)],
     "--warm-imports: 'my-lib' is not a module name (give e.g. torch,transformers, or off)"),
    (["--standalone", "--warm-imports=off,torch", str(SPEAK)],
     "--warm-imports=off,torch: off cannot be combined with modules"),
    (["--foo", "train.py"], "unrecognized arguments: --foo (see --help)"),
    (["trian.py"], "training script not found: trian.py"),  # close to no subcommand: a missing script
    # elastic nodes without a backend: static is the default, as torchrun's
    (["--nnodes=1:3", str(SPEAK)],
     "--nnodes=1:3 is elastic, which the static rendezvous (the default --rdzv-backend) cannot run: give "
     "--rdzv-backend=c10d (the built-in store) or etcd, with --rdzv-endpoint=host:port; or --nnodes=N for a "
     "fixed number of nodes"),
]


def test_a_mistake_gets_one_line_and_a_suggestion(tmp_path: Path) -> None:
    started = [(start_cli(argv, cwd=tmp_path), line) for argv, line in MISTAKES]  # at once: seconds, not minutes
    for proc, line in started:
        done = finish(proc)
        assert (done.returncode, done.stdout, done.stderr) == (2, "", f"elasticrun: error: {line}\n"), done.args


def test_help_says_the_default_backend_is_static_and_what_elastic_needs() -> None:
    text = " ".join(launch_parser().format_help().split())
    assert "static (the default, as torchrun's: a fixed number of nodes; --nnodes=MIN:MAX needs c10d or etcd)" in text


def test_help_names_every_subcommand() -> None:
    text = " ".join(launch_parser().format_help().split())
    found = re.search(r"Job control: elasticrun \{([a-z,]+)\} --help; the standalone store: elasticrun store", text)
    assert found is not None, text
    subcommands = subcommand_parser()._subparsers._group_actions[0].choices
    assert sorted([*found.group(1).split(","), "store"]) == sorted(subcommands)


def test_help_lists_every_rdzv_conf_key() -> None:
    """Generated from the one table of keys, so that it cannot drift from it."""
    def listed(parser: argparse.ArgumentParser) -> list[str]:
        text = next(a.help for a in parser._actions if a.dest == "rdzv_conf") or ""
        return re.findall(r"[a-z_]+(?=[,;]|$)", text.split(":", 1)[1])

    assert sorted(listed(launch_parser())) == sorted(RDZV_CONF_KEYS)
    assert sorted(listed(subcommand_parser()._subparsers._group_actions[0].choices["status"])) == sorted(ACCESS_KEYS)


# --- logs --rank ---------------------------------------------------------------------------

QUIET_RANK = """\
import os, sys, time
from pathlib import Path
if os.environ["RANK"] == "0":
    print("rank 0 speaks", flush=True)
while not Path(sys.argv[1]).exists():
    time.sleep(0.05)
"""


def test_logs_of_a_rank_that_is_not_there_or_has_printed_nothing(cluster: Cluster, c10d_store: str) -> None:
    script = cluster.tmp / "quiet.py"
    script.write_text(QUIET_RANK)
    rid = run_id()
    agent = cluster.launch("agent", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={rid}", "--rdzv-conf=is_host=false,last_call_timeout=0.1",
        str(script), str(cluster.stop_file),
    )
    job = [f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={rid}"]
    wait_until(lambda: "[0]<stdout>: rank 0 speaks" in run_cli(["logs", *job]).stdout, what="rank 0's line")
    missing = run_cli(["logs", *job, "--rank", "7"])
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        2, "", f"elasticrun: error: no rank 7 in job '{rid}': its ranks are 0-1 (see elasticrun status)\n")
    node = f"{socket.gethostname()}_{agent.pid}"
    quiet = run_cli(["logs", *job, "--rank", "1"])
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (
        0, f"[1]<round>: --- round 1: rank 1 of 2 on node {node}, restart 0 ---\n",
        f"elasticrun: rank 1 of job '{rid}' has printed nothing yet\n")
    spoke = run_cli(["logs", *job, "--rank", "0"])
    assert (spoke.returncode, spoke.stdout, spoke.stderr) == (
        0, f"[0]<round>: --- round 1: rank 0 of 2 on node {node}, restart 0 ---\n[0]<stdout>: rank 0 speaks\n", "")
    cluster.stop_training()
    assert agent.wait_exit() == 0


FAILS_ONCE = """\
import os, sys, time
from pathlib import Path
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {restart}", flush=True)
if restart == "0":
    sys.exit("first attempt fails on purpose")
while not Path(sys.argv[1]).exists():
    time.sleep(0.05)
"""


def test_logs_mark_where_each_round_began(cluster: Cluster, c10d_store: str) -> None:
    """An old round's traceback never reads as the latest output: each round starts with a line of its own."""
    script = cluster.tmp / "fails_once.py"
    script.write_text(FAILS_ONCE)
    rid = run_id()
    agent = cluster.launch("agent", "--nnodes=1", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={rid}", "--rdzv-conf=is_host=false,last_call_timeout=0.1",
        str(script), str(cluster.stop_file),
    )
    job = [f"--rdzv-endpoint={c10d_store}", f"--rdzv-id={rid}"]
    wait_until(lambda: "[0]<stdout>: attempt 1" in run_cli(["logs", *job]).stdout, what="the second attempt's line")
    node = f"{socket.gethostname()}_{agent.pid}"
    lines = run_cli(["logs", *job]).stdout.splitlines()
    rounds = [i for i, line in enumerate(lines) if line.startswith("[0]<round>: ")]
    assert [lines[i] for i in rounds] == [
        f"[0]<round>: --- round 1: rank 0 of 1 on node {node}, restart 0 ---",
        f"[0]<round>: --- round 2: rank 0 of 1 on node {node}, restart 1 ---",
    ], lines
    assert rounds[0] < lines.index("[0]<stdout>: attempt 0") < lines.index(
        "[0]<stderr>: first attempt fails on purpose") < rounds[1] < lines.index("[0]<stdout>: attempt 1"), lines
    cluster.stop_training()
    assert agent.wait_exit() == 0


# --- --nproc-per-node=xpu --------------------------------------------------------------------


def test_xpus_are_counted_as_torch_counts_them(tmp_path: Path) -> None:
    """Intel cards under /sys/class/drm (not their connectors, not other vendors'), or
    ZE_AFFINITY_MASK's entries when it narrows them."""
    for name, vendor in (("card0", "0x8086"), ("card1", "0x10de"), ("card2", "0x8086"), ("card0-DP-1", "0x8086")):
        (tmp_path / name / "device").mkdir(parents=True)
        (tmp_path / name / "device" / "vendor").write_text(vendor + "\n")
    assert intel_xpus({}, tmp_path) == 2
    assert intel_xpus({"ZE_AFFINITY_MASK": "1"}, tmp_path) == 1
    assert intel_xpus({}, tmp_path / "absent") == 0


def test_nproc_per_node_xpu(tmp_path: Path) -> None:
    """As torchrun: one worker per XPU; without any (this host), one line instead of
    torchrun's traceback."""
    if intel_xpus({}) or "ZE_AFFINITY_MASK" in clean_env():
        pytest.skip("this host shows XPUs")
    none = run_cli(["--standalone", "--nproc-per-node=xpu", str(SPEAK)], cwd=tmp_path)
    assert (none.returncode, none.stderr) == (2, (
        "elasticrun: error: --nproc-per-node=xpu needs an Intel GPU (XPU), but this node shows none; "
        "use --nproc-per-node=auto, cpu or a number\n"))
    two = run_cli(["--standalone", "--nproc-per-node=xpu", str(SPEAK)], cwd=tmp_path,
                  env=clean_env(ZE_AFFINITY_MASK="0,1"))
    assert two.returncode == 0, two.stderr
    assert sorted(line for line in two.stdout.splitlines() if "out rank=" in line) == [
        "[0]<stdout>: out rank=0 attempt=0", "[1]<stdout>: out rank=1 attempt=0"]
