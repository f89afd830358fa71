"""Generation speed of glmtune's GLM-4 model: tokens/s at batch 1/8/32, and 16 prompts x 256 new tokens.

    python bench/generate_speed.py                      # CUDA: full-size glm-4-9b-chat, random bf16 weights
    python bench/generate_speed.py --tiny               # CPU smoke run: tiny model, few tokens

Random weights cost exactly what real ones do; no download. Every row decodes exactly --new-tokens tokens
(no stop token) from left-padded prompts of random ids with lengths spread over [--prompt-len/2, --prompt-len],
through `model.generate` as mode=infer calls it (greedy, KV cache, return_last_logit).

Rows:
- batch 1 / 8 / 32: decode throughput (new tokens of all rows / wall time, prefill included);
- 16 x 256 "before": batch 4 (the old infer.batch_size default), the KV cache grown by torch.cat at every
  token and expanded to every query head at each decode step (the code before this change) — the issue's
  ~55 s on an H100;
- 16 x 256 batch 4: the same batch with a preallocated cache and grouped decoding (attention reads the 2 KV
  groups as stored);
- 16 x 256 auto: batch from the estimator's KV-cache term (infer.batch_size=0), same decoding.
The batch rows also print the peak CUDA memory of generate() (CPU: peak live tensor bytes) next to the
estimator's generate phase
(weights + batch x (KV cache of prompt + new tokens + one block's prefill working set)).
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch

from glmtune.config.units import GIB
from glmtune.infer.sampling import auto_batch_size, free_gpu_bytes, per_row_bytes
from glmtune.models import ChatGLMForConditionalGeneration, GLMConfig, released_config
from glmtune.models.chatglm.layers import SelfAttention
from glmtune.models.kvcache import preallocated_kv_cache
from glmtune.models.loading import TINY_ARCH


def build(tiny: bool) -> ChatGLMForConditionalGeneration:
    if tiny:
        config = GLMConfig(**TINY_ARCH, padded_vocab_size=1024, rope_ratio=500.0)
        return ChatGLMForConditionalGeneration(config).eval()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = ChatGLMForConditionalGeneration(released_config("glm4_9b_chat"))
    torch.set_default_dtype(torch.float32)
    return model.eval()


def prompts(n: int, length: int, vocab: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, n_tok in enumerate(lengths):
        ids[i, width - n_tok :] = torch.randint(10, vocab, (n_tok,), generator=g)
        mask[i, width - n_tok :] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(model, batch: dict, batch_size: int, new_tokens: int, before: bool = False) -> float:
    """Seconds to generate new_tokens for every row of `batch`, batch_size rows per generate() call.
    before=True: the cache grown by concatenation at each token, as before the preallocated cache."""
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(0, batch["input_ids"].shape[0], batch_size):
        part = {k: v[i : i + batch_size] for k, v in batch.items()}
        with torch.no_grad(), nullcontext() if before else preallocated_kv_cache(model, new_tokens):
            out = model.generate(
                **part,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                use_cache=True,
            )
        assert out.shape[1] == part["input_ids"].shape[1] + new_tokens
    sync()
    return time.perf_counter() - start


def cpu_peak(model, batch: dict, new_tokens: int) -> int:
    """Peak live tensor bytes of one generate() on CPU (glmtune.probe.track; weights counted as baseline)."""
    from glmtune.probe.track import LiveTensorTracker

    with (
        torch.no_grad(),
        preallocated_kv_cache(model, new_tokens),
        LiveTensorTracker(baseline=[*model.parameters(), *model.buffers()]) as tracker,
    ):
        model.generate(
            **batch,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
        )
    return tracker.peak_bytes


def expanded_decode(self, q, k, v, mask):
    """The decode step before grouped decoding: K/V copied out to every query head, then SDPA."""
    b, _, _, hd = q.shape
    rep = self.heads // self.groups
    k = k.unsqueeze(2).expand(b, self.groups, rep, k.shape[2], hd).reshape(b, self.heads, k.shape[2], hd)
    v = v.unsqueeze(2).expand(b, self.groups, rep, v.shape[2], hd).reshape(b, self.heads, v.shape[2], hd)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(b, self.heads, hd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    parser.add_argument("--prompt-len", type=int, default=None, help="longest prompt in tokens")
    parser.add_argument("--new-tokens", type=int, default=None)
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke test")
    prompt_len = args.prompt_len or (32 if args.tiny else 512)
    new = args.new_tokens or (8 if args.tiny else 256)
    model = build(args.tiny)
    device = model.get_input_embeddings().weight.device
    vocab = model.config.padded_vocab_size
    name = "tiny (CPU)" if args.tiny else f"glm-4-9b-chat random bf16, {torch.cuda.get_device_name(0)}"
    print(f"{name}; prompts up to {prompt_len} tokens, {new} new tokens each; torch {torch.__version__}\n")
    for before in (True, False):  # warm-up of both paths: kernels, allocator
        SelfAttention._decode_grouped, saved = (
            expanded_decode if before else SelfAttention._decode_grouped,
            SelfAttention._decode_grouped,
        )
        run(model, prompts(4, prompt_len, vocab, device), 4, 4, before=before)
        SelfAttention._decode_grouped = saved

    print("| case | prompts | batch | decoding | seconds | new tokens/s | vs before | peak GiB measured | predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    unit = 4 if args.tiny else 2  # GiB decimals
    dtype = "fp32" if args.tiny else "bf16"
    for b in (1, 8, 32):
        batch = prompts(b, prompt_len, vocab, device, seed=b)
        t = run(model, batch, b, new)
        # the estimator's generate phase: weights + per row (KV cache of prompt + new tokens, prefill working set)
        predicted = (weights + b * per_row_bytes(model.config, dtype, batch["input_ids"].shape[1], new)) / GIB
        measured = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else cpu_peak(model, batch, new)
        measured = f"{measured / GIB:.{unit}f}"
        print(
            f"| batch {b} | {b} | {b} | prealloc + grouped | {t:.2f} | {b * new / t:.1f} | | {measured} "
            f"| {predicted:.{unit}f} |"
        )
    batch16 = prompts(16, prompt_len, vocab, device, seed=16)
    grouped = SelfAttention._decode_grouped
    SelfAttention._decode_grouped = expanded_decode
    try:
        before = run(model, batch16, 4, new, before=True)
    finally:
        SelfAttention._decode_grouped = grouped
    print(f"| 16 x {new} before | 16 | 4 | cat + expanded KV | {before:.2f} | {16 * new / before:.1f} | 1.00x | | |")
    t = run(model, batch16, 4, new)
    print(f"| 16 x {new} | 16 | 4 | prealloc + grouped | {t:.2f} | {16 * new / t:.1f} | {before / t:.2f}x | | |")
    auto = auto_batch_size(
        model.config, dtype, batch16["input_ids"].shape[1], new, 16, free_gpu_bytes(None, 2 * 1024**3)
    )
    t = run(model, batch16, auto, new)
    print(
        f"| 16 x {new} auto batch | 16 | {auto} | prealloc + grouped | {t:.2f} | {16 * new / t:.1f} "
        f"| {before / t:.2f}x | | |"
    )


if __name__ == "__main__":
    main()
