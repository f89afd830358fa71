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

Any other documented exit (README "When a run fails": 2 bad input, 3 does not fit, 4 out of memory, ...) is
carried the same way: torchrun exits 1 whatever its ranks said, after the line once per rank and a 40-line
ChildFailedError report. Each `glmtune: error:` line is passed on once, torchrun's own lines about a failure a
rank already explained are dropped, and the supervisor exits with the first failed rank's code. A failure no
rank explained (a rank killed by a signal, a crash outside glmtune's handlers) keeps the launcher's report.

`torchrun` and `deepspeed` are run from this interpreter (`python -m torch.distributed.run`, `python -m
deepspeed.launcher.runner`), not looked up on PATH: a venv's python named without activating the venv (SLURM
scripts often do) finds them there, and the ranks run under the same python.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from .exits import ERROR_PREFIX, EXIT_BAD_INPUT, EXIT_INTERRUPTED
from .signals import STOP_SIGNALS

OURS = re.compile(r"glmtune: (error: |stopped by )")  # glmtune's one line: an error, or a stop that kept its work
STOPPED = re.compile(r"glmtune: (?:error: )?stopped by (SIG\w+)")
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")  # torchrun's failure report, one per failed rank
# torchrun's first line about a failure: the first failed rank's code; all it prints after is its report.
FIRST_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank")
# torchrun's agent log lines ("W1126 07:38:04.143000 5271 torch/distributed/elastic/...] Sending process ...");
# torch shortens the path against sys.path, so with the repo on PYTHONPATH and the venv inside it the path reads
# ".venv/lib/python3.11/site-packages/torch/distributed/...": any path that ends in torch/distributed/.
AGENT_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ \d+ \S*\btorch/distributed/")
# The launchers by module, with the package that brings each (pip name) for the line when it is missing.
LAUNCHERS = {"torchrun": ("torch.distributed.run", "torch"), "deepspeed": ("deepspeed.launcher.runner", "deepspeed")}


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


def running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_descendants(grace_s: float = 2.0) -> None:
    """SIGTERM every process below this one, then SIGKILL what still runs `grace_s` later. Looked up again until
    none runs: a pool's helper thread may fork a replacement for a worker just stopped. SIGKILL, because a child
    that outlives its SIGTERM (one that ignores or handles it; launch/signals.py covers the fork itself) keeps
    Python's exit waiting: multiprocessing joins its non-daemon children, datasets' manager process among them."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [pid for pid in descendants(os.getpid()) if running(pid)]
        if not alive:
            return
        late = time.monotonic() >= deadline
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
            except ProcessLookupError:
                pass
        if late:
            return
        time.sleep(0.05)  # s: a stopped Python process usually exits within a few ms


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


def launcher_command(argv: list[str]) -> list[str]:
    """`torchrun ...` / `deepspeed ...` as this interpreter's module; another launcher as found on PATH. Raises
    LookupError with the line to print when it cannot be run."""
    name, rest = os.path.basename(argv[0]), argv[1:]
    if name in LAUNCHERS:
        module, package = LAUNCHERS[name]
        if importlib.util.find_spec(package) is None:
            raise LookupError(
                f"{name} needs {package}, which {sys.executable} cannot import: pip install {package} "
                "into this python's environment, or set PYTHON= to the python that has it"
            )
        return [sys.executable, "-m", module, *rest]
    if shutil.which(argv[0]) is None:
        raise LookupError(f"launcher {argv[0]!r} not found on PATH ({os.environ.get('PATH', '')})")
    return argv


class Supervisor:
    def __init__(self, argv: list[str]):
        self.argv, self.stopped, self.signal_name = argv, False, ""
        self.seen: set[str] = set()
        self.exit_codes: list[int] = []
        self.stop_line = False
        self.first_failure: int | None = None  # the first failed rank's exit code, as torchrun reports it
        self.reporting = False  # torchrun is printing its failure report (traceback, ChildFailedError block)

    def forward(self, signum, frame) -> None:
        self.stopped, self.signal_name = True, signal.Signals(signum).name
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
            failed = FIRST_FAILURE.search(line)
            if failed and self.first_failure is None:
                self.first_failure, self.reporting = int(failed.group(1)), True
            if STOPPED.search(line):
                self.stop_line = True
            if OURS.search(line):  # every rank says the same line: once
                if line in self.seen:
                    continue
                self.seen.add(line)
            elif self.stopped or self.stop_line or (self.seen and (self.reporting or AGENT_LOG.match(line))):
                continue  # the launcher's account of what a rank's own line already said
            sys.stderr.write(line)
            sys.stderr.flush()

    def run(self) -> int:
        try:
            command = launcher_command(self.argv)
        except LookupError as missing:
            print(f"{ERROR_PREFIX}{missing}", file=sys.stderr)
            return EXIT_BAD_INPUT
        self.proc = subprocess.Popen(
            command,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.forward)
        reader = threading.Thread(target=self.relay, daemon=True)
        reader.start()
        code = self.proc.wait()
        reader.join(timeout=10)
        ranks_stopped = self.exit_codes and all(c == EXIT_INTERRUPTED for c in self.exit_codes)
        if (
            code != 0
            and (self.stopped or self.stop_line)
            and (ranks_stopped or self.stop_line or code == EXIT_INTERRUPTED)
        ):
            return EXIT_INTERRUPTED
        if code != 0 and self.stopped and not self.seen:  # the signal came before any rank could answer it
            # (torchrun's SignalException, or ranks still importing, which SIGTERM kills): nothing was saved
            print(
                f"glmtune: stopped by {self.signal_name} before training began; nothing to save — re-run the same "
                "command to start again",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
        if code != 0 and self.seen and self.first_failure is not None and self.first_failure > 0:
            return self.first_failure  # torchrun's 1 for any failure: the rank's documented code instead
        if code != 0 and not self.seen and not self.reporting:  # nothing said why: the deepspeed launcher runs at
            # --log_level critical (scripts/deepspeed_launch.sh), without its "exits with return code" line
            print(
                f"{ERROR_PREFIX}{os.path.basename(self.argv[0])} ended with exit code {code} and no rank said why: "
                "read the rank<N>.log files in the run dir",
                file=sys.stderr,
            )
        return code


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m glmtune.supervise LAUNCHER [ARGS...]", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if os.path.basename(sys.argv[1]) == "deepspeed":  # its runner and launcher import DeepSpeed too: tell them
        from .quiet import quiet_libraries  # the accelerator, as the ranks are told (costs a torch import)

        quiet_libraries()
    sys.exit(Supervisor(sys.argv[1:]).run())


if __name__ == "__main__":
    main()
