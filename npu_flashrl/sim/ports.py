"""A free TCP port for a test rig's rendezvous (torch.distributed's MASTER_PORT, a gloo store).

Why not the kernel's `bind(0)`: it answers from the ephemeral range, which every outgoing
connection on the machine also draws its source port from (Ray's workers open many), so between
the probe and the rendezvous the port is often taken and the store fails with "address already in
use" (seen in CI as a dead CheckpointEngineWorker). Ports are drawn at random below the ephemeral
range and above Ray's default worker ports (10002-19999), and probed with a bind."""
from __future__ import annotations

import random
import socket

_RAY_WORKER_PORTS_END = 19999
_FALLBACK_EPHEMERAL_LOW = 32768


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    low, high = _RAY_WORKER_PORTS_END + 1, _ephemeral_low() - 1
    rng = random.SystemRandom()  # not the tests' seeded global RNG: parallel runs must differ
    if high > low:
        for _ in range(tries):
            port = rng.randint(low, high)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # nothing free there: any port
        s.bind((host, 0))
        return s.getsockname()[1]
