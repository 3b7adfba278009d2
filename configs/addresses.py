"""Which addresses only reach this machine: what decides whether a server needs a key (``inference/auth.py``) and
whether the config may start it in dev mode (``configs/settings.py``, ``inference.host``)."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) only reaches this machine: 127.0.0.0/8, ::1, ``localhost``.
    ``0.0.0.0`` and ``::`` (every interface) are not; a name that does not resolve is taken as not."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except OSError:
            return False
