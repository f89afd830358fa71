"""Estimator accuracy: predicted vs measured peak of one steady-state LoRA training step.

    python bench/memory_accuracy.py          # CPU: live tensor bytes via glmtune.probe.track

On CPU the measurement is glmtune.probe.track.LiveTensorTracker (tensor bytes incl. weights, adapters,
Adam states and the batch); the estimator runs with device="cpu" (no CUDA context/workspace/NCCL/slack
terms). The GPU constants are measured by bench/gpu_memory.py (bench/RESULTS.md, section 0).
Also prints the prediction for the GLM-4 finetune demo's LoRA settings (published 21,531 MiB).
"""

from __future__ import annotations

import itertools
import time

from glmtune.config.units import MIB
from glmtune.models import GLMConfig, released_config
from glmtune.models.loading import TINY_ARCH
from glmtune.plan.estimate import RunShape, estimate
from glmtune.probe.track import measure_lora_step

ALL = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
TINY = GLMConfig(**TINY_ARCH, padded_vocab_size=1024)
MID = GLMConfig(
    num_layers=12,
    hidden_size=768,
    ffn_hidden_size=2048,
    kv_channels=64,
    num_attention_heads=12,
    multi_query_attention=True,
    multi_query_group_num=2,
    padded_vocab_size=32000,
)


def grid():
    for seq, batch, rank, targets, ckpt, dtype in itertools.product(
        (64, 256), (1, 2), (8,), (("query_key_value",), ALL), (False, True), ("fp32", "bf16")
    ):
        yield (
            "tiny",
            TINY,
            RunShape(
                dtype=dtype,
                micro_batch=batch,
                seq_len=seq,
                lora_r=rank,
                lora_targets=targets,
                gradient_checkpointing=ckpt,
                device="cpu",
            ),
        )
    for seq, batch, targets, ckpt, dtype, chunk in [
        (128, 1, ("query_key_value",), False, "bf16", 0),
        (128, 1, ("query_key_value",), True, "bf16", 0),
        (256, 2, ALL, False, "fp32", 0),
        (256, 2, ALL, True, "fp32", 0),
        (256, 2, ALL, False, "bf16", 128),
        (512, 1, ALL, True, "bf16", 128),
    ]:
        yield (
            "mid-109M",
            MID,
            RunShape(
                dtype=dtype,
                micro_batch=batch,
                seq_len=seq,
                lora_r=16,
                lora_targets=targets,
                gradient_checkpointing=ckpt,
                loss_chunk_tokens=chunk,
                device="cpu",
            ),
        )


def main() -> None:
    print("| model | dtype | seq | batch | r | targets | ckpt | chunk | measured MiB | predicted MiB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    t0 = time.time()
    for name, arch, s in grid():
        measured, _ = measure_lora_step(arch, s)
        predicted = estimate(arch, s).peak_bytes
        err = (predicted - measured) / measured
        errors.append(abs(err))
        print(
            f"| {name} | {s.dtype} | {s.seq_len} | {s.micro_batch} | {s.lora_r} | {len(s.lora_targets)} | "
            f"{'on' if s.gradient_checkpointing else 'off'} | {s.loss_chunk_tokens} | {measured / MIB:.2f} | "
            f"{predicted / MIB:.2f} | {err * 100:+.1f}% |"
        )
    print(
        f"\n{len(errors)} configs, max |error| {max(errors) * 100:.1f}%, mean {sum(errors) / len(errors) * 100:.1f}%, "
        f"{time.time() - t0:.0f} s"
    )

    arch = released_config("glm4_9b_chat")
    print("\nGLM-4 demo LoRA (r 8 on query_key_value, bf16, batch 1, A100-80G), published 21,531 MiB:")
    for seq in (200, 1024):
        for ckpt in (False, True):
            e = estimate(
                arch, RunShape(dtype="bf16", seq_len=seq, lora_r=8, gpu_family="ampere", gradient_checkpointing=ckpt)
            )
            print(
                f"  {seq} tokens, checkpointing {'on ' if ckpt else 'off'}: {e.peak_bytes / MIB:,.0f} MiB ({e.phase})"
            )
    e = estimate(arch, RunShape(dtype="bf16", seq_len=1024, gpu_family="ampere", eval_batch=4, eval_max_new_tokens=512))
    print(
        "  eval batch 4, generation +512 tokens: phases "
        + ", ".join(f"{k} {v / MIB:,.0f}" for k, v in e.phases.items())
        + " MiB"
    )


if __name__ == "__main__":
    main()
