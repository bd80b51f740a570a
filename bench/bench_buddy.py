"""A restore from a buddy node against torch.load from local disk.

    python bench/bench_buddy.py                  # a 128 MB state, 3 rounds
    python bench/bench_buddy.py --mb 512         # a 1 GiB state (512 MB model + momentum)

A model of `--mb` MB of float32 parameters with SGD momentum (bench/bench_state.py's),
committed once into a replica file that a holder process keeps, as a buddy keeps its
predecessor's commits (elasticrun.agent.state_replicas, its own process and loop,
serving on 127.0.0.1). Then, alternating per round:

- from the buddy: what a node that took a lost node's place does before and as its
  worker starts: fetch the commit over the replica channel (the HMAC challenge, then
  the bytes, into the local rank's file on /dev/shm), then the worker's restore from
  that file (map, pick the newest whole commit, load the model and the optimizer);
- torch.load of the same state dicts from a file on local disk (`--disk-dir`) and
  `load_state_dict`: the file was just written, so it comes from the page cache, its
  best case.

The channel runs over loopback here: a real buddy is across the network, which adds the
link's time (a 1 GiB commit: about 0.1 s more per 100 Gbit/s). Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_state import build, memory_for  # noqa: E402
from elasticrun.agent.commit_files import CommitFile  # noqa: E402
from elasticrun.agent.replica_wire import job_key  # noqa: E402
from elasticrun.agent.state_files import StateFiles  # noqa: E402
from elasticrun.agent.state_replicas import StateReplicas  # noqa: E402
from elasticrun.rendezvous.handler import JobControl  # noqa: E402
from elasticrun.rendezvous.records import ReplicaPost  # noqa: E402
from elasticrun.worker.elastic import State  # noqa: E402
from elasticrun.worker.elastic.host_copy import HostCopy  # noqa: E402

KEY = job_key("bench", "token")


class _Loopback(JobControl):
    addr = "127.0.0.1"


def _files(folder: Path, size: int, kind: str) -> StateFiles:
    return StateFiles(folder, size, lambda path, made: None, kind=kind)


async def _hold(mb: int, folder: Path) -> None:
    """The holder: one commit of rank 0 in a replica file, served until stdin closes."""
    model, optimizer = build(mb)
    own, replicas = _files(folder, memory_for(mb), "state"), _files(folder, memory_for(mb), "replica")
    state = State(model=model, optimizer=optimizer, step=7)
    state._keep_in(HostCopy(replicas.path(0)))
    state.commit()
    holder = StateReplicas(own, replicas, _Loopback(), "holder", KEY, lambda: None)
    assert await holder.start()
    print(holder.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await holder.close()
    own.close()


async def _fetch(port: int, into: CommitFile) -> list[int]:
    fetcher = StateReplicas(
        _files(into.path.parent, 1 << 20, "unused"), _files(into.path.parent, 1 << 20, "unused-replica"),
        _Loopback(), "fetcher", KEY, lambda: None,
    )
    post = ReplicaPost(round=1, node_id="holder", addr="127.0.0.1", port=port, first_rank=0, nproc=1, held=(0,))
    got = await fetcher._get(post, 0, 1, into)  # what StateReplicas.round_starts does for a lacking rank
    return [r.generation for r in got]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="MB of parameters (the state is twice that with momentum)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--disk-dir", default=tempfile.gettempdir())
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    folder = Path(args.disk_dir)
    if args.hold:
        asyncio.run(_hold(args.mb, folder))
        return 0

    holder = subprocess.Popen(
        [sys.executable, __file__, "--hold", f"--mb={args.mb}", f"--disk-dir={args.disk_dir}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    port = int(holder.stdout.readline())
    files = _files(folder, memory_for(args.mb), "state")
    path = files.path(0)
    disk = Path(tempfile.mkdtemp(dir=args.disk_dir)) / "state.pt"
    fetches, restores, loads = [], [], []
    try:
        model, optimizer = build(args.mb)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}, disk)
        for _ in range(args.rounds):
            fresh_model, fresh_optimizer = build(args.mb)
            fresh = State(model=fresh_model, optimizer=fresh_optimizer, step=0)
            start = time.perf_counter()
            into = CommitFile(path)
            generations = asyncio.run(_fetch(port, into))
            into.close()
            fetched = time.perf_counter()
            fresh._keep_in(HostCopy(path, frozenset(generations)))
            done = time.perf_counter()
            assert fresh.restored and fresh.restored_from == "buddy" and fresh.step == 7
            fetches.append(fetched - start)
            restores.append(done - start)

            start = time.perf_counter()
            saved = torch.load(disk)
            fresh_model.load_state_dict(saved["model"])
            fresh_optimizer.load_state_dict(saved["optimizer"])
            loads.append(time.perf_counter() - start)
    finally:
        holder.stdin.close()
        holder.wait(60)
        files.close()
        disk.unlink(missing_ok=True)
        disk.parent.rmdir()

    print(f"state: {2 * args.mb} MB (model {args.mb} MB + momentum), {args.rounds} rounds, torch threads 1, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'fetch from the buddy (loopback)':40s} median {statistics.median(fetches) * 1e3:8.1f} ms")
    print(f"{'fetch + restore from the buddy':40s} median {statistics.median(restores) * 1e3:8.1f} ms")
    print(f"{'torch.load from disk, load_state_dict':40s} median {statistics.median(loads) * 1e3:8.1f} ms")
    print(f"ratio buddy restore / torch.load: {statistics.median(restores) / statistics.median(loads):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
