"""How long can examples be? The longest data.max_length the planner fits, per model, base dtype, GPU count and card.

    python bench/length_table.py            # the README's table (markdown), ~1 min on one CPU core
    python bench/length_table.py --detail   # one row per cell: SP degree, rungs, host RAM, tokens/s
    python bench/length_table.py --models glm4_9b_0414 glm4_32b_0414   # some rows only

No GPU and no weights: every cell is `plan.planner.make_plan` called in-process, exactly as `mode=plan` plans
(LoRA r 8 on query_key_value, i.e. q/k/v_proj on GLM-4-0414;
micro-batch 1, no evaluation set, the preset's hw.margin and host RAM), with a
binary search over data.max_length in multiples of 1,024 up to 1M tokens (">= 1024K": the search's top). GPUs
beyond hw.gpus_per_node are whole nodes (8 RTX 4090s: 2 nodes of 4); host RAM is per node. dist.sequence_parallel
is auto, so a cell names the smallest sequence-parallel degree that fits. A length that fits is what the
estimator promises; the probe measures it before a real run. Evaluation is left out: it scores whole rows
without sequence parallelism (train/sequence.py), so a run with a val set needs its own `mode=plan`.

Estimated tokens/s (whole job) is a model, not a measurement. It rests on the H100 rows of bench/RESULTS.md §0
(glm-4-9b-chat, checkpointing, chunked loss, batch 1): 6,363 tokens/s at 8K and 4,486 at 32K, fitted as
seconds per token = 1.352e-4 + 2.68e-9 x length (the attention term; it predicts the measured 16K row, 5,584, to
0.1 %), scaled by parameter count for the other models and by datasheet dense bf16 TFLOP/s for the other cards
(A100 312, RTX 4090 165, H100 989). Rungs multiply it as measured there: pinned checkpoint offload x 0.88,
a 256-token loss chunk x 0.99; ZeRO-3 adds 1.64 s per micro-step (its 2K row: 1,050 vs 6,656 tokens/s); each
sequence-parallel all-to-all moves (heads + KV rows) x head size x 2 B per local token, in forward, recompute and
backward, at 150 GB/s (NVLink) or 12 GB/s (PCIe, no peer-to-peer on RTX 4090). nf4 is counted at the bf16 rate
(its dequantization is not measured on a GPU yet): treat those figures as an upper bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.config import DataConfig, DistConfig, ModelConfig, RunConfig  # noqa: E402
from glmtune.config.units import GIB  # noqa: E402
from glmtune.models import released_config  # noqa: E402
from glmtune.plan.advice import hw_presets  # noqa: E402
from glmtune.plan.archsize import frozen_params  # noqa: E402
from glmtune.plan.planner import make_plan  # noqa: E402

MODELS = ("glm4_9b_chat", "glm4v_9b", "chatglm3_6b", "glm4_9b_0414", "glm4_32b_0414")
BASES = ("none", "nf4")
GPUS = (1, 2, 4, 8)
CARDS = ("rtx4090_24g", "a100_40g", "a100_80g")
STEP = 1024
TOP = 1024  # x STEP: 1M tokens
TFLOPS = {"rtx4090_24g": 165, "a100_40g": 312, "a100_80g": 312, "h100_80g": 989}
LINK_BYTES_S = {"nvlink": 150e9, "pcie": 12e9}
H100_A, H100_B = 1.352e-4, 2.68e-9  # s per token at length L: A + B x L (module docstring)
GLM4_PARAMS = frozen_params(released_config("glm4_9b_chat"))


def plan_at(name: str, base: str, gpus: int, card: str, length: int):
    hw = hw_presets()[card]
    nodes = -(-gpus // hw.gpus_per_node)  # 8 RTX 4090s are 2 nodes of 4: each node's RAM holds its own ranks
    run = RunConfig(
        model=ModelConfig(name=name, quantize=base),
        hw=hw,
        data=DataConfig(max_length=length, val_file=None),
        dist=DistConfig(nnodes=nodes, nproc_per_node=gpus // nodes),
    )
    return make_plan(run, released_config(name), gpus, True, advice=False)


def longest(name: str, base: str, gpus: int, card: str):
    """(length, plan) of the longest multiple of STEP that fits, or (0, None)."""
    lo, hi, best = 1, TOP, (0, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = plan_at(name, base, gpus, card, mid * STEP)
        if plan.fits:
            best, lo = (mid * STEP, plan), mid + 1
        else:
            hi = mid - 1
    return best


def rungs(c) -> str:
    on = [
        ("ckpt", c.gradient_checkpointing),
        (f"chunk {c.loss_chunk_tokens}", c.loss_chunk_tokens),
        ("offload", c.offload_checkpoints),
        ("ZeRO-3", c.zero_stage == 3),
        ("tiled MLP", getattr(c, "mlp_tile_tokens", 0)),
    ]  # branch tiledmlp's rung, where merged
    return ", ".join(n for n, v in on if v) or "none"


def tokens_per_s(name: str, card: str, length: int, c) -> float:
    """The whole job's tokens/s under the model in the module docstring."""
    arch, hw = released_config(name), hw_presets()[card]
    scale = (GLM4_PARAMS / frozen_params(arch)) * TFLOPS[card] / TFLOPS["h100_80g"]
    per_token = (H100_A + H100_B * length) / scale  # one GPU computing the whole row
    factor = (0.88 if c.offload_checkpoints else 1.0) * (0.99 if c.loss_chunk_tokens == 256 else 1.0)
    n = c.sequence_parallel
    step = length * per_token / n / factor  # the row's compute split over its N ranks
    if c.zero_stage == 3:
        step += 1.64
    if n > 1:
        rows = max(arch.kv_groups, n)
        moved = 2 * (length / n) * (arch.num_attention_heads + rows) * arch.kv_channels * (n - 1) / n
        step += 3 * arch.num_layers * moved / LINK_BYTES_S.get(hw.interconnect, LINK_BYTES_S["pcie"])
    return length * c.world_size / step


def cell(name: str, base: str, gpus: int, card: str) -> dict:
    length, plan = longest(name, base, gpus, card)
    if plan is None:
        return {"length": 0}
    c = plan.choices
    return {
        "length": length,
        "sp": c.sequence_parallel,
        "rungs": rungs(c),
        "host": plan.host["bytes"] / GIB if plan.host else 0.0,
        "tps": tokens_per_s(name, card, length, c),
    }


def short(n: int) -> str:
    return "-" if n == 0 else f"{'>= ' if n >= TOP * STEP else ''}{n // 1024}K"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--detail", action="store_true", help="one row per cell instead of the README's grid")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="rows of these presets only")
    args = ap.parse_args()
    models = args.models
    cells = {(m, b, g, k): cell(m, b, g, k) for m in models for b in BASES for k in CARDS for g in GPUS}
    if args.detail:
        print("| model | base | card | GPUs | longest max_length | SP | rungs | host GiB/node | est. tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (m, b, g, k), x in cells.items():
            if x["length"]:
                print(
                    f"| {m} | {b} | {k} | {g} | {x['length']:,} | {x['sp']} | {x['rungs']} | {x['host']:.0f} | "
                    f"{x['tps']:,.0f} |"
                )
            else:
                print(f"| {m} | {b} | {k} | {g} | does not fit | - | - | - | - |")
        return
    print("| model | base | card | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in GPUS) + " |")
    print("|---|---|---|" + "---|" * len(GPUS))
    for m in models:
        for b in BASES:
            for k in CARDS:
                row = []
                for g in GPUS:
                    x = cells[(m, b, g, k)]
                    row.append(
                        "-"
                        if not x["length"]
                        else f"{short(x['length'])} SP{x['sp']}, {x['host']:.0f} GiB host, {x['tps']:,.0f} tok/s"
                    )
                print(f"| {m} | {'bf16' if b == 'none' else b} | {k} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
