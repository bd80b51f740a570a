"""bench/bench_node_loss.py's worker: a ShardedState committed every step, until it is killed.

A model of --mb MB of float32 parameters and SGD with momentum (bench/bench_state.py's),
held in an `elastic.ShardedState` with the step. Each step: a one-element all-reduce
(the job's lockstep), a training step on a small batch, --pace seconds more (the rest of
a real step), `state.commit()`. Lines the bench reads:

    begin rank=1 restored=True from=buddy step=41
    step=42 rank=1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: a --baseline run keeps its own elasticrun

from bench.bench_state import build, train_step  # noqa: E402
from elasticrun.worker import elastic  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--pace", type=float, default=0.05)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    model, optimizer = build(args.mb)
    state = elastic.ShardedState(model=model, optimizer=optimizer, step=0)
    batch = torch.randn(1, 512)

    @elastic.run(backend="gloo")
    def train(state: Any) -> None:
        print(f"begin rank={rank} restored={state.restored} from={state.restored_from} step={state.step}", flush=True)
        flag = torch.zeros(1)
        while True:
            dist.all_reduce(flag)
            train_step(model, optimizer, batch)
            time.sleep(args.pace)
            state.step += 1
            state.commit()
            print(f"step={state.step} rank={rank}", flush=True)

    train(state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
