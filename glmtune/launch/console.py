"""What a glmtune process prints: the console (rich, rank 0's tables and lines) and `fail`, the one line on stderr
and the exit code (exits.py) every stop that is not a success ends with."""

from __future__ import annotations

import logging
import sys

from rich.console import Console

from .exits import ERROR_PREFIX, EXIT_BAD_INPUT
from .ranks import rank

# Not a terminal (a log file, SLURM output, CI): tables wrap their cells at 120 columns (rich's default would be 80)
# rather than growing to the longest cell, and are never cut ("…"). soft_wrap: plain lines are never folded by rich,
# so a path or a step line stays whole for grep; the header and the plan's options wrap themselves at 120.
LOG_WIDTH = 120
console = Console(highlight=False, width=None if sys.stdout.isatty() else LOG_WIDTH, soft_wrap=True)


def fail(message: str, code: int = EXIT_BAD_INPUT, leader_speaks: bool = False, prefix: str = ERROR_PREFIX) -> None:
    """One line on stderr, no traceback: what is wrong and what to do.

    `leader_speaks`: a line every rank would say alike (a stop on a signal) is printed by rank 0 only; the other
    ranks write it to their own log (rank<N>.log), so the console shows it once. `prefix`: STOP_PREFIX for a stop
    that was asked for (not an error, though the exit code is 7)."""
    if leader_speaks and rank() != 0:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.emit(
                    logging.makeLogRecord(
                        {"msg": message, "levelno": logging.WARNING, "levelname": "WARNING", "name": "glmtune"}
                    )
                )
        sys.exit(code)
    print(f"{prefix}{message}", file=sys.stderr)
    sys.exit(code)
