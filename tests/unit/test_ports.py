"""free_port: a port below the kernel's ephemeral range (which outgoing connections draw from), bindable."""

import socket

from goodserve import ports
from goodserve.ports import free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    port = free_port()
    assert 1024 <= port < ports._ephemeral_low()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy - 1 if busy > 1025 else busy + 1])
        monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
        assert free_port() != busy
