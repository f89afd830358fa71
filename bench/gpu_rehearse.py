"""GPU rows of issue 42 for bench/gpu_pending.py: multi-GPU plans rehearsed on one GPU capped like each card
(`--part rehearse`), QLoRA bases on a 24 GB cap (`--part qlora`), per-document attention (`--part docattn`).

Each row is the user's own command, `python -m glmtune mode=probe ...` in its own process, on random-weight
checkpoints of the released architectures with glmtune's tiny tokenizer files (the probe's worst-case rows are
token ids). `+hw=` on a larger GPU caps the allocator at that card's memory less the context (probe/probe.py
emulate_card), so a row fails where the card would. A rehearsal row runs rank 0 of `dist.nproc_per_node` GPUs
on this one GPU (probe/rehearse.py); its phase table is the plan's estimate of each phase (planned) against the
rehearsed or measured peak: the whole process, NCCL's communicator added by name in a rehearsal.

`--tiny` runs the same rows on CPU with the tiny models at short lengths, so the driver itself is tested.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpu_cli import checkpoint, long_conversations

BENCH = Path(__file__).resolve().parent
GIB = 2**30
# (title, overrides, GPUs, tokens, probe steps, time limit s): cheapest first. Rank 0's step time on an H200, from
# FLOPs (flash attention ~400 TFLOP/s, 9.4B parameters x 6 per local token): 8K on 2 ranks under 1 s a step (the
# row checks DDP and the all-to-alls on CUDA: the 24 GB rows run ZeRO-3), 64K on 2 ranks ~10 s, 128K on 4 ~20 s;
# the 512K row is ~4 minutes for its one step (attention over 524,288 positions for 8 heads, 40 layers).
REHEARSALS = [
    ("8K on 2 x 80 GB, SP 2 over DDP", ["+hw=a100_80g", "dist.sequence_parallel=2"], 2, 8192, 2, 60),
    ("64K on 2 x 24 GB", ["+hw=rtx4090_24g"], 2, 65536, 2, 100),
    ("128K on 4 x 24 GB", ["+hw=rtx4090_24g"], 4, 131072, 2, 130),
    ("512K on 8 x 80 GB", ["+hw=a100_80g"], 8, 524288, 1, 330),
]
# The tiny model fits a whole row anywhere: its rows take the 9B plans' layouts (SP over DDP; ZeRO-3 over the
# ranks with every rank one row's 1/N), so the same code runs.
TINY_REHEARSALS = [
    ("128 on 2 ranks, SP 2 over DDP", ["dist.sequence_parallel=2"], 2, 128, 2, 60),
    ("256 on 2 ranks", ["dist.strategy=zero3", "dist.sequence_parallel=2"], 2, 256, 2, 120),
    ("512 on 4 ranks", ["dist.strategy=zero3", "dist.sequence_parallel=4"], 4, 512, 2, 120),
]
QLORA = [
    ("glm4_9b_chat", "glm4", "nf4", 8192),
    ("glm4_9b_chat", "glm4", "int8", 8192),
    ("glm4v_9b", "glm4v", "nf4", 2048),
    ("glm4v_9b", "glm4v", "int8", 2048),
]
WORDS_PER_TOKEN = 1 / 3.6  # the tiny tokenizer cuts long_conversations' words into ~3.7 tokens each


def _run(preset: str, ckpt: Path, run_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "glmtune",
        "mode=probe",
        f"model={preset}",
        f"model.path={ckpt}",
        *args,
        "data.val_file=null",
        "train.report_to=[]",
        f"hydra.run.dir={run_dir}",
    ]


def rehearse_steps(tiny: bool, work: Path, rows: str | None = None) -> list[tuple[str, list[str], int]]:
    """glm-4-9b-chat's long-context plans, rank 0 of each rehearsed on this one device. rows: '1,2' runs those."""
    ckpt = checkpoint("glm4_9b_chat", "glm4", work, tiny, timeout=300)
    preset = "glm4_tiny" if tiny else "glm4_9b_chat"
    steps = []
    for i, (title, layout, gpus, tokens, probe_steps, limit) in enumerate(TINY_REHEARSALS if tiny else REHEARSALS, 1):
        if rows and str(i) not in rows.split(","):
            continue
        data = long_conversations(work / f"rows-{tokens}.jsonl", 2, int(tokens * WORDS_PER_TOKEN) + 50)
        steps.append(
            (
                f"rehearsal: {title}",
                _run(
                    preset,
                    ckpt,
                    work / f"rehearse-{i}",
                    *layout,
                    f"dist.nproc_per_node={gpus}",
                    f"data.train_file={data}",
                    f"data.max_length={tokens}",
                    f"probe.steps={probe_steps}",
                ),
                limit,
            )
        )
    return steps


def qlora_steps(tiny: bool, work: Path) -> list[tuple[str, list[str], int]]:
    """nf4 and int8 bases of glm-4-9b-chat and GLM-4V under the 24 GB card's cap (one GPU, no rehearsal)."""
    data = long_conversations(work / "qlora.jsonl", 2, 2400)  # ~8.8K tokens, cut to each row's length
    steps = []
    for preset, family, quant, tokens in QLORA:
        ckpt = checkpoint(preset, family, work, tiny, timeout=300)
        tiny_preset = {"glm4_9b_chat": "glm4_tiny", "glm4v_9b": "glm4v_tiny"}[preset]
        card = [] if tiny else ["+hw=rtx4090_24g"]
        length = 256 if tiny else tokens
        steps.append(
            (
                f"QLoRA {quant}: {tiny_preset if tiny else preset} at {length} tokens"
                f"{'' if tiny else ' on a 24 GB cap'}",
                _run(
                    tiny_preset if tiny else preset,
                    ckpt,
                    work / f"qlora-{preset}-{quant}",
                    *card,
                    f"model.quantize={quant}",
                    f"data.train_file={data}",
                    f"data.max_length={length}",
                ),
                60 if tiny else 100,
            )
        )
    return steps


def docattn_steps(tiny: bool) -> list[tuple[str, list[str], int]]:
    script = [sys.executable, str(BENCH / "doc_attention.py")]
    if tiny:
        return [
            (
                "per-document attention vs the dense mask (tiny, CPU)",
                script + ["--lengths", "256,512", "--docs", "128", "--steps", "1"],
                120,
            )
        ]
    return [
        (
            "per-document attention vs the dense mask: GLM-4-9B blocks, bf16, CUDA",
            script
            + [
                "--model",
                "glm4_9b",
                "--layers",
                "2",
                "--lengths",
                "2048,4096,8192,16384,32768",
                "--docs",
                "512,2048",
                "--steps",
                "2",
            ],
            140,
        )
    ]


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}" if value >= GIB else f"{value / GIB:.4f}"


def phase_rows(run_dirs: list[Path]) -> list[str]:
    """Markdown rows per probed run: each attempt's phases, planned (the estimate) against measured or rehearsed."""
    out = [
        "| run | ranks | attempt | levers | phase | planned GiB | measured GiB | error | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run_dir in run_dirs:
        probe = run_dir / "probe.json"
        if not probe.is_file():
            out.append(f"| {run_dir.name} | - | - | - | - | - | no probe.json | - | - |")
            continue
        report = json.loads(probe.read_text())
        ranks = f"{report['rehearsed']} rehearsed" if report.get("rehearsed") else "1"
        for i, attempt in enumerate(report["attempts"], 1):
            detail, c = attempt["detail"], attempt["choices"]
            levers = (
                f"SP {c.get('sequence_parallel', 1)}, {'ZeRO-3' if c['zero_stage'] == 3 else 'no ZeRO'}, "
                f"mb {c['micro_batch_size']}x{c['grad_accum']}, ckpt {'on' if c['gradient_checkpointing'] else 'off'}"
                f", chunk {c['loss_chunk_tokens']}"
                + (", offload ckpt" if c.get("offload_checkpoints") else "")
                + (f", MLP tiles {c['mlp_tile_tokens']}" if c.get("mlp_tile_tokens") else "")
            )
            planned, measured = detail.get("predicted_phase_peak_bytes") or {}, detail.get("phase_peak_bytes") or {}
            for phase in sorted(set(planned) | set(measured)):
                p, m = planned.get(phase), measured.get(phase)
                err = f"{p / m - 1:+.1%}" if p and m else "-"
                out.append(
                    f"| {run_dir.name} | {ranks} | {i} | {levers} | {phase} | "
                    f"{_gib(p)} | {_gib(m)} | "
                    f"{err} | {attempt['outcome']} |"
                )
            if not measured:
                out.append(
                    f"| {run_dir.name} | {ranks} | {i} | {levers} | {detail.get('phase', '-')} | - | - | - | "
                    f"{attempt['outcome']} |"
                )
        added = (report.get("rehearsal") or {}).get("added_terms") or {}
        if added:
            out.append(
                f"| {run_dir.name} | added to each phase: "
                + "; ".join(f"{k} {v / GIB:.2f} GiB" for k, v in added.items())
                + " | | | | | | | |"
            )
    return out
