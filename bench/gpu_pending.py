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
    python bench/gpu_pending.py --part 0414  # GLM-4-0414 (issue 41): 9B and 32B bf16, 32B nf4 under a 24 GB cap
                                             # (estimate vs measured, bench/gpu_memory.py --grid 0414), then
                                             # 9B-0414 through the command: probe + 3 steps at 8K, 40 GB card
    python bench/gpu_pending.py --part rehearse  # issue 42: rank 0 of glm-4-9b-chat's plans rehearsed on this GPU:
                                             # 8K on 2 x 80 GB (SP 2 over DDP), 64K on 2 x 24 GB, 128K on 4 x 24 GB;
                                             # planned vs rehearsed per phase (--rows 4: 512K on 8 x 80 GB, one
                                             # step, ~5 minutes)
    python bench/gpu_pending.py --part qlora     # issue 42: nf4 and int8 bases of glm-4-9b-chat and GLM-4V probed
                                             # on a 24 GB cap, planned vs measured per phase
    python bench/gpu_pending.py --part docattn   # issue 42: per-document attention vs the dense mask on GLM-4-9B
                                             # blocks (bench/doc_attention.py): time and memory by row length,
                                             # and the DENSE_MASK_MAX they suggest
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
from gpu_rehearse import docattn_steps, phase_rows, qlora_steps, rehearse_steps

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PART_LIMIT_S = 540  # 9 minutes per call
# Issue 42's parts share one device call with every other issue's: ~2-3 minutes each on an H200 (the 512K
# rehearsal alone, --rows 4, takes the whole 540 s).
LIMITS = {"rehearse": 290, "qlora": 240, "docattn": 150}


def steps(part: str, tiny: bool, work: Path, rows: str | None = None) -> list[tuple[str, list[str], int]]:
    """(title, command, time limit in s) for one part."""
    py, glmtune = [sys.executable], [sys.executable, "-m", "glmtune"]
    if part == "0414":
        return steps_0414(tiny, work, py, glmtune)
    if part == "rehearse":
        return rehearse_steps(tiny, work, rows)
    if part == "qlora":
        return qlora_steps(tiny, work)
    if part == "docattn":
        return docattn_steps(tiny)
    part = int(part)
    if part == 1:
        if tiny:  # the grid needs CUDA; on CPU the table code runs on the recorded rows
            return [
                (
                    "memory grid (recorded rows, CPU)",
                    py + [str(BENCH / "gpu_memory.py"), "--table", str(BENCH / "gpu_calib_2026-11-23.jsonl")],
                    120,
                )
            ]
        return [
            (
                "held-out memory grid",
                py
                + [
                    str(BENCH / "gpu_memory.py"),
                    "--grid",
                    "check",
                    "--out",
                    str(work / "check.jsonl"),
                    "--budget-s",
                    "470",
                ],
                530,
            )
        ]
    if part == 2:
        # Random bf16 weights of glm-4-9b-chat beside the tiny tokenizer files (tiny: the tiny model itself).
        ckpt = checkpoint("glm4_9b_chat", "glm4", work, tiny, timeout=PART_LIMIT_S)
        data = long_conversations(work / "long.jsonl", 8, 300 if tiny else 6000)
        length, steps_n = (256, 2) if tiny else (8192, 20)
        card = [] if tiny else ["+hw=rtx4090_24g"]  # on an H100 the probe caps the allocator at the 24 GB card
        quant = py + [
            str(BENCH / "quantized.py"),
            "--ckpt",
            str(work / "ckpt-tiny" if tiny else ckpt),
            "--modes",
            "bf16,int8,nf4",
        ]
        quant += ["--tiny", "--lengths", "32", "--steps", "1"] if tiny else ["--lengths", "2048,8192", "--steps", "2"]
        return [
            ("quantized bases: memory and tokens/s", quant, 60 if tiny else 250),
            (
                f"probe + {steps_n} steps at {length} tokens{'' if tiny else ' under the emulated 24 GB card'}",
                glmtune
                + [
                    "model=glm4_9b_chat" if not tiny else "model=glm4_tiny",
                    f"model.path={ckpt}",
                    *card,
                    f"data.train_file={data}",
                    f"data.val_file={data}",
                    f"data.max_length={length}",
                    f"train.max_steps={steps_n}",
                    "train.logging_steps=1",
                    "train.save_minutes=0",
                    f"hydra.run.dir={work / 'probe-run'}",
                ],
                240 if tiny else 280,
            ),
        ]
    if part == 4:  # one GPU cannot run SP > 1: the 1-GPU rows of issue 30 (tiled MLP, checkpoint offload)
        ckpt = checkpoint("glm4_9b_chat", "glm4", work, tiny, timeout=PART_LIMIT_S)
        data = long_conversations(work / "longest.jsonl", 2, 400 if tiny else 70000)  # cut to each length
        out = []
        for length, steps_n, limit in [(256, 2, 120), (512, 1, 120)] if tiny else [(65536, 2, 200), (131072, 1, 290)]:
            out.append(
                (
                    f"probe + {steps_n} step(s) at {length} tokens, tiled MLP on",
                    glmtune
                    + [
                        "model=glm4_tiny" if tiny else "model=glm4_9b_chat",
                        f"model.path={ckpt}",
                        *([] if tiny else ["+hw=h100_80g"]),
                        "train.tiled_mlp=on",
                        f"data.train_file={data}",
                        "data.val_file=null",
                        f"data.max_length={length}",
                        f"train.max_steps={steps_n}",
                        "train.logging_steps=1",
                        "train.save_minutes=0",
                        "train.report_to=[]",
                        f"hydra.run.dir={work / f'long-{length}'}",
                    ],
                    limit,
                )
            )
        return out
    if tiny:
        return [
            (
                "throughput: compile and packing on demo-like data",
                py
                + [
                    str(BENCH / "throughput.py"),
                    "--tiny",
                    "--cases",
                    "demo",
                    "--steps",
                    "1",
                    "--warmup",
                    "1",
                    "--compile",
                    "off",
                ],
                240,
            ),
            (
                "generation speed",
                py + [str(BENCH / "generate_speed.py"), "--tiny", "--prompt-len", "8", "--new-tokens", "2"],
                120,
            ),
        ]
    return [
        (
            "throughput: compile and packing on demo-like data",
            py
            + [
                str(BENCH / "throughput.py"),
                "--cases",
                "demo",
                "--steps",
                "8",
                "--warmup",
                "3",
                "--compile",
                "off,on",
                "--attention",
                "sdpa,flex",
            ],
            380,
        ),
        ("generation speed", py + [str(BENCH / "generate_speed.py")], 150),
    ]


def steps_0414(tiny: bool, work: Path, py: list[str], glmtune: list[str]) -> list[tuple[str, list[str], int]]:
    """GLM-4-0414 (issue 41), within ~4 minutes on an H200: the memory rows need no disk (32B's 65 GB would not
    fit the machine's 64 GiB): random weights made on the GPU, nf4 quantized as they are made. Then 9B-0414 through
    the command on a random bf16 checkpoint written from the GPU (18.8 GB) with the tiny 0414 tokenizer beside it.
    On CPU (--tiny): the 32B plans, and the command on the tiny 0414 model."""
    if tiny:
        plans = [
            (f"plan: 32B {' '.join(extra)}", glmtune + ["mode=plan", "model=glm4_32b_0414", *extra], 60)
            for extra in (["+hw=a100_80g"], ["+hw=rtx4090_24g", "model.quantize=nf4"])
        ]
        ckpt, card, length, steps_n = checkpoint("glm4_0414_tiny", "glm4_0414", work, True), [], 256, 2
    else:
        plans = [
            (
                "memory: 9B-0414 and 32B-0414 bf16, 32B nf4 under a 24 GB cap (estimate vs measured)",
                py
                + [
                    str(BENCH / "gpu_memory.py"),
                    "--grid",
                    "0414",
                    "--out",
                    str(work / "0414.jsonl"),
                    "--budget-s",
                    "120",
                ],
                150,
            )
        ]
        ckpt = checkpoint("glm4_9b_0414", "glm4_0414", work, False, 120)
        card, length, steps_n = ["+hw=a100_40g"], 8192, 3
    data = long_conversations(work / "data-0414.jsonl", 8, 300 if tiny else 6000)
    return plans + [
        (
            f"9B-0414: probe + {steps_n} steps at {length} tokens{'' if tiny else ', 40 GB card'}",
            glmtune
            + [
                "model=glm4_9b_0414",
                f"model.path={ckpt}",
                *card,
                f"data.train_file={data}",
                "data.val_file=null",
                f"data.max_length={length}",
                f"train.max_steps={steps_n}",
                "train.logging_steps=1",
                "train.save_minutes=0",
                "train.report_to=[]",
                f"hydra.run.dir={work / 'probe-run'}",
            ],
            120 if tiny else 110,
        )
    ]


def header() -> str:
    import torch

    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    driver = "-"
    if torch.cuda.is_available():
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        driver = out.stdout.strip() or "-"
    from glmtune.config.cli import installed_version as installed

    versions = ", ".join(f"{n} {installed(n)}" for n in ("torch", "transformers", "peft", "deepspeed", "bitsandbytes"))
    return f"{date.today().isoformat()}, {device}, driver {driver}; {versions}"


def run_part(part: str, tiny: bool, work: Path, rows: str | None = None) -> int:
    work.mkdir(parents=True, exist_ok=True)
    for old in [work / "probe-run", *work.glob("long-*"), *work.glob("rehearse-*"), *work.glob("qlora-*")]:
        shutil.rmtree(old, ignore_errors=True)  # each call measures fresh runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    budget = PART_LIMIT_S if part == "rehearse" and rows and "4" in rows.split(",") else LIMITS.get(part, PART_LIMIT_S)
    t0, failures, report = (
        time.perf_counter(),
        0,
        [f"## gpu_pending part {part}{' (tiny, CPU)' if tiny else ''}: {header()}"],
    )
    for title, command, limit in steps(part, tiny, work, rows):
        left = budget - (time.perf_counter() - t0)
        if left < 30:
            report += [f"### {title}: skipped, the part's {budget} s are spent"]
            failures += 1
            continue
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=min(limit, left))
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = (
                "timeout",
                (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or "",
                "",
            )
        seconds = time.perf_counter() - start
        rows = [
            line
            for line in out.splitlines()
            if line.startswith(("|", "done in ", "suggested ", "  peak ", "  adapter saved"))
        ]
        report += [
            f"### {title} ({seconds:.0f} s, exit {rc})",
            "`" + " ".join(Path(c).name if c.startswith("/") else c for c in command) + "`",
            *rows,
        ]
        if rc != 0:
            failures += 1
            report += ["    " + line for line in (err or out).strip().splitlines()[-15:]]
    for run_dir in (
        [work / "probe-run"] if part in ("2", "0414") else sorted(work.glob("long-*")) if part == "4" else []
    ):
        probe = run_dir / "probe.json"  # the probe's attempts: planned vs measured peak
        if probe.is_file():
            report.append(
                f"{run_dir.name} probe attempts: " + json.dumps(json.loads(probe.read_text()).get("attempts", []))
            )
    if part in ("rehearse", "qlora"):  # planned vs rehearsed (or measured) peak, phase by phase
        report += ["", *phase_rows(sorted(p for p in work.glob(f"{part}-*") if p.is_dir()))]
    if part == "qlora" and not tiny:  # GLM-4V's 28 GB checkpoint: the disk is shared with the other parts
        shutil.rmtree(work / "ckpt-glm4v_9b", ignore_errors=True)
    print("\n".join(report), flush=True)
    return 1 if failures else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part", choices=("1", "2", "3", "4", "cli", "0414", "rehearse", "qlora", "docattn"), required=True
    )
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny model: every step of the part, small")
    ap.add_argument("--rows", default=None, help="--part rehearse: which rows, e.g. 1,2,3 (default) or 4 (512K)")
    ap.add_argument(
        "--work", default=None, help="scratch folder (checkpoint, data, run dirs); default /tmp/glmtune-pending"
    )
    args = ap.parse_args()
    work = Path(args.work or f"/tmp/glmtune-pending{'-tiny' if args.tiny else ''}")
    if args.part == "cli":
        from gpu_cli import run_cli

        sys.exit(run_cli(args.tiny, work, header()))
    rows = args.rows or ("1,2,3" if args.part == "rehearse" and not args.tiny else None)
    sys.exit(run_part(args.part, args.tiny, work, rows))


if __name__ == "__main__":
    main()
