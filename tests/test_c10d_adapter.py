"""torch.distributed over the built-in store, through the worker-side adapter."""

from __future__ import annotations

import asyncio
import datetime
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticrun.errors import StoreAuthError, StoreSettingError, StoreTimeoutError
from elasticrun.store.credentials import worker_credential
from elasticrun.store.server.store_server import StoreServer
from elasticrun.worker.c10d_store import C10dStore
from tests.support.certs import TestCa

REPO = Path(__file__).resolve().parents[1]
TOKEN = "adapter-token"

WORKER = """
import datetime, sys
import torch, torch.distributed as dist
from elasticrun.worker.c10d_store import C10dStore
from tests.support.certs import TestCa

endpoint, token, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = C10dStore(endpoint, token=token, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(f"rank {rank} sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
async def server() -> AsyncIterator[StoreServer]:
    s = StoreServer("127.0.0.1", 0, token=TOKEN)
    await s.start()
    yield s
    await s.stop()


#: the store's token, and what an agent gives its workers: a worker credential of the
#: job, with which the same process group runs in the job's own key namespace
CREDENTIALS = pytest.mark.parametrize(
    "credential", [TOKEN, worker_credential(TOKEN, "job1")], ids=["admin token", "worker credential"]
)


@CREDENTIALS
async def test_two_process_gloo_all_reduce(server: StoreServer, credential: str) -> None:
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, server.endpoint, credential, str(rank),
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    try:
        async with asyncio.timeout(90):
            outputs = [(await p.communicate())[0].decode() for p in procs]
        for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
            assert proc.returncode == 0, out
            assert f"rank {rank} sum 3" in out, out
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@CREDENTIALS
async def test_adapter_operations_through_a_prefix_store(server: StoreServer, credential: str) -> None:
    def ops() -> None:
        store = C10dStore(server.endpoint, token=credential, timeout=datetime.timedelta(seconds=5))
        store.set("a", "text")
        assert store.get("a") == b"text"
        assert store.add("n", 2) == 2 and store.add("n", -1) == 1
        assert store.compare_set("a", "text", b"bytes") == b"bytes"
        store.multi_set(["x", "y"], [b"1", "2"])
        assert store.multi_get(["x", "y"]) == [b"1", b"2"]
        assert store.check(["a", "x"]) and not store.check(["absent"])
        assert store.num_keys() == 4
        assert store.delete_key("x")
        with pytest.raises(StoreTimeoutError):
            store.wait(["absent"], datetime.timedelta(seconds=0.2))
        prefixed = dist.PrefixStore("job", store)  # C++ calling back into our Python
        prefixed.set("k", b"v")
        assert store.get("job/k") == b"v"
        assert prefixed.add("c", 5) == 5
        store.close()
        refused = C10dStore(server.endpoint, token="wrong")
        with pytest.raises(StoreAuthError):
            refused.set("a", b"")
        refused.close()

    await asyncio.to_thread(ops)


async def test_without_a_token_the_agents_token_file_is_used(
    server: StoreServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "store_token"
    token_file.write_text(TOKEN)
    monkeypatch.delenv("ELASTICRUN_STORE_TOKEN_FILE", raising=False)

    def ops() -> None:
        outside = C10dStore(server.endpoint)  # no file named: no token, refused
        with pytest.raises(StoreAuthError):
            outside.set("k", b"v")
        outside.close()
        monkeypatch.setenv("ELASTICRUN_STORE_TOKEN_FILE", str(token_file))
        store = C10dStore(server.endpoint)  # as a worker under an agent builds it
        store.set("k", b"v")
        assert store.get("k") == b"v"
        store.close()
        token_file.unlink()  # the agent has ended
        with pytest.raises(StoreSettingError, match="ELASTICRUN_STORE_TOKEN_FILE.*cannot read"):
            C10dStore(server.endpoint)

    await asyncio.to_thread(ops)


@pytest.mark.timeout(60)  # a refusal taken for an unreachable store would retry for 600 s
async def test_a_worker_reaches_a_store_that_requires_client_certificates() -> None:
    ca = TestCa()
    server = StoreServer("127.0.0.1", 0, tls=ca.issue(), client_ca=ca.pem)
    await server.start()

    def ops() -> None:
        store = C10dStore(server.endpoint, tls_ca=ca.pem, client_tls=ca.issue("rank0"), connect_timeout=600)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        store.close()
        stranger = C10dStore(server.endpoint, tls_ca=ca.pem, connect_timeout=600)
        with pytest.raises(StoreAuthError, match="requires a client certificate and this client has none"):
            stranger.set("k", b"")
        stranger.close()

    try:
        await asyncio.to_thread(ops)
    finally:
        await server.stop()


@pytest.mark.security
def test_a_credential_sent_in_plaintext_to_another_host_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """The agents warn when their token would cross the network in plaintext;
    a worker's C10dStore did not. (No call is made: the stores are built and closed.)"""
    remote = C10dStore("192.0.2.1:29400", token="a-credential")  # TEST-NET-1: never reached here
    remote.close()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "the store credential goes to 192.0.2.1:29400 in plaintext" in line and "tls_ca" in line, line
    assert "a-credential" not in line
    caplog.clear()
    for quiet in (C10dStore("127.0.0.1:29400", token="a-credential"), C10dStore("192.0.2.1:29400"),
                  C10dStore("192.0.2.1:29400", token="a-credential", tls_ca=TestCa().pem)):
        quiet.close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
