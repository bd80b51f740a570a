"""Read a starting process's environment from /proc as fast as a process of its user can.

    python tests/workers/environ_poller.py SECRET -- COMMAND...

Starts COMMAND with SECRET in its environment (as `ELASTICRUN_STORE_TOKEN`) and reads
its `/proc/<pid>/environ` in a tight loop until the process is closed to its user's
other processes (non-dumpable) or exits, then prints one line

    reads=N leaked=L closed_after_ms=T first_read_ms=F

- reads: reads that returned its environment while another process of its user could
  read it, leaked: those that held SECRET,
- closed_after_ms: from the start to the first look that found it closed (-1: never),
- first_read_ms: from the start to the first read that returned anything.

Run by a user other than root, a read of a closed process is refused (EACCES). Root
reads every process, so as root COMMAND runs with the group `nogroup` (65534) and is
seen closed once the kernel makes its /proc files root's (group 0), which it does when
the process makes itself non-dumpable: a read counts only when the process was still
open after it (dumpable never comes back by itself). What the attack review's poller
did, bounded: it stops at the close, the exit or 30 s, and kills COMMAND by its pid
once it has its answer. Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

#: the group COMMAND runs with when this runs as root
NOGROUP = 65534


def _as_nogroup() -> None:
    os.setgroups([])
    os.setgid(NOGROUP)


def main(secret: str, command: list[str]) -> None:
    env = {**os.environ, "ELASTICRUN_STORE_TOKEN": secret}
    root = os.geteuid() == 0
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_as_nogroup if root else None)
    path = f"/proc/{proc.pid}/environ"
    reads = leaked = 0
    closed_ms = first_ms = -1.0
    needle = secret.encode()
    while proc.poll() is None and time.monotonic() - started < 30:
        try:
            with open(path, "rb") as f:
                data = f.read()
            still_open = not root or os.stat(path).st_gid == NOGROUP
        except PermissionError:
            still_open = False
        except OSError:
            continue
        if not still_open:
            closed_ms = (time.monotonic() - started) * 1000
            break
        if data:
            reads += 1
            leaked += needle in data
            if first_ms < 0:
                first_ms = (time.monotonic() - started) * 1000
    proc.kill()
    proc.wait()
    print(f"reads={reads} leaked={leaked} closed_after_ms={closed_ms:.1f} first_read_ms={first_ms:.1f}", flush=True)


if __name__ == "__main__":
    split = sys.argv.index("--")
    main(sys.argv[1], sys.argv[split + 1:])
