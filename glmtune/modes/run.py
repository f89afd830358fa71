"""The six modes of one run, each its own short function: infer, chat, serve (serve/), plan, probe and train.

`prepare` (prepare.py) composes what every mode needs; `planned` plans and prints the header; then `run_mode`
hands over to the mode (training: train.py). Every bad input is a ConfigError (one line, exit 2) raised before any
weights load; every other stop is `launch.console.fail` with its exit code (launch/exits.py).
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf

from ..config import ConfigError
from ..data.packing import expected_rows, format_packing, planned_packing
from ..data.pipeline import format_stats, longest_length
from ..launch import rank, world_size
from ..launch.console import console, fail
from ..launch.exits import EXIT_CRASH, EXIT_NO_FIT
from ..launch.signals import Interrupted
from ..plan.elastic import elastic_choices
from ..plan.estimate import image_extra_tokens
from ..plan.host import set_tokens
from ..plan.planner import Choices, make_plan, plan_world, rehearsed_world
from ..plan.table import format_plan
from ..rundir.atomic import is_disk_full
from ..rundir.files import probed_peak, remove_empty_dirs, write_run_files
from ..rundir.lock import Start, decide
from ..rundir.resume import check_inputs, refuse_training_run
from ..train.checkpoints import damage, last_complete
from ..train.compile import describe, resolve_compile
from ..train.preflight import check_device, check_disk, check_host_memory
from .launched import launch_note
from .prepare import Prepared, collator, typed
from .report import crash_line, header, no_fit_line, plan_written, report_probe
from .train import log_traceback, train_mode


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
    result = run_infer(run, prep.model_dir, prep.tokenizer, run_dir, config_sha)
    if run.infer.prompt and "predictions" in result:  # one-shot: the answer on the console too
        console.print(json.loads(Path(result["predictions"]).read_text().splitlines()[0])["output"], markup=False)
    if "merged" in result:
        console.print(result["merged_line"], markup=False)  # what and where, and the vllm serve command
    if "predictions" in result:  # the last line: where the outputs are
        console.print(
            f"{result['count']} predictions (batch {result['batch_size']}) written to {result['predictions']}; "
            f"provenance in {result['provenance']}",
            markup=False,
        )


def chat_mode(prep: Prepared, run_dir: Path) -> None:
    from ..infer.chat import run_chat

    try:
        run_chat(prep.run, prep.model_dir, prep.tokenizer, run_dir)
    except Interrupted:  # Ctrl-C in a chat is how people leave it: not an error, nothing to save
        console.print(f"\nchat ended (Ctrl-C); the transcript is in {run_dir / 'chat.jsonl'}", markup=False)


def planned(prep: Prepared, run_dir: Path, plan_scratch: bool):
    """The plan (exit 3 when nothing fits), the resume decision, the run files and the header."""
    run, arch, data = prep.run, prep.arch, prep.data
    world = plan_world(run, world_size())  # dist.nnodes x dist.nproc_per_node for mode=plan and a rehearsal
    length_set = run.data.max_length != 500 or typed(prep.overrides, "data.max_length")
    packed = prep.packing.shape() if prep.packing else planned_packing(run.data, image_extra_tokens(arch))
    plan = make_plan(
        run,
        arch,
        world,
        length_set,
        data_max_tokens=longest_length(data.stats) if data else None,
        packed=packed,
        data_tokens=set_tokens(data.stats) if data else 0,
        user_ds=prep.user_ds,
    )
    world = plan.choices.world_size  # the data-parallel width: processes / the planned sequence-parallel degree
    if plan.packing and prep.packing is not None:  # the data's own rows per micro-step at the plan's micro-batch
        plan.packing["expected_rows_per_micro_step"] = expected_rows(prep.packing, plan.choices.micro_batch_size)
    start = Start()
    if run.mode == "train":  # an earlier run in this dir: resume it, refuse, or move it aside (runlock.decide)
        start = decide(run_dir, run.train.resume, prep.config, last_complete(run_dir / "checkpoints"), rank() == 0)
        recorded = Choices(**start.choices) if start.choices else None
        if recorded and (
            recorded.world_size != world
            or start.levers_changed
            or recorded.sequence_parallel != plan.choices.sequence_parallel
        ):  # other hardware: re-split
            batch_set = any(
                k in ("train.per_device_batch_size", "train.grad_accum") and typed(prep.overrides, k)
                for k in start.levers_changed
            )  # typed on this command line, and changed
            plan.choices, line = elastic_choices(recorded, plan.choices, world, batch_set)  # same global batch
            start = replace(start, choices=None, note=f"{start.note}; {line}")  # probed like a first launch
        if start.resume_from and rank() == 0:
            check_inputs(run_dir, prep.inputs or {})
        problem = damage(start.resume_from) if start.resume_from else None
        if problem:  # every rank reads the same files, so every rank stops with the same line
            raise ConfigError(
                f"{start.resume_from}: cannot resume from this checkpoint: {problem} — delete that "
                "folder to resume from the one before it, or start over with train.resume=restart"
            )
    elif not plan_scratch:
        refuse_training_run(run_dir, run.mode)
    if not plan_scratch:  # mode=plan without a run dir writes nothing (not even into its scratch dir)
        write_run_files(run_dir, OmegaConf.to_yaml(prep.cfg), prep.overrides, run.model.path or run.model.name, plan)
    if rank() == 0:
        console.print(
            header(run, plan, None if plan_scratch else run_dir, len(data.train) if data else None), markup=False
        )
        if run.mode == "plan" or not plan.fits:
            console.print(format_plan(plan))
        if note := launch_note(run):  # dist.nproc_per_node=N in one process: how to launch N (modes/launched.py)
            console.print(note, markup=False)
    if not plan.fits:
        fail(no_fit_line(plan), code=EXIT_NO_FIT)
    return plan, start


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
    from ..probe.probe import emulate_card, run_probe
    from ..probe.report import probe_shortfall

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
            console.print(
                f"probe.enabled=false, but {plan.unmeasured_risk}; nothing measures them before training "
                "(probe.enabled=true to measure)"
            )
        if rank() == 0 and resolve_compile(run.train, plan.choices.zero_stage)[0]:
            console.print(
                "probe.enabled=false with compiled blocks: their memory is in no estimate and no probe "
                "measures it (probe.enabled=true to measure it before training)"
            )
        return plan.choices, plan.peak_bytes, None
    try:
        probe = run_probe(
            run,
            plan,
            arch,
            prep.model_dir,
            longest_length(prep.data.stats),
            prep.tokenizer,
            collator(prep),
            run_dir,
            world_size(),
            evaluates=prep.data.val is not None,
            packed=prep.packing.shape(),
            rehearsed=rehearsed_world(run, world_size()),
            user_ds=prep.user_ds,
        )
    except Exception as crash:  # noqa: BLE001 - not an out-of-memory (that is a rung): the run would fail the same way
        if is_disk_full(crash) or isinstance(crash, (ConfigError, Interrupted)):
            raise
        fail(
            f"the probe failed before training: {crash_line(crash)} — the run would fail the same way; the traceback "
            f"is in {log_traceback(crash) or 'rank0.log'}",
            code=EXIT_CRASH,
        )
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
