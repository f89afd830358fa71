"""Every GPU measurement the plan still rests on without one, in three calls of at most 9 minutes on an H100.

    python bench/gpu_pending.py --part 1     # held-out memory grid (bench/gpu_memory.py --grid check)
    python bench/gpu_pending.py --part 2     # nf4/int8/bf16 rows (bench/quantized.py), then mode=train with its
                                             # probe + 20 steps of glm-4-9b-chat at 8K under the emulated 24 GB card
    python bench/gpu_pending.py --part 3     # compile and packing on/off (bench/throughput.py, demo-like data),
                                             # generation speed (bench/generate_speed.py)
    python bench/gpu_pending.py --part cli   # the user's commands (issue 33): each run's exit, plan, probe and
                                             # per-phase peaks on random-weight checkpoints (bench/gpu_cli.py)
    python bench/gpu_pending.py --part 4     # long context on one GPU (issue 30): glm-4-9b-chat at 64K and 128K
                                             # with the tiled MLP, probe + steps, planned vs measured peak
    python bench/gpu_pending.py --tiny --part N   # the same steps on CPU with the tiny model (the test suite)

Each step is the existing bench script (or the glmtune command) in its own process with its own time limit, so
one failure or overrun does not lose the others; their table rows are printed together at the end under a
header (date, device, driver, versions) ready for bench/RESULTS.md. Weights are random (memory and speed do not
depend on their values): part 2 writes a bf16 checkpoint of the released architecture once (~18 GB, with
glmtune's tiny tokenizer files: the probe's worst-case rows are token ids, not text) under --work.

What each part settles (issue 22): part 1, the estimator's tensor and reserve terms on shapes never used to fit
them; part 2, quantized bases on a GPU and the probe's 24 GB emulation at 8K against a plan with 0.3 GiB of
headroom; part 3, whether compiled blocks / FlexAttention may become `auto` (glmtune/train/compile.py
MEASURED_COMPILE / MEASURED_FLEX take the device name only with such a row) and the KV cache of generation.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from gpu_cli import checkpoint, long_conversations  # bench/ is on sys.path when this script runs

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PART_LIMIT_S = 540  # 9 minutes per call


def steps(part: int, tiny: bool, work: Path) -> list[tuple[str, list[str], int]]:
    """(title, command, time limit in s) for one part."""
    py, glmtune = [sys.executable], [sys.executable, "-m", "glmtune"]
    if part == 1:
        if tiny:  # the grid needs CUDA; on CPU the table code runs on the recorded rows
            return [("memory grid (recorded rows, CPU)",
                     py + [str(BENCH / "gpu_memory.py"), "--table", str(BENCH / "gpu_calib_2026-11-23.jsonl")], 120)]
        return [("held-out memory grid", py + [str(BENCH / "gpu_memory.py"), "--grid", "check", "--out",
                                              str(work / "check.jsonl"), "--budget-s", "470"], 530)]
    if part == 2:
        # Random bf16 weights of glm-4-9b-chat beside the tiny tokenizer files (tiny: the tiny model itself).
        ckpt = checkpoint("glm4_9b_chat", "glm4", work, tiny, timeout=PART_LIMIT_S)
        data = long_conversations(work / "long.jsonl", 8, 300 if tiny else 6000)
        length, steps_n = (256, 2) if tiny else (8192, 20)
        card = [] if tiny else ["+hw=rtx4090_24g"]  # on an H100 the probe caps the allocator at the 24 GB card
        quant = py + [str(BENCH / "quantized.py"), "--ckpt", str(work / "ckpt-tiny" if tiny else ckpt),
                      "--modes", "bf16,int8,nf4"]
        quant += ["--tiny", "--lengths", "32", "--steps", "1"] if tiny else ["--lengths", "2048,8192", "--steps", "2"]
        return [("quantized bases: memory and tokens/s", quant, 60 if tiny else 250),
                (f"probe + {steps_n} steps at {length} tokens{'' if tiny else ' under the emulated 24 GB card'}",
                 glmtune + ["model=glm4_9b_chat" if not tiny else "model=glm4_tiny", f"model.path={ckpt}", *card,
                            f"data.train_file={data}", f"data.val_file={data}", f"data.max_length={length}",
                            f"train.max_steps={steps_n}", "train.logging_steps=1", "train.save_minutes=0",
                            f"hydra.run.dir={work / 'probe-run'}"], 240 if tiny else 280)]
    if part == 4:  # one GPU cannot run SP > 1: the 1-GPU rows of issue 30 (tiled MLP, checkpoint offload)
        ckpt = checkpoint("glm4_9b_chat", "glm4", work, tiny, timeout=PART_LIMIT_S)
        data = long_conversations(work / "longest.jsonl", 2, 400 if tiny else 70000)  # cut to each length
        out = []
        for length, steps_n, limit in ([(256, 2, 120), (512, 1, 120)] if tiny else [(65536, 2, 200), (131072, 1, 290)]):
            out.append((f"probe + {steps_n} step(s) at {length} tokens, tiled MLP on",
                        glmtune + ["model=glm4_tiny" if tiny else "model=glm4_9b_chat", f"model.path={ckpt}",
                                   *([] if tiny else ["+hw=h100_80g"]), "train.tiled_mlp=on", f"data.train_file={data}",
                                   "data.val_file=null", f"data.max_length={length}", f"train.max_steps={steps_n}",
                                   "train.logging_steps=1", "train.save_minutes=0", "train.report_to=[]",
                                   f"hydra.run.dir={work / f'long-{length}'}"], limit))
        return out
    if tiny:
        return [("throughput: compile and packing on demo-like data",
                 py + [str(BENCH / "throughput.py"), "--tiny", "--cases", "demo", "--steps", "1", "--warmup", "1",
                       "--compile", "off"], 240),
                ("generation speed", py + [str(BENCH / "generate_speed.py"), "--tiny", "--prompt-len", "8",
                                           "--new-tokens", "2"], 120)]
    return [("throughput: compile and packing on demo-like data",
             py + [str(BENCH / "throughput.py"), "--cases", "demo", "--steps", "8", "--warmup", "3",
                   "--compile", "off,on", "--attention", "sdpa,flex"], 380),
            ("generation speed", py + [str(BENCH / "generate_speed.py")], 150)]


def header() -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    driver = "-"
    if torch.cuda.is_available():
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        driver = out.stdout.strip() or "-"
    from glmtune.config.cli import installed_version as installed

    versions = ", ".join(f"{n} {installed(n)}" for n in ("torch", "transformers", "peft", "deepspeed", "bitsandbytes"))
    return f"{date.today().isoformat()}, {device}, driver {driver}; {versions}"


def run_part(part: int, tiny: bool, work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    for old in [work / "probe-run", *work.glob("long-*")]:  # each call measures fresh runs
        shutil.rmtree(old, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0, failures, report = time.perf_counter(), 0, [f"## gpu_pending part {part}{' (tiny, CPU)' if tiny else ''}: "
                                                      f"{header()}"]
    for title, command, limit in steps(part, tiny, work):
        left = PART_LIMIT_S - (time.perf_counter() - t0)
        if left < 30:
            report += [f"### {title}: skipped, the part's {PART_LIMIT_S} s are spent"]
            failures += 1
            continue
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=min(limit, left))
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = "timeout", (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or "", ""
        seconds = time.perf_counter() - start
        rows = [line for line in out.splitlines() if line.startswith(("|", "done in ", "  peak ", "  adapter saved"))]
        report += [f"### {title} ({seconds:.0f} s, exit {rc})", "`" + " ".join(Path(c).name if c.startswith("/")
                                                                            else c for c in command) + "`", *rows]
        if rc != 0:
            failures += 1
            report += ["    " + line for line in (err or out).strip().splitlines()[-15:]]
    for run_dir in ([work / "probe-run"] if part == 2 else sorted(work.glob("long-*")) if part == 4 else []):
        probe = run_dir / "probe.json"  # the probe's attempts: planned vs measured peak
        if probe.is_file():
            report.append(f"{run_dir.name} probe attempts: "
                          + json.dumps(json.loads(probe.read_text()).get("attempts", [])))
    print("\n".join(report), flush=True)
    return 1 if failures else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("1", "2", "3", "4", "cli"), required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny model: every step of the part, small")
    ap.add_argument("--work", default=None, help="scratch folder (checkpoint, data, run dirs); default /tmp/glmtune-pending")
    args = ap.parse_args()
    work = Path(args.work or f"/tmp/glmtune-pending{'-tiny' if args.tiny else ''}")
    if args.part == "cli":
        from gpu_cli import run_cli

        sys.exit(run_cli(args.tiny, work, header()))
    sys.exit(run_part(int(args.part), args.tiny, work))


if __name__ == "__main__":
    main()
