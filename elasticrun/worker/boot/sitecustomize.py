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
  torch part only once the script imports torch.

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


def _boot() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get(BOOT_ENV) != here:
        _chain(here)  # on the path by someone else's doing: only stand aside
        return
    stacks = os.environ.get(STACKS_FILE_ENV)
    steps = os.environ.get(STEPS_FILE_ENV)
    _forget_boot(here)
    if stacks:
        _install_stack_dump(stacks)
    if steps:
        _install_step_timing(steps)
    _chain(here)


_boot()
