"""The `train` config group: LoRA fine-tuning of glmtune's GLM model with the HF Trainer.

    python -m glmtune                                    # tiny model, data/samples, CPU
    python -m glmtune model=glm4_9b_chat model.path=/models/glm-4-9b-chat +hw=a100_40g

The Trainer runs the loop; glmtune only decides what it is given: the plan's dtype, checkpointing,
micro-batch and accumulation, an optimizer over the trainable (LoRA) parameters only, and where the
adapter, metrics and TensorBoard logs go in the run dir.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

from ..atomic import append_line, write_json
from ..config import RunConfig, TrainConfig
from ..launch import single_process_env
from .checkpoints import allow_numpy_rng_state, last_complete, remove_incomplete
from .saving import CompleteMarker, save_adapter
from .guard import Guard
from .zero3 import adapter_fingerprint, deepspeed_config
from .lora import apply_lora, trainable_parameters
from .timeline import MemoryTimeline
from ..models import enable_checkpointing, load_model
from ..plan.planner import Choices

_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def training_args(cfg: TrainConfig, choices: Choices, run_dir: Path, has_eval: bool,
                  probe_steps: int = 0) -> TrainingArguments:
    """Built before the model loads: under ZeRO-3 these arguments switch on deepspeed.zero.Init.

    probe_steps > 0 gives the probe's arguments: the same engine, dtype and batch, but that many steps and
    no logging, saving or evaluation."""
    evaluate = has_eval and cfg.eval_steps > 0 and not probe_steps
    if choices.zero_stage == 3:
        single_process_env()
    quiet = probe_steps > 0
    return TrainingArguments(
        output_dir=str(run_dir / ("probe" if quiet else "checkpoints")),
        max_steps=probe_steps or (cfg.max_steps if cfg.max_steps > 0 else -1),
        num_train_epochs=cfg.num_epochs,
        learning_rate=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        per_device_train_batch_size=choices.micro_batch_size,
        per_device_eval_batch_size=choices.eval_batch_size,
        gradient_accumulation_steps=choices.grad_accum,
        bf16=choices.dtype == "bf16",
        fp16=choices.dtype == "fp16",  # the Trainer adds dynamic loss scaling
        # evaluation_strategy, not eval_strategy: transformers 4.40 predates the rename (4.41).
        evaluation_strategy="steps" if evaluate else "no",
        eval_steps=cfg.eval_steps if evaluate else None,
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
        report_to=[] if quiet else ["tensorboard"],
        seed=cfg.seed,
        data_seed=cfg.seed,
        remove_unused_columns=False,  # our examples are already model inputs
        # Evaluation computes the loss only; otherwise the Trainer keeps every batch's full-vocabulary
        # logits on the GPU until the end of evaluation (the classic "eval OOMs after training fits").
        prediction_loss_only=True,
        dataloader_num_workers=0,
        disable_tqdm=quiet,
        save_safetensors=True,
        deepspeed=deepspeed_config(choices),
        # Without a GPU, accelerate 1.x starts no gloo group unless told the run is CPU-only: every rank of
        # a torchrun/deepspeed launch then believed it was rank 0 of 1 (same batches, every rank writing).
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every LoRA parameter gets a gradient each step
    )


def build_model(model_dir: Path, run: RunConfig, choices: Choices) -> torch.nn.Module:
    transformers.set_seed(run.train.seed)  # LoRA's A matrices are random: same seed, same start
    model = load_model(model_dir, dtype=_TORCH_DTYPE[choices.dtype], trust_remote_code=run.model.trust_remote_code)
    model.config.use_cache = False
    if hasattr(model, "loss_chunk_tokens"):
        model.loss_chunk_tokens = choices.loss_chunk_tokens
    model = apply_lora(model, run.lora)
    if choices.gradient_checkpointing:
        enable_checkpointing(model, use_reentrant=run.train.use_reentrant)
        # Reentrant checkpointing only back-propagates into a block when its input requires grad; the
        # embeddings are frozen, so make their output require it.
        model.enable_input_require_grads()
    return model


def make_trainer(args: TrainingArguments, model, train_set, val_set, collator, callbacks=()) -> Trainer:
    """The Trainer for the run and for the probe; args carries train.learning_rate and train.weight_decay."""
    return LoraTrainer(model=model, args=args, train_dataset=train_set, eval_dataset=val_set or None,
                       data_collator=collator, callbacks=list(callbacks))


class LoraTrainer(Trainer):
    """The HF Trainer with AdamW over the trainable (LoRA) parameters only.

    Only trainable parameters: an optimizer over frozen weights would allocate nothing useful, and the
    Trainer's default empty no-decay group makes torch's LR scheduler fail under DeepSpeed. This is an
    override rather than Trainer(optimizers=...) because transformers 4.40 refuses a ready optimizer when
    DeepSpeed is on; its DeepSpeed integration calls create_optimizer itself, so both paths share this one.
    """

    guard: Guard | None = None

    def training_step(self, model, inputs):
        loss = super().training_step(model, inputs)
        if self.guard is not None:
            self.guard.observe_loss(loss)  # no sync here: the guard reads it once per optimizer step
        return loss

    def create_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(trainable_parameters(self.model), lr=self.args.learning_rate,
                                               weight_decay=self.args.weight_decay)
        return self.optimizer


class MetricsFile(TrainerCallback):
    """Every log line of the Trainer, one JSON object per line, in run_dir/metrics.jsonl (rank 0)."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            append_line(self.path, json.dumps({"step": state.global_step, **logs}))


def train(run: RunConfig, choices: Choices, run_dir: Path, model_dir: Path, train_set, val_set,
          collator, resume_from: Path | None = None) -> tuple[dict, torch.nn.Module]:
    """Fine-tune (from `resume_from`, a complete checkpoint, when given), save the adapter (rank 0) and
    return (metrics, the trained PEFT model). Raises guard.Diverged / guard.StoppedBySignal instead of
    returning when the run stopped early; the last complete checkpoint is then in run_dir/checkpoints."""
    args = training_args(run.train, choices, run_dir, has_eval=bool(val_set))
    output_dir = Path(args.output_dir)
    if resume_from is not None:
        allow_numpy_rng_state()
        if args.process_index == 0:
            remove_incomplete(output_dir)  # a save that was killed: never resumed from, never rotated against
    model = build_model(model_dir, run, choices)
    guard = Guard(run.train.save_minutes, trainable_parameters(model))
    trainer = make_trainer(args, model, train_set, val_set, collator,
                           callbacks=[MetricsFile(run_dir / "metrics.jsonl"), MemoryTimeline(run_dir),
                                      CompleteMarker(output_dir, run.train.keep_checkpoints), guard])
    trainer.guard = guard
    result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    guard.raise_if_stopped()
    # The mean over this launch's steps only (the Trainer's own figure); the logged curve is in metrics.jsonl.
    metrics = {"train_loss": result.training_loss, "steps": result.global_step,
               # ds_numel: under ZeRO-3 a parameter's local tensor is an empty placeholder
               "trainable_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in trainable_parameters(model)),
               "runtime_s": result.metrics.get("train_runtime"),
               "resumed_from": str(resume_from) if resume_from else None}
    if val_set:
        metrics["eval_loss"] = trainer.evaluate()["eval_loss"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics["first_logged_loss"], metrics["last_logged_loss"] = (losses[0], losses[-1]) if losses else (math.nan,) * 2
    adapter_dir = run_dir / "adapter"
    # Every rank calls it: under ZeRO-3 the adapter is gathered from all shards, then rank 0 writes it,
    # weights and adapter_config.json together, into a temporary folder renamed into place whole.
    save_adapter(trainer, adapter_dir)
    # Each rank hashes its own view of the adapter (gathered under ZeRO-3) into its rank log: ranks that
    # drifted apart, or a saved adapter that is not the trained one, show up as different fingerprints.
    metrics["adapter_sha256"] = adapter_fingerprint(model)
    logging.getLogger(__name__).info("adapter fingerprint %s (rank %d of %d)", metrics["adapter_sha256"],
                                     trainer.args.process_index, trainer.args.world_size)
    if trainer.is_world_process_zero():
        write_json(run_dir / "metrics.json", metrics)
    metrics["adapter_dir"] = str(adapter_dir)
    metrics["last_checkpoint"] = str(last_complete(output_dir) or "")
    return metrics, model
