"""Fuzzing the built-in store server.

A real server process — `python -m elasticrun store serve` with a token, logging at
DEBUG — on loopback gets, through plain gRPC channels with identity serializers:

- malformed request bytes, to every method of both services (unary, server-streaming
  Watch, bidi LeaseKeepAlive): random bytes and mutated valid requests;
- valid but hostile messages: keys and values at and just past their bounds, empty
  keys, deep prefixes, NaN/infinite/huge/tiny TTLs and timeouts, int64 extremes,
  thousands of keys in one request, mismatched multi_set lists;
- a client process that opens hundreds of connections, each with a watch, a
  keep-alive stream and a waiting get, abandons half of them, and is SIGKILLed — in
  rounds;
- the key-count bound (100,000 by default) reached and passed, and, on a server with
  small limits, the byte and lease bounds: RSS stays within the limits plus a margin
  although several times as much was sent;
- clients without the token or with a wrong one: UNAUTHENTICATED on every method, and
  no change to the store.

Properties: every answer is a deliberate status (never UNKNOWN, which is an exception
escaping a handler, nor INTERNAL or UNAVAILABLE); the server process stays up, logs no
traceback and never the token, and answers a normal client afterwards; its memory and
file descriptors return to their level after the hostile clients are gone.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elasticrun.errors import StoreSettingError
from elasticrun.proto import store_pb2 as pb
from elasticrun.store.client.c10d import C10dClient
from elasticrun.store.client.dial import grpc_target
from elasticrun.store.interface import MAX_LEASE_TTL
from elasticrun.store.server.limits import MAX_MULTI_SET_KEYS
from elasticrun.store.server.memory import DEFAULT_HISTORY_BYTES, DEFAULT_MAX_KEYS
from tests.support.helpers import ELASTICRUN, wait_until

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MIB = 1 << 20
#: how long one fuzzed call may take: a valid waiting call (get of a missing key) ends here
CALL_TIMEOUT = 0.3

# --- the server under test -----------------------------------------------------------------

#: a server with chosen limits (store serve has no flags for them), otherwise the same
RUNNER = """
import asyncio, json, sys
from elasticrun.store.server.memory import MemoryStore
from elasticrun.store.server.store_server import StoreServer

async def main():
    engine = MemoryStore(**json.loads(sys.argv[1]))
    server = StoreServer("127.0.0.1", 0, engine=engine, token=sys.argv[2], max_calls=int(sys.argv[3]))
    await server.start()
    print(f"elasticrun store serving on {server.endpoint}", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    endpoint: str
    token: str
    log: Path

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def check_healthy(self) -> None:
        """Up, answering a normal client, no traceback logged, the token never logged."""
        assert self.proc.poll() is None, f"the store server died ({self.proc.returncode}):\n{self.stderr()[-4000:]}"
        client = C10dClient(self.endpoint, token=self.token, timeout=10)
        try:
            key = "healthy-" + secrets.token_hex(4)
            client.set(key, b"yes")
            assert client.get(key, timeout=5) == b"yes"
            client.delete_key(key)
        finally:
            client.close()
        log = self.stderr()
        assert "Traceback" not in log, log[-4000:]
        assert self.token not in log, "the token appears in the server's log"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(tmp: Path, *, limits: dict[str, int] | None = None, max_calls: int = 100_000) -> Served:
    """`elasticrun store serve` (or RUNNER with `limits`) on 127.0.0.1, a token, DEBUG logs."""
    token = "tok-" + secrets.token_hex(12)
    token_file = tmp / f"token-{token[-6:]}"
    token_file.write_text(token + "\n")
    log = tmp / f"store-{token[-6:]}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.update(LOGLEVEL="DEBUG", ELASTICRUN_STORE_TOKEN="")
    if limits is None:
        argv = [*ELASTICRUN, "store", "serve", "--host", "127.0.0.1", "--port", "0",
                "--token-file", str(token_file)]
    else:
        argv = [sys.executable, "-c", RUNNER, json.dumps(limits), token, str(max_calls)]
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
    line = proc.stdout.readline().decode()  # bounded by the test's timeout
    if "serving on" not in line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the store did not start: {line!r}\n{log.read_text()}")
    return Served(proc, line.split()[-1], token, log)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start_server(tmp_path_factory.mktemp("store"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Served]:
    s = start_server(tmp_path)
    try:
        yield s
    finally:
        s.stop()


# --- raw calls ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    path: str
    name: str
    client_streaming: bool
    server_streaming: bool
    request: type

    def __repr__(self) -> str:
        return self.path


METHODS = [
    Method(f"/{service.full_name}/{m.name}", m.name, m.client_streaming, m.server_streaming,
           getattr(pb, m.input_type.name))
    for service in pb.DESCRIPTOR.services_by_name.values()
    for m in service.methods
]
BY_NAME = {m.name: m for m in METHODS}

#: deliberate answers; UNKNOWN (an exception escaped a handler), INTERNAL, UNAVAILABLE
#: (the server went away) and UNIMPLEMENTED (for a served method) are not among them
ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED,
}


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token is not None else ()


def open_channel(endpoint: str) -> grpc.Channel:
    """A channel of its own connection: gRPC shares one between channels of the same
    target and options unless told not to, and the server takes 64 calls a connection."""
    return grpc.insecure_channel(
        endpoint, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                           ("grpc.use_local_subchannel_pool", 1)]
    )


def raw_call(
    channel: grpc.Channel, method: Method, payloads: Sequence[bytes], md: Sequence[tuple[str, str]],
    timeout: float = CALL_TIMEOUT,
) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Send request bytes as they are; the status, its details and the reply bytes."""
    try:
        if method.client_streaming:
            replies = list(channel.stream_stream(method.path)(iter(payloads), timeout=timeout, metadata=md))
        elif method.server_streaming:
            stream = channel.unary_stream(method.path)(payloads[0], timeout=timeout, metadata=md)
            replies = [next(stream)]  # a watch confirms itself, then streams until cancelled
            stream.cancel()
        else:
            replies = [channel.unary_unary(method.path)(payloads[0], timeout=timeout, metadata=md)]
    except grpc.RpcError as e:
        return e.code(), e.details() or "", []
    return grpc.StatusCode.OK, "", replies


def state(channel: grpc.Channel, token: str) -> tuple[int, list[tuple[str, bytes, int]], int]:
    """(revision, every key with its value and mod revision, key count): what a write changes."""
    md = metadata(token)
    pages = [
        pb.RangeReply.FromString(page)
        for page in channel.unary_stream(BY_NAME["RangePages"].path)(
            pb.RangeRequest(key="", prefix=True).SerializeToString(), metadata=md, timeout=10
        )
    ]
    assert len({page.revision for page in pages}) == 1, "the pages of one read are at one revision"
    count = pb.NumKeysReply.FromString(
        channel.unary_unary(BY_NAME["NumKeys"].path)(b"", metadata=md, timeout=10)
    ).count
    return pages[0].revision, [(kv.key, kv.value, kv.mod_revision) for page in pages for kv in page.kvs], count


def wipe(channel: grpc.Channel, token: str) -> None:
    channel.unary_unary(BY_NAME["DeleteRange"].path)(
        pb.DeleteRangeRequest(key="", prefix=True).SerializeToString(), metadata=metadata(token), timeout=10
    )
    # (waiting calls fuzzed into asking for the empty key return at once: it is refused)


@pytest.fixture(scope="module")
def channel(served: Served) -> Iterator[grpc.Channel]:
    ch = open_channel(served.endpoint)
    wipe(ch, served.token)
    yield ch
    ch.close()


# --- 0. the clients' endpoint check ------------------------------------------------------------


@settings(FUZZ, max_examples=200)
@given(endpoint=st.one_of(
    st.text(max_size=30),
    st.builds(lambda h, p: f"{h}:{p}", st.text(max_size=10), st.one_of(st.text(max_size=6), st.integers().map(str))),
))
@example(endpoint="h:²")  # str.isdigit(), but int() refuses it
@example(endpoint="[::1]:١")
def test_client_endpoint_check_never_crashes(endpoint: str) -> None:
    try:
        assert grpc_target(endpoint) == endpoint
    except StoreSettingError as e:
        assert "malformed store endpoint" in str(e)


# --- 1. malformed bytes ---------------------------------------------------------------------


def _mutate(data: bytes, how: int, at: int, junk: bytes) -> bytes:
    at = at % (len(data) + 1)
    if how == 0:
        return data[:at]  # truncated
    if how == 1:
        return data[:at] + junk + data[at:]  # spliced
    if how == 2 and data:
        return data[:at] + bytes([data[at % len(data)] ^ 0xFF]) + data[at + 1:]  # a byte flipped
    return data + junk


VALID = {
    "Put": pb.PutRequest(key="a/b", value=b"v", lease=0),
    "Range": pb.RangeRequest(key="a/", prefix=True),
    "Watch": pb.WatchRequest(key="a/", prefix=True, start_revision=1),
    "LeaseKeepAlive": pb.LeaseKeepAliveRequest(lease=12345),
    "MultiSet": pb.MultiSetRequest(keys=["a", "b"], values=[b"1", b"2"]),
    "Wait": pb.WaitRequest(keys=[""], timeout_seconds=0.01),
}

malformed = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"\xff" * 10, b"\x0a\x02\xff\xfe", b"\x0a\x80\x80\x80\x80\x10", b"\x0a\xff\xff\xff\xff\x0f",
                     b"\x12\x05abc", b"\x08" + b"\xff" * 11, b"\x0b\x0c", b"\x07", b"\x0a\x03a\x00b"]),
    st.builds(
        _mutate,
        st.sampled_from(sorted(VALID)).map(lambda name: VALID[name].SerializeToString()),
        st.integers(0, 3), st.integers(0, 1000), st.binary(min_size=1, max_size=8),
    ),
)


@FUZZ
@given(method=st.sampled_from(METHODS), payloads=st.lists(malformed, min_size=1, max_size=3))
@example(method=BY_NAME["Put"], payloads=[b"\x0a\x02\xff\xfe"])  # a key that is not UTF-8
@example(method=BY_NAME["Watch"], payloads=[b"\xff"])
@example(method=BY_NAME["LeaseKeepAlive"], payloads=[b"\x08\x01", b"\xff"])
def test_malformed_bytes_get_a_deliberate_status(
    served: Served, channel: grpc.Channel, method: Method, payloads: list[bytes]
) -> None:
    code, details, _ = raw_call(channel, method, payloads, metadata(served.token))
    assert code in ALLOWED, f"{method} {payloads!r}: {code} {details}"
    assert served.proc.poll() is None


def test_malformed_bytes_leave_the_server_well(served: Served, channel: grpc.Channel, reliability) -> None:
    # runs after the fuzz above (file order): the server is still up and clean
    before = served.rss_mib()
    for method in METHODS:
        code, details, _ = raw_call(channel, method, [b"\xff\xff\xff"], metadata(served.token))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in details, (method, code, details)
    served.check_healthy()
    reliability.record(
        scenario="store: malformed request bytes",
        injected=f"{FUZZ.max_examples} hypothesis examples of random and mutated bytes over the {len(METHODS)} methods "
        "(unary, Watch, LeaseKeepAlive)",
        happened="every call answered INVALID_ARGUMENT or another deliberate status, no traceback logged, "
        "the server kept serving",
        lost="nothing", server_rss_mib=round(before, 1),
    )


# --- 2. valid but hostile messages -------------------------------------------------------

NAN, INF = math.nan, math.inf
keys = st.one_of(
    st.sampled_from(["", "k", "/", "a/b", "k" * 4096, "k" * 4097, "é" * 2048, "é" * 2049, "/" * 4000,
                     "\U0001f600" * 1024, "\U0001f600" * 1025, "\u202e", "a\x00b"]),
    st.text(max_size=16),
)
values = st.one_of(st.sampled_from([0, 1, 7, MIB, MIB + 1]).map(bytes), st.binary(max_size=16))
int64 = st.one_of(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**62]), st.integers(-(2**63), 2**63 - 1))
seconds = st.sampled_from([0.0, 0.01, -1.0, NAN, INF, -INF, 1e300, 5e-324, 0.05])
many_keys = st.one_of(
    st.lists(keys, max_size=4), st.sampled_from([[""] * 50_000, [f"m{i}" for i in range(5000)], ["k" * 4097]])
)

hostile = st.one_of(
    st.builds(lambda k, v, lease: ("Put", pb.PutRequest(key=k, value=v, lease=lease)), keys, values, int64),
    st.builds(lambda k, p: ("Range", pb.RangeRequest(key=k, prefix=p)), keys, st.booleans()),
    st.builds(lambda k, p: ("DeleteRange", pb.DeleteRangeRequest(key=k, prefix=p)), keys, st.booleans()),
    st.builds(
        lambda k, v, r, lease: (
            "CompareAndPut", pb.CompareAndPutRequest(key=k, value=v, expected_mod_revision=r, lease=lease)
        ),
        keys, values, int64, int64,
    ),
    st.builds(
        lambda k, r: ("CompareAndDelete", pb.CompareAndDeleteRequest(key=k, expected_mod_revision=r)), keys, int64
    ),
    st.builds(lambda t: ("LeaseGrant", pb.LeaseGrantRequest(ttl_seconds=t)), seconds),
    st.builds(lambda lease: ("LeaseRevoke", pb.LeaseRevokeRequest(lease=lease)), int64),
    st.builds(
        lambda ls: ("LeaseKeepAlive", [pb.LeaseKeepAliveRequest(lease=x) for x in ls]),
        st.lists(int64, min_size=1, max_size=20),
    ),
    st.builds(
        lambda k, p, r: ("Watch", pb.WatchRequest(key=k, prefix=p, start_revision=r)), keys, st.booleans(), int64
    ),
    st.builds(lambda k, v: ("Set", pb.SetRequest(key=k, value=v)), keys, values),
    st.builds(lambda k, t: ("Get", pb.GetRequest(key=k, timeout_seconds=t)), keys, seconds),
    st.builds(lambda k, a: ("Add", pb.AddRequest(key=k, amount=a)), st.sampled_from(["", "n", "counter"]), int64),
    st.builds(lambda k, e, d: ("CompareSet", pb.CompareSetRequest(key=k, expected=e, desired=d)), keys, values, values),
    st.builds(lambda ks, t: ("Wait", pb.WaitRequest(keys=ks, timeout_seconds=t)), many_keys, seconds),
    st.builds(lambda ks: ("Check", pb.CheckRequest(keys=ks)), many_keys),
    st.just(("NumKeys", pb.NumKeysRequest())),
    st.builds(lambda k: ("DeleteKey", pb.DeleteKeyRequest(key=k)), keys),
    st.builds(lambda ks, t: ("MultiGet", pb.MultiGetRequest(keys=ks, timeout_seconds=t)), many_keys, seconds),
    st.builds(
        lambda ks, vs: ("MultiSet", pb.MultiSetRequest(keys=ks, values=vs)), many_keys, st.lists(values, max_size=4)
    ),
)


def _encode(request: object) -> list[bytes]:
    try:
        if isinstance(request, list):
            return [r.SerializeToString() for r in request]
        return [request.SerializeToString()]
    except ValueError:  # not encodable at all (protobuf refuses the string): nothing to send
        return []


@settings(FUZZ, max_examples=100)
@given(calls=st.lists(hostile, min_size=1, max_size=4))
@example(calls=[("Add", pb.AddRequest(key="n", amount=2**63 - 1)), ("Add", pb.AddRequest(key="n", amount=2**63 - 1))])
@example(calls=[("LeaseGrant", pb.LeaseGrantRequest(ttl_seconds=NAN)),
                ("LeaseGrant", pb.LeaseGrantRequest(ttl_seconds=1e300))])
@example(calls=[("Put", pb.PutRequest(key="k" * 4097)), ("Put", pb.PutRequest(key="v", value=bytes(MIB + 1)))])
@example(calls=[("MultiSet", pb.MultiSetRequest(keys=["a", "b"], values=[b"1"]))])
@example(calls=[("Get", pb.GetRequest(key="", timeout_seconds=NAN)),
                ("Wait", pb.WaitRequest(keys=[""] * 50_000, timeout_seconds=INF))])
def test_hostile_messages_get_a_deliberate_status(
    served: Served, channel: grpc.Channel, calls: list[tuple[str, object]]
) -> None:
    try:
        for name, request in calls:
            payloads = _encode(request)
            if not payloads:
                continue
            code, details, _ = raw_call(channel, BY_NAME[name], payloads, metadata(served.token))
            assert code in ALLOWED, f"{name} {str(request)[:300]}: {code} {details}"
    finally:
        wipe(channel, served.token)  # each example starts from the same store
    assert served.proc.poll() is None


def test_hostile_messages_keep_memory_bounded(served: Served, channel: grpc.Channel, reliability) -> None:
    # after the fuzz above: the store is empty again; what stays is at most its watch
    # history (64 MiB by default) over the start, with a margin for the allocator
    served.check_healthy()
    first = pb.RangeReply.FromString(channel.unary_unary(BY_NAME["Range"].path)(
        pb.RangeRequest(key="", prefix=True).SerializeToString(), metadata=metadata(served.token), timeout=10))
    assert [kv.key for kv in first.kvs] == []
    rss = served.rss_mib()
    assert rss < 60 + DEFAULT_HISTORY_BYTES / MIB + 64, f"store server RSS {rss:.0f} MiB"
    reliability.record(
        scenario="store: hostile valid messages",
        injected="100 hypothesis examples (1-4 calls each): keys/values at and past their bounds, empty keys, "
        "4,000-deep prefixes, NaN/inf/1e300/5e-324 TTLs and timeouts, int64 extremes, 50,000 keys in one request",
        happened="deliberate statuses only (add past int64, empty keys, TTLs past etcd's limit and malformed "
        "lists: INVALID_ARGUMENT; bounds: "
        "RESOURCE_EXHAUSTED), the server kept serving",
        lost="nothing", server_rss_mib=round(rss, 1),
    )


# --- 3. many connections, abandoned streams ---------------------------------------------------

CLIENT = r"""
import sys, grpc
from elasticrun.proto import store_pb2 as pb
endpoint, token, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
md = (("authorization", "Bearer " + token),)
held = []
for i in range(n):
    # one connection each (no shared subchannel), as hundreds of hosts would have
    ch = grpc.insecure_channel(endpoint, options=[("grpc.use_local_subchannel_pool", 1)])
    watch = ch.unary_stream("/elasticrun.store.v1.Store/Watch")(
        pb.WatchRequest(key=f"conn/{i}/", prefix=True).SerializeToString(), metadata=md)
    next(watch)  # confirmed: the server holds it
    keep = ch.stream_stream("/elasticrun.store.v1.Store/LeaseKeepAlive")(iter([b"\x08\x01"]), metadata=md)
    get = ch.unary_unary("/elasticrun.store.v1.C10dStore/Get").future(
        pb.GetRequest(key=f"never/{i}").SerializeToString(), metadata=md)
    nobody = ch.unary_unary("/elasticrun.store.v1.C10dStore/NumKeys").future(b"")  # no token
    if i % 2:
        watch.cancel()  # abandoned politely; the other half by the kill below
        get.cancel()
    held.append((ch, watch, keep, get, nobody))
print("ready", flush=True)
sys.stdin.read()  # until killed
"""

CONNECTIONS = 300
ROUNDS = 3


def test_hundreds_of_connections_and_abandoned_watches(served: Served, reliability) -> None:
    served.check_healthy()
    fds0 = served.fds()
    watcher = open_channel(served.endpoint)  # a normal client's watch, kept throughout
    stream = watcher.unary_stream(BY_NAME["Watch"].path)(
        pb.WatchRequest(key="normal/", prefix=True).SerializeToString(), metadata=metadata(served.token), timeout=120)
    next(stream)
    rss, peak_fds = [], 0
    clock = reliability.clock()
    try:
        for round_ in range(ROUNDS):
            client = subprocess.Popen(
                [sys.executable, "-c", CLIENT, served.endpoint, served.token, str(CONNECTIONS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
            try:
                assert client.stdout.readline() == b"ready\n"
                peak_fds = max(peak_fds, served.fds())
                assert peak_fds >= fds0 + CONNECTIONS * 9 // 10, "the connections did not reach the server"
            finally:
                client.kill()  # abandoned: no goodbye on any of its streams
                client.wait()
            # the server notices every closed connection and lets go of its streams
            wait_until(lambda: served.fds() <= fds0 + 2, 30, f"the server's fds back to {fds0} (round {round_})")
            rss.append(served.rss_mib())
        # still serving, and the normal client's watch still delivers at once
        client = C10dClient(served.endpoint, token=served.token)
        client.set("normal/x", b"1")
        client.close()
        reply = pb.WatchReply.FromString(next(stream))
        assert [e.key for e in reply.events] == ["normal/x"]
    finally:
        stream.cancel()
        watcher.close()
    served.check_healthy()
    # memory reaches a plateau: later rounds reuse what the first one took
    assert rss[-1] - rss[0] < 16, f"server RSS by round: {rss}"
    reliability.record(
        scenario="store: hundreds of connections, abandoned streams",
        injected=f"{ROUNDS} rounds of a client with {CONNECTIONS} connections, each a watch, a keep-alive "
        "stream, a waiting get and an unauthenticated call; half cancelled, then the client SIGKILLed",
        happened=f"fds back to {fds0} after each round (peak {peak_fds}); RSS by round {[round(r) for r in rss]} MiB; "
        "a normal watch kept delivering",
        recovery_s=clock(), lost="nothing",
    )


def test_calls_in_progress_are_bounded(tmp_path: Path, reliability) -> None:
    # 25 KiB or so per open stream: the server caps the calls it holds (100,000 by
    # default; 200 here), so a client opening ever more watches is refused, not served
    served = start_server(tmp_path, limits={}, max_calls=200)
    channels = [open_channel(served.endpoint) for _ in range(13)]
    md = metadata(served.token)
    streams, refused = [], 0
    try:
        for i in range(260):
            stream = channels[i % len(channels)].unary_stream(BY_NAME["Watch"].path)(
                pb.WatchRequest(key=f"w/{i}").SerializeToString(), metadata=md, timeout=60)
            try:
                next(stream)
                streams.append(stream)
            except grpc.RpcError as e:
                assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, e
                refused += 1
        assert len(streams) <= 200 and refused >= 60, (len(streams), refused)
        for stream in streams:
            stream.cancel()
        # once the watches are gone, calls are served again
        wait_until(lambda: raw_call(channels[0], BY_NAME["NumKeys"], [b""], md, 5)[0] is grpc.StatusCode.OK,
                   30, "the server to take calls again")
        served.check_healthy()
    finally:
        for ch in channels:
            ch.close()
        served.stop()
    reliability.record(
        scenario="store: calls in progress bounded",
        injected="260 watches held open against a server capped at 200 calls in progress",
        happened=f"{len(streams)} served, {refused} refused (RESOURCE_EXHAUSTED); served again once they ended",
        lost="nothing",
    )


# --- 4. bounds: keys, bytes, leases -----------------------------------------------------------


def test_key_count_bound_reached_and_passed(fresh: Served, reliability) -> None:
    ch = open_channel(fresh.endpoint)
    md = metadata(fresh.token)
    multi_set = ch.unary_unary(BY_NAME["MultiSet"].path)
    half = DEFAULT_MAX_KEYS // 2
    for part in range(2):
        for start in range(0, half, MAX_MULTI_SET_KEYS):  # a multi_set's most
            names = [f"k{part}-{i}" for i in range(start, min(half, start + MAX_MULTI_SET_KEYS))]
            multi_set(pb.MultiSetRequest(keys=names, values=[b"x"] * len(names)).SerializeToString(),
                      metadata=md, timeout=60)
    revision, _, count = state(ch, fresh.token)
    assert count == DEFAULT_MAX_KEYS
    code, details, _ = raw_call(
        ch, BY_NAME["Put"], [pb.PutRequest(key="one-more", value=b"y").SerializeToString()], md, 10
    )
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_keys" in details, (code, details)
    code, details, _ = raw_call(ch, BY_NAME["Put"], [pb.PutRequest(key="", value=b"y").SerializeToString()], md, 10)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "empty" in details, (code, details)  # as etcd
    code, details, _ = raw_call(
        ch, BY_NAME["MultiSet"],
        [pb.MultiSetRequest(keys=["n1", "n2"], values=[b"1", b"2"]).SerializeToString()], md, 10,
    )
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert state(ch, fresh.token)[0] == revision and state(ch, fresh.token)[2] == DEFAULT_MAX_KEYS  # nothing written
    # an existing key may still change; a deleted one frees its place
    assert raw_call(
        ch, BY_NAME["Put"], [pb.PutRequest(key="k0-0", value=b"z").SerializeToString()], md, 10
    )[0] is grpc.StatusCode.OK
    assert raw_call(
        ch, BY_NAME["DeleteKey"], [pb.DeleteKeyRequest(key="k0-1").SerializeToString()], md, 10
    )[0] is grpc.StatusCode.OK
    assert raw_call(
        ch, BY_NAME["Put"], [pb.PutRequest(key="one-more", value=b"y").SerializeToString()], md, 10
    )[0] is grpc.StatusCode.OK
    rss = fresh.rss_mib()
    assert raw_call(
        ch, BY_NAME["DeleteKey"], [pb.DeleteKeyRequest(key="one-more").SerializeToString()], md, 10
    )[0] is grpc.StatusCode.OK
    ch.close()
    fresh.check_healthy()  # (it writes a key of its own)
    assert rss < 400, f"{DEFAULT_MAX_KEYS} small keys took the server to {rss:.0f} MiB"
    reliability.record(
        scenario="store: key-count bound",
        injected=f"{DEFAULT_MAX_KEYS} keys through multi_set, then more",
        happened="the next creations got RESOURCE_EXHAUSTED (max_keys) with the store unchanged; updates and "
        "a create after a delete went through",
        lost="nothing", server_rss_mib=round(rss, 1),
    )


LIMITS = {"max_total_bytes": 32 * MIB, "history_bytes": 8 * MIB, "max_leases": 500, "max_keys": 2000}


def test_byte_and_lease_bounds_hold_memory(tmp_path: Path, reliability) -> None:
    served = start_server(tmp_path, limits=LIMITS)
    try:
        ch = open_channel(served.endpoint)
        md = metadata(served.token)
        base = served.rss_mib()
        put = ch.unary_unary(BY_NAME["Put"].path)
        stored = refused = 0
        value = bytes(MIB - 64)
        for i in range(160):  # 160 MiB sent: five times the limit
            try:
                put(pb.PutRequest(key=f"big/{i}", value=value).SerializeToString(), metadata=md, timeout=10)
                stored += 1
            except grpc.RpcError as e:
                assert e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_total_bytes" in e.details(), e
                refused += 1
        for _ in range(40):  # rewriting one key churns only the (bounded) history
            put(pb.PutRequest(key="big/0", value=value).SerializeToString(), metadata=md, timeout=10)
        leases = 0
        for _ in range(LIMITS["max_leases"] + 50):
            code, details, _ = raw_call(
                ch, BY_NAME["LeaseGrant"], [pb.LeaseGrantRequest(ttl_seconds=MAX_LEASE_TTL).SerializeToString()], md, 10
            )
            if code is grpc.StatusCode.OK:
                leases += 1
            else:
                assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_leases" in details, (code, details)
        grown = served.rss_mib() - base
        ch.close()
        served.check_healthy()
    finally:
        served.stop()
    assert 28 <= stored <= 32 and refused == 160 - stored, (stored, refused)
    assert leases == LIMITS["max_leases"]
    # what it may hold (32 MiB of data, 8 MiB of history) and a margin; without the
    # bound it would hold the 160 MiB sent
    assert grown < 32 + 8 + 48, f"RSS grew {grown:.0f} MiB"
    reliability.record(
        scenario="store: byte and lease bounds",
        injected="160 values of 1 MiB to new keys and 40 rewrites of one, 550 leases with the longest TTL, on a "
        "server limited to 32 MiB of data, 8 MiB of history, 500 leases",
        happened=f"{stored} values stored, {refused} refused (max_total_bytes); {leases} leases, the rest "
        f"refused (max_leases); RSS grew {grown:.0f} MiB",
        lost="nothing", rss_growth_mib=round(grown, 1),
    )


# --- 5. authentication ---------------------------------------------------------------------------


def _valid_request(method: Method) -> list[bytes]:
    samples = {
        "Put": pb.PutRequest(key="auth/x", value=b"evil"), "DeleteRange": pb.DeleteRangeRequest(key="", prefix=True),
        "CompareAndPut": pb.CompareAndPutRequest(key="auth/x", value=b"evil"),
        "LeaseGrant": pb.LeaseGrantRequest(ttl_seconds=60),
        "Set": pb.SetRequest(key="auth/x", value=b"evil"), "Add": pb.AddRequest(key="auth/n", amount=5),
        "CompareSet": pb.CompareSetRequest(key="auth/x", desired=b"evil"),
        "DeleteKey": pb.DeleteKeyRequest(key="auth/keep"),
        "MultiSet": pb.MultiSetRequest(keys=["auth/x"], values=[b"evil"]),
        "Watch": pb.WatchRequest(key="", prefix=True),
        "Get": pb.GetRequest(key="auth/keep"), "Range": pb.RangeRequest(key="", prefix=True),
        "LeaseKeepAlive": pb.LeaseKeepAliveRequest(lease=1), "LeaseRevoke": pb.LeaseRevokeRequest(lease=1),
        "CompareAndDelete": pb.CompareAndDeleteRequest(key="auth/keep", expected_mod_revision=0),
    }
    request = samples.get(method.name) or method.request()
    return [request.SerializeToString()]


#: metadata values a client may send (grpc refuses non-printable ones on its side)
bad_tokens = st.one_of(
    st.just(None),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(lambda t: "raw:" + t),
)


def _authorization(served: Served, how: str) -> tuple[tuple[str, str], ...]:
    if how is None:
        return ()
    text = how.removeprefix("raw:")
    variants = {
        "~prefix": f"Bearer {served.token[:-1]}", "~longer": f"Bearer {served.token}x", "~bare": served.token,
        "~lower": f"bearer {served.token}", "~space": f"Bearer  {served.token}",
        "~upper": f"Bearer {served.token.upper()}",
        "~empty": "Bearer ", "~two": f"Bearer {served.token}, Bearer {served.token}",
    }
    value = variants.get(text, text)
    assert value != f"Bearer {served.token}"
    return (("authorization", value),)


@settings(FUZZ, max_examples=60)
@given(how=st.one_of(bad_tokens, st.sampled_from(["raw:~prefix", "raw:~longer", "raw:~bare", "raw:~lower",
                                                  "raw:~space", "raw:~upper", "raw:~empty", "raw:~two"])),
       method=st.sampled_from(METHODS), garbage=st.booleans())
def test_wrong_or_missing_token_is_refused_and_changes_nothing(
    served: Served, channel: grpc.Channel, how: str | None, method: Method, garbage: bool
) -> None:
    before = state(channel, served.token)
    payloads = [b"\xff\xfe"] if garbage else _valid_request(method)
    code, details, _ = raw_call(channel, method, payloads, _authorization(served, how), timeout=5)
    assert code is grpc.StatusCode.UNAUTHENTICATED, (method, how, code, details)
    assert served.token not in details
    assert state(channel, served.token) == before


def test_auth_refusals_leave_no_trace(served: Served, channel: grpc.Channel, reliability) -> None:
    # a key the refused clients tried to delete, then the same calls with the token
    md = metadata(served.token)
    channel.unary_unary(BY_NAME["Put"].path)(
        pb.PutRequest(key="auth/keep", value=b"1").SerializeToString(), metadata=md, timeout=10
    )
    before = state(channel, served.token)
    for method in METHODS:
        for md_bad in ((), (("authorization", "Bearer nope"),)):
            assert raw_call(channel, method, _valid_request(method), md_bad, 5)[0] is grpc.StatusCode.UNAUTHENTICATED
    assert state(channel, served.token) == before
    assert raw_call(channel, BY_NAME["Set"], _valid_request(BY_NAME["Set"]), md, 5)[0] is grpc.StatusCode.OK
    assert state(channel, served.token) != before  # the check can see a write
    served.check_healthy()  # and the token is in none of the (DEBUG) log lines
    reliability.record(
        part="security",
        scenario="store: missing and wrong tokens",
        injected=f"every one of the {len(METHODS)} methods without a token, with 'Bearer nope', and 60 hypothesis "
        "examples of wrong tokens (prefix, longer, lower-case scheme, no scheme, two values, random)",
        happened="UNAUTHENTICATED every time; revision, keys and values unchanged; the token in no reply and "
        "no log line (DEBUG)",
        lost="nothing",
    )
