"""A training worker for the fault-injection tests (tests/fault/): gloo, or its socket
stand-in (collective.py).

Like train_worker.py — one all_reduce per step, until --steps or --stop-file — plus what
the fault tests check afterwards:

- Numbered lines: every line it prints carries `seq=<n>`, numbered 0, 1, 2, ... per
  process, and after each line the count printed so far goes to `<--seq-dir>/<pid>`
  (atomically). A log file that lacks a number below that count lost a line.
- A global step counter that survives restarts: rank 0 saves `{"step": s}` to --ckpt
  (write, then rename) every --ckpt-every steps and prints `ckpt step=<s> at=<time>`
  once it is on disk; a new worker resumes at the saved step + 1 and prints
  `worker started ... resume=<step> read_at=<time>` (the time taken just before it read
  the file). Every rank adds its step to the all_reduce, so ranks that disagree on the
  step show up as `sum` != step * world.
- Wall-clock times (`t=`) on every step, to order the steps of different groups.

A step line reads

    step=12 rank=0 world=3 group_rank=0 restart=0 round=2 pid=1234 seq=15 t=1712.123 sum=36

SIGTERM prints `worker got SIGTERM ...` (numbered too) and exits 143. A collective that
breaks is reported (`collective failed ...`); then the worker waits up to --broken-wait
seconds for its agent to stop it, and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from collective import CollectiveFailed, join_group
from worker_tag import identity


class Lines:
    """Numbered output, with the count printed so far kept in a side file."""

    def __init__(self, seq_dir: str) -> None:
        self.n = 0
        self.pid = os.getpid()
        self.side = Path(seq_dir) / str(self.pid) if seq_dir else None
        if self.side is not None:
            self.side.parent.mkdir(parents=True, exist_ok=True)

    def say(self, text: str, *, in_handler: bool = False) -> None:
        # SIGTERM waits while a line is written, so its own line gets the next number
        if not in_handler:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            line = f"{text} seq={self.n}\n".encode()
            view = memoryview(line)
            while view:  # os.write: no buffering
                view = view[os.write(1, view):]
            self.n += 1
            if self.side is not None:
                tmp = self.side.with_suffix(".tmp")
                tmp.write_text(str(self.n))
                os.replace(tmp, self.side)
        finally:
            if not in_handler:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000_000)
    p.add_argument("--stop-file", default="")
    p.add_argument("--sleep", type=float, default=0.1)
    p.add_argument("--ckpt", default="", help="checkpoint file shared by every node")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--seq-dir", default="", help="folder for the per-process line counts")
    p.add_argument("--lines", type=int, default=0, help="extra numbered lines per step")
    p.add_argument("--broken-wait", type=float, default=60.0)
    args = p.parse_args()

    out = Lines(args.seq_dir)
    rank, world, tag = identity()

    def on_sigterm(signum: int, frame: object) -> None:
        out.say(f"worker got SIGTERM {tag}", in_handler=True)
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)

    ckpt = Path(args.ckpt) if args.ckpt else None
    read_at = time.time()
    start = 0
    if ckpt is not None and ckpt.exists():
        start = json.loads(ckpt.read_text())["step"] + 1
    group = join_group(rank, world)
    out.say(f"worker started {tag} resume={start} read_at={read_at:.6f}")
    stop_file = Path(args.stop_file) if args.stop_file else None
    step = start
    for _ in range(args.steps):
        stop = 1.0 if stop_file is not None and stop_file.exists() else 0.0
        try:
            t = group.all_reduce([float(step), stop])
        except CollectiveFailed as e:
            out.say(f"collective failed at step {step} {tag}: {str(e).splitlines()[0][:200]}")
            time.sleep(args.broken_wait)
            return 1
        out.say(f"step={step} {tag} t={time.time():.6f} sum={int(t[0])}")
        for i in range(args.lines):
            out.say(f"line {i} of step {step} pid={os.getpid()}")
        if ckpt is not None and rank == 0 and step % args.ckpt_every == 0:
            tmp = ckpt.with_name(f"{ckpt.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, ckpt)
            out.say(f"ckpt step={step} at={time.time():.6f} pid={os.getpid()}")
        if t[1] > 0:
            break
        step += 1
        time.sleep(args.sleep)
    out.say(f"worker done {tag}")
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
