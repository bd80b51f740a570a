"""A job that ended stays ended across a restart of `elasticrun store serve --state-dir`
and only as long as its closed record would have lived without one.

In-process, over a real `MemoryStore` and the real `close_round`: the journal follows a
job's end into its folder, puts it back into a new store for the time it had left, drops
it once expired or when the id starts afresh, and refuses a folder or file that is not
its own. End to end: a real store serve with a state folder, real agents; the store
restarts between a job's end and a requeued agent, which exits 0 saying the job is
closed instead of running it again, while a job whose record has expired runs again.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import pytest

from elasticrun.errors import UsageError
from elasticrun.launcher.store_state_dir import JOURNAL_VERSION, ClosedJournal, journaled
from elasticrun.rendezvous.codec import decode, encode
from elasticrun.rendezvous.keys import Keys
from elasticrun.rendezvous.leader import close_round
from elasticrun.rendezvous.rounds import RoundHead
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.server.memory import MemoryStore
from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc
from tests.support.helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(90)


class Clock:
    """Wall-clock time that a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def recorded(journal: ClosedJournal, key: str, present: bool = True) -> None:
    """Wait until the journal has (or no longer has) `key` on disk: its follow task writes
    the file off the loop."""
    async with asyncio.timeout(10):
        while (key in journal.records and journal.file_of(key).exists()) != present:
            await asyncio.sleep(0.01)


async def test_an_end_is_kept_and_put_back_for_the_time_it_had_left(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    keys = Keys("job")
    engine = MemoryStore()
    try:
        async with journaled(folder, engine) as journal:
            await close_round(engine, keys, "succeeded", "workers of a succeeded", 300.0)
            await recorded(journal, keys.round)
    finally:
        await engine.close()
    assert oct(folder.stat().st_mode & 0o777) == "0o700"

    clock = Clock()
    kept = ClosedJournal.open(folder, clock)
    record = kept.records[keys.round]
    clock.now = record.expires_at - 100  # 100 s of its 300 left
    fresh = MemoryStore()
    try:
        assert await kept.restore(fresh) == 1
        kv = await fresh.get(keys.round)
        assert kv is not None and decode(RoundHead, kv.value).closed == "succeeded"
        assert kv.lease and 99 <= fresh.lease_ttl(kv.lease) <= 100
    finally:
        await fresh.close()

    clock.now = record.expires_at + 1  # expired: not put back, and its file goes
    assert ClosedJournal.open(folder, clock).records == {}
    assert list(folder.iterdir()) == []


async def test_an_expired_end_or_a_fresh_job_drops_the_record(tmp_path: Path) -> None:
    keys, other = Keys("job"), Keys("other")
    engine = MemoryStore()
    try:
        async with journaled(tmp_path / "state", engine) as journal:
            await close_round(engine, keys, "failed", "worker 0 failed", 300.0)
            await close_round(engine, other, "stopped", "by elasticrun stop", 0.2)
            await recorded(journal, keys.round)
            await recorded(journal, other.round)
            await recorded(journal, other.round, present=False)  # its lease ran out in the store
            # the same id starts afresh: its round record is no end
            await engine.put(keys.round, encode(RoundHead(1, 0, "formed", 0.0)))
            await recorded(journal, keys.round, present=False)
            await close_round(engine, keys, "succeeded", "", 300.0)  # and ends again
        # ended while stopping: settled as the block ends, whatever the watch had seen
        assert decode(RoundHead, journal.records[keys.round].record.encode()).closed == "succeeded"
        assert journal.file_of(keys.round).exists()
    finally:
        await engine.close()


def test_a_folder_or_record_that_is_not_its_own_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(UsageError, match="writable by no one else"):
        ClosedJournal.open(shared)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(UsageError, match="is not a folder"):
        ClosedJournal.open(link)
    folder = tmp_path / "state"
    journal = ClosedJournal.open(folder)
    journal.file_of(Keys("job").round).write_text("{not json")
    with pytest.raises(UsageError, match="is not a closed-job record of this version"):
        ClosedJournal.open(folder)
    # An absurd expiry stopped `store serve` at the restore, naming no file
    for absurd in ("1e300", "Infinity", "NaN"):
        path = journal.file_of(Keys("job").round)
        path.write_text(f'{{"version":{JOURNAL_VERSION},"key":"{Keys("job").round}","record":"x","expires_at":{absurd}}}')
        with pytest.raises(UsageError, match=rf"{re.escape(str(path))} says .* move it away"):
            ClosedJournal.open(folder)


# --- end to end ---------------------------------------------------------------------------

#: the job's end is kept long; the other job's ends at once, so it runs again
KEPT, FRESH = "ended-kept", "ended-fresh"


def serve(cluster: Cluster, name: str, port: int, state: Path) -> Proc:
    store = cluster.launch(name, "store", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--state-dir", str(state),
    )
    store.wait_for(r"serving on")
    return store


def start_once(cluster: Cluster, name: str, endpoint: str, job: str, closed_ttl: str, script: Path) -> Proc:
    """One agent of a one-node job that counts its runs in runs-<job>."""
    return cluster.launch(name, "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job}", f"--rdzv-conf={RDZV_CONF},is_host=false,closed_ttl={closed_ttl}",
        "--local-addr=127.0.0.1", str(script), str(cluster.tmp / f"runs-{job}"),
    )


def succeeded(*procs: Proc) -> None:
    for proc in procs:
        assert proc.wait_exit() == 0, proc.text()[-3000:]


def runs(cluster: Cluster, job: str) -> int:
    return len((cluster.tmp / f"runs-{job}").read_text().splitlines())


def test_a_requeued_agent_after_a_store_restart_exits_instead_of_running_the_ended_job(cluster: Cluster) -> None:
    script = cluster.tmp / "count_run.py"
    script.write_text("import sys\nwith open(sys.argv[1], 'a') as f:\n    f.write('ran\\n')\n")
    port, state = free_port(), cluster.tmp / "state"
    endpoint = f"127.0.0.1:{port}"
    store = serve(cluster, "store", port, state)
    succeeded(start_once(cluster, "kept", endpoint, KEPT, "600", script),
              start_once(cluster, "fresh", endpoint, FRESH, "1", script))
    store.signal(signal.SIGTERM)
    assert store.wait_exit() == 0, store.text()[-3000:]

    serve(cluster, "store-again", port, state)
    requeued = start_once(cluster, "kept-requeued", endpoint, KEPT, "600", script)
    succeeded(requeued)
    assert f"job '{KEPT}' ended" in requeued.text() and "this node ran nothing" in requeued.text(), (
        requeued.text()[-3000:]
    )
    assert runs(cluster, KEPT) == 1

    async def fresh_record_gone() -> bool:
        async with GrpcStore(endpoint, timeout=5) as client:
            return await client.get(Keys(FRESH).round) is None

    wait_until(lambda: asyncio.run(fresh_record_gone()), what=f"the end of {FRESH} to expire", interval=0.2)
    succeeded(start_once(cluster, "fresh-again", endpoint, FRESH, "1", script))
    assert runs(cluster, FRESH) == 2
    assert sorted(p.name for p in state.iterdir() if not p.name.startswith("closed-")) == []
    assert os.stat(state).st_mode & 0o777 == 0o700
