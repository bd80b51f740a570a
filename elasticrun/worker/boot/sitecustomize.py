"""Worker start-up: Python's `site` module runs this in every worker an agent starts.

Why a sitecustomize: it is the one hook that runs inside a plain training script's
process before the script, with no change to the script. The agent puts this folder
first on the worker's PYTHONPATH (`elasticrun.agent.boot`); a worker started with
`python -I`, `-E` or `-S`, or a program that is not Python, never loads it, and the
agent then does without what it installs.

What it installs, each only when the agent asked for it through the environment:

- the stack dump (`ELASTICRUN_STACKS_FILE`): faulthandler, registered on a real-time
  signal, writes every thread's Python stack to that file when the agent sends the
  signal. It runs in C inside the signal handler, so it works while the main thread is
  blocked in a collective or holds the GIL in C code.
- the step timing (`ELASTICRUN_STEPS_FILE`): `elasticrun.worker.steptime` records the
  worker's compute time per step into that file, for the straggler check. It needs
  elasticrun in this interpreter (without it, the worker runs untimed) and installs its
  torch part once the script imports torch (at once where a standby imported it).

A standby (`ELASTICRUN_STANDBY`, elasticrun.agent.standby) is a worker started ahead
of its round: here, before Python opens the script, it imports `--warm-imports`
(`ELASTICRUN_WARM_IMPORTS`), tells the agent on that Unix socket that it is ready, and
waits. At the round's start the agent sends the worker's complete environment and its
stdout and stderr; the standby answers `ready` (or `cuda`: a worker must find CUDA
untouched, so one that initialised it is not used), and once the agent says `go` (all
of the node's standbys answered) the boot makes them the process's own and goes on as
for a worker started cold, so the script starts as it would have (a sitecustomize
this one hides runs then, after the warm imports). A standby whose agent hangs up exits.

It stays standalone (the standard library only): the worker may run another Python,
one without elasticrun installed. Then it hands over to the sitecustomize that would
have run without it, if any, and takes itself out of the environment that the worker's
own children inherit: a data loader's or a compiler's Python processes are not workers.
"""

from __future__ import annotations

import importlib
import os
import sys

#: the variable naming this folder, set by the agent: it marks the boot as the agent's
BOOT_ENV = "ELASTICRUN_BOOT"
#: the worker's stack file; the agent reads what the dump appends to it
STACKS_FILE_ENV = "ELASTICRUN_STACKS_FILE"
#: the worker's step timing file (elasticrun.worker.steptime.STEPS_FILE_ENV)
STEPS_FILE_ENV = "ELASTICRUN_STEPS_FILE"
#: the signal the agent sends for a dump: a real-time one, which no framework handles
#: (SIGUSR1 and SIGUSR2 are Slurm's and Lightning's requeue signals)
STACKS_SIGNAL_OFFSET = 7
#: a standby's variables (elasticrun.agent.standby): the agent's socket, the modules to
#: import ahead, and the nice value its imports run at
STANDBY_ENV = "ELASTICRUN_STANDBY"
WARM_IMPORTS_ENV = "ELASTICRUN_WARM_IMPORTS"
WARM_NICE_ENV = "ELASTICRUN_WARM_NICE"
#: the longest environment the agent may send (the kernel's own limit is about this)
_MAX_ENV_BYTES = 2_097_152  # 2 MiB


def _install_stack_dump(path: str) -> None:
    """Register the dump and mark the file with this process's id.

    So the agent signals only a process that handles the signal (a real-time signal's
    default is to exit)."""
    import faulthandler
    import signal

    try:
        f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open for the handler
    except OSError:
        return
    faulthandler.register(signal.SIGRTMIN + STACKS_SIGNAL_OFFSET, file=f, all_threads=True, chain=False)
    f.write(f"elasticrun-stacks pid {os.getpid()}\n")
    # faulthandler keeps the file's descriptor, not the object: keep the object alive
    globals()["_stacks_file"] = f


def _install_step_timing(path: str) -> None:
    """Time this worker's steps, if elasticrun can be imported here."""
    try:
        steptime = importlib.import_module("elasticrun.worker.steptime")
        progress = importlib.import_module("elasticrun.worker.progress")
    except ImportError:
        return
    steptime.install(path, progress.touch)


def _forget_boot(here: str) -> None:
    """Take the boot out of what this worker's own child processes inherit."""
    os.environ.pop(BOOT_ENV, None)
    os.environ.pop(STACKS_FILE_ENV, None)
    os.environ.pop(STEPS_FILE_ENV, None)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != here]
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)


def _chain(here: str) -> None:
    """Run the sitecustomize that this one hides, if there is one on the path."""
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")  # the next one on the path, run for its effects
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


#: what a module imports only at a training script's first use of it, imported with it
#: ahead: torch imports torch._dynamo when the script makes its first optimizer (1.1 s of
#: the 2.2 s torch costs a worker on a 2-core machine), and every training script makes one
_IMPORTED_LATER = {"torch": ("torch._dynamo",)}


def _import_ahead(names: list[str], nice: int) -> str:
    """Import `names`, each with what it imports at its first use (`_IMPORTED_LATER`); "" or why one failed.

    With `nice`, in a thread of that nice value (Linux's nice is per thread): the
    imports yield to the running workers, while the main thread, which becomes the
    worker's, keeps the priority of a worker started cold (an unprivileged process
    can lower its priority but never raise it back)."""
    failed: list[str] = []

    def run() -> None:
        if nice:
            import threading

            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError:
                pass
        for name in [m for given in names for m in (given, *_IMPORTED_LATER.get(given, ()))]:
            try:
                importlib.import_module(name)
            except BaseException as e:  # noqa: BLE001 - any failure of a user's module: said to the agent
                failed.append(f"cannot import {name}: {type(e).__name__}: {e}")
                return

    if nice:
        import threading

        thread = threading.Thread(target=run, name="elasticrun-warm-imports")
        thread.start()
        thread.join()
    else:
        run()
    return failed[0] if failed else ""


def _stand_by(path: str) -> None:
    """Wait for the round, as a standby; return once this process is its worker."""
    import json
    import socket

    def read_line() -> bytes:
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk or len(data) > _MAX_ENV_BYTES:
                raise ValueError("no round")
            data += chunk
        return data

    names = [n for n in os.environ.get(WARM_IMPORTS_ENV, "").split(",") if n]
    error = _import_ahead(names, int(os.environ.get(WARM_NICE_ENV) or 0))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.sendall(json.dumps({"pid": os.getpid(), "error": error}).encode() + b"\n")
        _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        env = json.loads(read_line())
        if len(fds) != 2:
            raise ValueError("no stdout and stderr")
    except (OSError, ValueError):
        os._exit(0)  # the agent is gone or hung up
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        sock.sendall(b"cuda\n")  # the agent starts the round's workers cold instead
        os._exit(1)
    try:
        sock.sendall(b"ready\n")
        if read_line() != b"go\n":  # every standby of the node answered: the round goes
            raise ValueError("not go")
    except (OSError, ValueError):
        os._exit(0)  # the round starts cold after all
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sock.close()


def _boot() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get(BOOT_ENV) != here:
        _chain(here)  # on the path by someone else's doing: only stand aside
        return
    standby = os.environ.get(STANDBY_ENV)
    if standby:
        _stand_by(standby)  # returns with the round's environment, which names the boot
    stacks = os.environ.get(STACKS_FILE_ENV)
    steps = os.environ.get(STEPS_FILE_ENV)
    _forget_boot(here)
    if stacks:
        _install_stack_dump(stacks)
    if steps:
        _install_step_timing(steps)
    _chain(here)


_boot()
