"""Worker-supplied text reaches the operator's terminal escaped.

A worker replaces the stack handler the boot registered with its own, which writes a
forged dump whose file and function names carry terminal escape sequences (set the
window's title, clear the screen, colour). `elasticrun stacks` and `elasticrun status`
show them escaped (`\\x1b`), never raw; `--json` escapes them as JSON does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticrun.agent.stacks import STACKS_SIGNAL
from tests.fault.test_security import Job
from tests.support.elastic_cluster import Cluster

pytestmark = pytest.mark.timeout(120)

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31m\x9b1m"
FORGER = """\
import faulthandler, signal, sys, time
from pathlib import Path

stop, dump = Path(sys.argv[1]), sys.modules["sitecustomize"]._stacks_file  # the boot's, kept open
ESCAPES = "@ESCAPES@"

def forge(signum, frame):
    dump.write("Current thread 0x00007f0000000001 (most recent call first):\\n"
               f'  File "/tmp/evil{ESCAPES}.py", line 7 in train{ESCAPES}\\n')
    dump.flush()

faulthandler.unregister(@SIGNAL@)
signal.signal(@SIGNAL@, forge)
print("forger up", flush=True)
while not stop.exists():
    time.sleep(0.05)
""".replace("@ESCAPES@", ESCAPES.encode("unicode_escape").decode()).replace("@SIGNAL@", str(int(STACKS_SIGNAL)))


@pytest.fixture
def job(cluster: Cluster, tmp_path: Path) -> Job:
    cluster._env.pop("ELASTICRUN_STORE_TOKEN", None)
    return Job(cluster, tmp_path)


def test_escape_sequences_from_a_forged_stack_dump_are_shown_escaped(job: Job, reliability) -> None:
    job.script.write_text(FORGER)
    a = job.agent("a")
    a.wait_for(r"forger up")
    flags = ["--rdzv-backend=c10d", f"--rdzv-endpoint={job.endpoint}", f"--rdzv-id={job.run_id}",
             f"--rdzv-conf=token_file={job.token_file}"]
    stacks = job.cluster.control("stacks", *flags)
    assert stacks.returncode == 0, stacks.stderr
    status = job.cluster.control("status", *flags)
    assert status.returncode == 0, status.stderr
    as_data = job.cluster.control("stacks", *flags, "--json")
    for name, out in (("stacks", stacks.stdout), ("status", status.stdout), ("stacks --json", as_data.stdout)):
        assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out, f"{name} printed raw escapes:\n{out!r}"
    assert "evil\\x1b]0;pwned\\x07" in stacks.stdout, stacks.stdout  # shown, escaped
    frames = json.loads(as_data.stdout)["ranks"][0]["threads"][0]["frames"]
    assert frames[0]["file"] == f"/tmp/evil{ESCAPES}.py", frames  # the data kept as it came
    job.stop_file.touch()
    assert a.wait_exit() == 0, a.text()[-3000:]
    job.store.kill()
    job.cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="terminal escape sequences from a worker",
        injected="a worker's own handler for the stacks signal wrote a forged dump whose file and function names "
        "carry escape sequences (window title, clear screen, colour, a C1 CSI)",
        happened="`elasticrun stacks` and `status` showed them escaped (\\x1b...), none raw; --json kept the "
        "text, escaped as JSON",
        restarts=0, lost="nothing",
    )
