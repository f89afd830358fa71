"""Replies from glmtune's model: prompts encoded with the chat template, batched left-padded, decoded greedily
(or sampled) with a KV cache allocated once per call.

Used by mode=infer and mode=chat (infer/) and by the evaluation during training (train/evaluation.py:
eval.generate), which is why it lives with the model and not with either of them.
"""

from __future__ import annotations

import torch

from ..config import InferConfig
from .chatglm.template import encode_one
from .chatglm.vision import load_image
from .kvcache import preallocated_kv_cache

CPU_BATCH = 8  # prompts per generate() batch without a GPU (infer/sampling.py sizes GPU batches)


def generation_kwargs(cfg: InferConfig) -> dict:
    """Keyword arguments for model.generate(); every value explicit so the checkpoint's generation_config
    (top_k=50 by transformers' default) cannot change what the user asked for."""
    if not cfg.do_sample:
        return {
            "do_sample": False,
            "repetition_penalty": cfg.repetition_penalty,
            "temperature": None,
            "top_p": None,
            "top_k": None,
        }
    return {
        "do_sample": True,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "repetition_penalty": cfg.repetition_penalty,
    }


def encode_prompt(messages: list[dict], tokenizer) -> tuple[list[int], str | None]:
    """(prompt ids, image path or None). GLM-4-0414's tokenizer renders its checkpoint's template itself."""
    if hasattr(tokenizer, "encode_prompt"):
        return tokenizer.encode_prompt(messages), None
    ids = list(tokenizer.prefix_ids())
    for message in messages:
        ids += encode_one(message, tokenizer)
    image = next((m["image"] for m in messages if "image" in m), None)
    return ids + [tokenizer.get_command("<|assistant|>")], image


def prompt_batch(encoded: list[tuple[list[int], str | None]], pad_id: int, image_size: int | None, device):
    """Left-padded like the official tokenizer, so every row's last position is its last prompt token."""
    width = max(len(ids) for ids, _ in encoded)
    batch = {
        "input_ids": torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in encoded], device=device),
        "attention_mask": torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in encoded], device=device
        ),
    }
    rows = [i for i, (_, image) in enumerate(encoded) if image]
    if rows:
        batch["images"] = torch.stack([load_image(encoded[i][1], image_size) for i in rows]).to(device)
        batch["image_rows"] = torch.tensor(rows, device=device)
    return batch


def generate(
    model,
    tokenizer,
    prompts: list[list[dict]],
    cfg: InferConfig,
    batch_size: int | None = None,
    streamer=None,
    synced_gpus: bool = False,
) -> list[str]:
    """Replies to each prompt (messages ending on the turn to answer), in order.

    synced_gpus: every rank of a ZeRO-3 job runs the same number of forward steps (each one gathers weights
    from all ranks), however early its own rows stop."""
    vision = getattr(model.config, "vision_config", None)
    device = model.get_input_embeddings().weight.device
    stops = list(tokenizer.stop_token_ids)
    batch_size = batch_size or cfg.batch_size or CPU_BATCH
    outputs = []
    for start in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(p, tokenizer) for p in prompts[start : start + batch_size]]
        batch = prompt_batch(encoded, tokenizer.pad_token_id, vision["image_size"] if vision else None, device)
        with torch.no_grad(), preallocated_kv_cache(model, cfg.max_new_tokens):
            out = model.generate(
                **batch,
                max_new_tokens=cfg.max_new_tokens,
                eos_token_id=stops,
                pad_token_id=tokenizer.pad_token_id,
                use_cache=True,
                streamer=streamer,
                synced_gpus=synced_gpus,
                **generation_kwargs(cfg),
            )
        for row in out[:, batch["input_ids"].shape[1] :].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            outputs.append(tokenizer.decode(row[:cut]).strip())
    return outputs
