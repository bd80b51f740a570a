"""A gloo training worker that uses the in-process API (elasticrun.worker.elastic).

Every process starts from its own random weights (seeded by its PID), so only the
wrapper's sync makes the ranks agree. Each step averages the gradients of a small model
over the group, steps an SGD optimizer with momentum (optimizer state that must travel
too), commits, and prints

    step=7 rank=0 world=3 round=4 pid=1234 digest=0123456789ab

where digest is a hash of the parameters: equal on every rank of a round when the state
was synced right. Each call of the training function prints

    joined rank=0 world=3 round=4 pid=1234 step=7

It ends (exit 0, all ranks at the same step) after --steps steps or once any rank sees
--stop-file. SIGTERM is reported ("worker got SIGTERM pid=...") and ends it (143).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--stop-file", default="")
    p.add_argument("--sleep", type=float, default=0.1)
    args = p.parse_args()
    pid = os.getpid()

    def on_sigterm(signum: int, frame: object) -> None:
        os.write(1, f"worker got SIGTERM pid={pid}\n".encode())
        os._exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)

    import torch
    import torch.distributed as dist

    from elasticrun.worker import elastic

    torch.manual_seed(pid)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = elastic.State(model=model, optimizer=optimizer, step=0)
    stop_file = Path(args.stop_file) if args.stop_file else None
    print(f"worker started pid={pid}", flush=True)

    @elastic.run(backend="gloo")
    def train(state: elastic.State) -> int:
        rank, world = dist.get_rank(), dist.get_world_size()
        tag = f"rank={rank} world={world} round={os.environ['ELASTICRUN_ROUND']} pid={pid}"
        print(f"joined {tag} step={state.step}", flush=True)
        while state.step < args.steps:
            g = torch.Generator().manual_seed(state.step * 1000 + rank)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)  # type: ignore[arg-type]
                param.grad /= world  # type: ignore[operator]
            stop = torch.tensor([float(stop_file is not None and stop_file.exists())])
            dist.all_reduce(stop)
            optimizer.step()
            state.step += 1
            flat = b"".join(t.detach().numpy().tobytes() for t in model.parameters())
            print(f"step={state.step} {tag} digest={hashlib.sha1(flat).hexdigest()[:12]}", flush=True)
            state.commit()
            if stop.item() > 0:
                break
            time.sleep(args.sleep)
        return state.step

    train(state)
    print(f"worker done pid={pid} step={state.step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
