"""The state replica channel's wire: who may talk on it, and how a commit travels on it.

Agents of one job send each other their workers' commits over TCP
(elasticrun.agent.state_replicas). Every connection starts with a challenge both ways,
before anything else is read:

    server -> client   MAGIC, a random nonce Ns (32 bytes)
    client -> server   MAGIC, a random nonce Nc, HMAC(key, "c" Ns Nc)
    server -> client   HMAC(key, "s" Ns Nc)

The key (`job_key`) is derived from the job's store token and its id: only an agent
that holds the token proves it belongs to the job, and a client learns that the server
does too before it takes a commit from it. Without a store token the key is derived
from the job id alone, which anyone who can read the job's records knows: then only
the network protects the channel, as it protects the store (docs/in-process.md says
so). The channel is not encrypted, and only TCP's checksum guards the tensors' bytes
in transit; a commit's record and structure are checked by their CRC
(elasticrun.state_layout), so a commit cut short is never taken.

Then one request:

    PUT  client -> server   b"P", a record (RECORD_BYTES)
         server -> client   b"\\x01" go on, b"\\x00" not now (it does not know its predecessor yet)
         client -> server   its commit's bytes, then b"\\x01" (whole) or b"\\x00" (the sender's
                            slot changed while it read it)
         server -> client   b"\\x01" kept, b"\\x00" not
    NEWER                   as PUT, with b"N": a commit newer than the last one PUT, kept
                            while it is the newest (a PUT's, until two more are PUT)
    GET  client -> server   b"G", a global rank and a world size (int64 each)
         server -> client   a count (up to SLOTS) of the commits it holds of that rank made at
                            that world size, then each, oldest first: a record, its bytes

A record names its commit's size, and a commit larger than the receiver's slot is
refused before any of it is read: nobody reads more than a state file holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import struct

from elasticrun.errors import ElasticrunError

MAGIC = b"ERREPL01"
NONCE = 32
MAC = 32
PUT = b"P"
NEWER = b"N"
GET = b"G"
WHOLE = b"\x01"
TORN = b"\x00"
#: a GET's rank and world size
WHICH = struct.Struct("<qq")
#: the bytes read or written at a time
CHUNK = 1 << 20
#: a stream's buffer, each way: asyncio's default (64 KiB) pauses the socket so often
#: that a commit crossed loopback at a quarter of the speed; a connection holds about
#: twice this in memory at most
BUFFER = 4 * CHUNK
#: how long a peer may take over the challenge, and over each chunk of a request
STEP_TIMEOUT = 10.0


class ReplicaProtocolError(ElasticrunError):
    """A peer on the replica channel did not prove it belongs to the job, or sent what is not a request."""


def job_key(run_id: str, token: str | None) -> bytes:
    """The channel's key: the job's store token, bound to the job."""
    return hmac.new((token or "").encode(), b"elasticrun state replicas\0" + run_id.encode(), hashlib.sha256).digest()


def _mac(key: bytes, side: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(key, side + ns + nc, hashlib.sha256).digest()


async def read(reader: asyncio.StreamReader, n: int) -> bytes:
    """Exactly `n` bytes, within STEP_TIMEOUT; a ReplicaProtocolError if the peer stops short."""
    try:
        async with asyncio.timeout(STEP_TIMEOUT):
            return await reader.readexactly(n)
    except (asyncio.IncompleteReadError, TimeoutError) as e:
        raise ReplicaProtocolError(f"the peer sent {len(getattr(e, 'partial', b''))} of {n} bytes") from None


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
    """The server's side of the challenge: returns once the client proved it holds the key."""
    writer.transport.set_write_buffer_limits(high=BUFFER)
    ns = secrets.token_bytes(NONCE)
    writer.write(MAGIC + ns)
    await writer.drain()
    hello = await read(reader, len(MAGIC) + NONCE + MAC)
    if hello[: len(MAGIC)] != MAGIC:
        raise ReplicaProtocolError("not an elasticrun replica client")
    nc, proof = hello[len(MAGIC) : len(MAGIC) + NONCE], hello[len(MAGIC) + NONCE :]
    if not hmac.compare_digest(proof, _mac(key, b"c", ns, nc)):
        raise ReplicaProtocolError("the client did not prove it belongs to the job (another job's, or no token)")
    writer.write(_mac(key, b"s", ns, nc))
    await writer.drain()


async def connect(host: str, port: int, key: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a peer's replica port, once the peer proved it holds the key."""
    async with asyncio.timeout(STEP_TIMEOUT):
        reader, writer = await asyncio.open_connection(host, port, limit=BUFFER)
        writer.transport.set_write_buffer_limits(high=BUFFER)
    try:
        hello = await read(reader, len(MAGIC) + NONCE)
        if hello[: len(MAGIC)] != MAGIC:
            raise ReplicaProtocolError(f"{host}:{port} is not an elasticrun replica port")
        ns, nc = hello[len(MAGIC) :], secrets.token_bytes(NONCE)
        writer.write(MAGIC + nc + _mac(key, b"c", ns, nc))
        await writer.drain()
        if not hmac.compare_digest(await read(reader, MAC), _mac(key, b"s", ns, nc)):
            raise ReplicaProtocolError(f"{host}:{port} did not prove it belongs to the job")
    except BaseException:
        writer.close()
        raise
    return reader, writer
