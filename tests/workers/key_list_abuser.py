"""A worker that sends the store the longest key lists it can, until SIGTERM.

    python tests/workers/key_list_abuser.py ENDPOINT WORKER_CREDENTIAL [IN_FLIGHT]

What an abusive worker does, with its job's worker credential: IN_FLIGHT (16)
c10d calls at a time, over 4 connections, each a Check, a Wait or a MultiGet (in turn)
naming either the issue's list (the one-letter key `r` 340,000 times: 1 MiB) or 10,000
distinct keys (the most a store that bounds key lists takes, and all that a job's
workers may hold: about 110 KB). It sets all those keys first (in multi_sets of 1,024),
so that no call waits. Prints `abusing` once each kind of call has been answered, then,
on SIGTERM, `calls=N refused=R errors=E`: the calls answered, those the store refused
(RESOURCE_EXHAUSTED: a bound), and any other error.
It speaks gRPC with raw messages (the generated protobuf classes only), so that
bench/bench_abuse.py can run it against an older checkout as well.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys

import grpc

from elasticrun.proto import store_pb2 as pb

CONNECTIONS = 4
SERVICE = "/elasticrun.store.v1.C10dStore/"
DISTINCT = 10_000
COPIES = 340_000


async def main(endpoint: str, credential: str, in_flight: int = 16) -> None:
    channels = [grpc.aio.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 4 << 20)])
                for _ in range(CONNECTIONS)]
    metadata = (("authorization", f"Bearer {credential}"),)
    names = ["r"] + [f"rank{i:05d}" for i in range(DISTINCT - 1)]
    multi_set = channels[0].unary_unary(SERVICE + "MultiSet")
    for start in range(0, DISTINCT, 1024):
        batch = names[start : start + 1024]
        await multi_set(pb.MultiSetRequest(keys=batch, values=[b"x"] * len(batch)).SerializeToString(),
                        metadata=metadata, timeout=60)
    lists = (["r"] * COPIES, names)
    requests = [
        (method, make(keys=keys, **extra).SerializeToString())
        for keys in lists
        for method, make, extra in (
            ("Check", pb.CheckRequest, {}),
            ("Wait", pb.WaitRequest, {"timeout_seconds": 10}),
            ("MultiGet", pb.MultiGetRequest, {"timeout_seconds": 10}),
        )
    ]
    counts = {"calls": 0, "refused": 0, "errors": 0}
    answered: set[int] = set()
    turns = itertools.cycle(range(len(requests)))

    async def abuse(channel: grpc.aio.Channel) -> None:
        while True:
            which = next(turns)
            method, data = requests[which]
            try:
                await channel.unary_unary(SERVICE + method)(data, metadata=metadata, timeout=60)
                counts["calls"] += 1
            except grpc.aio.AioRpcError as e:
                if e.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    counts["errors"] += 1
                    print(f"error: {e.code().name}: {e.details()}", flush=True)
                    await asyncio.sleep(0.01)
                    continue
                counts["refused"] += 1
            answered.add(which)

    tasks = [asyncio.create_task(abuse(channels[i % CONNECTIONS])) for i in range(in_flight)]
    while len(answered) < len(requests):
        await asyncio.sleep(0.01)
    print("abusing", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4])))
