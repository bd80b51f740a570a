"""Close this process to other processes of its user: prctl(PR_SET_DUMPABLE, 0).

Why: the agent holds the store's admin token (and etcd's password) and starts workers
as its own user. Any process of a user may read another's `/proc/<pid>/environ` (where
`ELASTICRUN_STORE_TOKEN` sits for as long as the process lives, whatever the process
does to its own variables afterwards), its memory (`/proc/<pid>/mem`, ptrace), its open
files (`/proc/<pid>/fd/`), unless the process is not "dumpable": then the kernel makes
its `/proc/<pid>/` files root's, refuses ptrace to anyone without CAP_SYS_PTRACE, and
writes no core dump of it. So a worker's code (or anything else of the user's) can no
longer read the token out of its agent.

What it does not close: `/proc/<pid>/cmdline` and `/proc/<pid>/stat` stay readable (so
a `token_file=` path in the agent's command line shows, and the file itself is the
user's to read), and root reads everything. The flag is the process's own: its children
start dumpable again when they exec (the workers, the warden), which is what they
need, and they never hold the token (`WorkerSpec.withheld_env`).
"""

from __future__ import annotations

import ctypes

#: from <linux/prctl.h>
PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3


def forbid_dumps() -> bool:
    """Make this process non-dumpable.

    Whether it now is (False off Linux, or where the call is refused: then it says so
    once, and the process goes on as before)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # the C library this process runs on
    except (OSError, AttributeError):  # no prctl: not Linux
        return False
    if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        import logging  # here: the launcher calls this before it imports anything else (`elasticrun.__main__`)

        logging.getLogger(__name__).warning(
            "could not make the agent non-dumpable (prctl: errno %d): processes of this user can read "
            "its environment, and with it the store's token",
            ctypes.get_errno(),
        )
        return False
    return bool(prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0)
