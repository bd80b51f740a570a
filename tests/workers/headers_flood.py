"""An anonymous client that opens gRPC calls and never sends their message.

    python tests/workers/headers_flood.py HOST:PORT CONNECTIONS CALLS SECONDS [PATH [CREDENTIAL]] [--rate=N] [--once]

Over CONNECTIONS plain TCP connections it speaks HTTP/2 by hand: the preface, its
SETTINGS, then HEADERS frames as fast as the server takes them, for SECONDS, until
CALLS in all (spread over the connections) or until SIGTERM, whichever comes first, each opening a
call of PATH (default `/elasticrun.store.v1.C10dStore/Set`) with no message, and no token
(or CREDENTIAL as its bearer): what an attacker sends. With `--rate=N`, paced: N
frames a second in all, sent every 10 ms, instead of as fast as the server takes them.
It answers the server's SETTINGS and PINGs and reads
everything else, counting what the server did with the calls; a connection the server
closes is opened again (what an attacker does), while time and calls remain (with
`--once`, not: the flood ends with the connections the server keeps); it holds
the connections open until SIGTERM. Prints `flooding` once every connection has sent
its first 1,000 frames, sent for a second, or stopped sending (or `flood-ended` if none could send a frame),
`flood-sent` once all have stopped sending before SIGTERM, and on SIGTERM one line
`sent=N refused_streams=R answered=A goaway=G connections=O closed=C`:

- refused_streams: RST_STREAM frames (the server refused or reset a call),
- answered: HEADERS frames from the server (initial metadata or a status),
- goaway: connections the server told to go away, connections: connections opened,
  closed: connections that ended.

Standard library only, and bounded: CALLS frames at most, loopback only by its use.
"""

from __future__ import annotations

import asyncio
import signal
import struct
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_HEADERS, ACK = 0x4, 0x1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (short strings)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def header_block(authority: str, path: str, credential: str = "") -> bytes:
    # 0x83 = :method POST, 0x86 = :scheme http (HPACK's static table)
    fields = [(b":path", path.encode()), (b":authority", authority.encode()),
              (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    if credential:
        fields.append((b"authorization", b"Bearer " + credential.encode()))
    return b"\x83\x86" + b"".join(_literal(name, value) for name, value in fields)


async def read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counts: dict[str, int]) -> None:
    """Answer the server's SETTINGS and PINGs and count what it did with the calls, until the connection ends."""
    while True:
        head = await reader.readexactly(9)
        length = int.from_bytes(head[:3], "big")
        kind, flags = head[3], head[4]
        payload = await reader.readexactly(length)
        if kind == SETTINGS and not flags & ACK:
            writer.write(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            writer.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            counts["refused_streams"] += 1
        elif kind == HEADERS:
            counts["answered"] += 1
        elif kind == GOAWAY:
            counts["goaway"] += 1


async def connection(
    host: str, port: int, path: str, credential: str, calls: int, seconds: float, counts: dict[str, int],
    rate: float = 0.0, once: bool = False,
) -> None:
    """One of the flood's connections: opened again each time the server closes it, while time and calls remain."""
    start = time.monotonic()
    end = start + seconds
    sent = 0
    started = stopped = False
    block = header_block(f"{host}:{port}", path, credential)
    while sent < calls and time.monotonic() <= end:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:  # refused: the server is gone, or past its backlog
            break
        counts["connections"] += 1
        writer.write(PREFACE + frame(SETTINGS, 0, 0))
        stream = 1
        reading = asyncio.create_task(read(reader, writer, counts))
        try:
            while sent < calls and not reading.done() and not writer.is_closing() and time.monotonic() <= end:
                if not started and (sent >= 1000 or time.monotonic() - start >= 1.0):
                    started = True
                    counts["started"] += 1
                if rate and sent >= (due := int((time.monotonic() - start) * rate)):
                    await asyncio.sleep(0.01)  # paced: the frames due so far are sent
                    continue
                writer.write(frame(HEADERS, END_HEADERS, stream, block))
                stream += 2
                sent += 1
                counts["sent"] += 1
                if sent % 64 == 0 or (rate and sent >= due):
                    await writer.drain()
            await writer.drain()
            if not reading.done() and (sent >= calls or time.monotonic() > end):  # hold it until SIGTERM
                if not started:
                    started = True
                    counts["started"] += 1
                stopped = True
                counts["stopped"] += 1
                await reading
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            counts["closed"] += 1
            reading.cancel()
            writer.close()
        if once:
            break
    if not started:  # stopped before its first 1,000 frames or its first second: under way all the same
        counts["started"] += 1
    if not stopped:
        counts["stopped"] += 1


async def main(
    endpoint: str, connections: int, calls: int, seconds: float,
    path: str = "/elasticrun.store.v1.C10dStore/Set", credential: str = "", rate: float = 0.0, once: bool = False,
) -> None:
    host, _, port = endpoint.rpartition(":")
    counts = dict.fromkeys(
        ("sent", "refused_streams", "answered", "goaway", "connections", "closed", "started", "stopped"), 0
    )
    each = -(-calls // connections)
    tasks = [asyncio.create_task(connection(host.strip("[]"), int(port), path, credential, each, seconds, counts,
                                            rate / connections, once))
             for _ in range(connections)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while counts["started"] < connections and not all(t.done() for t in tasks):
        await asyncio.sleep(0.01)
    print("flooding" if counts["sent"] else "flood-ended", flush=True)
    while counts["stopped"] < connections and not all(t.done() for t in tasks) and not stop.is_set():
        await asyncio.sleep(0.01)
    if not stop.is_set():
        print("flood-sent", flush=True)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for kept in ("started", "stopped"):
        counts.pop(kept)
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    paced = [float(a.removeprefix("--rate=")) for a in sys.argv if a.startswith("--rate=")]
    args = [a for a in sys.argv[1:] if not a.startswith("--rate=") and a != "--once"]
    asyncio.run(main(args[0], int(args[1]), int(args[2]), float(args[3]), *args[4:6], rate=sum(paced),
                     once="--once" in sys.argv))
