"""The probe: a few real optimizer steps on the worst batch the data can produce, measured on every rank.

    python -m glmtune mode=probe +hw=a100_40g model.path=...   # plan + probe, no training
    python -m glmtune probe.enabled=false ...                   # train without it

An estimate is a promise; the probe keeps it. It builds the model exactly as the run will (world size,
ZeRO stage, dtype, checkpointing, LoRA), runs `probe.steps` optimizer steps through the same HF Trainer
on synthetic examples of micro-batch x the longest kept length (every token a target, so the loss head
is at its largest), and reads the peak: reserved bytes on a GPU (what the card must hold), live tensor
bytes on CPU (probe/track.py LiveTensorTracker, the estimator benchmark's method). Over budget, or an
out-of-memory error inside the probe, moves one rung down the planner's ladder and probes again. All
ranks exchange their peaks and take the same decision from the maximum. mode=probe in one process for a
larger planned world rehearses it: this process is its rank 0 (probe/rehearse.py), measured the same way.

The probe's model, optimizer and Trainer are discarded before the real run builds its own, and the RNG
states are restored, so the run starts exactly as it would without the probe. The price is one extra
model load (from the page cache on the second read).
"""

from __future__ import annotations

import gc
import random
import time
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist

from ..config import RunConfig, userds
from ..config.units import GIB
from ..data.packing import RowPacker
from ..plan.estimate import CUDA_CONTEXT_DEFAULT, estimate, image_extra_tokens
from ..plan.packrows import fullest_micro_step
from ..plan.planner import Choices, Plan, run_shape, step_down
from ..train.gpumem import outside_allocator_bytes
from ..train.phases import estimated_phases
from ..train.trainer import build_model, make_trainer, training_args
from . import rehearse
from .batch import probe_image, worst_case_examples
from .diagnose import classify, record_memory_history
from .report import Attempt, ProbeReport, merge_ranks, over_in_evaluation


def emulate_card(memory_gib: float | None) -> bool:
    """Cap this process's CUDA allocator so `+hw=a100_40g` on an 80 GB card fails where a 40 GB card would:
    the preset's memory less what the process holds outside the allocator (context, kernels; measured when
    CUDA is already up, else the estimator's figure), since a real card must hold both. Returns whether it
    is emulating."""
    if memory_gib is None or not torch.cuda.is_available():
        return False
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if memory_gib * GIB >= total:
        return False
    outside = outside_allocator_bytes() if torch.cuda.is_initialized() else CUDA_CONTEXT_DEFAULT
    torch.cuda.set_per_process_memory_fraction(max(0.0, memory_gib * GIB - outside) / total)
    return True


def _attempt(
    run: RunConfig,
    choices: Choices,
    model_dir: Path,
    examples: list[dict],
    eval_examples,
    collator,
    scratch: Path,
    packer: RowPacker | None = None,
    user_ds=None,
) -> tuple[dict | None, dict]:
    """One probe attempt through the run's own Trainer and phases (train/phases.py): a training step, an
    evaluation when the run evaluates, training again, evaluating again. Returns (peak bytes per phase, detail),
    or (None, detail) when it ran out of memory; detail["phase"] then names the phase it ran out in."""
    args = training_args(
        run.train, choices, scratch, has_eval=bool(eval_examples), probe_steps=run.probe.steps, user_ds=user_ds
    )
    model = trainer = None
    try:
        model = build_model(model_dir, run, choices)
        trainer = make_trainer(
            args,
            model,
            examples,
            eval_examples or None,
            collator,
            normalization=run.train.loss_normalization,
            packer=packer,
            sequence_parallel=choices.sequence_parallel,
        )
        try:
            trainer.train()
        finally:
            trainer.phases.close()
            trainer.glm.set_sequence_group(None)
        peaks = trainer.phases.peaks()
        detail = {"phase_peak_bytes": peaks, "first_training_peak_bytes": trainer.phases.first_training_peak()}
        worst = max(trainer.phases.details, key=lambda p: peaks.get(p, 0), default=None)
        detail.update(trainer.phases.details.get(worst, {}))  # CUDA: the worst phase's allocator figures
        # train.compile=on: the estimate has no term for compiled blocks, so the plan rests on this attempt
        # having run them (nn.Module.compile sets _compiled_call_impl, which __call__ then uses).
        detail["compiled_blocks"] = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
        return peaks, detail
    except Exception as err:  # noqa: BLE001 - only out-of-memory errors are an outcome; others re-raise
        if classify(err) not in ("oom", "nvml_oom"):
            raise
        phase = trainer.phases.current if trainer is not None and trainer.phases.current else "train"
        return None, {"error": str(err).splitlines()[0][:300], "phase": phase}
    finally:
        if trainer is not None and getattr(trainer, "deepspeed", None) is not None:
            trainer.deepspeed.destroy()  # drops ZeRO-3's hooks so the real run's engine starts clean
        del trainer, model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _gather(value):
    if torch_dist.is_available() and torch_dist.is_initialized():
        out: list = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(out, value)
        return out
    return [value]


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _restore_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
    random.setstate(state[2])
    np.random.set_state(state[3])


def run_probe(
    run: RunConfig,
    plan: Plan,
    arch,
    model_dir: Path,
    longest: int,
    tokenizer,
    collator,
    run_dir: Path,
    world_size: int,
    evaluates: bool,
    packed: tuple[int, int] | None = None,
    rehearsed: int = 0,
    user_ds: userds.UserDeepSpeed | None = None,
) -> ProbeReport:
    """packed: (positions per row, images per row) when the data is packed: the probe then runs the fullest
    micro-step packing can make of its micro-batch (plan/packrows.py), laid out by the run's own packer.
    rehearsed: this one process is rank 0 of that many ranks (probe/rehearse.py), measured as rank 0.
    user_ds: dist.deepspeed_config (config/userds.load), which the probed runs' DeepSpeed config starts from."""
    start, rng = time.perf_counter(), _rng_state()
    world_size = rehearsed or world_size
    emulated = emulate_card(run.hw.memory_gib)
    record_memory_history()  # the run records it for its OOM snapshot: the probe runs under the same allocator
    image = probe_image(arch.vision_config["image_size"], run_dir / "probe") if arch.vision_config else None
    world = rehearse.rehearsal_world(world_size, max(1, world_size // run.dist.nnodes)) if rehearsed else nullcontext()
    with world:
        attempt = partial(_attempt, run, model_dir=model_dir, collator=collator, scratch=run_dir, user_ds=user_ds)
        attempts, choices = _ladder(
            run, plan, arch, longest, tokenizer, world_size, evaluates, packed, image, rehearsed, attempt
        )
    _restore_rng(rng)
    last = attempts[-1]
    added = last.detail.get("added_terms", {})
    return ProbeReport(
        device=_device_name(),
        emulated=emulated,
        method="whole process: torch.cuda max_memory_reserved + NVML bytes outside the allocator"
        if torch.cuda.is_available()
        else "live tensor bytes (train/livebytes.py LiveTensorTracker)",
        budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=last.predicted_peak_bytes,
        measured_peak_bytes=last.measured_peak_bytes,
        per_rank=last.per_rank,
        attempts=attempts,
        final=choices.to_dict(),
        fits=last.outcome == "fits",
        seconds=round(time.perf_counter() - start, 2),
        rehearsed=rehearsed,
        rehearsal={"ranks": world_size, "measured": "rank 0", "added_terms": added, "unseen": rehearse.UNSEEN}
        if rehearsed
        else {},
    )


def _ladder(
    run: RunConfig,
    plan: Plan,
    arch,
    longest: int,
    tokenizer,
    world_size: int,
    evaluates: bool,
    packed,
    image,
    rehearsed: int,
    attempt,
) -> tuple[list[Attempt], Choices]:
    """The probe's attempts, one rung down the ladder after each that does not fit. `attempt`: _attempt bound to
    this run's model folder, collator, scratch folder and DeepSpeed file, which no rung changes."""
    choices, attempts = plan.choices, []
    while True:
        length = min(choices.max_length, longest)
        count = choices.micro_batch_size * choices.grad_accum * run.probe.steps * world_size
        packer, each = None, length
        if packed is not None:  # equal examples the run's own packer lays into the fullest micro-step (packrows.py)
            extra = image_extra_tokens(arch)
            image_positions = extra if image is not None else 0
            each = (
                fullest_micro_step(choices.micro_batch_size, length + image_positions, packed[0]).example_positions
                - image_positions
            )
            packer = RowPacker(packed[0], extra)
        examples = worst_case_examples(count, each, tokenizer, run.train.seed, image)
        # Evaluation batches are never packed (data/packing.py): the longest examples, as unpacked.
        eval_examples = (
            worst_case_examples(choices.eval_batch_size * world_size, length, tokenizer, run.train.seed, image)
            if evaluates
            else None
        )
        shape = run_shape(run, arch, choices, longest, packed)
        if not torch.cuda.is_available():  # CPU: compare tensor terms only (no CUDA context, no allocator)
            shape = replace(shape, device="cpu", gpu_family=None)
        est = estimate(arch, shape)
        predicted = est.peak_bytes
        t0 = time.perf_counter()
        if rehearsed and choices.zero_stage == 3:
            rehearse.deepspeed_on_rehearsal_group()
        peaks, detail = attempt(choices, examples=examples, eval_examples=eval_examples, packer=packer)
        detail["host_rss_bytes"] = _host_rss()
        if rehearsed:  # rank 0 is the one rank here: its peaks, plus what no rehearsal allocates
            peaks, detail = rehearse.with_added(
                peaks, detail, rehearse.added_terms(choices.zero_stage, world_size, torch.cuda.is_available())
            )
        gathered = [(peaks, detail)] if rehearsed else _gather((peaks, detail))
        per_rank = [None if p is None else max(p.values()) for p, _ in gathered]
        host = [d.get("host_rss_bytes") for _, d in gathered]  # every rank's peak RSS; the node's is their sum
        peaks, detail = merge_ranks(gathered)
        detail["host_rss_per_rank"] = host
        detail["predicted_tensor_bytes"] = max(est.phases.values())  # beside the measured allocated peak
        detail["predicted_phase_peak_bytes"] = estimated_phases(est)  # beside phase_peak_bytes, phase by phase
        if peaks is None:
            outcome, measured = "out of memory", None
        else:
            measured = max(peaks.values())
            outcome = "fits" if plan.budget_bytes is None or measured <= plan.budget_bytes else "over budget"
        attempts.append(
            Attempt(
                choices.to_dict(), outcome, predicted, measured, per_rank, round(time.perf_counter() - t0, 2), detail
            )
        )
        if outcome == "fits":
            break
        # Evaluation over budget costs training nothing to fix: its batch is halved before any training rung.
        if over_in_evaluation(peaks, detail, plan.budget_bytes) and choices.eval_batch_size > 1:
            nxt = replace(choices, eval_batch_size=choices.eval_batch_size // 2)
            detail["next_rung"] = f"train.eval_batch_size={nxt.eval_batch_size}: evaluation was the phase over budget"
        else:
            nxt = step_down(choices, run, arch, choices.world_size)
        if nxt is None:
            break
        choices = nxt
    return attempts, choices


def _host_rss() -> int:
    """This process's peak resident set (bytes): what it has taken of the node's RAM, pinned offload included."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"
