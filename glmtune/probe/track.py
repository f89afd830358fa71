"""The estimator's CPU check: one steady-state LoRA step's live tensor bytes (train/livebytes.py measures them)."""

from __future__ import annotations

import torch

from ..train.livebytes import LiveTensorTracker

__all__ = ["LiveTensorTracker", "measure_lora_step", "optimizer_state_tensors"]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def measure_lora_step(arch, shape, seed: int = 0, sequence=None) -> tuple[int, int]:
    """Peak live tensor bytes (incl. weights, adapters, Adam states, batch) of one steady-state LoRA step on
    CPU, built as glmtune/train/model.py's build_model does. Adam states are created untracked; the step
    after is measured. Returns (peak_bytes, baseline_bytes). `arch` is a GLMConfig, `shape` a memory.RunShape.
    sequence: this rank's models/kernels/ulysses.SequenceGroup (a torchrun of N ranks): the step runs on its shard of the
    rows, as the trainer runs it (train/sequence.shard_batch), and the peak is this rank's."""
    from ..config import LoraConfig
    from ..models import enable_checkpointing
    from ..models.kernels.tiling import set_mlp_tile_tokens
    from ..models.loading import model_class
    from ..plan.estimate import BYTES
    from ..train.lora import apply_lora, trainable_parameters
    from ..train.optim import make_optimizer

    dtype = {2: torch.bfloat16, 4: torch.float32}[BYTES[shape.dtype]]
    torch.manual_seed(seed)
    model = model_class(arch)(arch).to(dtype)
    model.config.use_cache = False
    model.loss_chunk_tokens = shape.loss_chunk_tokens
    model = apply_lora(
        model,
        LoraConfig(
            r=shape.lora_r,
            alpha=2 * shape.lora_r,
            dropout=shape.lora_dropout,
            target_modules=list(shape.lora_targets),
            use_dora=shape.use_dora,
        ),
    )
    if shape.gradient_checkpointing:
        enable_checkpointing(model, use_reentrant=True)
        model.enable_input_require_grads()
    set_mlp_tile_tokens(model, shape.mlp_tile_tokens)
    model.train()
    params = trainable_parameters(model)
    opt = make_optimizer(shape.optimizer, params, lr=1e-4, weight_decay=0.0)
    ids = torch.randint(0, arch.padded_vocab_size, (shape.micro_batch, shape.seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if sequence is not None:
        from ..train.sequence import shard_batch

        batch = shard_batch(batch, sequence)
        model.get_base_model().set_sequence_group(sequence)

    # shape.autocast: bf16 autocast as the Trainer runs mixed precision (on CPU too, with train.precision=bf16).
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=shape.autocast)

    def step() -> None:
        with amp:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # Adam's states, as a first step leaves them, without that step's forward and backward (the model holds no
    # caches a forward would fill): a bf16 matmul is ~50x slower than fp32 on CPUs without AVX-512 BF16.
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    baseline = [*model.parameters(), *model.buffers(), *optimizer_state_tensors(opt), *batch.values()]
    with LiveTensorTracker(baseline) as tracker:
        step()
    return tracker.peak_bytes, tracker.baseline_bytes
