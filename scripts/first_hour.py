#!/usr/bin/env python3
"""Run a new user's first hour with elasticrun and write it into docs/troubleshooting.md.

    .venv/bin/python scripts/first_hour.py      # about half a minute

Each step is a real command, run in a temporary folder against a store on loopback, and
is written as `$ command`, what it printed and its exit code, between the first-hour
markers. Every step's output must hold its expected line (`Step.expect`) and exit with
its expected code, else nothing is written: tests/test_docs.py holds the block in the
doc to the same lines, so the doc shows what elasticrun says today. Node ids, ports,
times and paths vary from run to run; the lines that matter do not.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "troubleshooting.md"
BEGIN = "<!-- first-hour: written by scripts/first_hour.py -->"
END = "<!-- /first-hour -->"

TRAIN = """\
import os, time
print(f"training rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
time.sleep(0.5)
print(f"rank {os.environ['RANK']} done", flush=True)
"""
SILENT = """\
import time
time.sleep(600)  # never calls elasticrun.worker.heartbeat(), makes no optimizer step
"""


@dataclass(frozen=True)
class Step:
    """One command of the first hour: why a user runs it, and what it must say."""

    why: str
    argv: tuple[str, ...]
    exit_code: int
    #: a regex each run's output must match (multiline): the line this step is about
    expect: str


def steps(port: int, token: Path, host_port: int = 0) -> list[Step]:
    store = f"--rdzv-endpoint=127.0.0.1:{port}"
    hosted = f"--rdzv-endpoint=127.0.0.1:{host_port}"
    c10d = "--rdzv-backend=c10d"
    return [
        Step("One machine, two workers: a job that goes well says little.",
             ("--standalone", "--nproc-per-node=2", "train.py"), 0,
             r"workers healthy -> succeeded: all workers succeeded"),
        Step("A job on a store, without --rdzv-id: its id is 'none', said once.",
             ("--nnodes=1", c10d, store, "--rdzv-conf=is_host=false", "train.py"), 0,
             r"the job id is 'none', the default"),
        Step("The same command again, as torchrun users do: the job had ended, so nothing ran.",
             ("--nnodes=1", c10d, store, "--rdzv-conf=is_host=false", "train.py"), 0,
             r"job 'none' ended \d+s ago \(succeeded: .*\), before this node started: this node ran nothing"),
        Step("What happened, after the end: the nodes' last reports stay for closed_ttl.",
             ("status", store, "--rdzv-id=none"), 0,
             r"^\S+_\d+\s+succeeded\s"),
        Step("Their last lines too, each round's marked where it began.",
             ("logs", store, "--rdzv-id=none", "--tail=3"), 0,
             r"^\[0\]<round>: --- round 1: rank 0 of 1 on node \S+, restart 0 ---\n.*\n\[0\]<stdout>: rank 0 done$"),
        Step("A scheduler's clean-up stops the ended job: nothing to do, and no error.",
             ("stop", store, "--rdzv-id=none"), 0,
             r"job 'none' had already ended \(succeeded: .*\): nothing to stop"),
        Step("An elastic job without --rdzv-backend: the default is static, as torchrun's.",
             ("--nnodes=1:3", "train.py"), 2,
             r"--nnodes=1:3 is elastic, which the static rendezvous \(the default --rdzv-backend\) cannot run: "
             r"give --rdzv-backend=c10d"),
        Step("The README's set-up: the node on the endpoint hosts the store, and says what that means.",
             ("--nnodes=1", c10d, hosted, "--rdzv-id=hosted", "--log-dir=logs", "train.py"), 0,
             r"hosting the rendezvous store on 127\.0\.0\.1:\d+: a job of at most 1 node\(s\) cannot fail over"),
        Step("How that job ended, once its store ended with it: this machine's run folders say.",
             ("status", hosted, "--rdzv-id=hosted", "--log-dir=logs", "--rdzv-conf=store_timeout=1"), 200,
             r"^  \S+  succeeded  .*  all workers succeeded$"),
        Step("A misspelt --rdzv-conf key.",
             ("--nnodes=1", c10d, store, "--rdzv-id=second", "--rdzv-conf=join_timout=60", "train.py"), 2,
             r"unknown key 'join_timout'; did you mean join_timeout\?"),
        Step("A token given to the agent, but not to the store.",
             ("--nnodes=1", c10d, store, "--rdzv-id=third", f"--rdzv-conf=is_host=false,token_file={token.name}",
              "train.py"), 0,
             r"the store at 127\.0\.0\.1:\d+ has no token: the one this client presents protects nothing"),
        Step("The hang watchdog on a script it cannot see into: it says why.",
             ("--standalone", "--progress-timeout=3", "silent.py"), 1,
             r"hung: no progress for \ds since it started: it never called elasticrun.worker.heartbeat\(\) "
             r"and made no optimizer step"),
    ]


def run(folder: Path) -> str:
    """Run every step in `folder` and return the transcript.

    Raises AssertionError naming the step whose output lacks its line.
    """
    (folder / "train.py").write_text(TRAIN)
    (folder / "silent.py").write_text(SILENT)
    token = folder / "token"
    token.write_text("first-hour-token-0123456789\n")
    token.chmod(0o600)
    with socket.socket() as s, socket.socket() as h:
        s.bind(("127.0.0.1", 0))
        h.bind(("127.0.0.1", 0))
        port, host_port = s.getsockname()[1], h.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "LOGLEVEL"))}
    elasticrun = [sys.executable, "-m", "elasticrun"]
    server = subprocess.Popen([*elasticrun, "store", "serve", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()  # it says it serves once it does
        out = [f"$ elasticrun store serve --host 127.0.0.1 --port {port} &"]
        for step in steps(port, token, host_port):
            done = subprocess.run([*elasticrun, *step.argv], cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=120)
            # the checkout's own path says nothing to a reader (`.venv/bin/python`)
            said = (done.stdout + done.stderr).rstrip("\n").replace(f"{ROOT}/", "")
            assert done.returncode == step.exit_code and re.search(step.expect, said, re.M), (
                f"{' '.join(step.argv)} exited {done.returncode} (expected {step.exit_code}) without "
                f"/{step.expect}/:\n{said}"
            )
            out += ["", f"# {step.why}", f"$ elasticrun {' '.join(step.argv)}", *said.splitlines(),
                    f"(exit {done.returncode})"]
        return "\n".join(out) + "\n"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


def transcript(doc: str) -> str:
    """The transcript as the doc shows it: the code block between the markers."""
    part = doc.split(BEGIN, 1)[1].split(END, 1)[0]
    return part.split("```text\n", 1)[1].split("```", 1)[0]


def missing(text: str) -> list[str]:
    """The steps whose line `text` lacks (none for a whole, current transcript)."""
    port, token = 0, Path("token")
    return [step.why for step in steps(port, token) if not re.search(step.expect, text, re.M)]


def main() -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="first_hour_") as folder:
        text = run(Path(folder))
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{BEGIN}\n\n```text\n{text}```\n\n{END}{tail}")
    print(f"wrote the first hour into {DOC.relative_to(ROOT)} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
