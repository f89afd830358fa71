"""Training throughput through the HF Trainer: packing on/off, compile on/off, short and long data.

    python bench/throughput.py                          # CUDA: full-size GLM-4-9B-chat, random bf16 weights
    python bench/throughput.py --cases demo --steps 10  # one data set only
    python bench/throughput.py --tiny                   # CPU smoke test: tiny model, short rows, compile off

No download: the model is built from glmtune.models.released_config with random weights on the GPU; LoRA r 8
on query_key_value (fp32 adapters, bf16 autocast, the official demo's settings). Data is synthesized:
  demo  prompts 30-60 and answers 80-150 tokens (GLM-4 finetune demo-like), --micro-batch examples a step
        (8); unpacked = padded to the longest, packed = the same examples first-fit into rows of up to
        --pack-length positions (data/packing.py): the same examples and tokens per step either way
  2k    one 2,048-token example per step (1,024 prompt + 1,024 answer)
  8k    one 8,192-token example per step, gradient checkpointing on (as a 9B run at 8K needs on 80 GB)
Long examples fill a row alone, so 2k/8k are run unpacked only.

Per configuration it prints: tokens/s (real tokens, padding excluded), mean step time (end of one Trainer step
to the end of the next, so data loading and Trainer overhead count), achieved TFLOP/s at 4*N FLOPs per token
(N = the language model's parameters; forward 2N + the backward's input gradients 2N: the frozen base needs
no weight gradients; attention scores and LoRA FLOPs are not counted), that as a share of the card's
measured bf16 8Kx8Kx8K matmul rate, GPU-busy share (kernel time / wall time over 2 profiled steps, torch
profiler), and peak reserved memory against the estimator's prediction for the same shape.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.config import LoraConfig, TrainConfig  # noqa: E402
from glmtune.config.units import GIB  # noqa: E402
from glmtune.data.packing import RowPacker  # noqa: E402
from glmtune.data.pipeline import IGNORE_INDEX, DataCollator  # noqa: E402
from glmtune.models import ChatGLMForConditionalGeneration, GLMConfig, enable_checkpointing, released_config  # noqa: E402
from glmtune.models.loading import TINY_ARCH  # noqa: E402
from glmtune.plan.estimate import RunShape, estimate, gpu_family  # noqa: E402
from glmtune.plan.planner import Choices  # noqa: E402
from glmtune.train.compile import compile_blocks, set_packed_attention  # noqa: E402
from glmtune.train.lora import apply_lora  # noqa: E402
from glmtune.train.trainer import make_trainer, training_args  # noqa: E402


def demo_examples(count: int, vocab: int, rng: random.Random, prompt=(30, 60), answer=(80, 150)) -> list[dict]:
    """[gMASK] <sop> <|user|> prompt <|assistant|> answer <|user|>-like rows of random ids; the answer and the
    closing token are targets, as encode_conversation labels them."""
    out = []
    for _ in range(count):
        p, a = rng.randint(*prompt), rng.randint(*answer)
        ids = [rng.randrange(vocab) for _ in range(3 + p + 1 + a + 1)]
        n_context = 3 + p + 1
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * n_context + ids[n_context:]})
    return out


def long_examples(count: int, length: int, vocab: int, rng: random.Random) -> list[dict]:
    return demo_examples(
        count,
        vocab,
        rng,
        prompt=(length // 2 - 4, length // 2 - 4),
        answer=(length - length // 2 - 1, length - length // 2 - 1),
    )


class Recorder:
    """Collator wrapper: real tokens of every batch, in the order the Trainer draws them."""

    def __init__(self, collator: DataCollator):
        self.collator, self.tokens, self.widths, self.rows = collator, [], [], []

    def __call__(self, features):
        batch = self.collator(features)
        self.tokens.append(int(batch["attention_mask"].sum()))
        self.rows.append(batch["input_ids"].shape[0])
        self.widths.append(batch["input_ids"].shape[1])
        return batch


class Timer(TrainerCallback):
    """Wall time of each step, end to end; the last `profile` steps run under the torch profiler."""

    def __init__(self, cuda: bool, profile: int):
        self.cuda, self.profile, self.ends, self.prof, self.busy = cuda, profile, [], None, None
        self.max_steps = 0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_begin(self, args, state, control, **kwargs):
        self.max_steps = state.max_steps
        self._sync()
        self.ends = [time.perf_counter()]

    def on_step_begin(self, args, state, control, **kwargs):
        if self.cuda and self.profile and state.global_step == self.max_steps - self.profile:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._sync()
            self.prof.__enter__()
            self.prof_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.ends.append(time.perf_counter())
        if self.prof is not None and state.global_step == self.max_steps:
            wall = time.perf_counter() - self.prof_start
            self.prof.__exit__(None, None, None)
            kernel_us = sum(
                getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                for e in self.prof.key_averages()
            )
            self.busy = kernel_us / 1e6 / wall


def matmul_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t0) / 1e12


def versions() -> str:
    import peft
    import transformers

    driver = "-"
    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, IndexError, subprocess.SubprocessError):
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return (
        f"device {device}, driver {driver}, CUDA {torch.version.cuda}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, peft {peft.__version__}, python {platform.python_version()}"
    )


def run_one(
    model,
    rows,
    steps: int,
    warmup: int,
    profile: int,
    ckpt: bool,
    dtype: str,
    scratch: Path,
    micro_batch: int = 1,
    packer: RowPacker | None = None,
) -> dict:
    cuda = torch.cuda.is_available()
    choices = Choices(
        dtype=dtype,
        gradient_checkpointing=ckpt,
        zero_stage=0,
        offload_params=False,
        offload_optimizer=False,
        micro_batch_size=micro_batch,
        grad_accum=1,
        max_length=8192,
        world_size=1,
        eval_batch_size=1,
    )
    total = warmup + steps + profile
    args = training_args(TrainConfig(learning_rate=1e-4), choices, scratch, has_eval=False, probe_steps=total)
    recorder = Recorder(DataCollator(pad_id=0))
    timer = Timer(cuda, profile)
    trainer = make_trainer(args, model, rows, None, recorder, callbacks=[timer], packer=packer)
    for quiet in (PrinterCallback, ProgressCallback):  # keep stdout to the table
        trainer.remove_callback(quiet)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    times = [b - a for a, b in zip(timer.ends, timer.ends[1:])][warmup : warmup + steps]
    tokens = recorder.tokens[warmup : warmup + steps]
    del trainer
    return {
        "step_s": sum(times) / len(times),
        "tokens_per_s": sum(tokens) / sum(times),
        "tokens_per_step": sum(tokens) / len(tokens),
        "width": max(recorder.widths),
        "rows": max(recorder.rows),
        "busy": timer.busy,
        "reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="glm4_9b_chat")
    ap.add_argument("--cases", default="demo,2k,8k")
    ap.add_argument("--packing", default="off,on", help="demo only; long rows hold one example either way")
    ap.add_argument("--compile", default="off,on")
    ap.add_argument(
        "--attention",
        default="sdpa,flex",
        help="packed rows: dense-mask SDPA and/or FlexAttention (CUDA only; fused when compiled)",
    )
    ap.add_argument("--pack-length", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8, help="demo: examples per step, packed or not")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (compilation happens here)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, rows of 256/512, fp32")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        ap.error("no CUDA device: the full-size model needs a GPU (use --tiny for a CPU smoke test)")
    device, dtype = ("cuda", "bf16") if cuda and not a.tiny else ("cpu", "fp32")
    if a.tiny:
        arch = GLMConfig(**TINY_ARCH, padded_vocab_size=1024)
        lengths = {"2k": 256, "8k": 512}
        a.pack_length = min(a.pack_length, 512)
    else:
        arch = released_config(a.model)
        lengths = {"2k": 2048, "8k": 8192}
    print(versions())
    peak_mm = matmul_tflops(device)
    print(f"bf16 8192^3 matmul: {peak_mm:.0f} TFLOP/s" if peak_mm else "bf16 matmul: not measured (CPU)")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
    t0 = time.perf_counter()
    with torch.device(device):
        model = ChatGLMForConditionalGeneration(arch)
    torch.set_default_dtype(torch.float32)
    model.config.use_cache = False
    n_params = sum(p.numel() for n, p in model.named_parameters() if ".vision." not in n)
    model = apply_lora(model, LoraConfig(r=8, alpha=32, dropout=0.1, target_modules=["query_key_value"]))
    print(
        f"model {a.model if not a.tiny else 'tiny'}: N = {n_params / 1e9:.3f} B parameters (language model), "
        f"built in {time.perf_counter() - t0:.0f} s; FLOPs per token counted as 4*N = {4 * n_params / 1e9:.1f} G"
    )
    rng = random.Random(0)
    vocab = arch.padded_vocab_size
    need = (a.warmup + a.steps + 2) * 2
    data = {"demo": demo_examples(need * max(20, a.micro_batch), vocab, rng)}
    for name in ("2k", "8k"):
        data[name] = long_examples(need, lengths[name], vocab, rng)
    cases = [c for c in a.cases.split(",") if c]
    packings, compiles = a.packing.split(","), a.compile.split(",")
    attentions = [x for x in a.attention.split(",") if x and (cuda or x != "flex")]  # no flex backward on CPU
    print(
        "\n| data | packing | attention | compile | ckpt | rows x row (max) | tokens/step | step s | tokens/s "
        "| TFLOP/s (4N) | % of matmul | GPU busy | reserved GiB | estimate GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    baseline = None
    with tempfile.TemporaryDirectory() as scratch:
        for comp in compiles:  # compiled last: compile_blocks changes the model in place
            if comp == "on":
                compile_blocks(model)
            for case in cases:
                runs = [
                    (p, att)
                    for p in (packings if case == "demo" else ["off"])
                    for att in (attentions if p == "on" else ["-"])
                ]
                for packing, attention in runs:
                    rows, packer, micro = data[case], None, a.micro_batch if case == "demo" else 1
                    if packing == "on":
                        packer = RowPacker(a.pack_length)
                        set_packed_attention(model, attention)
                    ckpt = case == "8k"
                    if ckpt:
                        enable_checkpointing(model, use_reentrant=True)
                        model.enable_input_require_grads()
                    r = run_one(
                        model, rows, a.steps, a.warmup, 2 if cuda else 0, ckpt, dtype, Path(scratch), micro, packer
                    )
                    if ckpt:
                        model.gradient_checkpointing_disable()
                    tflops = 4 * n_params * r["tokens_per_s"] / 1e12
                    shape = RunShape(
                        dtype=dtype,
                        micro_batch=r["rows"],
                        seq_len=r["width"],
                        lora_r=8,
                        gradient_checkpointing=ckpt,
                        device=device,
                        gpu_family=gpu_family(torch.cuda.get_device_name().lower()) if cuda else None,
                    )
                    predicted = estimate(arch, shape).peak_bytes
                    if case == "demo" and packing == "off" and comp == "off":
                        baseline = r["tokens_per_s"]
                    speedup = f" ({r['tokens_per_s'] / baseline:.2f}x)" if baseline and case == "demo" else ""
                    fmt = lambda x, f: "-" if x is None else f.format(x)
                    print(
                        f"| {case} | {packing} | {attention} | {comp} | {'on' if ckpt else 'off'} | "
                        f"{r['rows']} x {r['width']} | "
                        f"{r['tokens_per_step']:.0f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f}{speedup} | "
                        f"{tflops:.1f} | {fmt(peak_mm and 100 * tflops / peak_mm, '{:.0f}%')} | "
                        f"{fmt(r['busy'] and 100 * r['busy'], '{:.0f}%')} | "
                        f"{fmt(r['reserved'] and r['reserved'] / GIB, '{:.1f}')} | {predicted / GIB:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
