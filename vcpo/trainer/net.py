"""Network helpers of the trainer's processes (no vLLM, no torch): a free port for a server, a rendezvous or a
weight-transfer group."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` (an IPv4 address of this machine) that nothing listens on now (it is bound a moment
    later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
