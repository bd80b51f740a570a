"""The built-in store server's limits, each with the reason for its value.

The server (`store/server/store_server.py`), its services and its call admission read them; tests
and `store serve` take their defaults from here.
"""

from __future__ import annotations

from elasticrun.store.wire import CLIENT_PING_MS, MAX_REPLY_BYTES

#: Calls in progress at once (watches and waits last): about 25 KiB each, so at most
#: ~2.5 GiB however many streams clients open; past it a call gets RESOURCE_EXHAUSTED.
#: A 1,000-node job holds a few thousand.
DEFAULT_MAX_CALLS = 100_000
#: A page of a prefix read: about this many bytes of keys and values (at least one key,
#: so up to a largest value more), or this many keys, whichever comes first. Encoding
#: one takes about a millisecond of CPU (a 1 MiB value alone, the largest, about 4 ms).
PAGE_BYTES = 256 << 10
PAGE_KEYS = 256
#: The most a c10d multi_get may answer at once: unlike a prefix read it cannot be
#: paged, and encoding a reply costs about 4 ms per MiB of the server's loop.
MAX_MULTI_GET_BYTES = 4 << 20
#: The most keys one c10d check, wait or multi_get may name (as many as a job's workers
#: may hold; duplicates count once in the work, every time in the reply), and the most
#: bytes its request may take, refused
#: before it is parsed; a multi_set writes at most MAX_MULTI_SET_KEYS keys (each write
#: keeps history and wakes watchers: ~10 µs a key). Their requests are parsed, bounded
#: and looked up by the handler, in the caller's turn (`Shares.turn`): one such call of
#: a worker's at a time, each a few milliseconds of the loop at most. Unbounded, a 1 MiB
#: list of one key 340,000 times held the loop 150 ms a call.
MAX_KEYS_PER_CALL = 10_000
MAX_KEY_LIST_BYTES = 256 << 10
MAX_MULTI_SET_KEYS = 1_024
#: The most of the loop's time one identity other than admin spends on those steps.
KEY_LIST_LOOP_SHARE = 0.25
#: How long a call may take to deliver its request message once its headers arrived:
#: a 1 MiB value over a slow link takes well under a second; a caller that sends headers
#: and nothing more holds its call (and its share) no longer than this.
MESSAGE_DEADLINE = 10.0
#: How long in-flight calls may finish when the server stops.
DEFAULT_STOP_GRACE = 2.0

#: Calls open at once on one connection. An agent holds a few watches and calls, a
#: worker one call. It also bounds what an anonymous flood queues ahead of the agents'
#: calls: gRPC's transport refuses the streams past it in C, but the ones it lets through
#: wait for the server's Python, in one queue with everyone's. With 256, 64 connections
#: queued 16,384 calls (an agent's put p99 0.3-2.7 s at 50,000 HEADERS a second); with
#: 64, 4,096 (BENCHMARKS.md, "a paced flood"). Not fewer: a client whose long-lived
#: streams (watches) fill its connection waits for one of them to end before any call.
MAX_STREAMS_PER_CONNECTION = 64

#: Pings keep idle connections (a quiet watch) alive through NATs and reveal dead
#: peers; the server must accept the client's pace.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # half the clients' pace: a ping that comes a little early is no abuse
    ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_MS // 2),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_REPLY_BYTES),
    # Calls open at once on one connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS):
    # a client queues past it, one that does not is refused the stream (REFUSED_STREAM)
    # by gRPC's transport, before any call exists. An agent holds a few, a worker one.
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    # a connection that has not finished its TLS handshake by then is closed
    ("grpc.server_handshake_timeout_ms", 5_000),
    # A connection with no call in progress (or never one: a flood of bare connections,
    # no token needed) is closed after this, with a GOAWAY: a client opens a new one for
    # its next call, and an agent always has one in progress (its watches).
    ("grpc.max_connection_idle_ms", 5_000),
]

#: Descriptors the serving process keeps for itself, out of reach of connections: an
#: agent hosting the store needs them for its workers' pipes, logs and /proc scans.
DESCRIPTOR_RESERVE = 512
#: Connections served at once at most, however many descriptors the process may have:
#: a 1,000-node job with 8 workers a node holds about 9,000.
MOST_CONNECTIONS = 50_000


def connection_cap(descriptors: int) -> int:
    """Connections served at once by a process that may hold `descriptors` descriptors.

    gRPC closes each connection past it as soon as it is accepted, so a flood of
    connections (each one descriptor) never takes the descriptors the process itself
    needs (`DESCRIPTOR_RESERVE`), and the connections already served (the agents') keep
    being served. It cannot keep some for authenticated callers: a connection shows who
    it is only with its first call."""
    return max(min(MOST_CONNECTIONS, descriptors - DESCRIPTOR_RESERVE), 64)
