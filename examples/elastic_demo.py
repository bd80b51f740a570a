"""A local elastic training demo: several "nodes" on this machine, coming and going.

    python examples/elastic_demo.py          (or: bash scripts/demo.sh)

What it does, step by step:

1. starts the built-in store on its own (`elasticrun store serve`), as you would on a
   host that is never preempted;
2. starts two agents, on 127.0.0.1 and 127.0.0.2, as two nodes of one `--nnodes=1:3`
   job running examples/train_elastic.py (one worker each);
3. adds a third node with `elasticrun join` (on 127.0.0.3): the job scales up to 3;
4. scales back in with `elasticrun drain --count 1`: the newest node leaves gracefully;
5. starts a fourth node (127.0.0.4) with the job's own command (3 nodes again), then
   preempts it (SIGTERM): it stops its worker and leaves at once, back to 2;
6. kills node-b outright (SIGKILL of its agent and its worker): its lease expires and
   node-a goes on alone;
7. node-a trains to the last step and the job ends with exit code 0.

After every stage it waits for training to step at the new world size; it prints the
table of `elasticrun status` along the way. The loss keeps falling across the changes because each
restart resumes from the latest checkpoint. It takes about a minute and a half on two cores.

Every process it starts (store, agents, their workers) is stopped by PID when it ends,
also when a stage fails or the demo is interrupted. KEEP_DEMO_LOGS=1 keeps the logs.
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
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_elastic.py"
RUN_ID = "demo"
STEPS = 160
STAGE_TIMEOUT = 90.0
ELASTICRUN = [sys.executable, "-m", "elasticrun"]

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """PIDs of every process below `pid` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and everything below it, each by its PID."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class Node:
    """One agent (a "node"); its output goes to a log file that the demo follows."""

    def __init__(self, name: str, argv: list[str], workdir: Path) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=HERE.parent)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(what: str, check: Callable[[], T], timeout: float = STAGE_TIMEOUT) -> T:
    """Poll the logs until `check()` returns something; fail loudly after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


STEP = re.compile(r"Step #(\d+)\s+Loss: ([0-9.]+)\s+\(world size (\d+)\)")


def steps_since(nodes: list[Node], marks: dict[str, int], world: int) -> list[re.Match[str]]:
    """`Step #N  Loss: x  (world size W)` lines at `world` written after `marks`."""
    return [
        m for n in nodes for m in STEP.finditer(n.text(), marks.get(n.name, 0))
        if int(m.group(3)) == world
    ]


def say(message: str) -> None:
    print(f"\n=== {message}", flush=True)


def progress(nodes: list[Node], world: int, steps: int = 10) -> None:
    """Wait until the job steps at `world` after the last change, then `steps` more."""
    marks = {n.name: len(n.text()) for n in nodes}
    first = wait_for(f"a training step at world size {world}", lambda: steps_since(nodes, marks, world))[0]
    print(f"    resumed at step {first.group(1)} with world size {world}, loss {first.group(2)}", flush=True)
    target = int(first.group(1)) + steps
    later = wait_for(
        f"step {target}",
        lambda: [m for m in steps_since(nodes, marks, world) if int(m.group(1)) >= target],
    )[0]
    print(f"    step {later.group(1)}, loss {later.group(2)}", flush=True)


def job_flags(endpoint: str) -> list[str]:
    return [f"--rdzv-endpoint={endpoint}", f"--rdzv-id={RUN_ID}"]


def show_status(endpoint: str, nodes: list[Node]) -> None:
    """Print the node table of `elasticrun status` (the events are left out here).

    Node ids are `<hostname>_<agent pid>`; a last line says which demo node is which.
    """
    out = subprocess.run(
        [*ELASTICRUN, "status", *job_flags(endpoint)], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise RuntimeError(f"elasticrun status failed: {out.stderr.strip()}")
    table = out.stdout.split("\nEVENTS", 1)[0].rstrip()
    print("    $ elasticrun status --rdzv-endpoint ... --rdzv-id demo", flush=True)
    print("\n".join("    " + line if line else "" for line in table.splitlines()), flush=True)
    alive = [f"{n.name} = {socket.gethostname()}_{n.proc.pid}" for n in nodes if n.proc.poll() is None]
    print(f"    ({', '.join(alive)})", flush=True)


def run_demo(workdir: Path, endpoint: str, nodes: list[Node]) -> int:
    ckpt = workdir / "ckpt"
    launch = [
        *ELASTICRUN, "--nnodes=1:3", "--nproc-per-node=1", "--rdzv-backend=c10d", *job_flags(endpoint),
        "--rdzv-conf=heartbeat_timeout=3,last_call_timeout=1", "--max-restarts=1",
    ]
    train = [str(TRAIN), f"--steps={STEPS}", f"--checkpoint-dir={ckpt}", "--step-time=0.15"]

    say("node-a and node-b start a --nnodes=1:3 job")
    for name, addr in (("node-a", "127.0.0.1"), ("node-b", "127.0.0.2")):
        nodes.append(Node(name, [*launch, f"--local-addr={addr}", *train], workdir))
    progress(nodes, 2)
    show_status(endpoint, nodes)

    say("node-c joins (elasticrun join): the job scales up to 3")
    # join runs the job's command only as given here, never as read from the store
    join = [*ELASTICRUN, "join", *job_flags(endpoint), "--local-addr=127.0.0.3", "--timeout=60", "--", *train]
    nodes.append(Node("node-c", join, workdir))
    progress(nodes, 3)
    show_status(endpoint, nodes)

    say("elasticrun drain --count 1: the newest node (node-c) leaves gracefully")
    drained = subprocess.run(
        [*ELASTICRUN, "drain", *job_flags(endpoint), "--count", "1", "--timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )
    if drained.returncode != 0:
        raise RuntimeError(f"elasticrun drain failed: {drained.stderr.strip()}")
    print(f"    {drained.stdout.strip()}", flush=True)
    code_c = nodes[2].proc.wait(timeout=STAGE_TIMEOUT)
    print(f"    node-c's agent exited {code_c}", flush=True)
    progress(nodes, 2)
    show_status(endpoint, nodes)

    say("node-d starts on 127.0.0.4 (the job's own command): the job grows to 3 again")
    nodes.append(Node("node-d", [*launch, "--local-addr=127.0.0.4", *train], workdir))
    progress(nodes, 3)

    say("node-d is preempted (SIGTERM): it leaves at once, the job goes on with 2")
    nodes[3].proc.send_signal(signal.SIGTERM)
    code_d = nodes[3].proc.wait(timeout=STAGE_TIMEOUT)
    print(f"    node-d's agent exited {code_d} (128+SIGTERM: a signalled agent's code, retryable for a scheduler)",
          flush=True)
    progress(nodes, 2)
    show_status(endpoint, nodes)

    say("node-b dies (SIGKILL of its agent and worker): node-a goes on alone")
    kill_tree(nodes[1].proc)
    progress(nodes, 1)
    show_status(endpoint, nodes)

    say(f"node-a trains to step {STEPS} and the job ends")
    code = nodes[0].proc.wait(timeout=STAGE_TIMEOUT * 2)
    final = list(STEP.finditer(nodes[0].text()))[-1]
    print(f"    node-a exited {code}; step {final.group(1)}, loss {final.group(2)}", flush=True)
    return code


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    workdir = Path(tempfile.mkdtemp(prefix="elasticrun-demo-"))
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    nodes: list[Node] = []
    with (workdir / "store.log").open("w") as store_log:
        store = subprocess.Popen(
            [*ELASTICRUN, "store", "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=store_log, stderr=subprocess.STDOUT,
        )
    failed = True
    try:
        say(f"elasticrun store serve on {endpoint}; logs in {workdir}")
        wait_for("the store", lambda: "serving on" in (workdir / "store.log").read_text(), 30)
        code = run_demo(workdir, endpoint, nodes)
        failed = code != 0
        return code
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"\ndemo failed: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\ndemo interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                kill_tree(node.proc)
        store.terminate()
        try:
            store.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(store)
        if failed:
            for node in nodes:
                tail = node.text().splitlines()[-15:]
                print(f"\n--- last lines of {node.name}.log", *tail, sep="\n    ", file=sys.stderr)
        if os.environ.get("KEEP_DEMO_LOGS"):
            print(f"logs kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
