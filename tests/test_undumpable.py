"""The agent closes itself to its user's other processes: its workers run as
its user, and /proc/<agent>/environ held the store's admin token for any of them."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from elasticrun.agent.undumpable import PR_SET_DUMPABLE, forbid_dumps

pytestmark = pytest.mark.timeout(60)

#: the user both processes run as when the test runs as root (root reads every process)
NOBODY = 65534


def _as_user() -> None:
    if os.geteuid() == 0:
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _agent_like(closed: bool, ready: int) -> None:
    """A forked process of the test's user: non-dumpable as the agent makes itself, or
    (the control) dumpable, as every process of a user is by default."""
    try:
        _as_user()
        if closed:
            assert forbid_dumps()
        else:  # a change of user leaves a process non-dumpable: set it back, as after an exec
            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        os.write(ready, b"1")
        time.sleep(30)
    finally:
        os._exit(0)


def _read_environ(pid: int) -> str:
    """What another process of the same user gets reading /proc/<pid>/environ."""
    out, into = os.pipe()
    reader = os.fork()
    if reader == 0:
        try:
            _as_user()
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    f.read()
                os.write(into, b"read")
            except PermissionError:
                os.write(into, b"refused")
        finally:
            os._exit(0)
    os.close(into)
    os.waitpid(reader, 0)
    with os.fdopen(out, "rb") as f:
        return f.read().decode()


@pytest.mark.security
def test_a_process_of_the_same_user_cannot_read_the_agents_environment(reliability) -> None:
    seen = {}
    for closed in (False, True):
        ready, told = os.pipe()
        agent = os.fork()
        if agent == 0:
            _agent_like(closed, told)
        os.close(told)
        try:
            assert os.read(ready, 1) == b"1"
            seen[closed] = _read_environ(agent)
        finally:
            os.close(ready)
            os.kill(agent, 9)
            os.waitpid(agent, 0)
    assert seen == {False: "read", True: "refused"}, seen
    reliability.record(
        part="security",
        scenario="a worker reads its agent's environment",
        injected="a process of the agent's user (as the workers are) opened /proc/<agent>/environ, where "
        "$ELASTICRUN_STORE_TOKEN sits, of a process made as the agent makes itself (forbid_dumps) and, as a "
        "control, of a dumpable one",
        happened="refused (EACCES: the agent is non-dumpable, its /proc files root's); the control's was read",
        lost="nothing",
    )
