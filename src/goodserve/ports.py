"""A free port to listen on, picked where no outgoing connection can take it first.

A port the kernel hands out for port 0 comes from its ephemeral range, the same range it draws
every outgoing connection's local port from: between picking a port and binding it, a client
connection of any process on the host (a test's, a router's) may take it. So the pick is made below
that range, at random, and checked by binding it.
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 12000  # ports below the ephemeral range to pick from


def free_port(host: str = "127.0.0.1") -> int:
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - _SPAN), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use: another pick
            return port
    with socket.socket() as s:  # that span is full: let the kernel pick, race and all
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The ephemeral range's first port (Linux's; 32768, its default, where it cannot be read)."""
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
