"""SIGTERM / SIGINT / SIGUSR1 (and submitit's SIGUSR2): stop cleanly, saving a checkpoint once training has begun.

Clusters pre-empt jobs with SIGTERM (SLURM sends it at the time limit, or `--signal=USR1@120` earlier); a
user presses Ctrl-C (SIGINT). Before the training loop runs there is nothing worth saving, so the signal
stops the run at once with one line. Once the loop runs, the handler only records the signal: the
training guard (guard.py) lets the current optimizer step finish, has every rank agree, writes a
complete checkpoint and stops; the launcher then exits with EXIT_INTERRUPTED (7) and re-running the same
command resumes. A second signal while that save is running stops at once (the last complete
checkpoint is still there).

Light on purpose (no torch import): the launcher installs it before anything slow starts.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s)


def preempt_signal() -> int | None:
    """Inside a submitit job (hydra/launcher=slurm, or submitit_local): the signal submitit has SLURM send
    `signal_delay_s` before the time limit or at pre-emption (SUBMITIT_PREEMPT_SIGNAL, USR2 by default), which
    its own handler answers by resubmitting the job. Elsewhere None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


class Interrupted(BaseException):
    """Raised where the main thread is when a stop signal arrives and no save is possible or wanted.

    A BaseException (like KeyboardInterrupt), so no `except Exception` on the way swallows it."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class Requeued(BaseException):
    """submitit resubmitted this job: the process exits with submitit's `code`, and a sweep records no result
    for the trial (the requeued job runs it on). Not a SystemExit, which a sweep's trial records as a failure."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


class StopSignals:
    """The process's stop-signal handler. `deferred=False`: raise Interrupted at once; `deferred=True`
    (the training loop runs): record the signal, and raise only on a second one."""

    def __init__(self):
        self.received: str | None = None
        self.deferred = False
        self._previous: dict[int, object] = {}
        self._fork_hook = False
        self._blocked: set[int] = set()  # the stop signals _block blocked for a fork, until _unblock

    def install(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only; nothing to install elsewhere
        for sig in (*STOP_SIGNALS, *filter(None, [preempt_signal()])):
            self._previous[sig] = signal.signal(sig, self._handle)
        if not self._fork_hook:  # once per process
            os.register_at_fork(before=self._block, after_in_parent=self._unblock, after_in_child=self._in_child)
            self._fork_hook = True
        if sys.unraisablehook is not _quiet_unraisable:
            _quiet_unraisable.default = sys.unraisablehook
            sys.unraisablehook = _quiet_unraisable
        return self

    def _block(self) -> None:
        """Before a fork: the stop signals wait (blocked in the forking thread, so in the child too) until the
        child has dropped the handler (_in_child). Unblocked, a SIGTERM landing between the fork and that reset ran
        this handler in the child, inside an at-fork hook where Python drops the exception: the child lived on,
        and a manager process that outlives its SIGTERM keeps the parent's exit waiting for it (multiprocessing
        joins its non-daemon children at exit)."""
        self._blocked = set(self._previous)  # recorded first: a signal raising right after the call still gets undone
        if self._blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, self._blocked)

    def _unblock(self) -> None:
        """After a fork (in the parent, and last in the child): a stop signal that came meanwhile is delivered now."""
        if self._blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self._blocked)
            self._blocked = set()

    def _in_child(self) -> None:
        """A forked child (a data-build worker, datasets' manager, a DataLoader worker) does not inherit the
        handler: raising Interrupted there would print a traceback per child, and a child that swallowed it would
        keep its parent waiting at exit. SIGTERM kills it (what a pool's terminate() sends); SIGINT, which Ctrl-C
        sends to the whole foreground group, and SIGUSR1 are the parent's to act on. A SIGTERM sent during the
        fork was held (_block) and kills the child when the mask is restored, after the reset."""
        if self._previous:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            for sig in self._previous:
                if sig != signal.SIGTERM:
                    signal.signal(sig, signal.SIG_IGN)  # a SIGINT held since the fork is discarded with it
            self._previous.clear()
        self._unblock()

    def settle(self) -> None:
        """The stop's checkpoint is complete: a later stop signal changes nothing and is ignored. torchrun sends
        one to the ranks still running when the first exits (exit 7 is a failure to it); that rank would have
        said "a second SIGTERM before the checkpoint was complete" about a complete checkpoint."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def requeues(self) -> bool:
        """Whether the stop came from submitit's pre-emption signal, whose handler requeues the job."""
        sig = preempt_signal()
        return sig is not None and self.received == signal.Signals(sig).name and callable(self._previous.get(sig))

    def requeue(self) -> None:
        """After the stop that submitit's signal asked for (the checkpoint is written): hand the signal to
        submitit's handler. On rank 0 it resubmits the job (at most max_num_timeout times; then it raises) and
        exits; the requeued job runs in the same trial dir and resumes from the checkpoint. Other ranks return."""
        if self.requeues():
            sig = preempt_signal()
            try:
                self._previous[sig](sig, None)
            except SystemExit as done:
                raise Requeued(done.code) from None

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.deferred and self.received is None:
            self.received = name
            return
        if self.received is None:
            self._watch(signum)
        self.received = self.received or name
        raise Interrupted(name)

    def _watch(self, signum: int) -> None:
        """Send the signal again every 3 s until the process stops or training takes it over.

        Python ignores an exception raised where it cannot propagate: in an os.fork hook (logging's lock
        release after every fork of a multi-process data build), a __del__, a weakref callback. There the
        first Interrupted is lost and the run would go on; the repeat lands in ordinary code and stops it. 3 s: long
        enough for the usual unwinding (a data build's pool teardown, the run dir's lock) to finish first."""

        def again() -> None:
            if self._previous and self.received and not self.deferred:  # still installed, nobody stopped yet
                os.kill(os.getpid(), signum)
                self._watch(signum)

        timer = threading.Timer(3.0, again)
        timer.daemon = True
        timer.start()


def _quiet_unraisable(unraisable) -> None:
    """An Interrupted that Python could not raise (see _watch) is not an error to print: the repeat handles it."""
    if not isinstance(unraisable.exc_value, Interrupted):
        _quiet_unraisable.default(unraisable)


_quiet_unraisable.default = sys.unraisablehook

# One per process: the launcher installs it, the training guard reads and switches it.
STOP = StopSignals()
