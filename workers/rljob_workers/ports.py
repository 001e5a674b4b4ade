"""Loopback ports for processes this machine starts itself (local runs, tests, the e2e cluster).

Asking the kernel for port 0 returns a port from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default). That is the range the kernel
also hands out to every *outgoing* connection. Between picking such a port and the server binding
it (seconds, while etcd and kube-apiserver start and open hundreds of client connections), a client
socket can take it, and the server then dies with "address already in use" (clean-clone CI at
a56159f: kwok lost port 39771 this way and 89 cluster tests errored).

So ports are picked below the ephemeral range, where the kernel never assigns a client port, and
also below the NodePort range (30000-32767), which kube-proxy may hold. Each pick is checked with a
bind, and a process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICK_RANGE = (20000, 29999)
"""Inclusive; below the Kubernetes NodePort range and Linux's default ephemeral range."""

_given: set[int] = set()
_lock = threading.Lock()
_rng = random.SystemRandom()  # independent of any seed a test or worker sets on `random`


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for client ports, inclusive (the Linux default where it can't be read)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def candidate_ports(ephemeral: tuple[int, int], pick: tuple[int, int] = PICK_RANGE) -> list[int]:
    """Ports in ``pick`` that the kernel never gives to a client socket."""
    low, high = ephemeral
    return [p for p in range(pick[0], pick[1] + 1) if not low <= p <= high]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, tries: int = 200) -> int:
    """A TCP port free on ``host`` now, outside the ephemeral range, not given out before here."""
    candidates = candidate_ports(ephemeral_range())
    with _lock:
        for port in _rng.sample(candidates, min(tries, len(candidates))):
            if port not in _given and _bindable(host, port):
                _given.add(port)
                return port
    # the whole pick range is taken or the ephemeral range covers it: ask the kernel
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
