"""QLoRA memory and speed: bf16 vs int8 vs NF4 base weights, measured against the estimator.

    python bench/quantized.py                          # GPU: random-weight glm-4-9b-chat, 2,048 and 8,192 tokens
    python bench/quantized.py --lengths 2048,8192,32768 --model glm4v_9b
    python bench/quantized.py --tiny                   # CPU smoke run on the tiny architecture

A random-weight checkpoint of the released architecture (glmtune.models.released_config) is written once to
--ckpt (safetensors, bf16; ~18 GB for glm-4-9b-chat; no download), then each mode loads it through glmtune's
own loaders (models.load_model / models.quantize.load_quantized) exactly as training does. Per mode it prints
the weights' real storage vs the estimator's "frozen weights", the load peak (how much beyond the quantized
weights the loader ever held on the GPU: one bf16 layer is the design), and per length one steady-state LoRA
step (r 8 on query_key_value, checkpointing, 1,024-token chunked loss, bf16 autocast as the Trainer runs it):
peak allocated vs the estimator's tensor terms, peak reserved vs its full estimate, and tokens/s.
On CPU, "allocated" is live tensor bytes (glmtune.probe.track) and there is no load peak or reserved.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from glmtune.config import LoraConfig
from glmtune.config.units import GIB, MIB
from glmtune.models import GLMConfig, enable_checkpointing, load_model, released_config
from glmtune.models.loading import TINY_ARCH, model_class
from glmtune.models.quantize import load_quantized, weight_storage_bytes, weight_tensors
from glmtune.plan.estimate import RunShape, estimate, gpu_family
from glmtune.probe.track import LiveTensorTracker, optimizer_state_tensors
from glmtune.train.lora import apply_lora, trainable_parameters

MODES = ("bf16", "int8", "nf4")


def write_checkpoint(arch: GLMConfig, folder: Path, device: str, dtype: torch.dtype) -> None:
    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # random init on the GPU: seconds for 9B parameters instead of minutes
            model = model_class(arch)(arch)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def load(folder: Path, mode: str, device: str, dtype: torch.dtype):
    if mode == "bf16":
        return load_model(folder, dtype=dtype).to(device)  # CPU first, as training loads it (no ZeRO)
    return load_quantized(folder, mode, dtype, device=device)


def step_peak(model, arch: GLMConfig, seq: int, device: str, dtype: torch.dtype, steps: int) -> tuple[int, int, float]:
    """(peak allocated or live bytes, peak reserved, tokens/s) of steady-state steps after one warm-up step."""
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-4)
    ids = torch.randint(0, arch.padded_vocab_size, (1, seq), device=device)
    cuda = device.startswith("cuda")

    def step():
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam states exist from here on
    if not cuda:
        baseline = [*weight_tensors(model), *model.buffers(), *optimizer_state_tensors(opt), ids]
        with LiveTensorTracker(baseline) as tracker:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            seconds = time.perf_counter() - t0
        return tracker.peak_bytes, 0, steps * seq / seconds
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), steps * seq / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="glm4_9b_chat", help="released preset: glm4_9b_chat, glm4v_9b, chatglm3_6b")
    ap.add_argument("--tiny", action="store_true", help="tiny architecture (CPU smoke run)")
    ap.add_argument("--lengths", default="2048,8192", help="tokens per sample, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up step)")
    ap.add_argument(
        "--ckpt", default=None, help="checkpoint folder to write/reuse (default /tmp/glmtune-bench-<model>)"
    )
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    e = "bf16" if cuda else "fp32"
    arch = GLMConfig(**TINY_ARCH, padded_vocab_size=1024) if args.tiny else released_config(args.model)
    name = "tiny" if args.tiny else args.model
    folder = Path(args.ckpt or f"/tmp/glmtune-bench-{name}")
    family = gpu_family(torch.cuda.get_device_name(0).lower()) if cuda else None
    write_checkpoint(arch, folder, device, dtype)
    print(
        f"{name} on {torch.cuda.get_device_name(0) if cuda else 'CPU'} (family {family}), compute {e}, "
        f"checkpoint {folder}\n"
    )
    unit, u = (GIB, "GiB") if cuda else (MIB, "MiB")  # the tiny model's tensors are a few MiB
    print(
        f"| mode | tokens | weights {u} (est) | load peak over weights {u} | allocated {u} | est tensors {u} | "
        f"reserved {u} | est total {u} | tokens/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model = load(folder, mode, device, dtype)
        load_s = time.perf_counter() - t0
        stored = weight_storage_bytes(model)
        load_over = (torch.cuda.max_memory_allocated() - stored) / unit if cuda else float("nan")
        model.config.use_cache = False
        model.loss_chunk_tokens = 1024
        model = apply_lora(model, LoraConfig(r=8, alpha=32, dropout=0.1, target_modules=["query_key_value"]))
        enable_checkpointing(model, use_reentrant=True)
        model.enable_input_require_grads()
        model.train()
        quantize = "none" if mode == "bf16" else mode
        for seq in (int(x) for x in args.lengths.split(",")):
            shape = RunShape(
                dtype=e,
                seq_len=seq,
                gradient_checkpointing=True,
                loss_chunk_tokens=1024,
                quantize=quantize,
                device="cuda" if cuda else "cpu",
                gpu_family=family,
            )
            est = estimate(arch, shape)
            tensors = est.peak_bytes - sum(v for k, v in est.breakdown.items() if "uncalibrated" in k)
            try:
                allocated, reserved, tps = step_peak(model, arch, seq, device, dtype, args.steps)
            except torch.cuda.OutOfMemoryError:
                allocated = reserved = tps = float("nan")
                torch.cuda.empty_cache()
            print(
                f"| {mode} | {seq} | {stored / unit:.2f} ({est.breakdown['frozen weights'] / unit:.2f}) | "
                f"{load_over:.2f} | {allocated / unit:.2f} | {tensors / unit:.2f} | {reserved / unit:.2f} | "
                f"{est.peak_bytes / unit:.2f} | {tps:,.0f} |",
                flush=True,
            )
        print(f"<!-- {mode}: load {load_s:.0f} s -->")
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
