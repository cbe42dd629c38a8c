"""The rendezvous port (`get_free_port`) is free and lies below the kernel's ephemeral range, so no outgoing
connection can take it between the draw and the rendezvous's bind (a test run saw EADDRINUSE when it was a port-0
bind, which draws from that range)."""
from __future__ import annotations

import socket

from verl.single_controller.base.worker import ephemeral_port_range, get_free_port


def test_the_rendezvous_port_is_free_and_never_an_ephemeral_one():
    low, high = ephemeral_port_range()
    assert 1024 <= low <= high <= 65535
    ports = [get_free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (ports, low)
    assert len(set(ports)) > 1, "drawn, not one fixed port"
    with socket.socket() as sock:  # and it binds
        sock.bind(("", ports[-1]))


def test_a_port_in_use_is_never_returned():
    low = ephemeral_port_range()[0]
    held = []
    try:
        for port in range(10_000, min(low, 10_000 + 300)):  # hold a block; the draws must avoid whatever is held
            sock = socket.socket()
            try:
                sock.bind(("", port))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {get_free_port() for _ in range(50)}
    finally:
        for sock in held:
            sock.close()
