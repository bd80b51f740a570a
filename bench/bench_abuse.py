"""A victim's store latency while another client abuses the store: before and after roles.

    python bench/bench_abuse.py                     # before (where this branch left main) and after
    python bench/bench_abuse.py --before-ref HEAD~5 --seconds 10 --json out.json
    python bench/bench_abuse.py --only headers keylists

The abuses are an abusive reader's, done by tests/workers/store_abuser.py from a process of its own
(8 connections):

- range: 4 loops reading 64 values of 1 MiB whole, again and again;
- watch: 2,000 prefix watches of everything, woken by each of the victim's writes;
- both at once;

and an unauthenticated or abusive worker's:

- headers: tests/workers/headers_flood.py, 8 TCP connections of raw HTTP/2 HEADERS
  frames opening calls with no token and no message, as fast as the store takes them,
  for the whole trial (no credential at all, on both sides);
- connections: the same from 1,000 connections of one host at once (the store cannot
  cap connections per peer: gRPC's Python server has no hook before a call; this shows
  what many connections cost it);
- paced: the same, paced at 50,000 HEADERS frames a second over 64 connections (what
  refused agents in the attack review of 2026-11-28; the flood above is a burst);
- descriptors: tests/workers/idle_flood.py, 1,500 HTTP/2 connections (preface, pings
  answered, no call, no token) on a store limited to 1,024 descriptors (`prlimit`, both
  sides); the victim also opens a new connection every 0.5 s and reads one key (what a
  joining agent or `status` does), and the figures say how many of those failed;
- keylists: tests/workers/key_list_abuser.py, a job's worker credential sending c10d
  check, wait and multi_get calls, 16 at a time, each naming one key 340,000 times
  (1 MiB) or 10,000 distinct keys.

The victim, in this process, keeps a 2 s lease alive (every 0.5 s) and puts a 100-byte
key every 10 ms for `--seconds`; the figures are its put latencies (p50, p99, max), its
slowest renewal, and whether its lease lapsed. Each side runs its own store server
(`elasticrun store serve --token-file`) and abuser:

- before: a checkout of `--before-ref` (default: the merge base of HEAD and main, so that
  only this branch's changes differ), made with `git archive` into a temporary folder.
  For the range and watch abuses the abuser holds the token (what one agent's token
  could do where the token was the store's only credential); for keylists, a worker
  credential of that checkout's own kind.
- after: this tree. The range and watch abuser holds the reader credential (it may read
  and watch, within its fair share), what `elasticrun store credential --role reader`
  prints; the keylists abuser a worker credential.

The abusers are this tree's scripts on both sides (clients only: the wire is the same).

Both victims use this tree's client (its Put and LeaseKeepAlive are unchanged). Nothing
here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import loadavg, machine, write_json  # noqa: E402

from elasticrun.store.client.grpc_store import GrpcStore  # noqa: E402

WORKERS = REPO / "tests" / "workers"
TOKEN = "bench-abuse-token"
BIG_KEYS, BIG_VALUE = 64, (1 << 20) - 64
#: the job whose worker credential the keylists abuser holds
JOB = "bench-abuse-job"
ABUSES = ("none", "range", "watch", "range+watch", "headers", "connections", "paced", "descriptors", "keylists")
#: the paced flood: frames a second, connections
PACED_RATE, PACED_CONNECTIONS = 50_000, 64
#: the descriptor flood: the store's descriptors (soft and hard limit), the flood's connections
STORE_DESCRIPTORS, IDLE_CONNECTIONS = 1024, 1500
#: abuses that are floods, and the line each says once under way
FLOODS = {"headers": "flooding", "connections": "flooding", "paced": "flooding", "descriptors": "opened"}


def abuser_argv(abuse: str, endpoint: str, credentials: dict[str, str], seconds: float) -> list[str] | None:
    """The abuser's command line for `abuse` against `endpoint` (None: no abuser)."""
    if abuse in ("headers", "connections"):  # for longer than the victim measures, bounded
        connections = "8" if abuse == "headers" else "1000"
        flood = str(WORKERS / "headers_flood.py")
        return [sys.executable, flood, endpoint, connections, "20000000", f"{seconds + 5:g}"]
    if abuse == "paced":
        return [sys.executable, str(WORKERS / "headers_flood.py"), endpoint, str(PACED_CONNECTIONS),
                str(int(PACED_RATE * (seconds + 5))), f"{seconds + 5:g}", f"--rate={PACED_RATE}"]
    if abuse == "descriptors":
        return [sys.executable, str(WORKERS / "idle_flood.py"), endpoint, str(IDLE_CONNECTIONS), f"{seconds + 5:g}"]
    if abuse == "keylists":
        return [sys.executable, str(WORKERS / "key_list_abuser.py"), endpoint, credentials["worker"]]
    watches = 2_000 if "watch" in abuse else 0
    readers = 4 if "range" in abuse else 0
    if not watches and not readers:
        return None
    return [sys.executable, str(WORKERS / "store_abuser.py"), endpoint, credentials["reader"], "/elasticrun/big/",
            "/elasticrun/", str(watches), str(readers)]


def credentials_of(tree: Path, reader_is_admin: bool) -> dict[str, str]:
    """The credentials the abusers hold against `tree`'s store, derived by `tree`'s code."""
    code = ("import sys; from elasticrun.store.credentials import reader_credential, worker_credential; "
            f"print(reader_credential({TOKEN!r})); print(worker_credential({TOKEN!r}, {JOB!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         check=True, capture_output=True, text=True).stdout.split()
    return {"reader": TOKEN if reader_is_admin else out[0], "worker": out[1]}


async def _line_with(proc: asyncio.subprocess.Process, text: str, timeout: float = 120) -> str:
    async with asyncio.timeout(timeout):
        while True:
            line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"the process ended before saying {text!r}")
            if text in line:
                return line


async def _stop(proc: asyncio.subprocess.Process) -> str:
    if proc.returncode is None:
        proc.terminate()
    try:
        async with asyncio.timeout(30):
            return (await proc.communicate())[0].decode()
    except TimeoutError:
        proc.kill()
        return (await proc.communicate())[0].decode()


@contextlib.asynccontextmanager
async def _process(tree: Path, *argv: str) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=tree, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    try:
        yield proc
    finally:
        await _stop(proc)


async def trial(tree: Path, credentials: dict[str, str], abuse: str, seconds: float) -> dict[str, object]:
    """One abuse against a fresh server of `tree`: the victim's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "token").write_text(TOKEN)
        serve = [sys.executable, "-m", "elasticrun", "store", "serve", "--host", "127.0.0.1", "--port", "0",
                 "--token-file", str(Path(tmp) / "token")]
        if abuse == "descriptors":
            serve = ["prlimit", f"--nofile={STORE_DESCRIPTORS}:{STORE_DESCRIPTORS}", "--", *serve]
        async with _process(tree, *serve) as server:
            endpoint = (await _line_with(server, "serving on")).split()[-1]
            victim = GrpcStore(endpoint, token=TOKEN, timeout=30)
            for i in range(BIG_KEYS):
                await victim.put(f"/elasticrun/big/{i:03d}", bytes([i]) * BIG_VALUE)
            await victim.put("/elasticrun/marker", b"")
            report = ""
            argv = abuser_argv(abuse, endpoint, credentials, seconds)
            async with _process(tree, *argv) if argv else contextlib.nullcontext() as abuser:
                if abuser is not None:
                    await _line_with(abuser, FLOODS.get(abuse, "abusing"), timeout=300)
                figures = await _victim(victim, seconds, endpoint if abuse == "descriptors" else None)
                if abuser is not None:
                    report = (await _stop(abuser)).strip().splitlines()[-1]
            await victim.close()
    figures["abuser"] = report
    return figures


async def _victim(victim: GrpcStore, seconds: float, newcomers_to: str | None = None) -> dict[str, object]:
    """The victim's figures; with `newcomers_to`, also how many of the new connections made there every 0.5 s
    failed to read a key within 2 s."""
    lease = await victim.grant_lease(2.0)
    renewals: list[float] = []
    lapsed = False
    try:
        await victim.put("/elasticrun/victim/r/nodes/n1", b"{}", lease=lease)
    except Exception:  # the put took longer than the lease: lost before it was used
        lapsed = True

    async def keep_alive() -> None:
        nonlocal lapsed
        while not lapsed:
            await asyncio.sleep(0.5)
            t = time.perf_counter()
            try:
                await victim.keep_alive(lease)
            except Exception:  # LeaseExpiredError, or the store gave up: the lease is lost
                lapsed = True
                return
            renewals.append(time.perf_counter() - t)

    newcomers = [0, 0]  # tried, failed

    async def newcome() -> None:
        while newcomers_to is not None:
            newcomers[0] += 1
            newcomer = GrpcStore(newcomers_to, token=TOKEN, timeout=2)
            try:
                await newcomer.get("/elasticrun/marker")
            except Exception:  # refused, or no answer in time: what a joining agent would see
                newcomers[1] += 1
            finally:
                await newcomer.close()
            await asyncio.sleep(0.5)

    renewing = asyncio.create_task(keep_alive())
    newcoming = asyncio.create_task(newcome())
    latencies, failures = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        try:
            await victim.put("/elasticrun/victim/r/job/state", b"x" * 100)
        except Exception:  # deadline exceeded: the issue saw these
            failures += 1
        latencies.append(time.perf_counter() - t)
        await asyncio.sleep(0.01)
    for task in (renewing, newcoming):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    latencies.sort()
    return {
        "puts": len(latencies),
        "failed_puts": failures,
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 1),
        "max_ms": round(latencies[-1] * 1000, 1),
        "renewal_max_ms": round(max(renewals, default=0.0) * 1000, 1),
        "lease_lapsed": lapsed,
        **({"newcomers": newcomers[0], "newcomers_failed": newcomers[1]} if newcomers_to else {}),
    }


def checkout(ref: str, into: Path) -> Path:
    """`ref` of this repository, as files under `into` (git archive: no .git, no build)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def main(args: argparse.Namespace) -> None:
    if args.before_ref is None:
        merge_base = ["git", "-C", str(REPO), "merge-base", "HEAD", "main"]
        args.before_ref = subprocess.run(merge_base, check=True, capture_output=True, text=True).stdout.strip()[:12]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-abuse-") as before_dir:
        before = checkout(args.before_ref, Path(before_dir))
        sides = (
            (f"before ({args.before_ref})", before, credentials_of(before, reader_is_admin=True)),
            ("after (this tree)", REPO, credentials_of(REPO, reader_is_admin=False)),
        )
        for name in args.only or ABUSES:
            for side, tree, credentials in sides:
                figures = await trial(tree, credentials, name, args.seconds)
                row = {"abuse": name, "side": side, **figures, "load": loadavg()}
                rows.append(row)
                print(
                    f"{name:12} {side[:6]:6}  put p50 {figures['p50_ms']:7.1f} ms  p99 {figures['p99_ms']:7.1f} ms  "
                    f"max {figures['max_ms']:7.1f} ms  failed {figures['failed_puts']}  renewal max "
                    f"{figures['renewal_max_ms']:6.1f} ms  lease lapsed {figures['lease_lapsed']}  "
                    + (f"newcomers failed {figures['newcomers_failed']} of {figures['newcomers']}  "
                       if "newcomers" in figures else "")
                    +
                    f"[{figures['abuser']}]  load {row['load']}",
                    flush=True,
                )
    write_json(args.json, {"machine": machine(), "before_ref": args.before_ref, "seconds": args.seconds, "rows": rows})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before-ref", help="the git ref of 'before' (default: the merge base of HEAD and main)")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the victim measures each trial")
    parser.add_argument("--json", help="write the figures here as JSON")
    parser.add_argument("--only", nargs="+", choices=ABUSES, help="run only these abuses (default: all)")
    asyncio.run(main(parser.parse_args()))
