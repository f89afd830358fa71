"""One rank of tests/models/test_docattention.py's sequence-parallel test, under `torchrun --nproc_per_node 4` (gloo, CPU).

Every rank builds the same tiny fp32 model (GLM-4 and ChatGLM3, 8 query heads over 2 KV groups) and packed rows
whose documents cross the shard boundaries of 2 and 4 ranks. The reference is one process holding the whole rows
on the dense-mask path, and each document run alone; then the segments path runs the same rows sharded over 2
ranks (two groups of 2) and over 4, and once over 2 with non-reentrant checkpointing. Per case, OUT/rank<N>.json
holds the largest relative differences of this rank's logits (against the reference and against the documents
alone), of the summed token loss and of every parameter's gradient (summed over the group).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# tests/ as conftest.py puts it for pytest: test_docattention (imported below) takes REPO from helpers/
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import sp_worker  # this folder is the script's: first on sys.path
import torch
import torch.distributed as dist
from sp_worker import rel
from test_docattention import packed

from glmtune.models.chatglm.configuration import GLMConfig
from glmtune.models.chatglm.modeling import ChatGLMForConditionalGeneration
from glmtune.models.kernels.ulysses import SequenceGroup, shard
from glmtune.models.loading import _FAMILY, TINY_ARCH

B, S, VOCAB = 2, 32, 128
DOCS = [[3, 9, 6, 11, 3], [13, 2, 8, 5]]  # boundaries off the shard edges (8, 16, 24); row 2 ends on 4 pads


def batch() -> dict[str, torch.Tensor]:
    return packed(DOCS, S, seed=11)  # the collator's layout (tests/models/test_docattention.py)


def run_case(model, data, sp: SequenceGroup | None, path: str):
    """(summed token loss, this rank's logits, gradients summed over the group) on `path` (tests/models/sp_worker.py)."""
    model.transformer.packed_attention = path
    return sp_worker.run_case(model, data, sp)


def documents_alone(model, data) -> torch.Tensor:
    """[B, S, vocab]: each document's logits from its own forward; zeros on pads."""
    out = torch.zeros(B, S, VOCAB)
    model.transformer.packed_attention = "sdpa"
    with torch.no_grad():
        for row, docs in enumerate(DOCS):
            at = 0
            for n in docs:
                hidden, _ = model.transformer(data["input_ids"][row : row + 1, at : at + n])
                out[row, at : at + n] = model.transformer.output_layer(hidden)[0].float()
                at += n
    return out


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    data = batch()
    real = data["seq_ids"] >= 0
    results = {}
    for family in ("glm4", "chatglm3"):
        torch.manual_seed(0)
        config = GLMConfig(
            **{**TINY_ARCH, **_FAMILY[family], "num_attention_heads": 8}, padded_vocab_size=VOCAB, torch_dtype="float32"
        )
        model = ChatGLMForConditionalGeneration(config).float()
        alone = documents_alone(model, data)
        ref_loss, ref_logits, ref_grads = run_case(model, data, None, "sdpa")
        for size, checkpointing in ((2, False), (4, False), (2, True)):
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.train()
            sp = SequenceGroup.of(pairs[rank // 2] if size == 2 else None)
            loss, logits, grads = run_case(model, data, sp, "segments")
            mine = shard(real, sp)
            results[f"{family} sp={size} checkpointing={checkpointing}"] = dict(
                loss=rel(loss, ref_loss),
                logits=rel(logits[mine], shard(ref_logits, sp)[mine]),
                alone=rel(logits[mine], shard(alone, sp)[mine]),
                positions=int(mine.sum()),
                grads=max(rel(grads[n], ref_grads[n]) for n in ref_grads),
                missing=sorted(set(ref_grads) - set(grads)),
            )
            model.gradient_checkpointing_disable()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
