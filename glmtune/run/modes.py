"""The six modes of one run, each its own short function: infer, chat, serve (serve/), plan, probe and train.

`prepare` composes what every mode needs (validated config, architecture, tokenizer, data); `planned` plans
and prints the header; then `run_mode` hands over to the mode. Every bad input is a ConfigError (one line,
exit 2) raised before any weights load; every other stop is `rundir.fail` with its documented exit code.
"""
from __future__ import annotations

import gc
import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..rundir.atomic import is_disk_full
from ..config import ConfigError, parse_config, userds
from ..data.packing import decide_packing, expected_rows, format_packing, planned_packing
from ..data.pipeline import DataCollator, build_datasets, cache_entries, format_stats, longest_length
from ..launch import rank, world_size
from ..models import load_tokenizer
from ..models.loading import check_weight_files
from ..models.presets import arch_config, resolve_model_dir
from ..plan.estimate import image_extra_tokens
from ..plan.elastic import elastic_choices
from ..plan.planner import Choices, make_plan, plan_world, rehearsed_world
from ..plan.table import format_plan
from ..plan.host import set_tokens
from .launched import check_launch, launch_note
from .report import crash_line, header, no_fit_line, plan_written, report_probe, summary
from ..rundir.resume import check_inputs, input_fingerprints, refuse_training_run, resume_command
from ..launch.console import console, fail
from ..launch.exits import EXIT_CRASH, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_NO_FIT, STOP_PREFIX
from ..rundir.files import probed_peak, remove_empty_dirs, write_run_files
from ..rundir.lock import Start, decide, trim_metrics, write_state
from ..train.checkpoints import checkpoint_step, damage, last_complete
from ..train.compile import check_attention, describe, resolve_compile
from ..train.preflight import check_device, check_disk, check_host_memory
from ..launch.signals import STOP, Interrupted


@dataclass
class Prepared:
    """What every mode starts from; `data`/`packing` only for the modes that train or probe."""

    cfg: DictConfig
    config: dict[str, Any]  # the resolved config, as recorded in run_state.json
    run: Any  # config_schema.RunConfig
    arch: Any
    overrides: list[str]
    model_dir: Path | None = None
    tokenizer: Any = None
    data: Any = None
    packing: Any = None
    inputs: dict | None = None  # data, tokenizer and weight fingerprints a resume must find unchanged


def prepare(cfg: DictConfig, overrides: list[str]) -> Prepared:
    """Validate the config, read the architecture, and (except for mode=plan) the tokenizer and every data line."""
    config = OmegaConf.to_container(cfg, resolve=True)
    try:
        run = parse_config(config)
        userds.apply(run)  # dist.deepspeed_config: checked now; its ZeRO stage decides dist.strategy=auto
        check_launch(run)  # dist.nproc_per_node=N without a launcher: exit 2 for mode=train (run/launched.py)
        check_attention(run.train)
        prep = Prepared(cfg, config, run, arch_config(run.model), overrides)  # config.json only: no weights read
        if run.mode != "plan":
            prep.model_dir = resolve_model_dir(run.model)
            check_weight_files(prep.model_dir)  # missing, truncated or pickled weights: one line now, not mid-load
            prep.tokenizer = load_tokenizer(prep.model_dir, thinking=run.data.thinking)
        if run.mode in ("train", "probe"):
            # Every line of every file is checked when its cache entry is built, before any weights load.
            data = build_datasets(run.data, prep.tokenizer, prep.arch.vision_config, seed=run.train.seed)
            # Read by rank 0 only (recorded at a first launch, compared at a resume): the weight files' sampled
            # content is hashed once per launch, not by every rank against the same disk.
            prep.inputs = input_fingerprints(cache_entries(data), prep.model_dir) if rank() == 0 else None
            prep.data = data  # packing never changes which examples a step trains: only how the collator lays them
            prep.packing = decide_packing(run.data, data.train, image_extra_tokens(prep.arch),
                                          run.train.per_device_batch_size, on_gpu=torch.cuda.is_available())
    except (ValueError, OSError) as err:  # bad input, or a device map that cannot place a tensor
        if is_disk_full(err):
            raise
        raise ConfigError(str(err)) from None
    return prep


def run_mode(prep: Prepared, run_dir: Path, plan_scratch: bool) -> float | None:
    """Dispatch on mode=; returns the train loss for sweepers (None for the other modes)."""
    if prep.run.mode == "infer":
        return infer_mode(prep, run_dir)
    if prep.run.mode == "chat":
        return chat_mode(prep, run_dir)
    if prep.run.mode == "serve":
        from ..serve.server import run_serve  # starlette/uvicorn: the optional extra `serve`

        return run_serve(prep.run, prep.model_dir, prep.tokenizer, run_dir)
    started = time.monotonic()
    plan, start = planned(prep, run_dir, plan_scratch)
    if prep.run.mode == "plan":
        if rank() == 0 and not plan_scratch:
            console.print(plan_written(prep.run, plan, prep.arch, prep.overrides, run_dir), markup=False)
        return None
    choices, peak, measured = probe_stage(prep, plan, start, run_dir)
    if prep.run.mode == "probe":
        return None
    return train_mode(prep, plan, start, choices, (peak, measured), run_dir, started)


def infer_mode(prep: Prepared, run_dir: Path) -> None:
    from ..infer.generate import run_infer  # checks the prompts file before loading the weights

    run = prep.run
    config_sha = hashlib.sha256(OmegaConf.to_yaml(prep.cfg).encode()).hexdigest()[:16]  # as versions.json
    result = run_infer(run.infer, run.model, run.hw.memory_gib, prep.model_dir, prep.tokenizer, run_dir, config_sha)
    if run.infer.prompt and "predictions" in result:  # one-shot: the answer on the console too
        console.print(json.loads(Path(result["predictions"]).read_text().splitlines()[0])["output"], markup=False)
    if "merged" in result:
        console.print(result["merged_line"], markup=False)  # what and where, and the vllm serve command
    if "predictions" in result:  # the last line: where the outputs are
        console.print(f"{result['count']} predictions (batch {result['batch_size']}) written to {result['predictions']}; "
                      f"provenance in {result['provenance']}", markup=False)


def chat_mode(prep: Prepared, run_dir: Path) -> None:
    from ..infer.chat import run_chat

    try:
        run_chat(prep.run.infer, prep.run.model, prep.run.hw.memory_gib, prep.model_dir, prep.tokenizer, run_dir)
    except Interrupted:  # Ctrl-C in a chat is how people leave it: not an error, nothing to save
        console.print(f"\nchat ended (Ctrl-C); the transcript is in {run_dir / 'chat.jsonl'}", markup=False)


def planned(prep: Prepared, run_dir: Path, plan_scratch: bool):
    """The plan (exit 3 when nothing fits), the resume decision, the run files and the header."""
    run, arch, data = prep.run, prep.arch, prep.data
    world = plan_world(run, world_size())  # dist.nnodes x dist.nproc_per_node for mode=plan and a rehearsal
    length_set = run.data.max_length != 500 or typed(prep.overrides, "data.max_length")
    packed = prep.packing.shape() if prep.packing else planned_packing(run.data, image_extra_tokens(arch))
    plan = make_plan(run, arch, world, length_set, data_max_tokens=longest_length(data.stats) if data else None,
                     packed=packed, data_tokens=set_tokens(data.stats) if data else 0)
    world = plan.choices.world_size  # the data-parallel width: processes / the planned sequence-parallel degree
    if plan.packing and prep.packing is not None:  # the data's own rows per micro-step at the plan's micro-batch
        plan.packing["expected_rows_per_micro_step"] = expected_rows(prep.packing, plan.choices.micro_batch_size)
    start = Start()
    if run.mode == "train":  # an earlier run in this dir: resume it, refuse, or move it aside (runlock.decide)
        start = decide(run_dir, run.train.resume, prep.config, last_complete(run_dir / "checkpoints"), rank() == 0)
        recorded = Choices(**start.choices) if start.choices else None
        if recorded and (recorded.world_size != world or start.levers_changed
                         or recorded.sequence_parallel != plan.choices.sequence_parallel):  # other hardware: re-split
            batch_set = any(k in ("train.per_device_batch_size", "train.grad_accum") and typed(prep.overrides, k)
                            for k in start.levers_changed)  # typed on this command line, and changed
            plan.choices, line = elastic_choices(recorded, plan.choices, world, batch_set)  # same global batch
            start = replace(start, choices=None, note=f"{start.note}; {line}")  # probed like a first launch
        if start.resume_from and rank() == 0:
            check_inputs(run_dir, prep.inputs or {})
        problem = damage(start.resume_from) if start.resume_from else None
        if problem:  # every rank reads the same files, so every rank stops with the same line
            raise ConfigError(f"{start.resume_from}: cannot resume from this checkpoint: {problem} — delete that "
                              "folder to resume from the one before it, or start over with train.resume=restart")
    elif not plan_scratch:
        refuse_training_run(run_dir, run.mode)
    if not plan_scratch:  # mode=plan without a run dir writes nothing (not even into its scratch dir)
        write_run_files(run_dir, OmegaConf.to_yaml(prep.cfg), prep.overrides, run.model.path or run.model.name, plan)
    if rank() == 0:
        console.print(header(run, plan, None if plan_scratch else run_dir, len(data.train) if data else None),
                      markup=False)
        if run.mode == "plan" or not plan.fits:
            console.print(format_plan(plan))
        if note := launch_note(run):  # dist.nproc_per_node=N in one process: how to launch N (run/launched.py)
            console.print(note, markup=False)
    if not plan.fits:
        fail(no_fit_line(plan), code=EXIT_NO_FIT)
    return plan, start


def typed(overrides: list[str], key: str) -> bool:
    """Whether the command line set `key` (key=, +key= or ~key=)."""
    return any(o.lstrip("+~").startswith(f"{key}=") for o in overrides)


def probe_stage(prep: Prepared, plan, start: Start, run_dir: Path) -> tuple[Choices, int, int | None]:
    """Device and host checks, the data tables, then the probe: the choices to train with, their predicted
    peak and the probe's measured one (bytes; None when nothing was probed)."""
    run, arch = prep.run, prep.arch
    try:
        check_device(plan.choices)
        check_host_memory(run, plan)
    except MemoryError as err:
        fail(str(err), code=EXIT_NO_FIT)
    if rank() == 0 and start.note:
        console.print(start.note)
    if run.mode == "train" and rank() == 0:
        console.print(check_disk(run_dir, run, arch, Choices(**start.choices) if start.choices else plan.choices))
    # the Trainer stack: ~0.7 s mode=plan does not need
    from ..probe.probe import emulate_card, probe_shortfall, run_probe

    if rank() == 0:
        console.print(format_stats(prep.data.stats))
        console.print(format_packing(prep.packing, plan.choices.micro_batch_size))
        console.print(describe(run.train, plan.choices.zero_stage, arch.attention_dropout, prep.packing.enabled))
    settle_process()
    if start.choices or not run.probe.enabled:  # +hw= on a larger card: run_probe caps the probed runs itself
        emulate_card(run.hw.memory_gib)
    if start.choices:  # a resume trains with the first launch's final choices; no second probe
        return Choices(**start.choices), plan.peak_bytes, probed_peak(run_dir)  # the first launch's, for trackers
    if not run.probe.enabled:
        if rank() == 0 and plan.unmeasured_risk:  # never skipped silently: the plan alone is not enough here
            console.print(f"probe.enabled=false, but {plan.unmeasured_risk}; nothing measures them before training "
                          "(probe.enabled=true to measure)")
        if rank() == 0 and resolve_compile(run.train, plan.choices.zero_stage)[0]:
            console.print("probe.enabled=false with compiled blocks: their memory is in no estimate and no probe "
                          "measures it (probe.enabled=true to measure it before training)")
        return plan.choices, plan.peak_bytes, None
    try:
        probe = run_probe(run, plan, arch, prep.model_dir, longest_length(prep.data.stats), prep.tokenizer,
                          collator(prep), run_dir, world_size(), evaluates=prep.data.val is not None,
                          packed=prep.packing.shape(), rehearsed=rehearsed_world(run, world_size()))
    except Exception as crash:  # noqa: BLE001 - not an out-of-memory (that is a rung): the run would fail the same way
        if is_disk_full(crash) or isinstance(crash, (ConfigError, Interrupted)):
            raise
        fail(f"the probe failed before training: {crash_line(crash)} — the run would fail the same way; the traceback "
             f"is in {log_traceback(crash) or 'rank0.log'}", code=EXIT_CRASH)
    report_probe(probe, run_dir, plan.peak_bytes)
    remove_empty_dirs(run_dir, "probe")  # the probe's Trainer makes an output folder it never writes to
    if not probe.fits:
        fail(probe_shortfall(probe, run), code=EXIT_NO_FIT)
    return Choices(**probe.final), probe.predicted_peak_bytes, probe.measured_peak_bytes


def settle_process() -> None:
    """What every training process pays once, paid before the probe's clock starts so that its seconds are
    its own: the first torch optimizer imports torch._dynamo (~1.5 s on CPU; DeepSpeed's ZeRO checks import
    it too), and full garbage collections walk every object alive. Everything alive now (modules, configs,
    the data's index) lives to the end, so it is frozen out of the collector: accelerate and DeepSpeed
    collect at every engine set-up and release, 4 x ~0.25 s per probe rung on a 2-rank CPU ZeRO-3 launch
    before (cProfile)."""
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.freeze()


def collator(prep: Prepared) -> DataCollator:
    return DataCollator(prep.tokenizer.pad_token_id, image_size=(prep.arch.vision_config or {}).get("image_size"))


def train_mode(prep: Prepared, plan, start: Start, choices: Choices, peaks: tuple[int, int | None], run_dir: Path,
               started: float) -> float:
    """Train (resuming when `start` says so); a signal, divergence or finish each ends in its state and line.
    peaks: the predicted and the probe's measured peak (bytes), for the memory timeline and the trackers."""
    from ..probe.diagnose import diagnosed, record_memory_history
    from ..train.guard import Diverged, StoppedBySignal, describe_checkpoint, divergence_advice
    from ..train.saving import barrier
    from ..train.trainer import train
    from .sweepstop import trial_stop_advice

    run, data, leader = prep.run, prep.data, rank() == 0
    resume_step = checkpoint_step(start.resume_from) if start.resume_from else 0
    if leader:
        # `started` orders unfinished runs for resume.unfinished_run; a resume keeps the first launch's
        write_state(run_dir, status="running", mode="train", config=prep.config, choices=choices.to_dict(),
                    step=resume_step, **({} if start.resume_from else {"started": round(time.time(), 3),
                                                                      "inputs": prep.inputs}))
        if start.resume_from:
            trim_metrics(run_dir / "metrics.jsonl", resume_step)
    record_memory_history()
    try:
        with diagnosed(run_dir, plan.breakdown, choices.to_dict(), run.probe.enabled):
            metrics, _ = train(run, choices, run_dir, prep.model_dir, data.train, data.val, collator(prep),
                               prep.tokenizer, peaks[0], plan.budget_bytes, resume_from=start.resume_from,
                               probe_bytes=peaks[1], packer=prep.packing.packer())
    except StoppedBySignal as stop:
        STOP.settle()  # the checkpoint is complete: nothing left for a later signal to protect
        last = last_complete(run_dir / "checkpoints")
        if leader:
            write_state(run_dir, status="interrupted", step=stop.step, checkpoint=str(last))
        barrier()  # no rank exits (and makes torchrun stop the rest) before rank 0 is done
        line = f"stopped by {stop.name} at step {stop.step}: {describe_checkpoint(last)} — "
        if STOP.requeues():  # a submitit job at its time limit: submitit resubmits it, and it resumes here
            if leader:
                console.print(f"glmtune: {line}submitit requeues the job, which resumes from it", markup=False)
            STOP.requeue()  # rank 0 exits in it; the others end below, with exit 7
        advice = (trial_stop_advice()  # a sweep's trial: the sweep command continues it (run/sweepstop.py)
                  or f"re-run the same command to resume from it, or: {resume_command(run_dir, prep.overrides)}")
        fail(f"{line}{advice}", code=EXIT_INTERRUPTED, leader_speaks=True,
             prefix=STOP_PREFIX)  # asked for, work kept: not an error
    except Diverged as bad:
        last = last_complete(run_dir / "checkpoints")
        if leader:
            write_state(run_dir, status="diverged", step=bad.step, checkpoint=str(last or ""))
        advice = divergence_advice(run.train.learning_rate, choices.dtype, run.train.weight_decay)
        fail(f"training diverged at step {bad.step}: {bad.what}; {describe_checkpoint(last)} — {advice}, then start "
             "over with train.resume=restart or another hydra.run.dir", code=EXIT_DIVERGED)
    except BaseException as crash:  # out of memory (exit 4), NCCL (5), any crash: the dir must not say running
        if leader:
            write_state(run_dir, status="interrupted" if isinstance(crash, Interrupted) else "failed",
                        error=f"{type(crash).__name__}: {crash}"[:300])
        if is_disk_full(crash):
            raise  # the entry point's one line for a full disk (exit 2), now that the state says failed
        if not isinstance(crash, Exception) or isinstance(crash, Interrupted):
            raise  # sys.exit of a diagnosed failure (its line is out), or a signal the entry point reports
        fail(f"training failed in {getattr(crash, 'glmtune_where', 'training')}: {crash_line(crash)} — the traceback "
             f"is in {log_traceback(crash) or 'rank0.log'}; run_state.json says failed. Re-running resumes from the "
             "last complete checkpoint, if any", code=EXIT_CRASH)
    remove_empty_dirs(run_dir, "checkpoints")  # nothing was due: no save_steps/save_minutes point was reached
    if leader:
        write_state(run_dir, status="done", step=metrics["steps"], adapter=metrics["adapter_dir"])
        console.print(summary(metrics, time.monotonic() - started), markup=False)
    return metrics["train_loss"]


def log_traceback(crash: BaseException) -> str | None:
    """The crash's traceback into this rank's log file only (the console gets one line); returns that file."""
    import logging
    import traceback

    text = "".join(traceback.format_exception(crash))
    path = None
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(logging.makeLogRecord({"msg": "training failed:\n%s", "args": (text,), "levelno": logging.ERROR,
                                                "levelname": "ERROR", "name": "glmtune"}))
            handler.flush()
            path = handler.baseFilename
    return path

