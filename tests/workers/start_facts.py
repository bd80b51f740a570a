"""Records what a worker finds at its start, then plays its part in tests/test_warm_start.py.

Run as `start_facts.py OUT_DIR GO_FILE`: writes OUT_DIR/facts_<restart>_<rank>.json
first thing (what a warm start must leave as a cold start has it), then, in its group,
OUT_DIR/torch_<restart>_<rank>.json (what PyTorch's own launcher tests check a worker
sees: torchelastic launched, rank and world, an env:// group's all-reduce), then makes
a few optimizer steps with its peers (so the agent starts standbys). In the first round it
waits for GO_FILE, then rank 1 fails; in the next round every rank exits 0.
"""

import sys

# before anything of the script's own runs: torch, and torch._dynamo, which a standby imports with it
PRELOADED = all(name in sys.modules for name in ("torch", "torch._dynamo"))
VERSION = 1  # the test edits this line between rounds

import fcntl  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import stat  # noqa: E402
import time  # noqa: E402


def stream(fd: int) -> dict[str, object]:
    st = os.fstat(fd)
    kind = "pipe" if stat.S_ISFIFO(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else oct(stat.S_IFMT(st.st_mode))
    target = os.readlink(f"/proc/self/fd/{fd}")
    return {
        "kind": kind,
        "target": "pipe" if kind == "pipe" else target,
        "flags": fcntl.fcntl(fd, fcntl.F_GETFL),
        "fd_flags": fcntl.fcntl(fd, fcntl.F_GETFD),
    }


def kernel_signals() -> dict[str, str]:
    """Blocked, ignored and caught signals as the kernel has them (its truth, not Python's)."""
    with open("/proc/self/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f) if k in ("SigBlk", "SigIgn", "SigCgt")}


def python_stream(s: object) -> list[object]:
    return [s.encoding, s.errors, s.line_buffering, s.write_through, type(s.buffer).__name__]  # type: ignore[attr-defined]


umask = os.umask(0)
os.umask(umask)
with open("/proc/self/cgroup") as f:
    cgroup_raw = f.read()
cgroup = re.sub(r"elasticrun-(\d+)-[0-9a-f]+", r"elasticrun-\1-X", cgroup_raw)  # the group's own token
facts = {
    "preloaded": PRELOADED,
    "version": VERSION,
    "pid": os.getpid(),
    "env": dict(os.environ),
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "executable": sys.executable,
    "flags": list(sys.flags),
    "file": __file__,
    "path0": sys.path[0],
    "path": sys.path,
    "cwd": os.getcwd(),
    "umask": umask,
    "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")},
    "signals": kernel_signals(),
    "python_signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "stdio": [stream(fd) for fd in (0, 1, 2)],
    "python_stdio": [python_stream(s) for s in (sys.stdout, sys.stderr)],
    "session_leader": os.getsid(0) == os.getpid(),
    "group_leader": os.getpgid(0) == os.getpid(),
    "ppid": os.getppid(),
    "cgroup": cgroup,
    "cgroup_raw": cgroup_raw,
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "affinity": sorted(os.sched_getaffinity(0)),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "main_module": sys.modules["__main__"].__spec__ is None,
}
out, go = sys.argv[1], sys.argv[2]
restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
path = os.path.join(out, f"facts_{restart}_{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(facts, f)
os.rename(path + ".tmp", path)
print(f"rank {rank} version {VERSION} preloaded {PRELOADED}", flush=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")  # init_method env://, as torch's own launcher tests use it
# what PyTorch's launcher tests (test/distributed/launcher) check a worker sees, in our words
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)
torch_facts = {
    "torchelastic_launched": dist.is_torchelastic_launched(),
    "rank_world": [dist.get_rank(), dist.get_world_size()],
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "sum_of_ranks": int(total.item()),
    "backend": dist.get_backend(),
}
with open(os.path.join(out, f"torch_{restart}_{rank}.json"), "w") as f:
    json.dump(torch_facts, f)
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):  # a step is the time between two: the agent sees steps, starts standbys
    model(torch.ones(2)).sum().backward()
    opt.step()
    dist.barrier()
if restart == "0":
    while not os.path.exists(go):  # the test says when (an event of its own)
        time.sleep(0.02)
    if rank == "1":
        sys.exit(3)
    while True:
        signal.pause()  # until the agent stops it (SIGTERM), once rank 1 has failed
dist.destroy_process_group()
