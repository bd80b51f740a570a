"""A store client doing what an abusive client did, until SIGTERM.

    python tests/workers/store_abuser.py ENDPOINT CREDENTIAL RANGE_PREFIX WATCH_PREFIX [WATCHES [READERS]]

Over 8 connections: WATCHES (2,000) prefix watches of WATCH_PREFIX (those the store
refuses are counted, not retried), and READERS (4) loops reading every key under
RANGE_PREFIX again and again.
The watches start at the store's latest write, which the caller makes under
WATCH_PREFIX, so that each open one says so with that event at once. Prints `abusing`
once every watch is open or refused and each loop has read the prefix whole, then, on
SIGTERM, `ranges=N mib=M open_watches=O refused_watches=W errors=E`. It uses only the client API that every
version of elasticrun has (GrpcStore's get_prefix and watch), so that
bench/bench_abuse.py can run it against an older checkout as well.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from elasticrun.errors import ElasticrunError
from elasticrun.store.client.grpc_store import GrpcStore

CONNECTIONS = 8


async def main(
    endpoint: str, credential: str, range_prefix: str, watch_prefix: str, watches: int = 2_000, readers: int = 4
) -> None:
    clients = [GrpcStore(endpoint, token=credential, timeout=60) for _ in range(CONNECTIONS)]
    counts = {"ranges": 0, "bytes": 0, "open_watches": 0, "refused_watches": 0, "errors": 0}
    revision = (await clients[0].get_prefix(watch_prefix + "\0")).revision  # just the revision

    async def hold_watch(client: GrpcStore) -> None:
        try:
            first = True
            async for _ in client.watch(watch_prefix, start_revision=revision, prefix=True):
                counts["open_watches"] += first
                first = False
        except ElasticrunError:
            counts["refused_watches"] += 1

    async def read(client: GrpcStore) -> None:
        while True:
            try:
                result = await client.get_prefix(range_prefix)
            except ElasticrunError:
                counts["errors"] += 1
                await asyncio.sleep(0.01)
                continue
            counts["ranges"] += 1
            counts["bytes"] += sum(len(kv.value) for kv in result.kvs)

    tasks = [asyncio.create_task(hold_watch(clients[i % CONNECTIONS])) for i in range(watches)]
    tasks += [asyncio.create_task(read(clients[i % CONNECTIONS])) for i in range(readers)]
    while counts["ranges"] < readers or counts["open_watches"] + counts["refused_watches"] < watches:
        await asyncio.sleep(0.01)
    print("abusing", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print(
        f"ranges={counts['ranges']} mib={counts['bytes'] >> 20} open_watches={counts['open_watches']} "
        f"refused_watches={counts['refused_watches']} errors={counts['errors']}",
        flush=True,
    )
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5], *map(int, sys.argv[5:7])))
