"""Packed-row attention: the dense block-diagonal mask (sdpa) against per-document SDPA (segments), time and memory.

    python bench/doc_attention.py                          # CPU: the tiny GLM-4, lengths 1,024-16,384, docs of 512
    python bench/doc_attention.py --lengths 2048,8192 --docs 1024 --steps 5
    python bench/doc_attention.py --model glm4_9b --layers 2 --lengths 2048,4096,8192,16384,32768 --docs 512,2048
                                                           # CUDA: 2 blocks of glm-4-9b-chat in bf16 (gpu_pending)

One packed row of `length` positions cut into documents of each `--docs` size (the last one shorter) runs forward +
backward through the model's own forward (models/chatglm/modeling.ChatGLMModel) with train.packed_attention forced to each
path. The tiny GLM-4 (2 blocks, hidden 64, 4 heads over 2 KV groups, fp32: attention is most of a step at these
lengths) runs on CPU; `--model glm4_9b` builds glm-4-9b-chat's blocks (32 heads of 128 over 2 KV groups, hidden
4,096, the 151,552-token head behind a 1,024-token chunked loss) with `--layers` blocks on the GPU in bf16. Per row:
the median step time of `--steps` timed steps after one warm-up (the paths take turns), the step's peak memory
above what it started with (CUDA: max_memory_allocated; CPU: live tensor bytes, train/livebytes.py), and the dense
mask's own bytes (B x S^2 bool; SDPA's bias made of it, in the compute dtype, comes on top per block). The segments
path has no [seq, seq] tensor. The closing line is the DENSE_MASK_MAX (models/kernels/docattention.py) the rows suggest:
the longest length up to which the dense mask is never more than 5 % slower than per-document SDPA for any
document size, and its extra step memory stays under 2 % of a 24 GB card.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from glmtune.models import released_config
from glmtune.models.chatglm.configuration import GLMConfig
from glmtune.models.chatglm.modeling import ChatGLMForConditionalGeneration
from glmtune.models.loading import _FAMILY, TINY_ARCH
from glmtune.train.livebytes import LiveTensorTracker

VOCAB = 128
SLOWER, CARD = 1.05, 24 * 2**30 * 0.02  # the suggestion's rule: at most 5 % slower, extra memory < 2 % of 24 GB


def packed_row(length: int, doc: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, length), generator=g)
    seq, pos = torch.empty(1, length, dtype=torch.long), torch.empty(1, length, dtype=torch.long)
    for i, start in enumerate(range(0, length, doc)):
        end = min(start + doc, length)
        seq[0, start:end], pos[0, start:end] = i, torch.arange(end - start)
    return {k: v.to(device) for k, v in dict(input_ids=ids, labels=ids, position_ids=pos, seq_ids=seq).items()}


def _step(model, batch, cuda: bool) -> tuple[float, int]:
    """(ms, peak bytes above the start) of one forward + backward."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        model(**batch).loss.backward()
        torch.cuda.synchronize()
        ms, peak = (time.perf_counter() - start) * 1e3, torch.cuda.max_memory_allocated() - base
    else:
        start = time.perf_counter()
        with LiveTensorTracker() as tracker:
            model(**batch).loss.backward()
        ms, peak = (time.perf_counter() - start) * 1e3, tracker.peak_bytes
    model.zero_grad(set_to_none=True)
    return ms, peak


def step_ms(model, batch, paths: tuple[str, ...], steps: int, cuda: bool = False) -> dict[str, tuple[float, int]]:
    """Median ms and the largest peak of a forward + backward per path. The paths take turns step by step, so a
    machine that others share slows both alike; the first round warms the allocator and the kernels up."""
    times, peaks = {path: [] for path in paths}, {path: 0 for path in paths}
    for i in range(steps + 1):
        for path in paths:
            model.transformer.packed_attention = path
            ms, peak = _step(model, batch, cuda)
            peaks[path] = max(peaks[path], peak)
            if i:
                times[path].append(ms)
    return {path: (statistics.median(ts), peaks[path]) for path, ts in times.items()}


def build(name: str, layers: int | None, device: str, dtype: torch.dtype):
    if name == "tiny":
        config = GLMConfig(**{**TINY_ARCH, **_FAMILY["glm4"]}, padded_vocab_size=VOCAB, torch_dtype="float32")
    else:
        config = released_config("glm4_9b_chat")
    if layers:
        config.num_layers = layers
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # random init where it runs: seconds for the 9B blocks on a GPU
            model = ChatGLMForConditionalGeneration(config).train()
    finally:
        torch.set_default_dtype(torch.float32)
    if name != "tiny":  # the 151,552-token head: fp32 logits of 32K tokens alone would be 18 GiB
        model.loss_chunk_tokens = 1024
    return model, config


def suggest(rows: list[tuple[int, int, str, float, int]]) -> int:
    """The longest length up to which the dense mask is within SLOWER of per-document SDPA in time for every
    document size, and its extra step memory under CARD; 0 when even the shortest fails."""
    best = 0
    for length in sorted({r[0] for r in rows}):
        pairs = [
            (dense, seg)
            for doc in {r[1] for r in rows if r[0] == length}
            for dense in [r for r in rows if r[:3] == (length, doc, "sdpa")]
            for seg in [r for r in rows if r[:3] == (length, doc, "segments")]
        ]
        if not pairs or any(d[3] > SLOWER * s[3] or d[4] - s[4] > CARD for d, s in pairs):
            break
        best = length
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("tiny", "glm4_9b"), default="tiny")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the tiny model's 2; 2 for glm4_9b)")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--docs", "--doc", default="512", help="positions per document, one size or a list")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    cuda = a.model != "tiny"
    if cuda and not torch.cuda.is_available():
        ap.error("--model glm4_9b runs on CUDA; use the tiny model on CPU")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model, config = build(a.model, a.layers or (2 if cuda else None), device, dtype)
    where = torch.cuda.get_device_name(0) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{a.model}: {config.num_layers} blocks, {str(dtype).removeprefix('torch.')}, {where}, torch {torch.__version__}"
    )
    print("| length | docs of | path | ms/step | step peak MiB | mask MiB |\n|---:|---:|---|---:|---:|---:|")
    rows = []
    for length in (int(x) for x in a.lengths.split(",")):
        for doc in (int(x) for x in a.docs.split(",")):
            batch = packed_row(length, doc, config.padded_vocab_size, device)
            for path, (ms, peak) in step_ms(model, batch, ("sdpa", "segments"), a.steps, cuda).items():
                rows.append((length, doc, path, ms, peak))
                mask = length * length if path == "sdpa" else 0
                print(f"| {length} | {doc} | {path} | {ms:.1f} | {peak / 2**20:.1f} | {mask / 2**20:.1f} |", flush=True)
    print(
        f"suggested DENSE_MASK_MAX: {suggest(rows)} (the longest length at which the dense mask is at most "
        f"{SLOWER - 1:.0%} slower than per-document SDPA for every document size and needs < {CARD / 2**30:.2f} GiB "
        "more in the step)"
    )


if __name__ == "__main__":
    main()
