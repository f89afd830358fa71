"""Sequence parallelism on CPU: tokens/s and the all-to-all share of a training step at SP 1, 2 and 4.

    python bench/sp_throughput.py [--seq 4096] [--steps 3] [--sizes 1 2 4]

Each SP degree is one real `torchrun --nproc_per_node N` launch on gloo (this file is also the worker). Every
rank builds the same GLM-shaped model — 32 query heads over 2 KV groups like GLM-4-9B, narrower and shallower
so a CPU step takes seconds — and trains fwd + bwd with reentrant checkpointing on its 1/N of one row of
`--seq` tokens (models/kernels/ulysses.py). Times are rank 0's, after one warm-up step:

- step ms: one forward + backward of the whole row (all N ranks in parallel, each on its shard);
- tokens/s: row tokens / step time (the group's), and per process (what one GPU would contribute);
- all-to-all ms and share: time inside the exchanges (the four per block forward, four again in the
  recomputation and four in backward), measured around `all_to_all_single` on rank 0.

On a CPU box the exchanges go through gloo over loopback TCP and N processes share the cores (the printed
cores column): the share here is an upper bound for NVLink GPUs, and the tokens/s says nothing about GPUs.
The GPU rows (one GPU cannot run SP > 1; 1-GPU long rows with tiled MLP) wait in bench/gpu_pending.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# GLM-4-9B's head layout (32 query heads, 2 KV groups, 128-wide heads would be 4096 wide): 32 heads of 32 here.
ARCH = dict(
    num_layers=2,
    hidden_size=1024,
    ffn_hidden_size=2816,
    num_attention_heads=32,
    kv_channels=32,
    multi_query_group_num=2,
    padded_vocab_size=4096,
)


def worker(seq: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from glmtune.models.chatglm.configuration import GLMConfig
    from glmtune.models.chatglm.modeling import ChatGLMForConditionalGeneration
    from glmtune.models.kernels import ulysses
    from glmtune.models.loading import _FAMILY, TINY_ARCH

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spent = [0.0]
    exchange = ulysses._exchange

    def timed(x, sp):  # seconds inside the collective, on this rank
        start = time.perf_counter()
        got = exchange(x, sp)
        spent[0] += time.perf_counter() - start
        return got

    ulysses._exchange = timed
    torch.manual_seed(0)
    config = GLMConfig(**{**TINY_ARCH, **_FAMILY["glm4"], **ARCH}, torch_dtype="float32")
    model = ChatGLMForConditionalGeneration(config).float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.loss_reduction = "sum"
    sp = ulysses.SequenceGroup.of(None) if world > 1 else None
    model.transformer.set_sequence_group(sp)
    ids = torch.randint(0, ARCH["padded_vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    labels = ids  # one process: the model shifts the labels itself
    if sp is not None:  # shifted on the whole row, then cut (train/sequence.py shard_batch)
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        ids, labels = ulysses.shard(ids, sp), ulysses.shard(labels, sp)
    times, exchanges = [], []
    for step in range(steps + 1):
        dist.barrier()
        spent[0], start = 0.0, time.perf_counter()
        model(input_ids=ids, labels=labels).loss.backward()
        dist.barrier()
        if step:  # the first step warms up the allocator and gloo's connections
            times.append(time.perf_counter() - start)
            exchanges.append(spent[0])
        model.zero_grad(set_to_none=True)
    if rank == 0:
        Path(out).write_text(json.dumps(dict(step_s=min(times), exchange_s=exchanges[times.index(min(times))])))
    dist.destroy_process_group()


def launch(size: int, seq: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // size)),
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(size),
                __file__,
                "--worker",
                "--seq",
                str(seq),
                "--steps",
                str(steps),
                "--out",
                str(out),
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        return worker(args.seq, args.steps, args.out)
    import torch

    cores = os.cpu_count() or 1
    print(
        f"# SP on CPU: torch {torch.__version__}, {cores} cores, gloo; model {ARCH}; one row of {args.seq} tokens, "
        f"fp32, reentrant checkpointing; best of {args.steps} steps"
    )
    print("| SP | processes/core | step ms | tokens/s (group) | tokens/s per process | all-to-all ms | share |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        r = launch(size, args.seq, args.steps)
        tps = args.seq / r["step_s"]
        print(
            f"| {size} | {size / cores:.1f} | {r['step_s'] * 1e3:.0f} | {tps:.0f} | {tps / size:.0f} | "
            f"{r['exchange_s'] * 1e3:.0f} | {r['exchange_s'] / r['step_s']:.1%} |"
        )


if __name__ == "__main__":
    main()
