"""Nodes with CPUs of their own on one machine, and one made slow as shared hosts make it slow.

On a cluster every node has its own CPUs, and a slow one is a host where other
processes take its CPU. Here all nodes share two cores with whatever else the suite
runs, and the kernel's autogroup gives every session an equal share: a node's worker
competing with ten other sessions gets a tenth of the machine, whatever the test meant.
So `CpuShare` makes two cgroups of the v1 `cpu` controller:

- `own(pid)` moves a node into a cgroup whose weight is that of many sessions, capped
  at one CPU for all the nodes in it: they get that CPU when they compute, as on hosts
  of their own, and the rest of the suite, running beside the test, keeps the other;
- `take(pid)` moves a node into a cgroup limited to half a CPU, with a busy process in
  it: the node's workers then have about a quarter of a CPU, where they had a whole one.

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
#: the scheduler's period, and the slow cgroup's quota in it: half a CPU
PERIOD_US, QUOTA_US = 100_000, 50_000
#: the weight of a node's own cgroup: sixteen sessions' (each has 1024)
OWN_SHARES = 16 * 1024


class CpuShare:
    """The two cgroups of one test: nodes on CPUs of their own, and the slow node's half CPU."""

    def __init__(self) -> None:
        if not (CPU_CONTROLLER / "cpu.cfs_quota_us").exists() or not os.access(CPU_CONTROLLER, os.W_OK):
            pytest.skip(f"no writable cgroup v1 cpu controller at {CPU_CONTROLLER} (needs root)")
        name = f"elasticrun-test-{uuid.uuid4().hex[:12]}"
        self._own, self._slow = CPU_CONTROLLER / f"{name}-own", CPU_CONTROLLER / f"{name}-slow"
        self._own.mkdir()
        self._slow.mkdir()
        (self._own / "cpu.shares").write_text(str(OWN_SHARES))
        (self._own / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self._own / "cpu.cfs_quota_us").write_text(str(PERIOD_US))
        (self._slow / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self._slow / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        self._busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        self._move(self._slow, self._busy.pid)

    def own(self, pid: int) -> None:
        """Give `pid` and every process below it a CPU of their own."""
        for each in (pid, *descendants(pid)):
            self._move(self._own, each)

    def take(self, pid: int) -> None:
        """Move `pid` and every process below it onto the busy half CPU."""
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
        for cgroup in (self._own, self._slow):

            def emptied(cgroup: Path = cgroup) -> bool:
                return not (cgroup / "cgroup.procs").read_text().split()

            wait_until(emptied, timeout=30, what=f"the end of the processes in {cgroup}", interval=0.1)
            cgroup.rmdir()
