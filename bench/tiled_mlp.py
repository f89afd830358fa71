"""Tiled MLP (issue 30 item 4): what tiling costs per step, and what it saves, on CPU.

    python bench/tiled_mlp.py                       # hidden 512, 4 blocks, 2K-8K tokens (slow on 2 cores)
    python bench/tiled_mlp.py --hidden 256 --layers 2 --tokens 1024 2048 --tiles 0 256 512 1024 --repeats 2

Each row is one LoRA training step (forward + backward; every target; reentrant block checkpointing, as the
planner takes it at long lengths; fp32: bf16 matmuls are ~50x slower on CPUs without AVX-512 BF16) of a model
shaped like GLM-4-9B scaled down (ffn / hidden = 13,696 / 4,096, 64-dim heads over 2 KV groups), tiled at
`tile` tokens (0 = untiled). Columns: ms per step, wall and CPU (all threads; the best of --repeats after a
warm-up round, the tiles' steps alternating so a neighbour's load falls on all alike), the CPU cost against
untiled, the step's peak live tensor bytes (train/livebytes.py; weights included) and the largest
[tokens, 2 x ffn] tensor any op produced in the step: the MLP intermediate that tiling bounds. RESULTS.md §18.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from glmtune.config import LoraConfig  # noqa: E402
from glmtune.models import ChatGLMForConditionalGeneration, GLMConfig, enable_checkpointing  # noqa: E402
from glmtune.models.kernels.tiling import set_mlp_tile_tokens  # noqa: E402
from glmtune.train.livebytes import LiveTensorTracker  # noqa: E402
from glmtune.train.lora import apply_lora, trainable_parameters  # noqa: E402

ALL = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def arch(hidden: int, layers: int) -> GLMConfig:
    return GLMConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=hidden * 13696 // 4096,
        kv_channels=64,
        num_attention_heads=hidden // 64,
        multi_query_attention=True,
        multi_query_group_num=2,
        padded_vocab_size=1024,
    )


class WidestMLP(LiveTensorTracker):
    """Live bytes, plus the largest tensor whose last dim is the fused [gate | up] width."""

    def __init__(self, width: int, baseline):
        super().__init__(baseline)
        self.width, self.widest = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.width:
                self.widest = max(self.widest, t.numel() * t.element_size())
        return out


def build(cfg: GLMConfig, tokens: int, tile: int):
    """The model tiled at `tile` (same seed, same weights for every tile) and its step function."""
    torch.manual_seed(0)
    model = ChatGLMForConditionalGeneration(cfg).float()
    model.config.use_cache = False
    model = apply_lora(model, LoraConfig(r=8, alpha=16, dropout=0.0, target_modules=ALL))
    enable_checkpointing(model, use_reentrant=True)
    model.enable_input_require_grads()
    set_mlp_tile_tokens(model, tile)
    model.train()
    model.loss_chunk_tokens = 256  # the loss head (256 x 1,024 x 12 B) is not what this measures
    ids = torch.randint(0, cfg.padded_vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        for p in trainable_parameters(model):
            p.grad = None

    return model, ids, step


def rows(cfg: GLMConfig, tokens: int, tiles: list[int], repeats: int) -> dict[int, tuple[float, float, int, int]]:
    """Per tile: (best wall ms, best CPU ms over all threads, peak live bytes, widest [t, 2f] bytes). The tiles'
    steps alternate, so a neighbour's load on a shared machine falls on all of them alike."""
    built = {tile: build(cfg, tokens, tile) for tile in tiles}
    wall = {tile: float("inf") for tile in tiles}
    cpu = dict(wall)
    for _ in range(repeats + 1):  # the first round warms up
        for tile, (_, _, step) in built.items():
            w, c = time.perf_counter(), time.process_time()
            step()
            wall[tile] = min(wall[tile], time.perf_counter() - w)
            cpu[tile] = min(cpu[tile], time.process_time() - c)
    out = {}
    for tile, (model, ids, step) in built.items():
        with WidestMLP(2 * cfg.ffn_hidden_size, [*model.parameters(), *model.buffers(), ids]) as tracker:
            step()
        out[tile] = (wall[tile] * 1000, cpu[tile] * 1000, tracker.peak_bytes, tracker.widest)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--tiles", type=int, nargs="+", default=[0, 256, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = arch(args.hidden, args.layers)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; hidden "
        f"{cfg.hidden_size}, ffn {cfg.ffn_hidden_size}, {cfg.num_layers} blocks, fp32, LoRA r=8 on all four targets, "
        f"reentrant checkpointing"
    )
    print(
        f"{'tokens':>7} {'tile':>6} {'wall ms':>9} {'CPU ms':>9} {'CPU cost':>9} {'peak MiB':>9} "
        f"{'widest [t,2f] MiB':>18}"
    )
    for tokens in args.tokens:
        result = rows(cfg, tokens, [t for t in args.tiles if t < tokens], args.repeats)
        base = result[0][1] if 0 in result else None
        for tile, (wall, cpu, peak, widest) in result.items():
            cost = f"{cpu / base - 1:+.1%}" if base and tile else "-"
            print(
                f"{tokens:>7} {tile or 'off':>6} {wall:>9.0f} {cpu:>9.0f} {cost:>9} {peak / 2**20:>9.1f} "
                f"{widest / 2**20:>18.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
