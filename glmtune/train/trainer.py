"""The `train` config group: LoRA fine-tuning of glmtune's GLM model with the HF Trainer.

    python -m glmtune                                    # tiny model, data/samples, CPU
    python -m glmtune model=glm4_9b_chat model.path=/models/glm-4-9b-chat +hw=a100_40g

The Trainer runs the loop; glmtune only decides what it is given: the plan's dtype, checkpointing,
micro-batch and accumulation, an optimizer over the trainable (LoRA) parameters only, and where the
adapter, metrics and TensorBoard logs go in the run dir.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from transformers import TrainingArguments

from ..config import EVAL_METRICS, RunConfig, TrainConfig, userds
from ..config.units import GIB
from ..launch import single_process_env
from ..launch.trainjob_status import status_callbacks  # Kubeflow Trainer progress, inside a TrainJob only
from ..models.identity import write_base_identity
from ..plan.planner import Choices
from ..rundir.atomic import write_json
from .checkpoints import allow_numpy_rng_state, checkpoint_step, last_complete, remove_incomplete
from .evaluation import BestTracker, GenerationEval, keep_best_adapter
from .guard import Guard
from .logs import MetricsFile, whole_run_loss
from .lora import trainable_parameters
from .lora_trainer import make_trainer  # noqa: F401  (the probe and bench/ build theirs here too)
from .model import build_model
from .optim import HF_NAMES
from .phases import format_peaks, gathered_peaks
from .saving import CompleteMarker, save_adapter
from .timeline import MemoryTimeline
from .tracking import TrackerRuns, launch_params, run_label
from .zero3 import adapter_fingerprint, deepspeed_config, skip_shm_build


def training_args(
    cfg: TrainConfig,
    choices: Choices,
    run_dir: Path,
    has_eval: bool,
    probe_steps: int = 0,
    user_ds: userds.UserDeepSpeed | None = None,
) -> TrainingArguments:
    """Built before the model loads: under ZeRO-3 these arguments switch on deepspeed.zero.Init.

    probe_steps > 0 gives the probe's arguments: the same engine, dtype and batch, but that many steps, an
    evaluation after each one when the run evaluates (the run's order: training, evaluation, training again),
    and no logging or saving."""
    evaluate = has_eval and (cfg.eval_steps > 0 or probe_steps > 0)
    eval_every = 1 if probe_steps else cfg.eval_steps
    if choices.zero_stage == 3 or user_ds is not None:
        single_process_env()
        skip_shm_build()
    quiet = probe_steps > 0
    max_steps = probe_steps or (cfg.max_steps if cfg.max_steps > 0 else -1)
    return TrainingArguments(
        output_dir=str(run_dir / ("probe" if quiet else "checkpoints")),
        max_steps=max_steps,
        # Whole epochs unless a step count is given. With one, epochs are unused: 0 keeps the Trainer from
        # warning "max_steps is given, it will override any value given in num_train_epochs" on every run.
        num_train_epochs=0 if max_steps > 0 else cfg.num_epochs,
        learning_rate=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        warmup_ratio=cfg.warmup_ratio,  # used by the Trainer only when warmup_steps is 0
        lr_scheduler_type=cfg.lr_scheduler,
        optim=HF_NAMES[cfg.optimizer],  # recorded in training_args.bin; LoraTrainer builds it (train/optim.py)
        weight_decay=cfg.weight_decay,
        per_device_train_batch_size=choices.micro_batch_size,
        per_device_eval_batch_size=choices.eval_batch_size,
        gradient_accumulation_steps=choices.grad_accum,
        bf16=choices.dtype == "bf16",
        fp16=choices.dtype == "fp16",  # the Trainer adds dynamic loss scaling
        # evaluation_strategy, not eval_strategy: transformers 4.40 predates the rename (4.41).
        evaluation_strategy="steps" if evaluate else "no",
        eval_steps=eval_every if evaluate else None,
        # Step-based saves by the Trainer; time-based and on-signal saves by the Guard, which sets
        # control.should_save (honoured under either strategy). Rotation is CompleteMarker's, not
        # save_total_limit's: the Trainer would delete old checkpoints before the new one is complete.
        save_strategy="steps" if cfg.save_steps > 0 and not quiet else "no",
        save_steps=cfg.save_steps if cfg.save_steps > 0 else 500,
        # NaN/inf losses are logged as they are (the default replaces them with the running mean, which
        # made a diverged run look healthy); the Guard stops the run on the first one.
        logging_nan_inf_filter=False,
        logging_strategy="no" if quiet else "steps",
        logging_steps=cfg.logging_steps,
        logging_dir=str(run_dir / "tensorboard"),
        # train.report_to: the Trainer's tensorboard/wandb/mlflow integrations; swanlab is a callback (train())
        report_to=[] if quiet else [t for t in cfg.report_to if t != "swanlab"],
        run_name=run_label(run_dir),  # as train/tracking.py names the tracker runs (the default: output_dir)
        seed=cfg.seed,
        data_seed=cfg.seed,
        remove_unused_columns=False,  # our examples are already model inputs
        # Evaluation computes the loss only; otherwise the Trainer keeps every batch's full-vocabulary
        # logits on the GPU until the end of evaluation (the classic "eval OOMs after training fits").
        prediction_loss_only=True,
        dataloader_num_workers=0,
        disable_tqdm=quiet,
        include_num_input_tokens_seen=not quiet,  # tokens/s in the summary (padded tokens, all ranks)
        save_safetensors=True,
        deepspeed=deepspeed_config(choices, user_ds.data if user_ds else None),  # dist.deepspeed_config's or the plan's
        # Without a GPU, accelerate 1.x starts no gloo group unless told the run is CPU-only: every rank of
        # a torchrun/deepspeed launch then believed it was rank 0 of 1 (same batches, every rank writing).
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every LoRA parameter gets a gradient each step
    )


def swanlab_callback(report_to: list[str]) -> list:
    """SwanLab's own Trainer callback: transformers 4.40 has no swanlab integration (it came in 4.50). It logs
    into the run train/tracking.py opened (SWANLAB_MODE=local or offline keeps it on disk, no account)."""
    if "swanlab" not in report_to:
        return []
    from swanlab.integration.transformers import SwanLabCallback

    return [SwanLabCallback()]


def train(
    run: RunConfig,
    choices: Choices,
    run_dir: Path,
    model_dir: Path,
    train_set,
    val_set,
    collator,
    tokenizer=None,
    planned_bytes: int | None = None,
    budget_bytes: int | None = None,
    resume_from: Path | None = None,
    probe_bytes: int | None = None,
    packer=None,
    user_ds: userds.UserDeepSpeed | None = None,
) -> tuple[dict, torch.nn.Module]:
    """Fine-tune (from `resume_from`, a complete checkpoint, when given), save the adapter (rank 0) and
    return (metrics, the trained PEFT model). Raises guard.Diverged / guard.StoppedBySignal instead of
    returning when the run stopped early; the last complete checkpoint is then in run_dir/checkpoints.

    tokenizer: needed for eval.generate (replies are generated and decoded). planned_bytes and budget_bytes
    (the plan's per-GPU peak and budget) are drawn on memory_timeline.png; they and probe_bytes (the probe's
    measured peak) go to the trackers with every training log line. packer: data.packing's RowPacker when
    packing (each micro-batch's examples laid into rows), else None. user_ds: dist.deepspeed_config
    (config/userds.load), merged with the plan's choices."""
    args = training_args(run.train, choices, run_dir, has_eval=bool(val_set), user_ds=user_ds)
    output_dir = Path(args.output_dir)
    if resume_from is not None:
        allow_numpy_rng_state()
        if args.process_index == 0:
            remove_incomplete(output_dir)  # a save that was killed: never resumed from, never rotated against
    model = build_model(model_dir, run, choices)
    generation_eval = None
    if val_set and run.eval.generate and tokenizer is not None:
        # data.val_size: the held-out examples' lines in the train files (data/mixing.py Selection)
        val_source = run.data.val_file or val_set.sources()
        generation_eval = GenerationEval(
            run.eval,
            val_source,
            tokenizer,
            choices.eval_batch_size,
            run_dir / "eval",
            synced_gpus=choices.zero_stage == 3,
            fmt=run.data.format,
        )
    best = BestTracker(run.eval) if val_set else None
    timeline = MemoryTimeline(run_dir, planned_bytes, budget_bytes, probe_bytes)
    guard = Guard(run.train.save_minutes, trainable_parameters(model))
    trainer = make_trainer(
        args,
        model,
        train_set,
        val_set,
        collator,
        callbacks=[
            MetricsFile(run_dir / "metrics.jsonl", guard),
            timeline,
            CompleteMarker(output_dir, run.train.keep_checkpoints, run_dir),
            guard,
            *swanlab_callback(run.train.report_to),
            *status_callbacks(),
        ],
        generation_eval=generation_eval,
        best=best,
        normalization=run.train.loss_normalization,
        packer=packer,
        sequence_parallel=choices.sequence_parallel,
    )  # the plan's degree
    trainer.guard, trainer.memory = guard, timeline
    trackers = TrackerRuns(
        run.train.report_to,
        run_dir,
        launch_params(run, choices, planned_bytes, budget_bytes, probe_bytes, run_dir),
        args.process_index == 0,
    )
    # On CPU the meter's tracker is a dispatch mode on torch's stack: it must come off however train() ends (a
    # stop signal, a crash), or every later op of this process runs through it (an in-process sweep's next trial).
    # The tracker runs span training and the final evaluation: one run per launch, closed with its outcome.
    with trainer.phases, trackers:
        resumed_at = checkpoint_step(resume_from) if resume_from else 0
        if resume_from is not None:
            trainer.loss_carry.restore(resume_from, resumed_at)
        try:
            result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            trainer.glm.set_sequence_group(None)  # what uses the model next sees whole rows
        except Exception as err:  # where it failed, for the one line modes.train_mode prints
            meter = trainer.phases
            err.glmtune_where = (
                f"step {meter.step}"
                if meter.current in (None, "train")
                else f"the {'evaluation' if meter.current == 'eval' else 'checkpoint save'} after step {meter.step}"
            )
            raise
        guard.raise_if_stopped()
        runtime = result.metrics.get("train_runtime")
        train_loss = trainer.loss_carry.train_loss(result.training_loss, result.global_step)
        if train_loss is None:  # a checkpoint of an older glmtune, without the loss sums: rebuilt from the logs
            train_loss = whole_run_loss(trainer.state.log_history, result.training_loss, result.global_step, resumed_at)
        metrics = {
            "train_loss": train_loss,
            "steps": result.global_step,
            "epochs": trainer.state.epoch,
            # ds_numel: under ZeRO-3 a parameter's local tensor is an empty placeholder
            "trainable_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in trainable_parameters(model)),
            "runtime_s": runtime,
            "tokens_per_s": trainer.state.num_input_tokens_seen / runtime if runtime else None,
            "resumed_from": str(resume_from) if resume_from else None,
            **timeline.peak(),
        }
        if val_set:
            # The last step's evaluation, when the loop just ran it (eval_steps divides the steps), is not repeated.
            last = (
                trainer.last_eval
                if trainer.last_eval and trainer.last_eval["step"] == result.global_step
                else trainer.evaluate()
            )
            metrics.update({k: v for k, v in last.items() if k in EVAL_METRICS})
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        metrics["first_logged_loss"], metrics["last_logged_loss"] = (
            (losses[0], losses[-1]) if losses else (math.nan,) * 2
        )
        adapter_dir = run_dir / "adapter"
        # Every rank calls it: under ZeRO-3 the adapter is gathered from all shards, then rank 0 writes it,
        # weights and adapter_config.json together, into a temporary folder renamed into place whole.
        with trainer.phases.phase("save"):
            save_adapter(trainer, adapter_dir)
        trainer.phases.close()
        metrics.update(phase_metrics(gathered_peaks(trainer.phases), probe_bytes))
        # Each rank hashes its own view of the adapter (gathered under ZeRO-3) into its rank log: ranks that
        # drifted apart, or a saved adapter that is not the trained one, show up as different fingerprints.
        metrics["adapter_sha256"] = adapter_fingerprint(model)
        logging.getLogger(__name__).info(
            "adapter fingerprint %s (rank %d of %d)",
            metrics["adapter_sha256"],
            trainer.args.process_index,
            trainer.args.world_size,
        )
        if trainer.is_world_process_zero():
            write_base_identity(adapter_dir, model_dir)  # mode=infer/chat refuse this adapter on another base
            if best is not None and best.step is not None:
                kept = keep_best_adapter(
                    best, Path(args.output_dir), adapter_dir, result.global_step, run_dir / "adapter_best"
                )
                metrics["best"] = {**best.summary(), "adapter_dir": str(kept) if kept else None}
            write_json(run_dir / "metrics.json", metrics)
        metrics["adapter_dir"] = str(adapter_dir)
        metrics["last_checkpoint"] = str(last_complete(output_dir) or "")
        return metrics, model


def phase_metrics(peaks: dict[str, int], probe_bytes: int | None) -> dict:
    """The run's own peak per phase (metrics.json, the closing line), measured as the probe measures; a warning
    when the run needed more than 1 % over what its probe certified."""
    if not peaks:
        return {}
    out = {
        "phase_peak_bytes": peaks,
        "phase_peak_kind": "GPU, whole process" if torch.cuda.is_available() else "CPU, live tensors as probed",
    }
    run_peak = max(peaks.values())
    if probe_bytes and run_peak > probe_bytes * 1.01:
        out["over_probe"] = run_peak / probe_bytes - 1
        logging.getLogger("glmtune").warning(
            "the run's peak %.2f GiB (%s) is %.1f %% over its probe's %.2f GiB: the probe did not see this run's "
            "worst phase; lower hw.margin or report it",
            run_peak / GIB,
            format_peaks(peaks),
            100 * out["over_probe"],
            probe_bytes / GIB,
        )
    return out
