"""A restart-mode worker whose state the agent keeps in host memory (elasticrun.worker.elastic).

Each rank holds its own shard (an int64 tensor of --numel values, a different pattern
per rank, plus 1 each step) and a small model with an SGD optimizer with momentum, in a
ShardedState (--kind=sharded) or a State (--kind=replicated); each step all-reduces a
flag (so the ranks stay in step, as training does), commits and prints

    step=7 rank=1 digest=0123456789ab

(digest: a hash of everything the state holds). With `--fsdp` the model is sharded with
FSDP2's `fully_shard` over the ranks: its parameters and their momentum are DTensors, and
each rank's digest hashes its local shards. When the function starts it prints

    begin rank=1 restart=1 restored=True from=own memory step=22 digest=... intact=True pid=... file=...

where intact says whether the shard is exactly what that step's shard must be. The first
attempt's rank --kill-rank is SIGKILLed:

- `--kill=after-commit`: right after its commit --kill-at;
- `--kill=mid-copy`: during the copy of its commit --kill-at into host memory. A
  `Killer` in the state, after the shard and the model, is asked for its state dict
  when its turn to be copied comes, once the shard and the model are written into the
  slot; armed, it kills its process at the first call that finds the copy under way
  (the slot's record cleared: one whole commit held, not two), after printing
  `mid-copy held=[...]`. With other ranks it first waits in a barrier that they enter
  once their own commit --kill-at is whole, so they hold the commit it tore.

With `--hold-at=N --hold-file=F`, every rank waits after its commit N (for the signal
that stops it), once in the job (F marks it done): a test can then act while every node's
newest commit is N.

With `--pace=S`, each step takes S seconds more (a sleep, standing for the work of a
real step): commits come at a known rate, as fast as a test wants them to outpace the
agents' copies.

With `--wait-go`, a worker that restored a commit waits, before its first step, for a
SIGUSR1 (caught from before its `begin` line on, so one sent after that line is never lost;
any of the worker's threads may take it, and the byte CPython's handler writes to the
wake-up pipe reaches the waiting main thread whichever did):
while it waits no rank can commit (each step's all-reduce needs every rank), so a test
can look at where the restored commits are while none changes.

It ends after --steps steps (exit 0).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=["sharded", "replicated"], default="sharded")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--numel", type=int, default=1 << 16)
    p.add_argument("--kill", choices=["none", "after-commit", "mid-copy"], default="none")
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--hold-at", type=int, default=0)
    p.add_argument("--hold-file", type=Path)
    p.add_argument("--wait-go", action="store_true")
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--fsdp", action="store_true")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from elasticrun.worker import elastic
    from elasticrun.worker.elastic.host_copy import HostCopy

    rank = int(os.environ["RANK"])
    first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    doomed = first_attempt and rank == args.kill_rank and args.kill != "none"

    class Killer:
        """Kills its process in the middle of a commit's copy once armed (see the module doc)."""

        armed = False

        def state_dict(self) -> dict[str, Any]:
            if self.armed:
                held = HostCopy(Path(os.environ["ELASTICRUN_STATE_FILE"])).held()
                if len(held) == 1:
                    if dist.get_world_size() > 1:
                        dist.barrier()
                    print(f"mid-copy held={[r.commits for r in held]}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    def expected_shard(step: int) -> torch.Tensor:
        return torch.arange(args.numel, dtype=torch.int64) * (rank + 1) + step

    torch.manual_seed(rank)
    model = torch.nn.Linear(16, 16)
    if args.fsdp:  # FSDP2 shards over the group: made here, before the model (the wrapper keeps it)
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        fully_shard(model)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if args.fsdp else t  # type: ignore[attr-defined]  # a DTensor: this rank's shard
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    killer = Killer()
    kind = elastic.ShardedState if args.kind == "sharded" else elastic.State
    state = kind(shard=expected_shard(0), model=model, optimizer=optimizer, killer=killer, step=0)

    def digest() -> str:
        h = hashlib.sha256(state.shard.numpy().tobytes())
        for t in model.state_dict().values():
            h.update(mine(t).numpy().tobytes())
        for group in optimizer.state.values():
            h.update(mine(group["momentum_buffer"]).numpy().tobytes())
        return h.hexdigest()[:12]

    def go_signal() -> Callable[[], None]:
        """Catch SIGUSR1 from now on; the function returned waits until one came.

        Not sigwait: a mask set now binds only this thread, and a signal the kernel gives
        to one of the threads torch and gloo started earlier would end the process."""
        wake, woken = os.pipe()
        os.set_blocking(woken, False)
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        signal.set_wakeup_fd(woken)

        def wait() -> None:
            while os.read(wake, 1)[0] != signal.SIGUSR1:
                pass

        return wait

    @elastic.run(backend="gloo")
    def train(state: Any) -> None:
        intact = torch.equal(state.shard, expected_shard(state.step))
        go = go_signal() if args.wait_go else None
        print(
            f"begin rank={rank} restart={os.environ['TORCHELASTIC_RESTART_COUNT']} restored={state.restored} "
            f"from={state.restored_from} step={state.step} digest={digest()} intact={intact} pid={os.getpid()} "
            f"file={os.environ.get('ELASTICRUN_STATE_FILE', '')}",
            flush=True,
        )
        if go is not None and state.restored:
            go()
        flag = torch.zeros(1)
        while state.step < args.steps:
            dist.all_reduce(flag)
            time.sleep(args.pace)
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(state.step))
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
            state.shard += 1
            state.step += 1
            if doomed and args.kill == "mid-copy" and state.step == args.kill_at:
                killer.armed = True
            state.commit()
            print(f"step={state.step} rank={rank} digest={digest()}", flush=True)
            if first_attempt and args.kill == "mid-copy" and not doomed and state.step == args.kill_at:
                dist.barrier()  # the doomed rank's Killer waits for this commit to be whole
            if doomed and args.kill == "after-commit" and state.step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.hold_file and state.step == args.hold_at:
                held = Path(f"{args.hold_file}.{rank}")
                if not held.exists():
                    held.touch()
                    print(f"holding at step={state.step} rank={rank}", flush=True)
                    while True:  # until the test's agents stop it (SIGTERM, SIGKILL)
                        signal.pause()

    train(state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
