"""PyTorch's own launcher test scripts, run warm and cold under elasticrun: do they behave the same?

PyTorch tests its launcher with small scripts (test/distributed/launcher/bin/ of a
pytorch checkout: the environment a worker is given, a failing worker, an `env://` and a
`file://` group's all-reduce, `is_torchelastic_launched()`, `--local_rank`). They are not
part of this repository (PyTorch's code stays PyTorch's), so this is a check to run by
hand against a checkout, not a test of the suite:

    python bench/torch_launcher_scripts.py ~/src/pytorch/test/distributed/launcher/bin

Each script runs as the second attempt of a job (`--max-restarts=1`), warm (a standby
takes it) and cold (`--warm-imports=off`): a node's first attempt always starts cold,
so the first attempt is a stand-in that waits until the standbys are ready (warm) or
its workers run (cold), then fails; the script's file is replaced by PyTorch's script
meanwhile, and a warm start reads the script at the hand-over, a cold one at its start.
Printed: per script and start, the job's exit code, what the script wrote or printed
(values that differ between any two runs, ports and run ids, left out), whether the
second attempt was warm, and whether warm and cold agree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: the first attempt: waits for the go file, then fails, so that the script runs as the second
STAND_IN = """\
import os, sys, time
out = os.environ["STAND_IN_DIR"]
open(os.path.join(out, "waiting_" + os.environ["RANK"]), "w").close()
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.05)
sys.exit(1)
"""

#: printed values that differ between two runs of one job whatever the start
_VARYING = re.compile(r"^(MASTER_PORT|MASTER_ADDR|TORCHELASTIC_RUN_ID|TORCHELASTIC_ERROR_FILE) = .*$", re.M)


@dataclass(frozen=True)
class Case:
    name: str
    script: str
    nproc: int
    #: the script's arguments, given the run's folder
    args: tuple[str, ...]
    #: whether what it prints is the same in every run (a failing rank ends its peers
    #: wherever they are, with either start)
    prints_the_same: bool = True


def cases(folder: Path) -> list[Case]:
    return [
        Case("environment", "test_script.py", 2, ("--touch_file_dir", str(folder / "touched"))),
        Case("failure", "test_script.py", 2, ("--fail",), prints_the_same=False),
        Case("env:// group", "test_script_init_method.py", 2, ("--init-method", "env://")),
        Case("file:// group", "test_script_init_method.py", 2, ("--init-method", f"file://{folder / 'rendezvous'}")),
        Case("is_torchelastic_launched", "test_script_is_torchelastic_launched.py", 1,
             ("--out_file", str(folder / "launched"))),
        Case("--local_rank", "test_script_local_rank.py", 1, ("--local_rank", "0")),
    ]


@dataclass
class Outcome:
    exit_code: int
    #: what the script printed and wrote, the varying values left out
    seen: str
    warm: bool


def run(case: Case, bin_dir: Path, warm: bool, folder: Path, timeout: float) -> Outcome:
    folder.mkdir(parents=True)
    (folder / "touched").mkdir()
    script = folder / case.script
    script.write_text(STAND_IN)
    env = {**os.environ, "STAND_IN_DIR": str(folder), "TEST_SENTINEL_PARENT": "FOOBAR", "LOGLEVEL": "DEBUG",
           "PYTHONPATH": str(REPO)}
    flags = ["--standalone", f"--nproc-per-node={case.nproc}", "--max-restarts=1", f"--log-dir={folder / 'logs'}"]
    if not warm:
        flags.append("--warm-imports=off")
    log = (folder / "agent.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticrun", *flags, str(script), *case.args],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        ready = "standby workers ready" if warm else None
        while not _first_attempt_ready(folder, case.nproc, ready):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{case.name}: the first attempt never got ready; see {folder / 'agent.log'}")
            time.sleep(0.1)
        shutil.copy(bin_dir / case.script, script)
        (folder / "go").touch()
        exit_code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    log.seek(0)
    text = log.read()
    log.close()
    # the standbys were ready before the second attempt; a start without them says why at DEBUG
    after_ready = text.partition("standby workers ready")[2]
    return Outcome(exit_code, _seen(case, folder, text), bool(after_ready) and "workers start cold" not in after_ready)


def _first_attempt_ready(folder: Path, nproc: int, needle: str | None) -> bool:
    if len(list(folder.glob("waiting_*"))) < nproc:
        return False
    return needle is None or needle in (folder / "agent.log").read_text()


def _seen(case: Case, folder: Path, text: str) -> str:
    """What the script's second attempt printed and wrote, in an order and form two runs share."""
    lines = [re.sub(r"^\[\d+\]<std(out|err)>: ?", "", line) for line in text.splitlines()]
    printed = sorted(
        _VARYING.sub(r"\1 = <varies>", line) for line in lines
        if not line.startswith(("[elasticrun", "elasticrun", "DEBUG", "INFO", "WARNING"))
        and ("=" in line or line.startswith(("Start", "End", "Done", "Success", "Distributed")))
    )
    printed = [re.sub(r"/\S+/touched/", "<dir>/", line) for line in printed]
    raised = "raising exception since --fail flag was set" in text
    touched = sorted(p.name for p in (folder / "touched").iterdir())
    launched = (folder / "launched").read_text() if (folder / "launched").exists() else "-"
    return f"printed={printed if case.prints_the_same else '-'} raised={raised} touched={touched} launched={launched}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bin_dir", type=Path, help="test/distributed/launcher/bin of a pytorch checkout")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    args = parser.parse_args()
    if not (args.bin_dir / "test_script.py").is_file():
        print(f"torch_launcher_scripts: no test_script.py in {args.bin_dir}", file=sys.stderr)
        return 2
    agree = True
    tmp = tempfile.mkdtemp(prefix="torch-scripts-")
    for i, name in enumerate(c.name for c in cases(Path(tmp))):
        outcomes = {}
        for warm in (True, False):
            folder = Path(tmp) / f"{i}-{'warm' if warm else 'cold'}"
            outcomes[warm] = run(cases(folder)[i], args.bin_dir, warm, folder, args.timeout)
        same = (outcomes[True].exit_code, outcomes[True].seen) == (outcomes[False].exit_code, outcomes[False].seen)
        agree &= same and outcomes[True].warm
        print(f"{name}: warm exit {outcomes[True].exit_code} (second attempt warm: {outcomes[True].warm}), "
              f"cold exit {outcomes[False].exit_code}: {'the same' if same else 'DIFFERENT'}")
        print(f"  warm: {outcomes[True].seen}")
        if not same:
            print(f"  cold: {outcomes[False].seen}")
    if agree:
        shutil.rmtree(tmp)
    else:
        print(f"the runs' folders and agent logs are kept in {tmp}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
