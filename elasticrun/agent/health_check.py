"""The operator's health check (`--health-check CMD`): run it, bounded, and judge it.

The command is the operator's own, given on this node's command line (never read from
the store: whoever can write the store would choose what every host runs). It runs
through `/bin/sh -c`, as a cron line or a Kubernetes `sh -c` probe does, so that a
check can be a pipeline or a `test` (`test "$(cat /sys/class/net/ib0/operstate)" = up`).
A check passes when it exits 0 within the timeout; anything else (another status, a
signal, the timeout, a command that cannot start) fails it, and the last line it wrote
is the reason that the log, `status`, the quarantine and the metrics show.

The check runs as the leader of a process group of its own, with no stdin and the
agent's environment less its secrets (the same as the workers'). At the timeout, or
when the agent stops waiting for it (the round ended), the whole group is SIGKILLed:
a check never outlives its verdict. Its output (stdout and stderr together) is read as
it comes and only its last `_TAIL` bytes are kept, so a chatty or runaway check can
neither block on a full pipe nor flood the agent's memory or log.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from elasticrun.agent.failures import describe_exit

#: the check's output kept, from its end: enough for its last line
_TAIL = 4096
#: the longest reason taken from the check's last line
REASON_LIMIT = 200
#: how long a SIGKILLed check may take to end before the agent stops waiting for it
_REAP_LIMIT = 5.0
#: reads of what is left in the pipe once the check ended: a full pipe's buffer, and a
#: bound on one that something outside the check's group still writes to
_LAST_READS = 16


class Verdict(enum.Enum):
    """How one run of the check ended; the values label the metrics."""

    PASSED = "passed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One run of the health check."""

    verdict: Verdict
    #: one line: `health check failed (exit code 1): eth0 is down`, or for a pass its
    #: last line (or "")
    reason: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.PASSED


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """The operator's command, how long one run may take, and its environment."""

    command: str
    timeout: float
    #: the environment it runs with (the agent's, less the secrets it withholds)
    env: Mapping[str, str]

    async def run(self) -> CheckResult:
        """Run the check once, to its end or its timeout.

        Never raises but for cancellation (which kills what it started)."""
        started = time.monotonic()
        # Our own pipe, not asyncio's: its Process.wait() also waits for the pipes to
        # close, which a process the check left behind (a daemon) may never let happen.
        out, into = os.pipe()
        os.set_blocking(out, False)
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", self.command,
                stdin=asyncio.subprocess.DEVNULL, stdout=into, stderr=into, env=dict(self.env),
                start_new_session=True,
            )
        except OSError as e:
            os.close(out)
            return CheckResult(Verdict.FAILED, f"health check could not start: {e.strerror or e}", 0.0)
        except BaseException:
            os.close(out)
            raise
        finally:
            os.close(into)
        tail = bytearray()
        loop = asyncio.get_running_loop()
        loop.add_reader(out, _read_into, out, tail, loop, 1)
        returncode: int | None = None
        try:
            async with asyncio.timeout(self.timeout):
                returncode = await proc.wait()
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(out)
            await _end_group(proc)
            _read_into(out, tail, None, _LAST_READS)  # what it wrote before it ended
            os.close(out)
        seconds = time.monotonic() - started
        last = last_line(tail)
        if returncode is None:
            return CheckResult(Verdict.TIMED_OUT, f"health check timed out after {self.timeout:g}s: "
                               f"{last or 'no output'}", seconds)
        if returncode == 0:
            return CheckResult(Verdict.PASSED, last, seconds)
        reason = f"health check failed ({describe_exit(returncode)}): {last or 'no output'}"
        return CheckResult(Verdict.FAILED, reason, seconds)

    async def watch(self, interval: float, seen: Callable[[CheckResult], None]) -> CheckResult:
        """Run the check every `interval` seconds (after the last run ended); return the first run that fails.

        `seen` is told of every run (metrics, a log line)."""
        while True:
            await asyncio.sleep(interval)
            result = await self.run()
            seen(result)
            if not result.ok:
                return result


def _read_into(fd: int, tail: bytearray, loop: asyncio.AbstractEventLoop | None, reads: int) -> None:
    """Read from the check's output pipe, keeping the last `_TAIL` bytes.

    At most `reads` times (a check writing without end must not hold the loop); at the
    pipe's end, stop watching it (`loop`: the loop that watches it)."""
    for _ in range(reads):
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            if loop is not None:
                loop.remove_reader(fd)
            return
        tail += chunk
        del tail[:-_TAIL]


async def _end_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL what is left of the check's process group, and reap its leader.

    The group's id is the leader's pid, which the kernel does not hand out again while a
    process of the group lives; an empty group refuses the signal. A leader stuck in
    the kernel past `_REAP_LIMIT` is left to asyncio to reap whenever it ends.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_REAP_LIMIT):
            await proc.wait()


def last_line(output: bytes | bytearray) -> str:
    """The last line with something on it, printable and at most REASON_LIMIT long."""
    for raw in reversed(bytes(output).splitlines()):
        line = raw.decode(errors="replace").strip()
        if line:
            line = "".join(c if c.isprintable() else "?" for c in line)
            return line if len(line) <= REASON_LIMIT else line[: REASON_LIMIT - 3] + "..."
    return ""
