"""Packed-row attention on CPU: the dense block-diagonal mask (sdpa) against per-document SDPA (segments).

    python bench/doc_attention.py                          # lengths 1,024-16,384, documents of 512 positions
    python bench/doc_attention.py --lengths 2048,8192 --doc 1024 --steps 5

The suite's tiny GLM-4 (2 blocks, hidden 64, 4 heads over 2 KV groups, fp32: attention is most of a step at these
lengths) runs forward + backward on one packed row of `length` positions cut into documents of `--doc` positions
(the last one shorter), through the model's own forward (modeling_glm4.ChatGLMModel) with
train.packed_attention forced to each path. Printed per row: the
median step time of `--steps` timed steps after one warm-up (the paths take turns), and the dense mask's bytes (B x S^2, bool; SDPA's
bias made of it, in the compute dtype per block, comes on top). The segments path has no [seq, seq] tensor.
What DENSE_MASK_MAX (models/docattention.py) rests on; results: bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from glmtune.models.chatglm.configuration import GLMConfig
from glmtune.models.loading import _FAMILY, TINY_ARCH
from glmtune.models.chatglm.modeling import ChatGLMForConditionalGeneration

VOCAB = 128


def packed_row(length: int, doc: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    seq, pos = torch.empty(1, length, dtype=torch.long), torch.empty(1, length, dtype=torch.long)
    for i, start in enumerate(range(0, length, doc)):
        end = min(start + doc, length)
        seq[0, start:end], pos[0, start:end] = i, torch.arange(end - start)
    return dict(input_ids=ids, labels=ids, position_ids=pos, seq_ids=seq)


def step_ms(model, batch, paths: tuple[str, ...], steps: int) -> dict[str, float]:
    """Median ms of a forward + backward per path. The paths take turns step by step, so a machine that others
    share slows both alike; the first round warms the allocator and the kernels up."""
    times = {path: [] for path in paths}
    for i in range(steps + 1):
        for path in paths:
            model.transformer.packed_attention = path
            start = time.perf_counter()
            model(**batch).loss.backward()
            if i:
                times[path].append((time.perf_counter() - start) * 1e3)
            model.zero_grad(set_to_none=True)
    return {path: statistics.median(ts) for path, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--doc", type=int, default=512, help="positions per document")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    config = GLMConfig(**{**TINY_ARCH, **_FAMILY["glm4"]}, padded_vocab_size=VOCAB, torch_dtype="float32")
    model = ChatGLMForConditionalGeneration(config).float().train()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, documents of {a.doc} positions, "
          f"{config.num_layers} blocks, fp32")
    print(f"{'length':>7} {'path':>9} {'ms/step':>9} {'mask bytes':>16}")
    for length in (int(x) for x in a.lengths.split(",")):
        for path, ms in step_ms(model, packed_row(length, a.doc), ("sdpa", "segments"), a.steps).items():
            mask = length * length if path == "sdpa" else 0
            print(f"{length:>7} {path:>9} {ms:>9.1f} {mask / 2**20:>12.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
