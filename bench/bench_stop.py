"""`elasticrun stop` on a running job whose store its first agent hosts: how long it takes.

    python bench/bench_stop.py                       # 20 stops, ~1-2 minutes
    python bench/bench_stop.py --checkout /path/to/other/elasticrun --runs 20

Each run starts a 2-node c10d job on loopback (the agent on 127.0.0.1 hosts the store,
with a token; the other joins from 127.0.0.2), a third agent with a wrong token that the
store refuses (as in the first-hour report that found the slow stop), waits until both
workers run, then times `elasticrun stop` from its start to its exit. When the hosting
agent exits with the job, its store goes with it: a stop that does not know the store
was an agent's waited out store_timeout (10 s) on the refused connection.
`--checkout` runs another checkout's elasticrun (first on PYTHONPATH) to compare.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PYTHON, ProcessTracker, base_env, fmt, loadavg, median, start_run, write_json  # noqa: E402

WORKER = "import time\nwhile True:\n    time.sleep(0.2)\n"
CAP_S = 60.0


def _healthy(log: Path) -> bool:
    try:
        return "-> healthy" in log.read_text()
    except OSError:
        return False


def trial(n: int, folder: Path, env: dict[str, str], port: int) -> tuple[float, str]:
    tracker = ProcessTracker()
    token, wrong, script = folder / "token", folder / "wrong", folder / "worker.py"
    endpoint = f"127.0.0.1:{port}"

    def agent(addr: str, token_file: Path, log: Path) -> list[str]:
        return [PYTHON, "-m", "elasticrun", "--nnodes=1:3", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id=stop{n}", f"--rdzv-conf=token_file={token_file},last_call_timeout=0.5",
                f"--local-addr={addr}", f"--log-dir={folder / 'logs'}", str(script)]

    try:
        logs = [folder / f"{n}-host.log", folder / f"{n}-joined.log"]
        tracker.start(agent("127.0.0.1", token, logs[0]), env=env, log=logs[0])
        tracker.start(agent("127.0.0.2", token, logs[1]), env=env, log=logs[1])
        deadline = time.monotonic() + CAP_S
        while not all(_healthy(log) for log in logs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"run {n}: the job did not start")
            time.sleep(0.05)
        refused = subprocess.run(agent("127.0.0.3", wrong, folder / "x"), env=env, capture_output=True, timeout=CAP_S)
        assert refused.returncode == 2, refused.stderr
        started = time.monotonic()
        done = subprocess.run(
            [PYTHON, "-m", "elasticrun", "stop", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=stop{n}",
             f"--rdzv-conf=token_file={token}"], env=env, capture_output=True, text=True, timeout=CAP_S,
        )
        took = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        return took, done.stdout.strip()
    finally:
        tracker.stop_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--checkout", help="another elasticrun checkout to run instead of this one")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    info, folder = start_run("bench_stop_")
    extra = {"PYTHONPATH": os.path.abspath(args.checkout)} if args.checkout else {}
    env = base_env(**extra)
    env.pop("LOGLEVEL")
    (folder / "token").write_text("bench-token-1234567890\n")
    (folder / "wrong").write_text("not-the-token-098765\n")
    for name in ("token", "wrong"):
        os.chmod(folder / name, 0o600)
    (folder / "worker.py").write_text(WORKER)
    from common import free_port

    times = []
    for n in range(args.runs):
        took, said = trial(n, folder, env, free_port())
        times.append(took)
        print(f"run {n:2d}: {took:6.2f} s  {said}", flush=True)
    print(f"stop: median {fmt(median(times))} s, max {fmt(max(times))} s over {len(times)} runs; "
          f"load average now {loadavg()}", flush=True)
    write_json(args.json, {"machine": info, "checkout": args.checkout, "times": times})


if __name__ == "__main__":
    main()
