"""Free loopback ports for the servers a test run starts (standard library only: the conformance
suite, which runs in vLLM's venv, takes its ports here too)."""

from __future__ import annotations

import random
import socket

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768 up), never one handed out before
    in this process: a run hands ports out (a cluster's nodes and their bus ports, a stack's and
    its pods') before they are bound, so a port free now may be handed out again until then; and
    an outgoing connection (ours, or another test run's on this machine) takes its local port from
    the ephemeral range, so one from there could be gone (a cluster node that found its port taken
    exited at start in a CI run)."""
    while True:
        port = random.randrange(20_000, 32_000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
