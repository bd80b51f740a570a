"""Workers' stacks: faulthandler's text parsed, summarised, bounded, and captured from
real processes through the worker boot.

The captures run real Python processes started as the agent starts workers (a session
of their own, the boot on PYTHONPATH, a stack file): one in a function, one run with
`python -I` (no boot: no stack, and not killed), one under a shell wrapper (its Python
child is signalled), one whose stack file names a stranger's pid (not signalled), one
that replaced the boot's handler, one stopped (SIGSTOP: a bounded wait), one whose
main thread blocks the signal, one with a thread that blocks it.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticrun.agent.boot import BOOT_DIR, boot_env
from elasticrun.agent.sessions import Session
from elasticrun.agent.stacks import (
    MARKER,
    NO_BOOT,
    STACKS_SIGNAL,
    StackCapture,
    Target,
    marked_pid,
    parse_dump,
    prepare_file,
    stacks_env,
)
from elasticrun.rendezvous.codec import decode, encode
from elasticrun.rendezvous.records import Frame, NodeStacks, RankStacks, ThreadStack
from elasticrun.rendezvous.stack_summary import (
    groups,
    one_line,
    ranges,
    render_groups,
    render_rank,
    summarise,
    where,
)
from elasticrun.rendezvous.stacks import bounded, left_out

pytestmark = pytest.mark.timeout(60)

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"

#: faulthandler's dump of a worker waiting in a gloo all-reduce, with a data loader
#: thread waiting on its queue (as captured, paths shortened)
ALL_REDUCE = f"""\
Thread 0x00007f0a1c9fe6c0 (most recent call first):
  File "{STDLIB}/threading.py", line 327 in wait
  File "{STDLIB}/queue.py", line 171 in get
  File "{SITE}/torch/utils/data/_utils/pin_memory.py", line 31 in do_one_step
  File "{STDLIB}/threading.py", line 982 in run
  File "{STDLIB}/threading.py", line 1045 in _bootstrap_inner
  File "{STDLIB}/threading.py", line 1002 in _bootstrap

Current thread 0x00007efccafccb80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/job/train.py", line 120 in step
  File "/job/train.py", line 140 in main
  File "/job/train.py", line 150 in <module>
"""

#: a rank stuck in its own function (time.sleep is C: no frame of its own)
LOAD_BATCH = """\
Current thread 0x00007f4ac73c9b80 (most recent call first):
  File "/job/train.py", line 88 in load_batch
  File "/job/train.py", line 118 in step
  File "/job/train.py", line 140 in main
  File "/job/train.py", line 150 in <module>
"""


def rank_of(rank: int, text: str, node: str = "n0") -> RankStacks:
    threads, more = parse_dump(text)
    return RankStacks(rank=rank, local_rank=rank % 8, node_id=node, pid=1000 + rank, threads=threads,
                      more_threads=more)


# --- faulthandler's text ------------------------------------------------------------------


def test_a_dump_is_parsed_into_threads_with_the_main_thread_first() -> None:
    threads, more = parse_dump(ALL_REDUCE)
    assert more == 0 and [t.main for t in threads] == [True, False]
    main, loader = threads
    assert main.thread == "0x00007efccafccb80"
    assert main.frames[0] == Frame(f"{SITE}/torch/distributed/distributed_c10d.py", 3252, "all_reduce")
    assert main.frames[-1] == Frame("/job/train.py", 150, "<module>") and len(main.frames) == 5
    assert loader.frames[-1].function == "_bootstrap"


def test_faulthandler_s_own_limits_and_odd_lines_are_read() -> None:
    """'...' after the frames (over 100) or after the threads (over 100), an unknown
    line number, a thread with no Python frame, a garbage collection note."""
    text = textwrap.dedent("""\
        Thread 0x0000000000000002 (most recent call first):
          <no Python frame>

        Current thread 0x0000000000000001 (most recent call first):
          Garbage-collecting
          File "/job/deep.py", line ??? in recurse
          File "/job/deep.py", line 5 in recurse
          ...
        ...
        """)
    (main, idle), more = parse_dump(text)
    assert more == 1
    assert main.main and main.frames == (Frame("/job/deep.py", 0, "recurse"), Frame("/job/deep.py", 5, "recurse"))
    assert main.more == 1 and idle.frames == ()
    assert parse_dump("") == ((), 0) and parse_dump("garbage\n") == ((), 0)


def test_the_latest_mark_names_the_process_to_signal() -> None:
    assert marked_pid("") is None and marked_pid("Thread 0x1 (most recent call first):\n") is None
    assert marked_pid(f"{MARKER}12\n{LOAD_BATCH}{MARKER}34\n") == 34


def test_the_boot_and_the_agent_agree_on_the_signal_and_the_variable() -> None:
    """Read from the boot's source: importing it would run it in this process."""
    tree = ast.parse((BOOT_DIR / "sitecustomize.py").read_text())
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
    }
    assert STACKS_SIGNAL == signal.SIGRTMIN + constants["STACKS_SIGNAL_OFFSET"]
    assert stacks_env(Path("/x")) == {constants["STACKS_FILE_ENV"]: "/x"}


# --- the summary ----------------------------------------------------------------------------


def test_where_names_the_innermost_user_frame_and_the_library_call_inside_it() -> None:
    assert where(rank_of(0, ALL_REDUCE)) == "in all_reduce (train.py:120)"  # not the decorator's wrapper
    assert where(rank_of(3, LOAD_BATCH)) == "train.py:88 in load_batch"
    queue_wait = textwrap.dedent(f"""\
        Current thread 0x1 (most recent call first):
          File "{STDLIB}/threading.py", line 327 in wait
          File "{STDLIB}/queue.py", line 171 in get
          File "/job/loader.py", line 9 in next_batch
        """)
    assert where(rank_of(0, queue_wait)) == "in get (loader.py:9)"  # what the user called, not threading's wait
    library_only = f'Current thread 0x1 (most recent call first):\n  File "{STDLIB}/runpy.py", line 88 in _run_code\n'
    assert where(rank_of(0, library_only)) == "runpy.py:88 in _run_code"
    assert where(RankStacks(0, 0, "n0", 0, missing="it has exited")) == "no stack: it has exited"


def test_the_summary_names_the_odd_ones_out_first_and_counts_the_rest() -> None:
    ranks = [rank_of(r, ALL_REDUCE, f"n{r // 8}") for r in range(16) if r != 3] + [rank_of(3, LOAD_BATCH, "n0")]
    lines = summarise(ranks)
    assert lines == ["rank 3 on node n0: train.py:88 in load_batch", "15 ranks: in all_reduce (train.py:120)"]
    assert one_line(lines) == "rank 3 on node n0: train.py:88 in load_batch; 15 ranks: in all_reduce (train.py:120)"
    assert summarise([rank_of(r, ALL_REDUCE) for r in range(8)]) == ["all 8 ranks: in all_reduce (train.py:120)"]
    missing = [RankStacks(r, r, f"n{r}", 0, missing="it has exited") for r in (5, 9)]
    assert summarise([*missing, rank_of(0, ALL_REDUCE)])[1] == "ranks 5, 9 on nodes n5, n9: no stack: it has exited"


def test_ranks_waiting_in_different_collectives_are_named_a_mismatch_first() -> None:
    broadcast = ALL_REDUCE.replace("line 3252 in all_reduce", "line 2811 in broadcast").replace("line 120", "line 99")
    lines = summarise([rank_of(0, broadcast), rank_of(1, ALL_REDUCE, "n1")])
    assert lines[0] == (
        "collective mismatch: rank 0 in broadcast, rank 1 in all_reduce: the ranks wait in different collectives "
        "and can never meet"
    ), lines
    assert lines[1:] == [
        "rank 0 on node n0: in broadcast (train.py:99)", "rank 1 on node n1: in all_reduce (train.py:120)"
    ]
    # one rank outside any collective is what the others wait for: a stuck rank, no mismatch
    assert not summarise([rank_of(0, broadcast), rank_of(1, LOAD_BATCH)])[0].startswith("collective mismatch")
    assert not summarise([rank_of(r, ALL_REDUCE) for r in range(4)])[0].startswith("collective mismatch")


def test_the_step_timings_wrapper_is_no_frame_of_a_stack() -> None:
    """Between the user's call and torch's all_reduce lies elasticrun's `timed`: never shown, never named."""
    ours = "/site/elasticrun/worker/steptime.py"
    wrapped = ALL_REDUCE.replace(
        '  File "/job/train.py", line 120 in step',
        f'  File "{ours}", line 380 in timed\n  File "/job/train.py", line 120 in step',
    )
    (main, _), _ = parse_dump(wrapped)
    assert [f.function for f in main.frames] == ["all_reduce", "wrapper", "step", "main", "<module>"]


def test_the_summary_has_a_bounded_number_of_lines() -> None:
    ranks = [rank_of(r, LOAD_BATCH.replace("line 88", f"line {r}")) for r in range(20)]
    lines = summarise(ranks, lines=4)
    assert len(lines) == 5 and lines[-1] == "16 more places (16 ranks): see elasticrun stacks"


def test_the_detailed_view_shows_each_distinct_stack_once() -> None:
    ranks = [rank_of(r, ALL_REDUCE, "a" if r < 2 else "b") for r in (0, 1, 2, 4, 5)] + [rank_of(3, LOAD_BATCH, "b")]
    found = groups(ranks)
    assert [[s.rank for s in g.ranks] for g in found] == [[3], [0, 1, 2, 4, 5]]
    text = "\n".join(render_groups(ranks))
    assert "--- rank 3 (1 on node b): train.py:88 in load_batch" in text
    assert "--- ranks 0-2,4-5 (5 on nodes a, b): in all_reduce (train.py:120)" in text
    assert text.count("distributed_c10d.py") == 1 and "pin_memory" not in text  # main threads only
    assert "... 1 more threads (--rank shows them)" in text
    full = "\n".join(render_rank(ranks[0]))
    assert "pin_memory.py" in full and "Thread 0x00007efccafccb80 (main)" in full
    assert ranges([0, 1, 2, 4, 6, 7]) == "0-2,4,6-7"


def test_published_stacks_are_bounded_and_keep_the_user_frame() -> None:
    deep = ThreadStack("0x1", tuple(Frame(f"{SITE}/lib.py", i, "inner") for i in range(60))
                       + (Frame("/job/train.py", 7, "step"),), main=True)
    many = tuple(ThreadStack(f"0x{i + 2}", (Frame(f"{STDLIB}/threading.py", 1, "wait"),)) for i in range(20))
    node = NodeStacks("n0", "r1", "why", 0.0, 1, (RankStacks(0, 0, "n0", 9, (deep, *many)),))
    cut = bounded(node)
    (rank,) = cut.ranks
    assert len(rank.threads) == 8 and rank.more_threads == 13
    assert rank.threads[0].frames[-1] == Frame("/job/train.py", 7, "step") and rank.threads[0].more == 0
    assert where(rank) == "in inner (train.py:7)"
    wide = NodeStacks("n0", "r1", "why", 0.0, 1, tuple(rank_of(r, ALL_REDUCE) for r in range(64)))
    small = bounded(wide, limit=8000)
    assert len(encode(small)) <= 8000 and len(small.ranks) + small.left_out == 64 and small.left_out
    assert left_out([small]) == [
        f"{small.left_out} ranks of node n0 left out (too large for the store; its run folder has them)"
    ]
    assert decode(NodeStacks, encode(small)) == small


# --- captures of real processes -----------------------------------------------------------

SCRIPT = """\
import os, signal, sys, threading, time
mode = sys.argv[1]

def waiter():
    if mode == "thread-blocks":
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN + 7])
    threading.Event().wait()

def load_batch():
    print("ready", flush=True)
    while True:
        time.sleep(3600)  # load_batch's line

threading.Thread(target=waiter, name="loader", daemon=True).start()
if mode == "own-handler":
    import faulthandler
    faulthandler.register(signal.SIGRTMIN + 7, file=open(os.devnull, "w"), all_threads=True)
if mode == "main-blocks":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN + 7])
load_batch()
"""


class Workers:
    """Processes started as the agent starts workers: a session each, the boot, a stack file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.script = tmp / "work.py"
        self.script.write_text(SCRIPT)
        lines = SCRIPT.splitlines()
        first = next(n for n, t in enumerate(lines, 1) if t.startswith("def load_batch"))
        #: where load_batch may be seen: a capture may come between its print and its sleep
        self.place = rf"work\.py:({first + 1}|{first + 2}|{first + 3}) in load_batch"
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], name: str) -> tuple[subprocess.Popen[str], Target]:
        file = self.tmp / f"{name}.stacks"
        prepare_file(file)
        env = dict(os.environ)
        env.update(boot_env(env))
        env.update(stacks_env(file))
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc, Target(local_rank=len(self.procs) - 1, rank=len(self.procs) - 1,
                            session=Session.of_leader(proc.pid), file=file)

    def python(self, mode: str = "plain", *flags: str) -> tuple[subprocess.Popen[str], Target]:
        return self.start([sys.executable, *flags, str(self.script), mode], mode + "".join(flags))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    w = Workers(tmp_path)
    try:
        yield w
    finally:
        w.close()


def capture(*targets: Target, limit: float = 5.0) -> tuple[RankStacks, ...]:
    return StackCapture("n0").capture(list(targets), limit)


def test_a_worker_in_a_function_is_captured_and_keeps_running(workers: Workers) -> None:
    proc, target = workers.python()
    for _ in range(3):  # again and again: each capture reads its own dump
        (stacks,) = capture(target)
        assert stacks.pid == proc.pid and not stacks.missing
        assert re.fullmatch(workers.place, where(stacks))
        assert [t.main for t in stacks.threads] == [True, False]
        assert stacks.threads[1].frames[-1].function == "_bootstrap"
    assert proc.poll() is None


def test_a_worker_without_the_boot_has_no_stack_and_is_not_signalled(workers: Workers) -> None:
    proc, target = workers.python("plain", "-I")
    (stacks,) = capture(target)
    assert stacks.missing == NO_BOOT and stacks.pid == 0
    assert proc.poll() is None and target.file.read_text() == ""


def test_under_a_shell_wrapper_the_python_child_is_signalled(workers: Workers) -> None:
    proc, target = workers.start(["sh", "-c", f'"{sys.executable}" "{workers.script}" plain; exit 3'], "wrapped")
    (stacks,) = capture(target)
    assert not stacks.missing and stacks.pid != proc.pid
    assert re.fullmatch(workers.place, where(stacks))
    assert proc.poll() is None


def test_a_pid_that_is_not_one_of_the_worker_s_processes_is_never_signalled(workers: Workers) -> None:
    stranger, _ = workers.python("plain", "-I")  # no handler: the signal would end it
    _, target = workers.python("plain", "-I")
    target.file.write_text(f"{MARKER}{stranger.pid}\n")
    (stacks,) = capture(target)
    assert stacks.missing == f"pid {stranger.pid} in its stack file is not one of the worker's processes: not signalled"
    assert stranger.poll() is None


def test_a_script_that_replaced_the_handler_is_said_in_one_line(workers: Workers) -> None:
    proc, target = workers.python("own-handler")
    (stacks,) = capture(target)
    assert stacks.missing.startswith(f"process {proc.pid} took the signal but wrote nothing to its stack file")
    assert proc.poll() is None


def test_a_stopped_worker_is_waited_for_a_bounded_time(workers: Workers) -> None:
    proc, target = workers.python()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        (stacks,) = capture(target, limit=0.3)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert stacks.missing.startswith(f"process {proc.pid} wrote no stacks within 0.3s of the signal (state T")
    assert proc.poll() is None


def test_threads_that_block_the_signal_do_not_stop_a_capture(workers: Workers) -> None:
    """The kernel hands the signal to a thread that does not block it: a loader thread
    when the main thread blocks it; the dump still names the main thread."""
    for mode in ("thread-blocks", "main-blocks"):
        proc, target = workers.python(mode)
        (stacks,) = capture(target, limit=2.0)
        assert re.fullmatch(workers.place, where(stacks)), stacks
        assert proc.poll() is None


def test_an_exited_worker_and_a_missing_file_are_said_in_one_line(workers: Workers, tmp_path: Path) -> None:
    _, target = workers.python()
    gone = Target(1, 1, target.session, target.file, exited="exit code 1")
    (stacks,) = capture(gone)
    assert stacks.missing == "the worker has exited (exit code 1)"
    nowhere = Target(2, 2, target.session, tmp_path / "none")
    assert capture(nowhere)[0].missing.startswith(f"its stack file {tmp_path / 'none'} cannot be read")


def test_the_boot_marks_the_file_and_leaves_the_worker_s_children_alone(tmp_path: Path) -> None:
    """The worker's own Python children (a data loader's, a compiler's) are no workers:
    they neither mark the file nor inherit the boot."""
    file = tmp_path / "w.stacks"
    prepare_file(file)
    env = dict(os.environ, PYTHONPATH="/elsewhere")
    env.update(boot_env(env))
    env.update(stacks_env(file))
    child = "import os; print(os.environ.get('ELASTICRUN_STACKS_FILE'), os.environ.get('PYTHONPATH'))"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    out = subprocess.run([sys.executable, "-c", parent], env=env, capture_output=True, text=True, timeout=30,
                         check=True)
    assert out.stdout == "None /elsewhere\n"
    lines = file.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith(MARKER)
