"""A free local TCP port for the tests' servers and rendezvous stores.

A port taken with ``bind(("127.0.0.1", 0))`` and released comes from the kernel's ephemeral range,
which every outgoing connection on the machine draws from too: between the choice and the server's
own bind, another process's connection (a rendezvous client of a test on the other pytest worker)
could take it, and a tensor-parallel group then failed to start ("Connection reset by peer").
Ports below that range are never handed out implicitly, so one chosen there (at random, checked
bindable) stays free unless another test picks the same number."""

from __future__ import annotations

import random
import socket


def _ephemeral_low(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the ephemeral range."""
    high = min(_ephemeral_low(), 32768) - 1
    for _ in range(200):
        port = random.randint(10000, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000..{high} after 200 tries")
