"""glmtune [+hw=CARD] [group=option ...] [key=value ...]   (or python -m glmtune ...; glmtune --help)

compose (Hydra) -> validate the config and every data line -> plan -> probe -> train. README.md: launches.
Exit codes: 0 done; 2 bad config or input, run dir in use or holding another run, full disk (one line, no
traceback); 3 the plan or the probe says it does not fit the card (or a CPU run the host's RAM); 4 out of
memory during training; 5 NCCL error; 6 remote code / transformers version error; 7 stopped by
SIGTERM/SIGINT/SIGUSR1 (a complete checkpoint is saved: re-run the same command to resume); 8 training
diverged (NaN/inf loss or weights).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Before anything touches CUDA: expandable segments keep the allocator's reserve within ~3 % of what is
# allocated (measured on an H100: the default allocator reserved up to 21 % more, 5.4 GiB at evaluation,
# and the plan counts on the smaller reserve). A value the user set is kept.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .atomic import disk_nearly_full, is_disk_full
from .cli import check_command_line, chosen_mode, is_multirun, wants_info
from .config import CONF_DIR, ConfigError, check_override_keys, parse_config
from .data.packing import format_packing, pack_datasets, planned_packing
from .data.pipeline import DataCollator, build_datasets, format_stats, longest_length
from .launch import export_slurm_env, rank, run_name, world_size
from .models import load_tokenizer
from .models.loading import check_weight_files
from .models.presets import arch_config, resolve_model_dir
from .plan.estimate import GIB, image_extra_tokens
from .plan.planner import Choices, format_plan, make_plan
from .report import header, summary
from .rundir import console, discard_unused, fail, remove_empty_dirs, report_probe, write_run_files
from .runlock import RunDirLock, Start, decide, trim_metrics, write_state
from .sweep import final_line, run_trial
from .train.checkpoints import last_complete
from .train.compile import check_attention, describe
from .train.preflight import check_device, check_disk, check_host_memory
from .train.signals import EXIT_DIVERGED, EXIT_INTERRUPTED, STOP, Interrupted

# Every rank of one launch must agree on the run dir; ${now:} alone would differ by a second. Cached in the
# config, so a SLURM sweep's jobs reuse the sweep dir the submitting process resolved.
OmegaConf.register_new_resolver("glmtune_run", run_name, replace=True, use_cache=True)


# Set by `cli` for mode=plan without hydra.run.dir: Hydra's run dir is then a temporary folder, removed after.
PLAN_SCRATCH: str | None = None


# An absolute path: Hydra reads it as a folder. A relative one becomes pkg://glmtune.conf under the console
# script, which Hydra only finds in a package with an __init__.py.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
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
        lock.discard()
        discard_unused(run_dir)  # a run that never started leaves no folder behind (an earlier run's files stay)
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
    started = time.monotonic()
    config = OmegaConf.to_container(cfg, resolve=True)  # parsed below, and recorded in run_state.json
    try:
        run = parse_config(config)
        check_attention(run.train)
        arch = arch_config(run.model)  # config.json or built-in facts: no weights read
        data = None
        if run.mode != "plan":
            model_dir = resolve_model_dir(run.model)
            check_weight_files(model_dir)  # missing, truncated or pickled weights: one line now, not mid-load
            tokenizer = load_tokenizer(model_dir)
        if run.mode == "infer":
            from .infer.generate import run_infer  # checks the prompts file before loading the weights

            config_sha = hashlib.sha256(OmegaConf.to_yaml(cfg).encode()).hexdigest()[:16]  # as versions.json
            result = run_infer(run.infer, run.model, run.hw.memory_gib, model_dir, tokenizer, run_dir, config_sha)
            console.print(result)
            if run.infer.prompt and "predictions" in result:  # one-shot: the answer on the console too
                console.print(json.loads(Path(result["predictions"]).read_text().splitlines()[0])["output"])
            return None
        if run.mode == "chat":
            from .infer.chat import run_chat

            run_chat(run.infer, run.model, run.hw.memory_gib, model_dir, tokenizer, run_dir)
            return None
        packing = None
        if data is None and run.mode != "plan":
            # Every line of every file is checked when its cache entry is built, before any weights load.
            data = build_datasets(run.data, tokenizer, arch.vision_config)
            data, packing = pack_datasets(run.data, data, image_extra_tokens(arch), run.train.per_device_batch_size,
                                          on_gpu=torch.cuda.is_available())
    except (ValueError, OSError) as err:  # bad input, or a device map that cannot place a tensor
        if is_disk_full(err):
            raise
        raise ConfigError(str(err)) from None
    world = world_size() if run.mode != "plan" else run.dist.nnodes * run.dist.nproc_per_node
    length_set = run.data.max_length != 500 or any(o.lstrip("+~").startswith("data.max_length=") for o in overrides)
    packed = packing.shape() if packing else planned_packing(run.data, image_extra_tokens(arch))
    plan = make_plan(run, arch, world, length_set, data_max_tokens=longest_length(data.stats) if data else None,
                     packed=packed)
    start = Start()
    if run.mode == "train":  # an earlier run in this dir: resume it, refuse, or move it aside (runlock.decide)
        start = decide(run_dir, run.train.resume, config, last_complete(run_dir / "checkpoints"), rank() == 0)
    write_run_files(run_dir, OmegaConf.to_yaml(cfg), overrides, run.model.path or run.model.name, plan)
    shown_dir = None if PLAN_SCRATCH else run_dir
    if rank() == 0:
        console.print(header(run, plan, shown_dir, len(data.train) if data else None), markup=False)
        if run.mode == "plan" or not plan.fits:
            console.print(format_plan(plan))
    if not plan.fits:
        fail(f"the plan does not fit: estimated peak {plan.peak_bytes / GIB:.1f} GiB > budget "
             f"{plan.budget_bytes / GIB:.1f} GiB with every memory lever on; "
             + ("what fits: " + "; ".join(plan.advice) if plan.advice else
                "no preset card, GPU count or data.max_length fits: lower lora.r or train.per_device_batch_size"),
             code=3)
    if run.mode == "plan":
        if rank() == 0 and not PLAN_SCRATCH:
            console.print(f"plan written to {run_dir / 'plan.json'}", markup=False)
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
    from .probe.probe import probe_shortfall, run_probe
    from .train.guard import Diverged, StoppedBySignal, describe_checkpoint, divergence_advice
    from .train.trainer import train

    if rank() == 0:
        console.print(format_stats(data.stats))
        console.print(format_packing(packing, run.train.per_device_batch_size))
        console.print(describe(run.train, plan.choices.zero_stage, arch.attention_dropout, packing.enabled))
    collator = DataCollator(tokenizer.pad_token_id, image_size=(arch.vision_config or {}).get("image_size"))
    choices, planned = plan.choices, plan.peak_bytes
    if start.choices:  # a resume trains with the first launch's final choices; no second probe
        choices = Choices(**start.choices)
    elif run.probe.enabled:
        probe = run_probe(run, plan, arch, model_dir, longest_length(data.stats), tokenizer, collator,
                          run_dir, world, evaluates=data.val is not None, packed=packed)
        report_probe(probe, run_dir)
        remove_empty_dirs(run_dir, "probe")  # the probe's Trainer makes an output folder it never writes to
        if not probe.fits:
            fail(probe_shortfall(probe, run), code=3)
        choices, planned = Choices(**probe.final), probe.predicted_peak_bytes
    if run.mode == "probe":
        return None
    leader = rank() == 0
    resume_step = int(start.resume_from.name.rsplit("-", 1)[-1]) if start.resume_from else 0  # checkpoint-<step>
    if leader:
        write_state(run_dir, status="running", mode="train", config=config, choices=choices.to_dict(),
                    step=resume_step)
        if start.resume_from:
            trim_metrics(run_dir / "metrics.jsonl", resume_step)
    record_memory_history()
    try:
        with diagnosed(run_dir, plan.breakdown, choices.to_dict(), run.probe.enabled):
            metrics, _ = train(run, choices, run_dir, model_dir, data.train, data.val, collator, tokenizer, planned,
                               plan.budget_bytes, resume_from=start.resume_from)
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
    remove_empty_dirs(run_dir, "checkpoints")  # nothing was due: no save_steps/save_minutes point was reached
    if leader:
        write_state(run_dir, status="done", step=metrics["steps"], adapter=metrics["adapter_dir"])
        console.print(summary(metrics, time.monotonic() - started), markup=False)
    return metrics["train_loss"]


def cli() -> None:
    """The `glmtune` command and `python -m glmtune`: --help/--version, command-line checks, then Hydra."""
    global PLAN_SCRATCH
    # A log line that cannot be written (full disk) must not print a traceback per line; the write that
    # matters fails too and is reported as one line (Python's docs advise this setting in production).
    logging.raiseExceptions = False
    argv = sys.argv[1:]
    info = wants_info(argv)
    if info is not None:
        print(info)
        return
    try:
        check_command_line(argv)
        check_override_keys(argv)
    except ConfigError as err:
        fail(str(err))
    multirun = is_multirun(argv)
    PLAN_SCRATCH = None
    if chosen_mode(argv) == "plan" and not multirun and not any(a.startswith("hydra.run.dir=") for a in argv):
        PLAN_SCRATCH = tempfile.mkdtemp(prefix="glmtune-plan-")
        sys.argv.append(f"hydra.run.dir={PLAN_SCRATCH}")
    # Hydra then raises its composition errors instead of printing them with exit code 1; below they become
    # glmtune's one line with exit code 2 (the checks above catch the common ones with a better message).
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        fail(" ".join(str(err).split()))
    finally:
        if PLAN_SCRATCH:
            shutil.rmtree(PLAN_SCRATCH, ignore_errors=True)
    if multirun and rank() == 0 and final_line():
        console.print(final_line(), markup=False)


if __name__ == "__main__":
    cli()
