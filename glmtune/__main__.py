"""python -m glmtune [+hw=CARD] [group=option ...] [key=value ...]

compose (Hydra) -> validate the config and every data line -> plan -> probe -> train. README.md: launches.
Exit codes: 0 done; 2 bad config or input, run dir in use or holding another run, full disk (one line, no
traceback); 3 the plan or the probe says it does not fit the card (or a CPU run the host's RAM); 4 out of
memory during training; 5 NCCL error; 6 remote code / transformers version error; 7 stopped by
SIGTERM/SIGINT/SIGUSR1 (a complete checkpoint is saved: re-run the same command to resume); 8 training
diverged (NaN/inf loss or weights).
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .atomic import disk_nearly_full, is_disk_full
from .config import ConfigError, check_override_keys, parse_config
from .data.pipeline import DataCollator, build_datasets, format_stats, longest_length, validate_files
from .launch import export_slurm_env, rank, run_name, world_size
from .models import load_tokenizer
from .models.loading import check_weight_files
from .models.presets import arch_config, resolve_model_dir
from .plan.planner import Choices, format_plan, make_plan
from .rundir import console, fail, print_config, report_probe, write_run_files
from .runlock import RunDirLock, Start, decide, trim_metrics, write_state
from .sweep import run_trial
from .train.checkpoints import last_complete
from .train.preflight import check_device, check_disk, check_host_memory
from .train.signals import EXIT_DIVERGED, EXIT_INTERRUPTED, STOP, Interrupted

# Every rank of one launch must agree on the run dir; ${now:} alone would differ by a second. Cached in the
# config, so a SLURM sweep's jobs reuse the sweep dir the submitting process resolved.
OmegaConf.register_new_resolver("glmtune_run", run_name, replace=True, use_cache=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    export_slurm_env()  # a SLURM task of the submitit launcher: RANK, WORLD_SIZE, ... from SLURM's variables
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:  # a trial that fails or does not fit is recorded; the sweep goes on
        return run_trial(lambda: execute(cfg), Path(hydra_cfg.sweep.dir), Path(hydra_cfg.runtime.output_dir),
                         hydra_cfg.job.num, list(hydra_cfg.overrides.task))
    return execute(cfg)


def execute(cfg: DictConfig) -> float | None:
    """One run, holding its run dir's lock throughout; every way it can stop ends in one line and an exit code."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    lock = RunDirLock(run_dir, rank())
    STOP.install()  # SIGTERM/SIGINT: one line now; a checkpoint first once training runs (train/signals.py)
    try:
        lock.acquire()
        return _execute(cfg, run_dir, list(HydraConfig.get().overrides.task))
    except ConfigError as err:
        fail(str(err))
    except Interrupted as sig:
        fail(f"stopped by a second {sig.name} before the checkpoint was complete — re-run the same command to resume "
             "from the last complete one" if STOP.deferred else f"stopped by {sig.name} before training began; "
             "nothing to save — re-run the same command to start again", code=EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 - only a full disk is turned into one line; the rest re-raises
        if not (is_disk_full(err) or disk_nearly_full(run_dir)):
            raise
        fail(f"disk full or over quota writing {getattr(err, 'filename', None) or 'a run file'} in {run_dir} "
             f"({str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__}) — free space, "
             "then re-run the same command: it resumes from the last complete checkpoint")
    finally:
        lock.release()
        STOP.uninstall()
        STOP.received, STOP.deferred = None, False  # a sweep runs the next trial in this process


def _execute(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> float | None:
    try:
        run = parse_config(OmegaConf.to_container(cfg, resolve=True))
        arch = arch_config(run.model)  # config.json or built-in facts: no weights read
        data = None
        if run.mode in ("train", "probe"):
            validate_files(run.data)  # every line of every file, before any weights load
        if run.mode != "plan":
            model_dir = resolve_model_dir(run.model)
            check_weight_files(model_dir)  # missing, truncated or pickled weights: one line now, not mid-load
            tokenizer = load_tokenizer(model_dir)
        if run.mode == "infer":
            from .infer.generate import run_infer  # checks the prompts file before loading the weights

            result = run_infer(run.infer, run.model, run.hw.memory_gib, model_dir, tokenizer, run_dir)
            console.print(result)
            return None
        if data is None and run.mode != "plan":
            data = build_datasets(run.data, tokenizer, arch.vision_config)
    except (ValueError, OSError) as err:  # bad input, or a device map that cannot place a tensor
        if is_disk_full(err):
            raise
        raise ConfigError(str(err)) from None
    world = world_size() if run.mode != "plan" else run.dist.nnodes * run.dist.nproc_per_node
    length_set = run.data.max_length != 500 or any(o.lstrip("+~").startswith("data.max_length=") for o in overrides)
    plan = make_plan(run, arch, world, length_set, data_max_tokens=longest_length(data.stats) if data else None)
    config = OmegaConf.to_container(cfg, resolve=True)
    start = Start()
    if run.mode == "train":  # an earlier run in this dir: resume it, refuse, or move it aside (runlock.decide)
        start = decide(run_dir, run.train.resume, config, last_complete(run_dir / "checkpoints"), rank() == 0)
    write_run_files(run_dir, OmegaConf.to_yaml(cfg), overrides, run.model.path or run.model.name, plan)
    print_config(run, run_dir)
    if rank() == 0:
        console.print(format_plan(plan))
    if not plan.fits:
        fail("the plan does not fit: " + "; ".join(plan.advice), code=3)
    if run.mode == "plan":
        return None
    try:
        check_device(plan.choices)
        check_host_memory(run, plan)
    except MemoryError as err:
        fail(str(err), code=3)
    if rank() == 0 and start.note:
        console.print(start.note)
    if run.mode == "train" and rank() == 0:
        console.print(check_disk(run_dir, run, arch, Choices(**start.choices) if start.choices else plan.choices))
    # The Trainer stack costs ~0.7 s of imports that mode=plan does not need.
    from .probe.diagnose import diagnosed, record_memory_history
    from .probe.probe import run_probe
    from .train.guard import Diverged, StoppedBySignal, describe_checkpoint, divergence_advice
    from .train.trainer import train

    if rank() == 0:
        console.print(format_stats(data.stats))
    collator = DataCollator(tokenizer.pad_token_id, image_size=(arch.vision_config or {}).get("image_size"))
    choices = plan.choices
    if start.choices:  # a resume trains with the first launch's final choices; no second probe
        choices = Choices(**start.choices)
    elif run.probe.enabled:
        probe = run_probe(run, plan, arch, model_dir, longest_length(data.stats), tokenizer, collator,
                          run_dir, world, evaluates=data.val is not None)
        report_probe(probe, run_dir)
        if not probe.fits:
            fail("the probe measured more than the budget on every rung: " + "; ".join(plan.advice), code=3)
        choices = Choices(**probe.final)
    if run.mode == "probe":
        return None
    leader = rank() == 0
    if leader:
        write_state(run_dir, status="running", mode="train", config=config, choices=choices.to_dict(),
                    step=start.resume_from and int(start.resume_from.name.rsplit("-", 1)[-1]) or 0)
        if start.resume_from:
            trim_metrics(run_dir / "metrics.jsonl", int(start.resume_from.name.rsplit("-", 1)[-1]))
    record_memory_history()
    try:
        with diagnosed(run_dir, plan.breakdown, choices.to_dict(), run.probe.enabled):
            metrics, _ = train(run, choices, run_dir, model_dir, data.train, data.val, collator, start.resume_from)
    except StoppedBySignal as stop:
        last = last_complete(run_dir / "checkpoints")
        if leader:
            write_state(run_dir, status="interrupted", step=stop.step, checkpoint=str(last))
        fail(f"stopped by {stop.name} at step {stop.step}: {describe_checkpoint(last)} — re-run the same command "
             "to resume from it", code=EXIT_INTERRUPTED)
    except Diverged as bad:
        last = last_complete(run_dir / "checkpoints")
        if leader:
            write_state(run_dir, status="diverged", step=bad.step, checkpoint=str(last or ""))
        fail(f"training diverged at step {bad.step}: {bad.what}; {describe_checkpoint(last)} — "
             f"{divergence_advice(run.train.learning_rate, choices.dtype)}, then start over with "
             "train.resume=restart or another hydra.run.dir", code=EXIT_DIVERGED)
    if leader:
        write_state(run_dir, status="done", step=metrics["steps"], adapter=metrics["adapter_dir"])
        console.print(f"adapter saved to {metrics['adapter_dir']}  (train loss {metrics['train_loss']:.4f})")
    return metrics["train_loss"]


if __name__ == "__main__":
    # A log line that cannot be written (full disk) must not print a traceback per line; the write that
    # matters fails too and is reported as one line (Python's docs advise this setting in production).
    logging.raiseExceptions = False
    try:
        check_override_keys(sys.argv[1:])
    except ConfigError as err:
        fail(str(err))
    main()
