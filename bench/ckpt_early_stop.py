"""Issue 33's step-1 crash, isolated: the chunked loss's checkpoint × the allocator's history recording.

    python bench/ckpt_early_stop.py            # CUDA: every combination; CPU: the checkpoint rows only

The card's command died in its first training step with `SystemError: <built-in function cross_entropy_loss>
returned NULL without setting an exception`, raised while torch's non-reentrant checkpoint recomputed a loss
chunk in backward. Its probe had run the same chunks without failing. What the probe did not have was the
allocator history the run records for OOM snapshots (probe/diagnose.py record_memory_history). The suspect:
a non-reentrant checkpoint stops its recomputation early by raising an exception from the saved-tensor hook,
here inside `cross_entropy_loss` (a C++ composite: log_softmax, then nll_loss saves its inputs). While that
exception unwinds through C++, the log_softmax output is freed, and a recording allocator runs Python to
capture the free's stack. If that loses the in-flight error, the binding returns NULL with none set.

Each row runs one loss-head forward and backward shaped like GLM-4's (4,096 hidden, 151,552-token vocabulary,
1,024-token chunks, bf16 head, fp32 logits) and says whether backward raised, and what.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


def one_step(kind: str, tokens: int, hidden: int, vocab: int, chunk: int, device: str) -> str:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype).requires_grad_(False)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,), device=device)

    def chunk_sum(hs, ys):
        return F.cross_entropy(head(hs).to(torch.float32), ys, reduction="sum")

    ckpt = {
        "non-reentrant, early stop": partial(checkpoint, use_reentrant=False),
        "non-reentrant, no early stop": partial(checkpoint, use_reentrant=False),
        "reentrant": partial(checkpoint, use_reentrant=True),
    }[kind]
    stop = set_checkpoint_early_stop(False) if kind == "non-reentrant, no early stop" else contextlib.nullcontext()
    try:
        with stop:
            total = sum(ckpt(chunk_sum, h[s : s + chunk], y[s : s + chunk]) for s in range(0, tokens, chunk))
        total.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return "ok" if h.grad is not None and bool(torch.isfinite(h.grad).all()) else "no/bad gradient"
    except Exception as err:  # noqa: BLE001 - the row reports what was raised
        return f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--small", action="store_true", help="a 256-wide, 32,000-token head (quick CPU check)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, vocab = (256, 32000) if args.small or device == "cpu" else (4096, 151552)
    histories = {"off": None}
    if device == "cuda":
        histories.update(
            {
                "on (glmtune's: context all, stacks all)": {},
                "on, context alloc": {"context": "alloc"},
                "on, stacks python": {"stacks": "python"},
            }
        )
    print(
        f"{device} {torch.cuda.get_device_name(0) if device == 'cuda' else ''} torch {torch.__version__}, "
        f"python {sys.version.split()[0]}; {args.tokens} tokens, chunk 1024, hidden {hidden}, vocab {vocab}"
    )
    print("| allocator history | checkpoint | backward |\n|---|---|---|")
    for name, options in histories.items():
        for kind in ("non-reentrant, early stop", "non-reentrant, no early stop", "reentrant"):
            if options is not None:
                torch.cuda.memory._record_memory_history(max_entries=100_000, **options)
            outcome = one_step(kind, args.tokens, hidden, vocab, 1024, device)
            if options is not None:
                torch.cuda.memory._record_memory_history(enabled=None)
            print(f"| {name} | {kind} | {outcome} |", flush=True)


if __name__ == "__main__":
    main()
