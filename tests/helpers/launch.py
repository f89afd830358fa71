"""Launches of several ranks on CPU: the environment they run in, a free port for a rendezvous, and the line each
rank logs with its view of the adapter (glmtune.train.zero3.adapter_fingerprint)."""

import os
import re
import socket

from . import BIN

FINGERPRINT = re.compile(r"adapter fingerprint ([0-9a-f]{64}) \(rank (\d+) of (\d+)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_env(**extra: str) -> dict:
    """This environment for a launch's ranks: this interpreter's torchrun and deepspeed first on PATH, and one
    thread per rank (two ranks on two cores; more would oversubscribe and slow everything down)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra}
