"""GPU memory benchmark: the estimator against real LoRA steps of full-size GLM models, no weights downloaded.

    python bench/gpu_memory.py                          # the default grid on this GPU; table at the end
    python bench/gpu_memory.py --grid check --out r.jsonl
    python bench/gpu_memory.py --one '{"model": "glm4_9b_chat", "seq": 8192, "ckpt": true, "chunk": 256}'
    python bench/gpu_memory.py --table r.jsonl          # re-print a table from saved results (any machine)
    python bench/gpu_memory.py --grid 0414              # GLM-4-0414: 9B, 32B in bf16 and 32B nf4 under a 24 GB cap

Each configuration runs in a fresh process (so the CUDA context, allocator state and NVML reading are its
own): the model is built straight on the GPU from the released config.json facts with random bf16 weights
(memory and speed do not depend on the values), under deepspeed.zero.Init for ZeRO-3 rows; a quantized row's
weights are made one tensor at a time on the GPU and quantized as they arrive (models.quantize.load_quantized), so
GLM-4-32B-0414's 65 GB never touch a disk, and `cap_gib` caps the allocator at a smaller card's memory. Then glmtune's
own path runs it: `train.model.prepare_model` (LoRA, fp32 adapters, checkpointing, loss chunk,
checkpoint offload), `training_args` + `make_trainer` (the HF Trainer, the DeepSpeed engine for ZeRO-3) for
`steps` optimizer steps on worst-case batches (every token a target; GLM-4V rows carry a 1120 px image), then
`trainer.evaluate` on an eval batch when the row asks for one. Measured per phase (train, eval):
torch's peak allocated and reserved bytes, and the whole process's device memory from NVML (context
included), sampled every 2 ms by a thread. Predicted: `plan.estimate.estimate` on the run shape the planner
builds for the same choices (`plan.planner.run_shape`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 2**30
QKV = ["query_key_value"]
ALL = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def row(
    model="glm4_9b_chat",
    seq=512,
    batch=1,
    ckpt=False,
    chunk=0,
    targets=QKV,
    image=False,
    eval_batch=0,
    zero=0,
    offload=False,
    offck=False,
    alloc="expandable",
    steps=3,
    zero_knobs=None,
    tag="",
    r=8,
    quantize="none",
    cap_gib=None,
):
    return dict(
        model=model,
        seq=seq,
        batch=batch,
        ckpt=ckpt,
        chunk=chunk,
        targets=targets,
        image=image,
        r=r,
        eval_batch=eval_batch,
        zero=zero,
        offload=offload,
        offck=offck,
        alloc=alloc,
        steps=steps,
        zero_knobs=zero_knobs or {},
        tag=tag,
        quantize=quantize,
        cap_gib=cap_gib,
    )


GRIDS = {
    # Fits the constants and checks the tensor terms: lengths 512-32K, batch, checkpointing, loss chunk,
    # targets, images, evaluation, ZeRO-3 with and without offload, both allocator settings.
    "calib": [
        row(seq=512),
        row(seq=512, batch=4),
        row(seq=2048),
        row(seq=2048, ckpt=True),
        row(seq=8192, ckpt=True),
        row(seq=8192, ckpt=True, chunk=1024),
        row(seq=8192, ckpt=True, chunk=256),
        row(seq=8192, ckpt=True, chunk=256, offck=True),
        row(seq=512, targets=ALL),
        row(seq=16384, ckpt=True, chunk=1024),
        row(seq=32768, ckpt=True, chunk=1024),
        row(seq=500, eval_batch=4),
        row(seq=2048, ckpt=True, chunk=1024, eval_batch=4),
        row(model="glm4v_9b", seq=500, image=True),
        row(model="glm4v_9b", seq=500, image=True, ckpt=True, chunk=1024, eval_batch=2),
        row(model="chatglm3_6b", seq=2048, ckpt=True),
        row(seq=2048, alloc="default"),
        row(seq=8192, ckpt=True, alloc="default"),
        row(seq=500, eval_batch=4, alloc="default"),
        row(seq=2048, ckpt=True, chunk=1024, zero=3),
        row(seq=4096, ckpt=True, chunk=1024, zero=3, offload=True, steps=2, tag="knobs as shipped"),
        row(
            seq=4096,
            ckpt=True,
            chunk=1024,
            zero=3,
            offload=True,
            steps=2,
            tag="reuse 0, live 1e8",
            zero_knobs={"MAX_REUSE_DISTANCE": 0, "MAX_LIVE_PARAMETERS": 100_000_000},
        ),
    ],
    # Held out: none of these shapes was used to fit the estimator's constants.
    "check": [
        row(seq=1024),
        row(seq=1024, batch=2, ckpt=True),
        row(seq=4096, ckpt=True, chunk=1024),
        row(seq=12288, ckpt=True, chunk=256, offck=True),
        row(seq=24576, ckpt=True, chunk=1024),
        row(seq=4096, ckpt=True, chunk=1024, targets=ALL, r=16),
        row(seq=2048, ckpt=True, chunk=1024, targets=ALL, r=64),
        row(seq=1000, eval_batch=8),
        row(seq=8192, ckpt=True, chunk=256, offck=True, eval_batch=1),
        row(model="glm4v_9b", seq=1000, image=True, ckpt=True, chunk=1024),
        row(model="glm4v_9b", seq=500, image=True, ckpt=True, chunk=256, offck=True, eval_batch=1),
        row(model="chatglm3_6b", seq=8192, ckpt=True, chunk=1024),
        row(model="chatglm3_6b", seq=512, batch=4),
        row(seq=4096, ckpt=True, chunk=1024, zero=3, eval_batch=2),
        row(
            seq=2048,
            ckpt=True,
            chunk=1024,
            zero=3,
            offload=True,
            steps=2,
            tag="reuse 0, live 1e8",
            zero_knobs={"MAX_REUSE_DISTANCE": 0, "MAX_LIVE_PARAMETERS": 100_000_000},
        ),
        row(
            seq=2048,
            ckpt=True,
            chunk=1024,
            zero=3,
            offload=True,
            steps=2,
            tag="reuse 0, live 1e8, prefetch 1e7",
            zero_knobs={"MAX_REUSE_DISTANCE": 0, "MAX_LIVE_PARAMETERS": 100_000_000, "PREFETCH_BUCKET": 10_000_000},
        ),
    ],
    # GLM-4-0414 (issue 41): lora=default is q/k/v_proj there. 32B bf16 needs > 65 GB (an H200); its nf4 row is the
    # plan's choice for one RTX 4090 at 500 tokens (checkpointing, 1,024-token chunk) under a 24 GB cap.
    "0414": [
        row(model="glm4_9b_0414", seq=8192, ckpt=True, chunk=1024),
        row(model="glm4_32b_0414", seq=2048, ckpt=True, chunk=1024, steps=2),
        row(
            model="glm4_32b_0414",
            seq=500,
            ckpt=True,
            chunk=1024,
            steps=2,
            quantize="nf4",
            cap_gib=24,
            tag="QLoRA, 24 GB cap",
        ),
    ],
}


# --- one configuration, in its own process ------------------------------------------------------------------


class NvmlPeak:
    """Device memory used by this process (NVML), sampled every 2 ms; falls back to the whole device's use
    minus what was used before this process touched CUDA."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("LOCAL_RANK", "0")))
        self.before = pynvml.nvmlDeviceGetMemoryInfo(self.handle).used
        self.peak, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def now(self) -> int:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
            mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory]
            if mine:
                return int(mine[0])
        except self.nvml.NVMLError:
            pass
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used - self.before)

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def reset(self):
        self.peak = self.now()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()

    def driver(self) -> str:
        return self.nvml.nvmlSystemGetDriverVersion()


def examples(count: int, length: int, vocab: int, seed: int, image: str | None, arch) -> list[dict]:
    """Worst-case rows as the probe makes them: random plain tokens, every one a target; with an image, the
    three placeholders after [gMASK]<sop> (boi, <|endoftext|>, eoi) that the tower's 1,602 embeddings replace."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, vocab, (count, length), generator=gen).tolist()
    out = []
    for r in rows:
        if image is None:
            out.append({"input_ids": r, "labels": r})
            continue
        r[2:5] = [arch.boi_token_id, arch.pad_token_id, arch.eoi_token_id]
        out.append({"input_ids": r, "labels": r[:2] + [-100] * 3 + r[5:], "image": image})
    return out


def plan_for(cfg: dict):
    """The architecture, run config, choices and estimator shape of one benchmark row, as the planner makes them."""
    from dataclasses import replace

    from glmtune.config import DataConfig, HwConfig, LoraConfig, ModelConfig, RunConfig, TrainConfig
    from glmtune.models import released_config
    from glmtune.plan.planner import Choices, run_shape

    arch = released_config(cfg["model"])
    run = RunConfig(
        model=ModelConfig(name=cfg["model"], quantize=cfg.get("quantize", "none")),
        lora=LoraConfig(r=cfg.get("r", 8), target_modules=list(cfg["targets"])),
        data=DataConfig(max_length=cfg["seq"], val_file="eval" if cfg["eval_batch"] else None),
        train=TrainConfig(per_device_batch_size=cfg["batch"], eval_batch_size=max(1, cfg["eval_batch"])),
        hw=HwConfig(name="h100_80g", memory_gib=cfg.get("cap_gib") or 79.1),
    )
    choices = Choices(
        dtype="bf16",
        gradient_checkpointing=cfg["ckpt"],
        zero_stage=cfg["zero"],
        offload_params=cfg["offload"],
        offload_optimizer=False,
        micro_batch_size=cfg["batch"],
        grad_accum=1,
        max_length=cfg["seq"],
        world_size=1,
        eval_batch_size=max(1, cfg["eval_batch"]),
        loss_chunk_tokens=cfg["chunk"],
        offload_checkpoints=cfg["offck"],
    )
    # The row's process ran with the allocator it names (run_grid sets or removes PYTORCH_CUDA_ALLOC_CONF).
    return arch, run, choices, replace(run_shape(run, arch, choices), allocator=cfg.get("alloc", "expandable"))


def run_one(cfg: dict) -> dict:
    nv = NvmlPeak()  # before torch touches CUDA
    import torch
    import transformers
    from transformers import TrainerCallback

    from glmtune.data.pipeline import DataCollator
    from glmtune.models.loading import model_class
    from glmtune.plan.estimate import estimate
    from glmtune.probe.batch import probe_image
    from glmtune.train import zero3
    from glmtune.train.model import prepare_model
    from glmtune.train.trainer import make_trainer, training_args

    transformers.logging.set_verbosity_error()
    for knob, value in cfg["zero_knobs"].items():  # the benchmark's experiments with DeepSpeed's knobs
        setattr(zero3, knob, value)
    scratch = Path(os.environ.get("BENCH_SCRATCH", "/tmp/glmtune-bench"))
    arch, run, choices, shape = plan_for(cfg)
    est = estimate(arch, shape)
    image = str(probe_image(arch.vision_config["image_size"], scratch)) if cfg["image"] else None
    args = training_args(run.train, choices, scratch, has_eval=False, probe_steps=cfg["steps"])

    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    if cfg["zero"] == 3:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=args.hf_deepspeed_config.config, dtype=torch.bfloat16):
            model = model_class(arch)(arch)
    elif cfg.get("quantize", "none") != "none":
        torch.set_default_dtype(torch.float32)
        model = random_quantized(arch, cfg["quantize"], scratch / cfg["model"])
    else:
        with torch.device("cuda"):
            model = model_class(arch)(arch)
    torch.set_default_dtype(torch.float32)
    if cfg.get("cap_gib"):  # the smaller card: the allocator may not hold more than its memory
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg["cap_gib"] * GIB / total))
    model = prepare_model(model, run, choices)
    build_s = time.perf_counter() - t0
    after_build = torch.cuda.memory_allocated()

    vocab = arch.padded_vocab_size - 1024  # plain tokens only; specials sit at the top of the vocabulary
    train_set = examples(cfg["batch"] * cfg["steps"], cfg["seq"], vocab, 0, image, arch)
    collator = DataCollator(arch.pad_token_id or 0, image_size=arch.vision_config["image_size"] if image else None)

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks, self.allocated = [], []

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
            self.allocated.append(torch.cuda.memory_allocated())  # what stays between steps (ZeRO-3 rows)

    clock = Clock()
    trainer = make_trainer(args, model, train_set, None, collator, callbacks=[clock])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    nv.reset()
    start = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    out = {
        "train": {
            "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
            "nvml": nv.peak,
        }
    }
    steps = [b - a for a, b in zip([start] + clock.marks, clock.marks)]
    if cfg["eval_batch"]:
        eval_set = examples(cfg["eval_batch"], cfg["seq"], vocab, 1, image, arch)
        torch.cuda.reset_peak_memory_stats()
        nv.reset()
        trainer.evaluate(eval_dataset=eval_set)
        torch.cuda.synchronize()
        out["eval"] = {
            "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
            "nvml": nv.peak,
        }
    context = nv.now() - torch.cuda.memory_reserved()  # what NVML sees beyond the allocator: context, modules
    tokens = cfg["batch"] * (shape.seq_len)
    steady = sorted(steps[1:]) if len(steps) > 1 else steps
    nv.close()
    return {
        **cfg,
        "measured": out,
        "context_bytes": context,
        "after_build_allocated": after_build,
        "build_s": round(build_s, 2),
        "step_s": [round(s, 3) for s in steps],
        "allocated_after_steps": clock.allocated,
        "tokens_per_s": round(tokens / steady[len(steady) // 2], 1) if steady else None,
        "estimate": {"peak": est.peak_bytes, "phase": est.phase, "phases": est.phases, "breakdown": est.breakdown},
        "device": torch.cuda.get_device_name(),
        "driver": nv.driver(),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            **_versions(),
        },
    }


def random_quantized(arch, quantize: str, folder: Path):
    """The architecture with random weights, each made on the GPU as the loader asks for it and quantized there:
    the bf16 model never exists whole (one tensor at a time, as models.quantize loads a checkpoint)."""
    import torch

    from glmtune.models import build_meta_model
    from glmtune.models.quantize import load_quantized

    folder.mkdir(parents=True, exist_ok=True)
    arch.to_json_file(str(folder / "config.json"))  # the architecture the loader reads; no weight file

    def tensors():
        for name, param in build_meta_model(arch).named_parameters():
            if name.endswith("norm.weight"):
                yield name, torch.ones(param.shape, device="cuda", dtype=torch.bfloat16)
            else:
                yield name, torch.randn(param.shape, device="cuda", dtype=torch.bfloat16) * 0.02

    return load_quantized(folder, quantize, torch.bfloat16, device="cuda", tensors=tensors())


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("peft", "deepspeed")}


# --- the grid, one process per configuration -----------------------------------------------------------------


def run_grid(name: str, out: Path, budget_s: float) -> list[dict]:
    results, t0 = [], time.perf_counter()
    for cfg in GRIDS[name]:
        if time.perf_counter() - t0 > budget_s:
            print(f"budget of {budget_s:.0f} s spent: skipping {cfg}", flush=True)
            continue
        env = dict(os.environ)
        if cfg["alloc"] == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        else:
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(cfg)], env=env, capture_output=True, text=True, timeout=600
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else {**cfg, "error": (proc.stderr or proc.stdout)[-1500:]}
        result["wall_s"] = round(time.perf_counter() - t, 1)
        results.append(result)
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(short(result), flush=True)
    return results


def short(r: dict) -> str:
    if "error" in r:
        return f"{label(r)}: ERROR {r['error'][-400:]}"
    m = r["measured"]["train"]
    return (
        f"{label(r)}: alloc {m['allocated'] / GIB:.2f} reserved {m['reserved'] / GIB:.2f} nvml {m['nvml'] / GIB:.2f} "
        f"est {r['estimate']['peak'] / GIB:.2f} GiB, ctx {r['context_bytes'] / 2**20:.0f} MiB, "
        f"{r['tokens_per_s']} tok/s, {r['wall_s']} s"
    )


def label(r: dict) -> str:
    bits = [
        r["model"],
        f"{r['seq']}x{r['batch']}",
        f"r {r['r']}" if r.get("r", 8) != 8 else "",
        "ckpt" if r["ckpt"] else "",
        f"chunk {r['chunk']}" if r["chunk"] else "",
        "offck" if r["offck"] else "",
        "all4" if len(r["targets"]) == 4 else "",
        r["quantize"] if r.get("quantize", "none") != "none" else "",
        "img" if r["image"] else "",
        f"eval {r['eval_batch']}" if r["eval_batch"] else "",
        f"zero3{'+offload' if r['offload'] else ''}" if r["zero"] else "",
        "" if r["alloc"] == "expandable" else "default alloc",
        r.get("tag", ""),
    ]
    return " ".join(b for b in bits if b)


def table(results: list[dict]) -> str:
    """Estimate vs measured: the whole process (NVML, context included) and torch's allocated peak."""
    from glmtune.plan.estimate import estimate

    lines = [
        "| configuration | est. GiB | NVML GiB | error | est. tensors GiB | alloc GiB | error | reserved/alloc | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {label(r)} | error | | | | | | | |")
            continue
        m = r["measured"]
        peak_nvml = max(p["nvml"] for p in m.values())
        peak_alloc = max(p["allocated"] for p in m.values())
        peak_res = max(p["reserved"] for p in m.values())
        arch, _, _, shape = plan_for(r)  # today's estimator on the row's shape, not the one saved with it
        est = estimate(arch, shape)
        tensors = max(est.phases.values())
        lines.append(
            f"| {label(r)} | {est.peak_bytes / GIB:.2f} | {peak_nvml / GIB:.2f} | {est.peak_bytes / peak_nvml - 1:+.1%} "
            f"| {tensors / GIB:.2f} | {peak_alloc / GIB:.2f} | {tensors / peak_alloc - 1:+.1%} "
            f"| {peak_res / peak_alloc:.3f} | {r['tokens_per_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grid", default="calib", choices=sorted(GRIDS))
    ap.add_argument("--one", help="one configuration as JSON (run in this process)")
    ap.add_argument("--out", default="gpu_memory.jsonl")
    ap.add_argument("--table", help="print the table of a saved results file and exit")
    ap.add_argument("--budget-s", type=float, default=520, help="launch no new configuration after this many seconds")
    args = ap.parse_args()
    if args.table:
        print(table([json.loads(x) for x in Path(args.table).read_text().splitlines() if x.strip()]))
        return
    if args.one:
        print("RESULT " + json.dumps(run_one({**row(), **json.loads(args.one)})), flush=True)
        return
    results = run_grid(args.grid, Path(args.out), args.budget_s)
    print(table(results))


if __name__ == "__main__":
    main()
