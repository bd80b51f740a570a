#!/bin/sh
# Install what tests/test_slurm.py runs a one-node Slurm cluster with, from Debian's
# packages, when any of it is missing: slurmctld, slurmd, slurm-client (sbatch, srun,
# sacct, ...), slurmdbd (the accounting that sacct reads), mariadb-server (slurmdbd's
# database) and munge (its authentication). Only the programs are used: the tests keep
# their configuration, munge key, database and state in a temporary folder and start
# the daemons themselves. Installing the packages starts no service here where
# policy-rc.d forbids it (containers); elsewhere, stop and disable them if you do not
# want a Slurm cluster on this machine. The munge package makes its own key,
# /etc/munge/munge.key, as it always does; the tests do not use it.
# Idempotent: does nothing when every program is on PATH. Needs root (or sudo) and apt-get.
set -eu

missing=""
for program in slurmctld slurmd slurmdbd sbatch sacct munged mungekey mariadbd mariadb-install-db; do
    command -v "$program" >/dev/null 2>&1 || missing="$missing $program"
done
if [ -z "$missing" ]; then
    echo "Slurm already installed: $(slurmctld -V)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: missing:$missing, and apt-get is not available; install Slurm" \
         "(slurmctld, slurmd, slurmdbd, the clients), munge and MariaDB by hand, or the" \
         "Slurm tests are skipped" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

$SUDO apt-get update
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    slurmctld slurmd slurmdbd slurm-client munge mariadb-server
slurmctld -V
