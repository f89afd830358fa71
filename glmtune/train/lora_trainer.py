"""The HF Trainer as glmtune runs it: one loss for every split of a step, portable checkpoints, an optimizer over
the adapter only (train/steps.py, train/portable.py, train/optim.py say why)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainingArguments

from ..rundir.atomic import plain_file_modes
from .evaluation import BestTracker, GenerationEval, perplexity
from .guard import Guard
from .lora import trainable_parameters
from .losscarry import LossCarry
from .optim import OPTIMIZERS, make_optimizer
from .phases import PhaseMeter
from .portable import load_states, save_portable_zero3
from .progress import StepLines
from .sequence import gather_groups, group_eval_loader, group_mean_loss, sequence_group, shard_batch
from .steps import ExampleLog, StepCollator, StepExamples, StepSampler, step_loss, target_counts


def make_trainer(
    args: TrainingArguments,
    model,
    train_set,
    val_set,
    collator,
    callbacks=(),
    generation_eval: GenerationEval | None = None,
    best: BestTracker | None = None,
    normalization: str = "tokens",
    packer=None,
    sequence_parallel: int = 1,
) -> Trainer:
    """The Trainer for the run and for the probe; args carries train.learning_rate and train.weight_decay;
    `normalization` is train.loss_normalization; `packer` (data.packing.RowPacker) packs each training
    micro-batch's examples into rows (data.packing=on), the step's examples staying those of the unpacked run;
    `sequence_parallel` (dist.sequence_parallel) ranks share each micro-batch's rows (train/sequence.py)."""
    steps = None
    if train_set is not None:  # train/steps.py: each step's examples, whatever the split
        steps = StepSampler(
            target_counts(train_set),
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size // sequence_parallel,
            args.seed,
            args.per_device_train_batch_size,
            sequence_parallel,
        )
        train_set, collator = StepExamples(train_set, steps), StepCollator(collator, packer)
    # The meter first, so each training step's peak is read before any other callback's own reset (timeline.py).
    meter = PhaseMeter(model)
    trainer = LoraTrainer(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=val_set or None,
        data_collator=collator,
        callbacks=[meter, *callbacks],
    )
    trainer.phases = meter
    trainer.step_sampler, trainer.example_log = steps, ExampleLog(args.process_index)
    trainer.normalization = normalization
    trainer.loss_carry = LossCarry()  # the running loss sums, saved with each checkpoint (train/losscarry.py)
    trainer.glm = model.get_base_model() if hasattr(model, "get_base_model") else model
    trainer.sequence = sequence_group(sequence_parallel)
    trainer.generation_eval, trainer.best = generation_eval, best
    if args.logging_strategy == "no":  # the probe: its closing {'train_loss': ..., 'epoch': 1.0} reads like a result
        trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:  # the bar stays; its log dicts become step lines
        trainer.add_callback(StepLines())
    return trainer


class LoraTrainer(Trainer):
    """The HF Trainer with AdamW over the trainable (LoRA) parameters only.

    Only trainable parameters: an optimizer over frozen weights would allocate nothing useful, and the
    Trainer's default empty no-decay group makes torch's LR scheduler fail under DeepSpeed. This is an
    override rather than Trainer(optimizers=...) because transformers 4.40 refuses a ready optimizer when
    DeepSpeed is on; its DeepSpeed integration calls create_optimizer itself, so both paths share this one.
    """

    guard: Guard | None = None
    step_sampler: StepSampler | None = None
    sequence = None  # this rank's sequence-parallel group (models/kernels/ulysses.SequenceGroup), None without
    normalization = "tokens"  # train.loss_normalization
    example_log: ExampleLog | None = None
    glm = None  # the GLM model under PEFT (and the engine): its loss_reduction is switched per micro-batch
    memory = None  # train/timeline.py MemoryTimeline: its figures ride on every training log line
    phases: PhaseMeter | None = None  # each phase's peak, the probe's and the run's alike (train/phases.py)

    def log(self, logs: dict) -> None:
        # Through the Trainer's own log, the memory figures reach every train.report_to tracker, at its step,
        # and metrics.jsonl; the console's step lines leave them out (train/progress.py).
        if self.memory is not None and "loss" in logs:
            logs = {**logs, **self.memory.tracker_figures()}
        super().log(logs)

    def get_train_dataloader(self):
        # A resume with another micro-batch (plan/elastic.py): transformers 4.40 would take the checkpoint's
        # batch size (its auto_find_batch_size bookkeeping) instead of this run's.
        self._train_batch_size = self.args.train_batch_size
        return super().get_train_dataloader()

    def _get_train_sampler(self):
        return self.step_sampler or super()._get_train_sampler()

    def compute_loss(self, model, inputs, return_outputs=False):
        """Training micro-batches of the step sampler: the summed token loss over the step's target tokens
        (train/steps.py); evaluation and train.loss_normalization=micro_batch: the model's mean, as the Trainer."""
        tokens, ids = inputs.pop("step_tokens", None), inputs.pop("example_ids", None)
        if ids is not None and self.example_log is not None:
            self.example_log.record(self.state.global_step + 1, ids)
        # The demo's mean, except for a micro-batch of null slots only (an epoch's padded last step): its mean
        # would be 0/0; its sum is 0 and it still runs the forward every rank's collectives expect.
        demo = self.normalization == "micro_batch" and bool((inputs["labels"][:, 1:] != -100).any())
        if tokens is None and self.sequence is not None and hasattr(self.glm, "loss_reduction"):
            return self._sharded_eval_loss(model, inputs, return_outputs)
        if tokens is None or demo or not hasattr(self.glm, "loss_reduction"):
            return super().compute_loss(model, inputs, return_outputs)
        outputs = self._summed_forward(model, inputs)
        loss = (
            outputs.loss.float()
            if self.normalization == "micro_batch"
            else step_loss(outputs.loss, tokens, self.args.gradient_accumulation_steps, self.args.world_size)
        )
        return (loss, outputs) if return_outputs else loss

    def _summed_forward(self, model, inputs):
        """The model's outputs with the summed token loss; under a sequence group on this rank's shard of every
        row, labels shifted first (train/sequence.py)."""
        self.glm.loss_reduction = "sum"
        if self.sequence is not None:
            inputs = shard_batch(inputs, self.sequence)
            # Left on through backward: checkpointed blocks recompute their attention, exchanges included.
            self.glm.set_sequence_group(self.sequence)
        try:
            return model(**inputs)
        finally:
            self.glm.loss_reduction = "mean"

    def _sharded_eval_loss(self, model, inputs, return_outputs=False):
        """An evaluation batch under the sequence group: the mean token loss over the whole batch, as the model
        gives it on whole rows (train/sequence.py), in the dtype the model's own mean comes back in."""
        outputs = self._summed_forward(model, inputs)
        loss = group_mean_loss(outputs.loss, inputs["labels"], self.sequence).to(self.glm.dtype)
        return (loss, outputs) if return_outputs else loss

    def get_eval_dataloader(self, eval_dataset=None):
        if self.sequence is None:
            return super().get_eval_dataloader(eval_dataset)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return group_eval_loader(dataset, self.data_collator, self.args, self.accelerator, self.sequence.size)

    def evaluation_loop(self, *args, **kwargs):
        if self.sequence is not None:  # the Trainer puts gather_for_metrics back at the loop's end
            self.gather_function = partial(gather_groups, self.accelerator, self.sequence.size)
        return super().evaluation_loop(*args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Any world size: a DDP checkpoint's states read onto the CPU first; a ZeRO-3 checkpoint's gathered
        states (train/portable.py) when this run is not ZeRO-3. A ZeRO-3 run reads its own engine's files."""
        if checkpoint is None or self.is_deepspeed_enabled:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_states(self, Path(checkpoint))

    loss_carry: LossCarry | None = None

    def _maybe_log_save_evaluate(self, tr_loss, *args, **kwargs):
        if self.sequence is not None and not self.control.should_log and self.state.global_step >= self.state.max_steps:
            # The loop adds the steps since the last log to train_loss as this rank's own sum, which under sequence
            # parallelism is one shard's share: the mean over the ranks instead, as a log takes it (every rank
            # reaches max_steps at the same step, so all of them gather).
            tr_loss.copy_(self._nested_gather(tr_loss).mean())
        if self.loss_carry is not None:  # its loop-local loss sum, for the checkpoint; a resume's sums put back
            self.loss_carry.see(self, tr_loss)
        return super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)

    def _save_checkpoint(self, model, trial, metrics=None):
        with self.phases.phase("save"):
            super()._save_checkpoint(model, trial, metrics)
            folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            if self.is_deepspeed_enabled:  # gathered optimizer states, so a ZeRO-3 run can resume as DDP
                save_portable_zero3(self.model_wrapped, self.state.global_step, folder, self.is_world_process_zero())
            if self.loss_carry is not None:
                self.loss_carry.save(self, folder)

    def training_step(self, model, inputs):
        loss = super().training_step(model, inputs)
        if self.guard is not None:
            self.guard.observe_loss(loss)  # no sync here: the guard reads it once per optimizer step
        return loss

    def create_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = make_optimizer(
                OPTIMIZERS[self.args.optim],
                trainable_parameters(self.model),
                lr=self.args.learning_rate,
                weight_decay=self.args.weight_decay,
            )
        return self.optimizer

    generation_eval: GenerationEval | None = None
    best: BestTracker | None = None
    last_eval: dict | None = None  # the latest evaluation's metrics, with its "step"

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """The Trainer's loss evaluation, then perplexity and (eval.generate) the generation metrics, logged as
        a second line of the same step (TensorBoard eval/*, metrics.jsonl); the best-checkpoint bookkeeping."""
        with self.phases.phase("eval"):
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # sharded (train/sequence.py)
            extra = {"eval_perplexity": perplexity(metrics["eval_loss"])}
            self.glm.set_sequence_group(None)  # generation decodes whole rows on every rank
            if self.generation_eval is not None:
                extra.update(self.generation_eval(self.model, self.state.global_step, self.is_world_process_zero()))
        self.log(extra)
        metrics.update(extra)
        if self.best is not None:
            self.best.update(metrics, self.state.global_step, self.control)
        self.last_eval = {**metrics, "step": self.state.global_step}
        return metrics

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The adapter, as Trainer._save writes a PeftModel, but with save_embedding_layers=False: glmtune never
        trains embeddings (config.LORA_TARGETS), and PEFT's "auto" check looks the local base-model folder up
        on the Hub and warns "Could not find a config file" at every save."""
        output_dir = output_dir or self.args.output_dir
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(
            output_dir,
            state_dict=state_dict,
            safe_serialization=self.args.save_safetensors,
            save_embedding_layers=False,
        )
        torch.save(self.args, Path(output_dir) / "training_args.bin")
        plain_file_modes(output_dir)  # safetensors' 0600 -> the umask's mode, as every other run file
