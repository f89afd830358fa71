"""`python -m glmtune.supervise LAUNCHER ARGS...`: a multi-process launcher that stops the way one process does.

    python -m glmtune.supervise torchrun --standalone --nproc_per_node 2 -m glmtune ...   (scripts/torchrun.sh)

A stop signal (SIGTERM from `timeout`, kill or a scheduler, Ctrl-C's SIGINT, SIGUSR1) sent to torchrun itself
makes it raise SignalException: it signals the ranks, SIGKILLs any still saving 30 s later, prints a traceback
and exits 1. The deepspeed launcher kills its ranks on SIGINT. Either can cut a checkpoint short, and neither
exits 7. So the scripts run the launcher under this supervisor, in a session of its own (Ctrl-C at the
terminal reaches the supervisor only), and the supervisor:

- sends each stop signal to the ranks (the launcher's descendants with RANK and LOCAL_RANK in their
  environment), never to the launcher; before any rank runs, to the launcher, which has nothing to save;
- after a stop, passes on only glmtune's own lines from the launcher's stderr (the ranks' stop line; the
  launcher's report that a rank "failed" with exit code 7 is noise), each once;
- exits 7 when the ranks stopped on the signal (every rank exit code the launcher reports is 7, or glmtune's
  stop line was printed), else with the launcher's exit code;
- makes the launcher die with it (PR_SET_PDEATHSIG), so a `kill -9` of the supervisor leaves no launcher
  behind, and the launcher stops its ranks.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading

from .signals import EXIT_INTERRUPTED, STOP_SIGNALS

OURS = re.compile(r"glmtune: (error: |stopped by )")  # glmtune's one line: an error, or a stop that kept its work
STOPPED = re.compile(r"glmtune: (?:error: )?stopped by (SIG\w+)")
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")  # torchrun's failure report, one per failed rank


def descendants(root: int) -> list[int]:
    """Every process below `root` (from /proc: pid -> parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            names = {item.split(b"=", 1)[0] for item in f.read().split(b"\0")}
    except OSError:
        return False
    return b"RANK" in names and b"LOCAL_RANK" in names


def _die_with_parent() -> None:
    """In the launcher, before exec: SIGTERM it when the supervisor dies (Linux prctl PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher outlives a SIGKILLed supervisor, as it would without one


class Supervisor:
    def __init__(self, argv: list[str]):
        self.argv, self.stopped = argv, False
        self.seen: set[str] = set()
        self.exit_codes: list[int] = []
        self.stop_line = False

    def forward(self, signum, frame) -> None:
        self.stopped = True
        ranks = [pid for pid in descendants(self.proc.pid) if is_rank(pid)]
        for pid in ranks or [self.proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def relay(self) -> None:
        """The launcher's stderr to ours, line by line; after a stop only glmtune's lines, each once."""
        for line in self.proc.stderr:
            self.exit_codes += [int(code) for code in EXITCODE.findall(line)]
            if STOPPED.search(line):
                self.stop_line = True
            if self.stopped or self.stop_line:
                if not OURS.search(line) or line in self.seen:
                    continue
                self.seen.add(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def run(self) -> int:
        self.proc = subprocess.Popen(self.argv, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.forward)
        reader = threading.Thread(target=self.relay, daemon=True)
        reader.start()
        code = self.proc.wait()
        reader.join(timeout=10)
        ranks_stopped = self.exit_codes and all(c == EXIT_INTERRUPTED for c in self.exit_codes)
        if code != 0 and (self.stopped or self.stop_line) and (ranks_stopped or self.stop_line
                                                              or code == EXIT_INTERRUPTED):
            return EXIT_INTERRUPTED
        return code


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m glmtune.supervise LAUNCHER [ARGS...]", file=sys.stderr)
        sys.exit(2)
    if os.path.basename(sys.argv[1]) == "deepspeed":  # its runner and launcher import DeepSpeed too: tell them
        from .quiet import quiet_libraries  # the accelerator, as the ranks are told (costs a torch import)

        quiet_libraries()
    sys.exit(Supervisor(sys.argv[1:]).run())


if __name__ == "__main__":
    main()
