"""The run folder and the files the agent writes in it: private, never through a link.

A log folder (`--log-dir`) may be shared, a team's or a world-writable scratch space,
and what the agent writes there is the workers' output, its event log, and the store
token for its workers. So:

- The run folder (`<log-dir>/<run id>_<node id>`) and the folders the agent makes in it
  are made private (0700). One that exists already is used only when it is a real folder
  (not a link) that this user owns, and is made private: another user's folder there
  could be read by them, or hold links to this user's files.
- Files are opened with O_NOFOLLOW: a link planted where a log goes is refused, never
  followed, so what it points at (`~/.bashrc`, `/etc/passwd` for an agent run as root)
  is never overwritten. A file that must be new (the token file) is made with O_EXCL,
  so nothing that was there before is ever written into. Files are made 0600.

Every refusal is a UsageError naming the path and the flag, said in one line.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from elasticrun.errors import UsageError

#: without --log-dir, the agent's log root is a fresh temporary folder named so
#: (`tempfile.mkdtemp(prefix=...)`): `elasticrun status` looks there for run folders
DEFAULT_ROOT_PREFIX = "elasticrun_"

_WRITE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def make_private_folder(path: Path) -> None:
    """Make folder `path` private to this user (0700), making it if it is not there.

    A folder already there must be a real folder this user owns. Its parent must exist."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise UsageError(f"cannot use the folder {path}: {e.strerror} (check --log-dir)") from e
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UsageError(
                f"{path} is a link or a file, not a folder: the agent writes only into folders it "
                "made itself (remove it, or choose another --log-dir)"
            ) from e
        raise UsageError(f"cannot use the folder {path}: {e.strerror} (check --log-dir)") from e
    try:
        info = os.fstat(fd)
        me = os.geteuid()
        if info.st_uid != me:
            raise UsageError(
                f"the folder {path} belongs to uid {info.st_uid}, not to this user (uid {me}): the agent "
                "writes its logs and secrets only into folders of its own (remove it, or choose another --log-dir)"
            )
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def open_log(path: Path, *, truncate: bool) -> int:
    """Open `path` for appending (emptied first when `truncate`), created 0600 if missing.

    Never through a link. Returns the descriptor (close-on-exec)."""
    return _open(path, _WRITE | os.O_APPEND | (os.O_TRUNC if truncate else 0), "log file")


def create_new(path: Path, what: str) -> int:
    """Create `path`, which must not exist (not even as a link), 0600, for writing."""
    return _open(path, _WRITE | os.O_EXCL, what)


def _open(path: Path, flags: int, what: str) -> int:
    try:
        return os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            reason = (
                "a symbolic link is there, and the agent never writes through one "
                "(remove it, or choose another --log-dir)"
            )
        elif e.errno == errno.EEXIST:
            reason = "something is there already, and the agent writes only into a file it made (remove it)"
        else:
            reason = f"{e.strerror or e} (check --log-dir)"
        raise UsageError(f"cannot write the {what} {path}: {reason}") from e
