"""Where a worker process runs: its Ray node's IP, its Ray GPU ids, a port it can listen on.

Each answers outside Ray too (loopback, no GPU ids), for the local process runner.
"""

from __future__ import annotations

import socket
from typing import List

import ray

__all__ = ["node_ip", "ray_gpu_ids", "free_address"]


def node_ip() -> str:
    """The IP of the Ray node this process runs on (loopback outside Ray)."""
    try:
        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # Ray not connected: local processes
        return "127.0.0.1"


def ray_gpu_ids() -> List[str]:
    """The Ray GPU ids this process holds (empty outside Ray): distinct per stage actor on a node."""
    try:
        return [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
    except Exception:  # Ray not connected: local processes
        return []


def free_address() -> tuple:
    """``(ip, port)`` this process can listen on, for the process group rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return node_ip(), sock.getsockname()[1]
