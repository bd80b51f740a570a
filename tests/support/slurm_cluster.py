"""A real single-host Slurm cluster for tests: munge, MariaDB, slurmdbd, slurmctld, slurmd.

`SlurmCluster` starts Debian's daemons (installed by `scripts/install_slurm.sh`) with
everything in a temporary folder: the munge key and socket, the database, the
configuration (`slurm.conf`, `slurmdbd.conf`, found through `SLURM_CONF`), spool, state
and logs. Nothing is read from or written to /etc. Every daemon listens on 127.0.0.1
only (`NoInAddrAny`, `NoCtldInAddrAny`, `DbdAddr`, MariaDB's `--bind-address`), on free
ports. `close()` cancels the jobs left, waits for them to end, then stops each daemon by
its PID.

Why each piece:
- munge authenticates every Slurm message. `munged` takes its key, socket, PID and seed
  files as options, so it runs as root on a key made here; the clients and daemons find
  the socket through `AuthInfo` (and slurmctld's messages to slurmdbd through
  `AccountingStoragePass`). munged wants every folder above its socket searchable by
  all, hence the 0711 temporary folder.
- `sacct` reads accounting from slurmdbd only (Slurm 22.05 has no file-based accounting
  that sacct reads: `jobcomp/filetxt` writes a log sacct does not read), and slurmdbd
  keeps it in MySQL or MariaDB: a private MariaDB server, its data in the temporary
  folder, small InnoDB files, no fsync per commit.
- One node, `localhost`, with 8 CPUs declared whatever the host has
  (`SlurmdParameters=config_overrides`), so that a job of 3 one-CPU tasks and a second
  job beside it fit on a 2-core machine; `OverSubscribe=FORCE` lets jobs share them.
- proctrack/linuxproc and task/none: no cgroups, which containers often lack.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.support.helpers import free_port, wait_until

#: the programs the cluster needs, from Debian's munge, mariadb-server, slurmdbd,
#: slurmctld, slurmd and slurm-client
PROGRAMS = (
    "mungekey", "munged", "mariadb-install-db", "mariadbd", "slurmdbd", "slurmctld", "slurmd",
    "sbatch", "sacct", "squeue", "scancel", "sinfo", "scontrol",
)
#: bounds each daemon's start, and the wait for the jobs to end at close
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
NODE = "localhost"
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def why_unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): run scripts/install_slurm.sh"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs"
    return None


class SlurmCluster:
    """The daemons of a one-node cluster, started by `start()`, stopped by `close()`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="slurm-test-"))
        self.root.chmod(0o711)
        self.conf = self.root / "slurm.conf"
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            # the job's `python` is this interpreter (the checkout's .venv)
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self) -> None:
        munge_socket = self.root / "munge.sock"
        db, db_port = self.root / "db", free_port()
        dbd_port, ctld_port, slurmd_port = free_port(), free_port(), free_port()
        self._write_configs(munge_socket, db_port, dbd_port, ctld_port, slurmd_port)
        subprocess.run(["mungekey", "--create", f"--keyfile={self.root / 'munge.key'}"], check=True)
        self._start("munged", [
            "munged", "--foreground", f"--key-file={self.root / 'munge.key'}", f"--socket={munge_socket}",
            f"--pid-file={self.root / 'munged.pid'}", f"--seed-file={self.root / 'munged.seed'}",
            f"--log-file={self.root / 'munged.log'}",
        ], munge_socket.exists)
        innodb = ["--innodb-log-file-size=4M", "--innodb-buffer-pool-size=16M"]
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={db}", "--user=root",
             "--auth-root-authentication-method=normal", "--skip-test-db", *innodb],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=READY_TIMEOUT,
        )
        db_log = self.root / "mariadb.err"
        self._start("mariadbd", [
            "mariadbd", "--no-defaults", f"--datadir={db}", "--user=root", "--bind-address=127.0.0.1",
            f"--port={db_port}", f"--socket={self.root / 'mariadb.sock'}", f"--pid-file={self.root / 'mariadb.pid'}",
            f"--log-error={db_log}", "--skip-name-resolve", "--innodb-flush-log-at-trx-commit=0", *innodb,
        ], lambda: "ready for connections" in _read(db_log))
        self._start("slurmdbd", ["slurmdbd", "-D"], lambda: " started" in self.log("slurmdbd"))
        self._start("slurmctld", ["slurmctld", "-D", "-i"],
                    lambda: "Running as primary controller" in self.log("slurmctld"))
        self._start("slurmd", ["slurmd", "-D", "-N", NODE], lambda: self._node_state() == "idle")

    def run(self, *argv: str, check: bool = True) -> str:
        """A Slurm command against this cluster; its standard output."""
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=READY_TIMEOUT)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, *argv: str, env: dict[str, str] | None = None) -> int:
        """Submit a batch job; its id. `env` adds to the job's environment (sbatch passes
        the submitting environment on)."""
        done = subprocess.run(
            ["sbatch", "--parsable", *argv], env={**self.env, **(env or {})},
            capture_output=True, text=True, timeout=READY_TIMEOUT,
        )
        if done.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def accounting(self, job: int) -> dict[str, tuple[str, str]]:
        """sacct's record of a job: {job id or step id: (state, exit code)}."""
        out = self.run("sacct", "-j", str(job), "--noheader", "--parsable2", "--format=JobID,State,ExitCode")
        return {row.split("|")[0]: (row.split("|")[1], row.split("|")[2]) for row in out.splitlines() if row}

    def wait_ended(self, job: int, timeout: float) -> tuple[str, str]:
        """Wait until sacct records the job's end; its (state, exit code)."""
        def ended() -> tuple[str, str] | None:
            state = self.accounting(job).get(str(job))
            return state if state and state[0].split()[0] in TERMINAL_STATES else None

        state = wait_until(ended, timeout, f"job {job} to end in sacct", interval=0.5)
        assert state is not None
        return state

    def log(self, name: str) -> str:
        return _read(self.root / f"{name}.log")

    def close(self) -> None:
        """Cancel the jobs left and wait for them to end; stop the daemons by PID."""
        try:
            if any(name == "slurmctld" and p.poll() is None for name, p in self._daemons):
                self._cancel_jobs()
        finally:
            self._stop_daemons()

    # --- internals ---

    def _cancel_jobs(self) -> None:
        jobs = self.run("squeue", "--noheader", "--format=%A", check=False).split()
        if jobs:
            self.run("scancel", "--full", *jobs, check=False)
            wait_until(lambda: not self.run("squeue", "--noheader", check=False).strip(),
                       STOP_TIMEOUT, "the cancelled jobs to end", interval=0.2)

    def _stop_daemons(self) -> None:
        for _, process in reversed(self._daemons):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._daemons.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def _start(self, name: str, argv: list[str], ready: Callable[[], bool]) -> None:
        with open(self.root / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self._daemons.append((name, process))

        def started() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"{name} exited {process.returncode}:\n{self.log(name)[-3000:]}")
            return ready()

        wait_until(started, READY_TIMEOUT, f"{name} to be ready", interval=0.1)

    def _node_state(self) -> str:
        return self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False).strip()

    def _write_configs(self, munge: Path, db_port: int, dbd_port: int, ctld_port: int, slurmd_port: int) -> None:
        auth = f"AuthType=auth/munge\nAuthInfo=socket={munge}\n"
        dbd_conf = self.root / "slurmdbd.conf"  # slurmdbd reads it beside SLURM_CONF
        dbd_conf.write_text(
            auth
            + f"DbdHost={NODE}\nDbdAddr=127.0.0.1\nDbdPort={dbd_port}\n"
            + "CommunicationParameters=NoInAddrAny\nSlurmUser=root\n"
            + f"PidFile={self.root / 'slurmdbd.pid'}\n"
            + f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={db_port}\n"
            + "StorageUser=root\nStorageLoc=slurm_acct_db\n"
        )
        dbd_conf.chmod(0o600)  # slurmdbd refuses a configuration others can read
        self.conf.write_text(
            auth
            + "ClusterName=elasticrun\nCredType=cred/munge\n"
            + f"SlurmctldHost={NODE}(127.0.0.1)\nSlurmctldPort={ctld_port}\nSlurmdPort={slurmd_port}\n"
            + "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny\n"
            + "SlurmUser=root\nSlurmdUser=root\n"
            + f"StateSaveLocation={self.root / 'state'}\nSlurmdSpoolDir={self.root / 'spool'}\n"
            + f"SlurmctldPidFile={self.root / 'slurmctld.pid'}\nSlurmdPidFile={self.root / 'slurmd.pid'}\n"
            + "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            + "MpiDefault=none\nMailProg=/bin/true\nReturnToService=2\n"
            + "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
            + f"AccountingStoragePort={dbd_port}\nAccountingStoragePass={munge}\n"
            + "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSlurmdParameters=config_overrides\n"
            + f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n"
            + f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
