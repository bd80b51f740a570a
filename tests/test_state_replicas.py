"""The parts of the buddy replication on their own: a commit's copy between files, and the wire's challenge.

End to end (agents, spares, workers) is tests/test_state_buddy.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest
import torch

from elasticrun.agent.commit_files import CommitFile, payload_bytes
from elasticrun.agent.replica_wire import ReplicaProtocolError, accept, connect, job_key
from elasticrun.agent.state_replicas import _write_commit
from elasticrun.state_layout import RECORD_BYTES
from elasticrun.worker.elastic.host_copy import HostCopy

pytestmark = pytest.mark.timeout(60)


def state_file(tmp_path: Path, name: str, size: int = 1 << 20) -> Path:
    path = tmp_path / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return path


def copy(source: CommitFile, into: CommitFile, corrupt: bool = False) -> object:
    """Move `source`'s newest commit into `into` as the replication does: record, bytes, record."""
    record = source.newest()
    assert record is not None
    raw = source.raw_record(record)
    slot, at = into.begin(record)
    data = bytes(source.payload(record))
    if corrupt:  # the last byte of the structure
        data = data[:-1] + bytes([data[-1] ^ 0xFF])
    into.write(at, data)
    return into.finish(slot, raw)


def test_a_commit_copied_into_another_file_reads_back_as_committed_there(tmp_path: Path) -> None:
    """The worker's reader takes the copy whole: tensors and structure, rank and count kept,
    under the receiving file's next generation (it is the newest there)."""
    src, dst = state_file(tmp_path, "own"), state_file(tmp_path, "replica", 2 << 20)
    worker = HostCopy(src)
    shard = torch.arange(1000, dtype=torch.int64)
    for commits in (1, 2):
        worker.write([("shard", shard + commits), ("step", commits)], commits, 3, 1, 2)
    into = CommitFile(dst)
    earlier = CommitFile(src)
    assert copy(earlier, into) is not None
    (held,) = into.held()
    assert (held.commits, held.round, held.rank, held.world, held.generation) == (2, 3, 1, 2, 1)
    assert RECORD_BYTES < payload_bytes(held) <= into.slot_bytes
    reader = HostCopy(dst, frozenset({held.generation}))
    got = reader.read(reader.held()[-1], torch.device("cpu"))
    assert torch.equal(got["shard"], shard + 2) and got["step"] == 2
    assert reader.source(reader.held()[-1]) == "buddy" and HostCopy(src).source(HostCopy(src).held()[-1]) == (
        "own memory"
    )


def test_a_copy_that_does_not_match_its_record_is_not_taken(tmp_path: Path) -> None:
    """Its bytes differ from what the record's CRC covers: the slot stays empty, and the
    commit the file held before is still its newest."""
    src, dst = state_file(tmp_path, "own"), state_file(tmp_path, "replica")
    worker = HostCopy(src)
    worker.write([("step", 1)], 1, 1, 0, 1)
    into = CommitFile(dst)
    assert copy(CommitFile(src), into) is not None
    worker.write([("step", 2)], 2, 1, 0, 1)
    assert copy(CommitFile(src), into, corrupt=True) is None
    assert [r.commits for r in into.held()] == [1]


def test_a_commit_larger_than_a_slot_is_refused_by_its_record(tmp_path: Path) -> None:
    src, small = state_file(tmp_path, "own", 8 << 20), state_file(tmp_path, "small", 64 << 10)
    HostCopy(src).write([("big", torch.zeros(1 << 17, dtype=torch.int64))], 1, 1, 0, 1)
    source = CommitFile(src)
    record = source.newest()
    assert record is not None
    assert CommitFile(small).fits(source.raw_record(record)) is None


def test_a_send_cancelled_midway_leaves_the_file_free_to_close(tmp_path: Path) -> None:
    """The agent closes its files when it ends, a send in flight or not (the newest
    commit goes to the buddy just as a job's workers finish): a send cancelled while
    the buddy reads nothing leaves no view of the mapping behind, so the file closes
    (a view left in the cancelled send's frame made the agent exit 1 with a BufferError)."""
    path = state_file(tmp_path, "own", 80 << 20)
    HostCopy(path).write([("big", torch.zeros(2 << 20, dtype=torch.int64))], 1, 1, 0, 1)  # more than a socket takes
    source = CommitFile(path)
    record = source.newest()
    assert record is not None

    async def cancelled_midway() -> None:
        server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # reads nothing
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        sending = asyncio.create_task(_write_commit(writer, source, record))
        while writer.transport.get_write_buffer_size() == 0:  # until the send waits for the buddy
            await asyncio.sleep(0)
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        writer.close()
        server.close()

    asyncio.run(cancelled_midway())
    source.close()


async def _handshake(server_key: bytes, client_key: bytes) -> tuple[BaseException | None, BaseException | None]:
    outcome: list[BaseException | None] = []
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await accept(reader, writer, server_key)
            outcome.append(None)
        except ReplicaProtocolError as e:
            outcome.append(e)
        finally:
            writer.close()
            done.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client: BaseException | None = None
    try:
        _, writer = await connect("127.0.0.1", port, client_key)
        writer.close()
    except ReplicaProtocolError as e:
        client = e
    await done.wait()
    server.close()
    await server.wait_closed()
    return outcome[0], client


def test_both_sides_prove_they_hold_the_jobs_key() -> None:
    key = job_key("job", "token")
    assert asyncio.run(_handshake(key, key)) == (None, None)


def test_a_client_of_another_job_or_without_the_token_is_refused() -> None:
    for other in (job_key("other", "token"), job_key("job", None)):
        server, client = asyncio.run(_handshake(job_key("job", "token"), other))
        assert "did not prove it belongs to the job" in str(server)
        assert client is not None  # the server closed on it, never proved itself
