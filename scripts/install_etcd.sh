#!/bin/sh
# Install an etcd server for the tests (Debian's etcd-server) when `etcd` is missing.
# Idempotent: does nothing when etcd is already on PATH. Needs root (or sudo) and apt-get.
set -eu

if command -v etcd >/dev/null 2>&1; then
    echo "etcd already installed: $(command -v etcd)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_etcd.sh: etcd is missing and apt-get is not available;" \
         "install etcd >= 3.4 by hand (https://etcd.io/docs/latest/install/)" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

$SUDO apt-get update
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends etcd-server
etcd --version | head -1
