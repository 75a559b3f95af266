"""What the lab's `ip=` means, said once: an address of this machine, or every interface
("0.0.0.0", "*", or ""), and what each part of a lab makes of it (validate.check_ip says
whether it is one of this machine's)."""

from __future__ import annotations

import dataclasses
import socket

EVERY_INTERFACE = ("0.0.0.0", "*", "")


@dataclasses.dataclass(frozen=True)
class Address:
    """One `ip=` read: where to listen, and what ranks elsewhere contact."""

    ip: str
    every_interface: bool  # "0.0.0.0", "*" or ""
    bind: str  # what a socket of this machine binds to
    contact: str  # what a process on another host reaches this machine at

    @property
    def loopback(self) -> bool:
        return self.ip.startswith("127.")


def address(ip: str) -> Address:
    """`ip=` read: every interface binds 0.0.0.0 and is reached by this host's name."""
    every = ip in EVERY_INTERFACE
    return Address(ip, every, "0.0.0.0" if every else ip,
                   socket.gethostname() if every else ip)
