"""Progress heartbeats for the agent's hang watchdog (`--progress-timeout`).

A training script calls `heartbeat()` once per step (or more often: it is cheap). Under
`elasticrun --progress-timeout SECONDS` the agent gives every worker a file of its own
(ELASTICRUN_PROGRESS_FILE) and watches its modification time: a worker that has not
called `heartbeat()` for that long is hung, and the agent restarts the group naming
the hang. Without the variable (no watchdog, or not under elasticrun) it does nothing.

It costs at most one system call (a touch of the file) per half second, whatever the
step rate, and never raises: progress reporting must not break training. No torch here.

Each call also marks a step for the step timing (`elasticrun.worker.steptime`), which
then counts steps from one call to the next: call it once per step.
"""

from __future__ import annotations

import os
import time

from elasticrun.worker.steptime import mark as mark_step

#: the variable that names this worker's progress file
PROGRESS_FILE_ENV = "ELASTICRUN_PROGRESS_FILE"
#: at most one touch of the file per this many seconds
MIN_INTERVAL = 0.5

_last_path = ""
_last_at = float("-inf")


def heartbeat() -> None:
    """Tell the agent this worker is making progress, and mark the end of a step for the step timing.

    A no-op unless the agent watches."""
    mark_step("heartbeat")
    touch()


def touch() -> None:
    """Touch the progress file (at most once per MIN_INTERVAL), if the agent gave one."""
    global _last_path, _last_at
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return
    now = time.monotonic()
    if path == _last_path and now - _last_at < MIN_INTERVAL:
        return
    _last_path, _last_at = path, now
    try:
        os.utime(path)
    except FileNotFoundError:
        try:
            with open(path, "ab"):
                pass
        except OSError:
            pass
    except OSError:
        pass
