"""The round's MASTER_PORT reservation: nobody else gets the port, the master's store does.

Between the agent's choice of MASTER_PORT and the rank-0 worker's bind (seconds: python
and torch start first), any other process could be given the port; the reservation keeps
it bound (not listening) for the whole round. These tests use real sockets and a real
torch TCPStore; the one that exhausts the ephemeral port range does it in a private
network namespace, with the range narrowed to 16 ports.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticrun.rendezvous.ports import PortReservation

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent

# Where another process might bind: this node's address, the IPv4 wildcard, the IPv6
# wildcard (dual-stack, as TCPStore's server binds) and IPv6 loopback.
ADDRESSES = ["127.0.0.1", "0.0.0.0"] + (["::", "::1"] if socket.has_dualstack_ipv6() else [])


def plain_bind(addr: str, port: int) -> None:
    """Bind (addr, port) as an ordinary program does, without SO_REUSEADDR."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, port))


@pytest.mark.parametrize("addr", ADDRESSES)
def test_a_reserved_port_cannot_be_bound_by_others_until_released(addr: str) -> None:
    reservation = PortReservation()
    try:
        with pytest.raises(OSError) as refused:
            plain_bind(addr, reservation.port)
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        reservation.close()
    plain_bind(addr, reservation.port)


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "legacy"])
def test_the_rank0_tcpstore_binds_a_reserved_port(use_libuv: bool) -> None:
    timeout = datetime.timedelta(seconds=10)
    reservation = PortReservation()
    try:
        master = dist.TCPStore(
            "127.0.0.1", reservation.port, 2, is_master=True, timeout=timeout,
            wait_for_workers=False, use_libuv=use_libuv,
        )
        client = dist.TCPStore("127.0.0.1", reservation.port, 2, is_master=False, timeout=timeout)
        client.set("k", "v")
        assert master.get("k") == b"v"
        del client, master
    finally:
        reservation.close()


def test_close_is_idempotent() -> None:
    reservation = PortReservation()
    reservation.close()
    reservation.close()
    plain_bind("0.0.0.0", reservation.port)


# Run in a private network namespace: every port of a 16-port ephemeral range is handed
# out, by bind(0) of every kind and by connect(), with the reservation held and then
# after it is released. Prints {"port": ..., "held": {probe: ports}, "released": {...}}.
_EXHAUST = textwrap.dedent("""
    import json, socket, subprocess
    from elasticrun.rendezvous.ports import PortReservation

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
        f.write("40000 40015")
    servers = [socket.create_server(("127.0.0.1", 5000))]  # outside the range
    if socket.has_dualstack_ipv6():
        servers.append(socket.create_server(("::1", 5000), family=socket.AF_INET6))

    def bind_any(addr, reuse):
        def make():
            s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
            if reuse:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, 0))
            return s
        return make

    def connect(server):
        return lambda: socket.create_connection(server.getsockname()[:2])

    probes = {f"bind {a} reuse={r}": bind_any(a, r) for a in ["127.0.0.1", "0.0.0.0"] for r in (False, True)}
    if socket.has_dualstack_ipv6():
        probes.update({f"bind {a}": bind_any(a, False) for a in ["::", "::1"]})
    probes.update({f"connect to {s.getsockname()[0]}": connect(s) for s in servers})

    def handed_out():
        result = {}
        for name, make in probes.items():
            held = []
            try:
                while len(held) < 20:
                    held.append(make())
            except OSError:
                pass
            result[name] = sorted(s.getsockname()[1] for s in held)
            for s in held:
                s.close()
        return result

    reservation = PortReservation()
    held = handed_out()
    reservation.close()
    print(json.dumps({"port": reservation.port, "held": held, "released": handed_out()}))
""")


def _netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root for a private network namespace"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip"
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        return "unshare --net is not permitted here"
    return ""


@pytest.mark.netns
def test_no_bind_to_port_0_nor_connect_is_given_the_reserved_port() -> None:
    why = _netns_unavailable()
    if why:
        pytest.skip(why)
    run = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", _EXHAUST],
        capture_output=True, text=True, cwd=REPO, timeout=30, check=True,
    )
    found = json.loads(run.stdout)
    port = found["port"]
    assert 40000 <= port <= 40015
    for probe, ports in found["held"].items():
        assert port not in ports, f"{probe} was given the reserved port {port}"
        assert len(ports) == 15, f"{probe} got {ports}: the range was not exhausted"
    for probe, ports in found["released"].items():
        assert port in ports, f"{probe} never got port {port} after its release: {ports}"
