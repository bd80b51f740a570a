"""A local elastic training demo: several nodes on this machine, coming and going.

    python examples/elastic_demo.py

It starts the built-in store (`elasticrun store serve`) and agents on 127.0.0.1-3 as
three "nodes" of one `--nnodes=1:3` job running examples/train_elastic.py, then:
a node joins (world size 2 -> 3), a node leaves gracefully (SIGTERM, 3 -> 2), a node is
killed outright (SIGKILL of agent and workers, 2 -> 1), and the last one finishes.
Each stage waits for the training to step at the new world size, and the loss keeps
falling because every restart resumes from the latest checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_elastic.py"
STEPS = 160
STAGE_TIMEOUT = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One agent (a "node"), its output going to a log file we follow."""

    def __init__(self, name: str, addr: str, endpoint: str, workdir: Path, ckpt: Path) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        cmd = [
            sys.executable, "-m", "elasticrun",
            "--nnodes=1:3", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=demo",
            f"--local-addr={addr}", "--rdzv-conf=heartbeat_timeout=3,last_call_timeout=1",
            "--max-restarts=1",
            str(TRAIN), f"--steps={STEPS}", f"--checkpoint-dir={ckpt}", "--step-time=0.15",
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(what: str, check, timeout: float = STAGE_TIMEOUT):
    """Follow the logs until `check()` returns something; fail loudly after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise SystemExit(f"demo: timed out waiting for {what}")


STEP = re.compile(r"Step #(\d+)\s+Loss: ([0-9.]+)\s+\(world size (\d+)\)")


def steps_since(nodes: list[Node], marks: dict[str, int], world: int) -> list[re.Match[str]]:
    """`Step #N  Loss: x  (world size W)` lines for `world` written after `marks`."""
    return [
        m for n in nodes for m in STEP.finditer(n.text(), marks.get(n.name, 0))
        if int(m.group(3)) == world
    ]


def say(message: str) -> None:
    print(f"\n=== {message}", flush=True)


def progress(nodes: list[Node], world: int, steps: int = 15) -> None:
    """Wait until the job steps at `world` after the last event, then `steps` more."""
    marks = {n.name: len(n.text()) for n in nodes}
    first = wait_for(f"a step at world size {world}", lambda: steps_since(nodes, marks, world))[0]
    print(f"    resumed at step {first.group(1)} with world size {world}, loss {first.group(2)}", flush=True)
    target = int(first.group(1)) + steps
    later = wait_for(
        f"step {target}",
        lambda: [m for m in steps_since(nodes, marks, world) if int(m.group(1)) >= target],
    )[0]
    print(f"    step {later.group(1)}, loss {later.group(2)}", flush=True)


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="elasticrun-demo-"))
    ckpt = workdir / "ckpt"
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    store = subprocess.Popen(
        [sys.executable, "-m", "elasticrun", "store", "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=(workdir / "store.log").open("w"), stderr=subprocess.STDOUT,
    )
    nodes: list[Node] = []
    try:
        say(f"store on {endpoint}; logs in {workdir}")
        say("two nodes start a --nnodes=1:3 job")
        nodes += [Node("node-a", "127.0.0.1", endpoint, workdir, ckpt), Node("node-b", "127.0.0.2", endpoint, workdir, ckpt)]
        progress(nodes, 2)

        say("node-c joins: the job scales up to 3")
        nodes.append(Node("node-c", "127.0.0.3", endpoint, workdir, ckpt))
        progress(nodes, 3)

        say("node-b is preempted (SIGTERM): it leaves gracefully, the job goes on with 2")
        nodes[1].proc.send_signal(signal.SIGTERM)
        progress(nodes, 2)

        say("node-c dies (SIGKILL of its agent and workers): the survivor goes on alone")
        os.killpg(nodes[2].proc.pid, signal.SIGKILL)
        progress(nodes, 1)

        say(f"node-a trains to step {STEPS} and the job ends")
        code = nodes[0].proc.wait(timeout=STAGE_TIMEOUT * 2)
        final = list(STEP.finditer(nodes[0].text()))[-1]
        print(f"    node-a exited {code}; step {final.group(1)}, loss {final.group(2)}", flush=True)
        return code
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait()
        store.terminate()
        store.wait(timeout=30)
        if os.environ.get("KEEP_DEMO_LOGS") is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
