"""How a glmtune command ends: every exit code in one table, and the prefixes of its one line on stderr.

The numbers are a contract (scripts, CI jobs and the launchers read them): `--help` prints EXIT_CODES; the
supervisor of scripts/*.sh, Ray's driver and a sweep pass a rank's code on unchanged. Light on purpose (no import):
the supervisor reads it before anything slow starts.
"""

EXIT_CRASH = 1  # anything else: one line, the traceback in the rank's log (not listed by --help)
EXIT_BAD_INPUT = 2  # a ConfigError: bad config, command line, data or prompts file
EXIT_NO_FIT = 3  # the plan, a CPU run's RAM or the probe says it does not fit
EXIT_OOM = 4  # out of memory during training (probe/diagnose.py)
EXIT_NCCL = 5  # a collective failed between ranks (probe/diagnose.py)
EXIT_TRANSFORMERS = 6  # a checkpoint's remote code wants another transformers (probe/diagnose.py)
EXIT_INTERRUPTED = 7  # stopped by a signal after a complete checkpoint; re-run the same command to resume
EXIT_DIVERGED = 8  # a NaN/inf loss or weight stopped training (train/guard.py)
EXIT_NO_TRIAL = 9  # a sweep in which no trial succeeded

# What `glmtune --help` lists under "exit codes:".
EXIT_CODES = {
    0: "done",
    EXIT_BAD_INPUT: "bad config, command line, data or prompts file (one line, no traceback)",
    EXIT_NO_FIT: "the plan or the probe says it does not fit the card; the line lists what would",
    EXIT_OOM: "out of memory during training",
    EXIT_NCCL: "NCCL / collective error (read the other ranks' logs)",
    EXIT_TRANSFORMERS: "the checkpoint's remote code needs another transformers version",
    EXIT_INTERRUPTED: "stopped by SIGTERM / SIGINT / SIGUSR1 after a complete checkpoint: the line names the "
    "command that resumes (re-running the same command also does); a sweep stops after "
    "its running trial saves, and the same sweep command continues it",
    EXIT_DIVERGED: "training diverged (NaN/inf loss or weights): the line names the step and what to lower",
    EXIT_NO_TRIAL: "a sweep in which no trial succeeded (each trial's line and <sweep dir>/summary.md say why)",
}

ERROR_PREFIX = "glmtune: error: "  # the sweep summary and the supervisor pick a rank's reason out of stderr by it
STOP_PREFIX = "glmtune: "  # a stop signal that saved a checkpoint: "glmtune: stopped by SIGTERM at step ..." (exit 7)
