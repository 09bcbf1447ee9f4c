"""Free loopback ports for benchmarks, tests and experiments that start peers on fixed ports
(the one home of this helper). A port is free when asked and may be taken before it is used:
callers that can listen on port 0 and read the port back should."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now (all held open until each is known, so they differ)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
