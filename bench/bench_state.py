"""Restart-mode state in host memory: what a commit costs, and a restore against torch.load.

    python bench/bench_state.py                  # ~1 minute: a 64 MB state, 5 rounds
    python bench/bench_state.py --mb 256 --rounds 3

In this process, with torch on the CPU and no process group (rank 0 of 1), a model of
`--mb` MB of float32 parameters with an SGD optimizer with momentum (state of the same
size again), in an `elastic.State`, its host copy in a file on /dev/shm made as the
agent makes it (elasticrun.agent.state_files, `--state-memory` room for its four copies):

- commit: training steps (forward, backward and the optimizer's step on a batch sized
  so that a step takes about `--step-ms`) with `state.commit()` after each, with the
  host copy (restart mode: the parameters and momentum copied while the next step runs,
  host_copy.py), against the same steps with no commit; and against `state.commit()`
  without a host copy (the in-memory copy of in-process mode), and `commit(every=10)`
  with the host copy. Variants alternate, `--steps` steps each per round; a commit's
  cost is the median step's time over the no-commit median, as a share of that step;
- restore: what a restarted worker does before calling the function (map the file, pick
  the newest whole commit, read it, load the model and the optimizer) against
  `torch.load` of the same state dicts from a file on local disk (`--disk-dir`, default
  the system's temporary folder) and `load_state_dict`, alternating; the ratio of the
  medians. The file was just written, so torch.load reads it from the page cache: its
  best case (a cold read adds the disk's time).

Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elasticrun.agent.state_files import StateFiles  # noqa: E402
from elasticrun.state_layout import mapped_bytes  # noqa: E402
from elasticrun.worker.elastic import State  # noqa: E402
from elasticrun.worker.elastic.host_copy import HostCopy  # noqa: E402


def memory_for(mb: int) -> int:
    """The `--state-memory` that holds four copies of `build(mb)`'s state (and each copy's structure)."""
    return mapped_bytes((2 * mb + 1) << 20)


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of `mb` MB of float32 parameters (1 MB layers), and SGD with momentum on it."""
    layers = [torch.nn.Linear(512, 512, bias=False) for _ in range(mb)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()  # the momentum buffers exist
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(batch).sum().backward()
    optimizer.step()


def batch_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_ms: float) -> torch.Tensor:
    """A batch whose training step takes about `step_ms` here (the median of 5 steps)."""
    rows = 1
    while True:
        batch = torch.randn(rows, 512)
        train_step(model, optimizer, batch)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            train_step(model, optimizer, batch)
            times.append((time.perf_counter() - start) * 1e3)
        took = statistics.median(times)
        if took >= 0.95 * step_ms or rows >= 4096:
            return batch
        rows = max(rows + 1, int(rows * min(2.0, step_ms / max(took, 1e-3))))


def time_steps(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, n: int,
    state: State | None, every: int | None = None,
) -> float:
    """The median time of a step followed by `state.commit(every=every)` (no commit with no state)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        train_step(model, optimizer, batch)
        if state is not None:
            state.step += 1
            state.commit(every=every)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="MB of parameters (the state is twice that with momentum)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps timed per round and variant")
    p.add_argument("--step-ms", type=float, default=100.0, help="what a training step takes, about")
    p.add_argument("--disk-dir", default=tempfile.gettempdir())
    args = p.parse_args()
    torch.set_num_threads(1)

    model, optimizer = build(args.mb)
    files = StateFiles(Path(args.disk_dir), memory_for(args.mb), lambda path, made: None)
    path = files.path(0)
    try:
        plain = State(model=model, optimizer=optimizer, step=0)
        kept = State(model=model, optimizer=optimizer, step=0)
        kept._keep_in(HostCopy(path))
        disk = Path(tempfile.mkdtemp(dir=args.disk_dir)) / "state.pt"
        batch = batch_for(model, optimizer, args.step_ms)
        bare, without, with_copy, thinned, restores, loads = [], [], [], [], [], []
        for _ in range(args.rounds):
            bare.append(time_steps(model, optimizer, batch, args.steps, None))
            without.append(time_steps(model, optimizer, batch, args.steps, plain))
            with_copy.append(time_steps(model, optimizer, batch, args.steps, kept))
            thinned.append(time_steps(model, optimizer, batch, args.steps, kept, every=10))
            kept.commit()  # untimed: the last step committed, whatever --commits left uncommitted
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": kept.step}, disk)

            fresh_model, fresh_optimizer = build(args.mb)
            fresh = State(model=fresh_model, optimizer=fresh_optimizer, step=0)
            start = time.perf_counter()
            fresh._keep_in(HostCopy(path))
            restores.append(time.perf_counter() - start)
            assert fresh.restored and fresh.step == kept.step
            assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True))

            start = time.perf_counter()
            saved = torch.load(disk)
            fresh_model.load_state_dict(saved["model"])
            fresh_optimizer.load_state_dict(saved["optimizer"])
            loads.append(time.perf_counter() - start)
        disk.unlink()
        disk.parent.rmdir()
    finally:
        files.close()

    step = statistics.median(bare)
    print(f"state: {2 * args.mb} MB (model {args.mb} MB + momentum), {args.rounds} rounds of {args.steps} "
          f"steps, a step {step * 1e3:.1f} ms with no commit (batch {batch.shape[0]}), torch threads 1, "
          f"load {os.getloadavg()[0]:.1f}")
    for what, times in (
        ("commit(), in-process copy", without),
        ("commit(), host copy", with_copy),
        ("commit(every=10), host copy", thinned),
    ):
        cost = statistics.median(times) - step
        print(f"{what:40s} a step {statistics.median(times) * 1e3:7.1f} ms: the commit {cost * 1e3:+7.2f} ms "
              f"({cost / step:+.1%} of the step)")
    print(f"{'restore from host memory':40s} median {statistics.median(restores) * 1e3:8.2f} ms")
    print(f"{'torch.load from disk, load_state_dict':40s} median {statistics.median(loads) * 1e3:8.2f} ms")
    print(f"ratio restore / torch.load: {statistics.median(restores) / statistics.median(loads):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
