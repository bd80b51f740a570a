"""A victim's store latency while another client abuses the store: before and after roles.

    python bench/bench_abuse.py                     # before (where this branch left main) and after
    python bench/bench_abuse.py --before-ref HEAD~5 --seconds 10 --json out.json

The abuse is issue 29's, done by tests/workers/store_abuser.py from a process of its own
(8 connections):

- range: 4 loops reading 64 values of 1 MiB whole, again and again;
- watch: 2,000 prefix watches of everything, woken by each of the victim's writes;
- both at once.

The victim, in this process, keeps a 2 s lease alive (every 0.5 s) and puts a 100-byte
key every 10 ms for `--seconds`; the figures are its put latencies (p50, p99, max), its
slowest renewal, and whether its lease lapsed. Each side runs its own store server
(`elasticrun store serve --token-file`) and abuser:

- before: a checkout of `--before-ref` (default: the merge base of HEAD and main, so that
  only this branch's changes differ), made with `git archive` into a temporary folder.
  There the token is the store's only credential, so the abuser holds it: what one
  agent's, or one worker's, token could do.
- after: this tree. The abuser holds the reader credential (it may read and watch,
  within its fair share), what `elasticrun store credential --role reader` prints.

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

from elasticrun.store.client import GrpcStore  # noqa: E402
from elasticrun.store.credentials import reader_credential  # noqa: E402

ABUSER = REPO / "tests" / "workers" / "store_abuser.py"
TOKEN = "bench-abuse-token"
BIG_KEYS, BIG_VALUE = 64, (1 << 20) - 64
#: (name, abuser's watches, abuser's reading loops)
ABUSES = (("none", 0, 0), ("range", 0, 4), ("watch", 2_000, 0), ("range+watch", 2_000, 4))


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


async def trial(tree: Path, credential: str, watches: int, readers: int, seconds: float) -> dict[str, object]:
    """One abuse against a fresh server of `tree`: the victim's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "token").write_text(TOKEN)
        serve = [sys.executable, "-m", "elasticrun", "store", "serve", "--host", "127.0.0.1", "--port", "0",
                 "--token-file", str(Path(tmp) / "token")]
        async with _process(tree, *serve) as server:
            endpoint = (await _line_with(server, "serving on")).split()[-1]
            victim = GrpcStore(endpoint, token=TOKEN, timeout=30)
            for i in range(BIG_KEYS):
                await victim.put(f"/elasticrun/big/{i:03d}", bytes([i]) * BIG_VALUE)
            await victim.put("/elasticrun/marker", b"")
            report = ""
            abuse = [sys.executable, str(ABUSER), endpoint, credential, "/elasticrun/big/", "/elasticrun/",
                     str(watches), str(readers)]
            async with _process(tree, *abuse) if watches or readers else contextlib.nullcontext() as abuser:
                if abuser is not None:
                    await _line_with(abuser, "abusing", timeout=300)
                figures = await _victim(victim, seconds)
                if abuser is not None:
                    report = (await _stop(abuser)).strip().splitlines()[-1]
            await victim.close()
    figures["abuser"] = report
    return figures


async def _victim(victim: GrpcStore, seconds: float) -> dict[str, object]:
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

    renewing = asyncio.create_task(keep_alive())
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
    renewing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await renewing
    latencies.sort()
    return {
        "puts": len(latencies),
        "failed_puts": failures,
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 1),
        "max_ms": round(latencies[-1] * 1000, 1),
        "renewal_max_ms": round(max(renewals, default=0.0) * 1000, 1),
        "lease_lapsed": lapsed,
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
        sides = (
            (f"before ({args.before_ref}), abuser with the token", checkout(args.before_ref, Path(before_dir)), TOKEN),
            ("after (this tree), abuser with the reader credential", REPO, reader_credential(TOKEN)),
        )
        for name, watches, readers in ABUSES:
            for side, tree, credential in sides:
                figures = await trial(tree, credential, watches, readers, args.seconds)
                row = {"abuse": name, "side": side, **figures, "load": loadavg()}
                rows.append(row)
                print(
                    f"{name:12} {side[:6]:6}  put p50 {figures['p50_ms']:7.1f} ms  p99 {figures['p99_ms']:7.1f} ms  "
                    f"max {figures['max_ms']:7.1f} ms  failed {figures['failed_puts']}  renewal max "
                    f"{figures['renewal_max_ms']:6.1f} ms  lease lapsed {figures['lease_lapsed']}  "
                    f"[{figures['abuser']}]  load {row['load']}",
                    flush=True,
                )
    write_json(args.json, {"machine": machine(), "before_ref": args.before_ref, "seconds": args.seconds, "rows": rows})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before-ref", help="the git ref of 'before' (default: the merge base of HEAD and main)")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long the victim measures each trial")
    parser.add_argument("--json", help="write the figures here as JSON")
    asyncio.run(main(parser.parse_args()))
