"""A gloo training worker whose node is bad: it crashes there, every time.

Like tests/workers/train_worker.py (the same step lines, `--stop-file`, a collective
broken by a peer's death reported and then waited out), plus: a worker crashes
(a traceback, exit 1) at any step from --crash-step on while the file
`<--crash-dir>/<its node id>` exists. Every node runs the same command (the job spec
must match); the test marks the bad node by creating that file, named by the node id
its agent gives the workers (ELASTICRUN_NODE_ID).

    step=12 rank=0 world=3 group_rank=0 restart=0 round=2 pid=1234
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-file", default="")
    p.add_argument("--crash-dir", default="")
    p.add_argument("--crash-step", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.1)
    p.add_argument("--broken-wait", type=float, default=60.0)
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = os.environ.get("ELASTICRUN_NODE_ID", "?")
    tag = (
        f"rank={rank} world={world} group_rank={os.environ['GROUP_RANK']} "
        f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} "
        f"round={os.environ.get('ELASTICRUN_ROUND', '?')} pid={os.getpid()}"
    )

    def on_sigterm(signum: int, frame: object) -> None:
        os.write(1, f"worker got SIGTERM {tag}\n".encode())
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    print(f"worker started {tag}", flush=True)
    stop_file = Path(args.stop_file) if args.stop_file else None
    bad = Path(args.crash_dir) / node if args.crash_dir else None
    step = 0
    while True:
        if bad is not None and step >= args.crash_step and bad.exists():
            raise RuntimeError(f"injected crash on bad node {node} at step {step} {tag}")
        stop = 1.0 if stop_file is not None and stop_file.exists() else 0.0
        t = torch.tensor([1.0, stop])
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            print(f"collective failed at step {step} {tag}: {e}", flush=True)
            time.sleep(args.broken_wait)
            return 1
        print(f"step={step} {tag} sum={int(t[0])}", flush=True)
        if t[1] > 0:
            break
        step += 1
        time.sleep(args.sleep)
    print(f"worker done {tag}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
