"""The store keeps room for authenticated callers (`store/server/connections.py`).

Real store servers on loopback, real HTTP/2 connections: a connection whose call carries
no credential is shut once refused; past the anonymous share the oldest connections
that never authenticated are shut, never one that did.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import pytest

from elasticrun.errors import StoreAuthError
from elasticrun.store.client.grpc_store import GrpcStore
from elasticrun.store.server import connections as server_connections
from elasticrun.store.server.connections import Connections, peer_of, reserve_of
from elasticrun.store.server.store_server import StoreServer

pytestmark = pytest.mark.timeout(60)

TOKEN = "connections-test-token"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, SETTINGS, END_HEADERS = 0x1, 0x4, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def anonymous_call(authority: str) -> bytes:
    """A HEADERS frame opening a call of Store/Range with no token (HPACK literals, no Huffman)."""
    fields = [(b":path", b"/elasticrun.store.v1.Store/Range"), (b":authority", authority.encode()),
              (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    block = b"\x83\x86" + b"".join(b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v for n, v in fields)
    return frame(HEADERS, END_HEADERS, 1, block)


class Raw:
    """A bare HTTP/2 connection to the store: the preface and empty SETTINGS, nothing more unless told."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.ended = asyncio.Event()
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while await self.reader.read(65536):
                pass
        except OSError:
            pass
        self.ended.set()

    async def close(self) -> None:
        self._reading.cancel()
        self.writer.close()


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    s = StoreServer("127.0.0.1", 0, token=TOKEN)
    await s.start()
    try:
        yield s
    finally:
        await s.stop(0)


async def connect(server: StoreServer, count: int) -> list[Raw]:
    raws = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(PREFACE + frame(SETTINGS, 0, 0))
        raws.append(Raw(reader, writer))
    return raws


def test_peers_are_named_alike_by_grpc_and_the_socket() -> None:
    assert peer_of("ipv4:127.0.0.1:41234") == ("127.0.0.1", 41234)
    assert peer_of("ipv6:[::1]:5000") == ("::1", 5000)
    assert peer_of("ipv6:[::ffff:10.0.0.5]:7") == ("10.0.0.5", 7)
    assert peer_of("unix:/tmp/store.sock") is None
    assert reserve_of(512) == 64 and reserve_of(4) == 1


async def test_a_connection_that_calls_without_a_credential_is_shut_after_its_refusal(server: StoreServer) -> None:
    (raw,) = await connect(server, 1)
    raw.writer.write(anonymous_call(server.endpoint))
    async with asyncio.timeout(20):
        await raw.ended.wait()
    await raw.close()
    assert server.connections is not None and server.connections.shut_count == 1
    # a client with a wrong token still reads why, before its connection is shut
    wrong = GrpcStore(server.endpoint, token="not-the-token", timeout=10)
    try:
        with pytest.raises(StoreAuthError, match="missing or wrong store token"):
            await wrong.get("/elasticrun/x")
    finally:
        await wrong.close()


async def test_past_the_anonymous_share_the_oldest_unauthenticated_are_shut(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cap of 16 keeps 2 for authenticated callers: of 20 connections that never called,
    the 6 past 14 are shut; the agent's connection, the oldest of all, is kept."""
    monkeypatch.setattr(server_connections, "FIRST_CALL_GRACE", 0.0)
    monkeypatch.setattr(server_connections, "SCAN_GAP", 0.0)
    connections = Connections(server.port, cap=16)
    assert connections.anonymous_share == 14
    server.connections = connections  # what the calls report to (the server's own sweeps keep its real cap)
    agent = GrpcStore(server.endpoint, token=TOKEN, timeout=10)
    try:
        await agent.put("/elasticrun/x", b"1")
        raws = await connect(server, 20)
        async with asyncio.timeout(20):  # every connection accepted by gRPC, then 20 - 14 shut
            while connections.shut_count < 6:
                connections.sweep()
                await asyncio.sleep(0.01)
            while sum(raw.ended.is_set() for raw in raws) < 6:
                await asyncio.sleep(0.01)
            scans = connections.scans
            while connections.scans == scans:  # one more count: within the share now, nothing more is shut
                connections.sweep()
                await asyncio.sleep(0.01)
        assert connections.shut_count == 6 and connections.found == 15, connections.found
        flood = {raw.writer.get_extra_info("sockname")[:2] for raw in raws}
        assert connections.shut <= flood, "a connection that authenticated was shut"
        assert await agent.get("/elasticrun/x") is not None  # its connection kept
        for raw in raws:
            await raw.close()
    finally:
        await agent.close()
