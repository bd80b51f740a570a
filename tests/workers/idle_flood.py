"""An anonymous client that opens HTTP/2 connections and does nothing with them.

    python tests/workers/idle_flood.py HOST:PORT CONNECTIONS SECONDS

Opens CONNECTIONS plain TCP connections to the store (as fast as it can, bounded by
CONNECTIONS), and on each speaks the HTTP/2 preface and SETTINGS, acknowledges the
server's SETTINGS and PINGs, and opens no stream and sends no token: what holds a
server's descriptor for nothing. Prints `opened N failed F` once every connection is
made or failed, then each second `open N` while any is open, and `all-closed S` (seconds
since the last was opened) once the server closed them all; it stops after SECONDS or
on SIGTERM, printing `held N` (connections still open then). Standard library only;
bounded by CONNECTIONS and SECONDS, loopback only by its use.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, ACK = 0x4, 0x6, 0x1


def frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


async def hold(host: str, port: int, opened: asyncio.Event, state: dict[str, int]) -> None:
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        state["failed"] += 1
        return
    finally:
        state["tried"] += 1
        if state["tried"] == state["wanted"]:
            opened.set()
    state["open"] += 1
    try:
        writer.write(PREFACE + frame(SETTINGS, 0))
        while True:
            head = await reader.readexactly(9)
            payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
            if head[3] == SETTINGS and not head[4] & ACK:
                writer.write(frame(SETTINGS, ACK))
            elif head[3] == PING and not head[4] & ACK:
                writer.write(frame(PING, ACK, payload))
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        state["open"] -= 1
        writer.close()


async def main(endpoint: str, connections: int, seconds: float) -> None:
    host, _, port = endpoint.rpartition(":")
    state = {"wanted": connections, "tried": 0, "failed": 0, "open": 0}
    opened = asyncio.Event()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    end = time.monotonic() + seconds
    tasks = [asyncio.create_task(hold(host.strip("[]"), int(port), opened, state)) for _ in range(connections)]
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(end - time.monotonic(), 0)):
            await opened.wait()
    start = time.monotonic()
    print(f"opened {state['open']} failed {state['failed']}", flush=True)
    while time.monotonic() < end and not stop.is_set():
        if not state["open"]:
            print(f"all-closed {time.monotonic() - start:.1f}", flush=True)
            break
        print(f"open {state['open']}", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    print(f"held {state['open']}", flush=True)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
