"""Where a rank is reachable on the network: rank side (runs inside rank processes; imports
nothing from the notebook side, like the rest of tplab/rank/).

Ranks started by another launcher (mpi, ssh, slurm) may sit on other hosts. Before they
join the process group, the lab asks rank 0 which of its addresses the controller's network
reaches (that address becomes `master_addr`, where torch's TCPStore listens), and every rank
points gloo at the interface that reaches `master_addr` (`GLOO_SOCKET_IFNAME`, see
https://pytorch.org/docs/stable/distributed.html#choosing-the-network-interface-to-use),
so that gloo listens there and nowhere else.
"""

from __future__ import annotations

import os
import socket

import psutil


def route_source(destination: str) -> str:
    """The local address this host's routing table uses to reach `destination` (no packet
    is sent: connect() on a UDP socket only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(destination), 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address` on this host."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def rank_address(controller: str) -> dict:
    """This rank's address facing the controller's network, a free port there, and the
    host name: what rank 0 tells the lab to use as master_addr and master_port."""
    address = route_source(controller)
    return {"address": address, "port": free_port(address), "host": socket.gethostname(),
            "pid": os.getpid()}


def point_gloo_at(master_addr: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface that reaches master_addr (unless the user
    set it already); returns the interface name."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    name = interface_of(route_source(master_addr))
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name
