"""Ray: `python -m glmtune.ray --workers N ...` runs a Ray Train V2 TorchTrainer whose workers are glmtune ranks
(`worker.py`: one `python -m glmtune` child per worker, the world from Ray's context, the run dir on the run's shared
storage); the driver (`__main__.py`) checks the command line, starts the trainer with FailureConfig and elastic
worker counts, and exits with glmtune's codes.

May import: glmtune.config, launch, rundir. Imported by nothing: it is a command.
"""
