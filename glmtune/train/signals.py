"""SIGTERM / SIGINT / SIGUSR1: stop cleanly, saving a checkpoint once training has begun.

Clusters pre-empt jobs with SIGTERM (SLURM sends it at the time limit, or `--signal=USR1@120` earlier); a
user presses Ctrl-C (SIGINT). Before the training loop runs there is nothing worth saving, so the signal
stops the run at once with one line. Once the loop runs, the handler only records the signal: the
training guard (guard.py) lets the current optimizer step finish, has every rank agree, writes a
complete checkpoint and stops; the launcher then exits with EXIT_INTERRUPTED and re-running the same
command resumes. A second signal while that save is running stops at once (the last complete
checkpoint is still there).

Light on purpose (no torch import): the launcher installs it before anything slow starts.
"""
from __future__ import annotations

import signal
import threading

EXIT_INTERRUPTED = 7  # stopped by a signal; re-run the same command to resume
EXIT_DIVERGED = 8  # a NaN/inf loss or weight stopped training (train/guard.py)
STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s)


class Interrupted(BaseException):
    """Raised where the main thread is when a stop signal arrives and no save is possible or wanted.

    A BaseException (like KeyboardInterrupt), so no `except Exception` on the way swallows it."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class StopSignals:
    """The process's stop-signal handler. `deferred=False`: raise Interrupted at once; `deferred=True`
    (the training loop runs): record the signal, and raise only on a second one."""

    def __init__(self):
        self.received: str | None = None
        self.deferred = False
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only; nothing to install elsewhere
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.deferred and self.received is None:
            self.received = name
            return
        self.received = self.received or name
        raise Interrupted(name)


# One per process: the launcher installs it, the training guard reads and switches it.
STOP = StopSignals()
