"""Nodes with CPUs of their own on one machine, and one made slow as shared hosts make it slow.

On a cluster every node has its own CPUs, and a slow one is a host where other
processes take its CPU. Here all nodes share two cores with whatever else the suite
runs, and the kernel's autogroup gives every session an equal share: a node's worker
competing with ten other sessions gets a tenth of the machine, whatever the test meant.
So `CpuShare` makes cgroups of the v1 `cpu` controller:

- `own(pid)` moves a node into a cgroup of its own, whose weight is that of many
  sessions, capped at half a CPU: the node gets it when it computes, as on a host of
  its own, whatever the other nodes do (a node starting beside it, importing torch,
  takes nothing from it), and two nodes computing leave the other core to the rest of
  the suite, running beside the test;
- `take(pid)` moves a node into a cgroup limited to a quarter of a CPU, with a busy
  process in it: the node's workers then have about an eighth of a CPU, where they had
  half of one.

A cgroup, not `nice` or `taskset`: autogroup makes niceness count only inside a
session, and a busy process pinned beside a node would take its share from everyone.
Processes forked later (the restarted workers) are in their node's cgroup too. Only
the test's own cgroups are written; the busy process is killed by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from examples.elastic_demo import descendants
from tests.support.helpers import wait_until

#: where the v1 cpu controller is mounted on the machines the tests run on
CPU_CONTROLLER = Path("/sys/fs/cgroup/cpu")
#: the scheduler's period, a node's quota in it (half a CPU), and the slow cgroup's (a quarter)
PERIOD_US, OWN_QUOTA_US, SLOW_QUOTA_US = 100_000, 50_000, 25_000
#: the weight of a node's own cgroup: sixteen sessions' (each has 1024)
OWN_SHARES = 16 * 1024


class CpuShare:
    """The cgroups of one test: a node's own half CPU each, and the slow node's busy quarter CPU."""

    def __init__(self) -> None:
        if not (CPU_CONTROLLER / "cpu.cfs_quota_us").exists() or not os.access(CPU_CONTROLLER, os.W_OK):
            pytest.skip(f"no writable cgroup v1 cpu controller at {CPU_CONTROLLER} (needs root)")
        self._name = f"elasticrun-test-{uuid.uuid4().hex[:12]}"
        self._cgroups: list[Path] = []
        self._slow = self._cgroup("slow", SLOW_QUOTA_US)
        self._busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        self._move(self._slow, self._busy.pid)

    def _cgroup(self, suffix: str, quota_us: int, shares: int | None = None) -> Path:
        """A new cgroup of this test, capped at `quota_us` of every period."""
        cgroup = CPU_CONTROLLER / f"{self._name}-{suffix}"
        cgroup.mkdir()
        self._cgroups.append(cgroup)
        if shares is not None:
            (cgroup / "cpu.shares").write_text(str(shares))
        (cgroup / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (cgroup / "cpu.cfs_quota_us").write_text(str(quota_us))
        return cgroup

    def own(self, pid: int) -> None:
        """Give `pid` and every process below it (a node) half a CPU of their own."""
        cgroup = self._cgroup(f"node-{pid}", OWN_QUOTA_US, OWN_SHARES)
        for each in (pid, *descendants(pid)):
            self._move(cgroup, each)

    def take(self, pid: int) -> None:
        """Move `pid` and every process below it onto the busy quarter CPU."""
        for each in (pid, *descendants(pid)):
            self._move(self._slow, each)

    @staticmethod
    def _move(cgroup: Path, pid: int) -> None:
        try:
            (cgroup / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            pass  # it ended meanwhile

    def close(self) -> None:
        """Kill the busy process; remove the cgroups once what was moved in has ended."""
        self._busy.send_signal(signal.SIGKILL)
        self._busy.wait()
        for cgroup in self._cgroups:

            def emptied(cgroup: Path = cgroup) -> bool:
                return not (cgroup / "cgroup.procs").read_text().split()

            wait_until(emptied, timeout=30, what=f"the end of the processes in {cgroup}", interval=0.1)
            cgroup.rmdir()
