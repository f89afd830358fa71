"""mode=infer: generate with base + adapter on one device or several, and optionally save the merged model.

    python -m glmtune mode=infer model.path=/models/glm-4v-9b infer.adapter=outputs/.../adapter \\
        infer.prompts_file=prompts.jsonl                     # every visible GPU; CPU when there is none
    python -m glmtune mode=infer ... infer.gpus=2 infer.merge_to=/models/glm-4v-9b-mine

Several GPUs get a device map from glmtune.devicemap: whole GLM blocks per GPU in proportion to their
memory, the vision tower, embedding and rotary buffer on GPU 0, and a map that would leave any parameter or
buffer without a device is refused with their names (the ChatGLM3 `inv_freq` failure). Image features
are moved to the embedding's device inside the model (GLM-4 issues #75, #295). The adapter is merged into
the base weights before placement: inference then runs at base-model speed and memory.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..atomic import folder_as_one_unit, write_text
from ..config import InferConfig, ModelConfig
from .adapter import check_outputs, load_adapter
from ..data.pipeline import encode_one
from ..data.validate import read_conversations
from .devicemap import GIB, bytes_per_device, device_map
from ..models import load_model
from ..models.vision import load_image

RESERVE = 2 * GIB  # per GPU, kept free for activations and the KV cache of a batch


def inference_dtype() -> torch.dtype:
    if not torch.cuda.is_available():
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_merged(model_dir: Path, adapter: str | None, model_cfg: ModelConfig, dtype: torch.dtype):
    model = load_model(model_dir, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code)
    if adapter:
        model = load_adapter(model, adapter).merge_and_unload()  # safetensors / weights_only: no pickled code
    return model.eval()


def save_merged(model, tokenizer, out: str) -> Path:
    """Base + adapter in the official layout: config.json, model.safetensors, tokenizer files, and the
    `transformer.rotary_pos_emb.inv_freq` buffer the official files carry (base 10000, as they store it)."""
    folder = Path(out)
    rotary = model.transformer.rotary_pos_emb
    state = dict(model.state_dict())
    state["transformer.rotary_pos_emb.inv_freq"] = (
        1.0 / 10000 ** (torch.arange(0, rotary.dim, 2, dtype=torch.float32) / rotary.dim)).to(model.dtype)
    with folder_as_one_unit(folder) as tmp:  # whole or not at all; an existing folder only with infer.overwrite
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return folder


def place(model, gpus: int, memory_gib: float | None):
    """One GPU, several (device map), or the CPU. Returns (model, {device: bytes of weights})."""
    if not torch.cuda.is_available():
        return model, {"cpu": sum(p.numel() * p.element_size() for p in model.parameters())}
    count = gpus or torch.cuda.device_count()
    if count == 1:
        return model.to("cuda:0"), {0: torch.cuda.memory_allocated(0)}
    from accelerate import dispatch_model

    budgets = [memory_gib * GIB if memory_gib else torch.cuda.get_device_properties(i).total_memory
               for i in range(count)]
    mapping = device_map(model, budgets, reserve=RESERVE)  # refuses a map that leaves any tensor unplaced
    return dispatch_model(model, device_map=mapping), bytes_per_device(model, mapping)


def encode_prompt(messages: list[dict], tokenizer) -> tuple[list[int], str | None]:
    ids = list(tokenizer.prefix_ids())
    for message in messages:
        ids += encode_one(message, tokenizer)
    image = next((m["image"] for m in messages if "image" in m), None)
    return ids + [tokenizer.get_command("<|assistant|>")], image


def _batch(encoded: list[tuple[list[int], str | None]], pad_id: int, image_size: int | None, device):
    """Left-padded like the official tokenizer, so every row's last position is its last prompt token."""
    width = max(len(ids) for ids, _ in encoded)
    batch = {"input_ids": torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in encoded], device=device),
             "attention_mask": torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in encoded],
                                            device=device)}
    rows = [i for i, (_, image) in enumerate(encoded) if image]
    if rows:
        batch["images"] = torch.stack([load_image(encoded[i][1], image_size) for i in rows]).to(device)
        batch["image_rows"] = torch.tensor(rows, device=device)
    return batch


def generate(model, tokenizer, prompts: list[list[dict]], cfg: InferConfig) -> list[str]:
    vision = getattr(model.config, "vision_config", None)
    device = model.get_input_embeddings().weight.device
    stops = list(tokenizer.stop_token_ids)
    outputs = []
    for start in range(0, len(prompts), cfg.batch_size):
        encoded = [encode_prompt(p, tokenizer) for p in prompts[start:start + cfg.batch_size]]
        batch = _batch(encoded, tokenizer.pad_token_id, vision["image_size"] if vision else None, device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=cfg.max_new_tokens, do_sample=False,
                                 eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            outputs.append(tokenizer.decode(row[:cut]).strip())
    return outputs


def run_infer(cfg: InferConfig, model_cfg: ModelConfig, memory_gib: float | None, model_dir: Path, tokenizer,
              run_dir: Path) -> dict:
    out = check_outputs(cfg, model_dir, run_dir)  # before any weights load: never overwrite an input
    prompts = read_conversations(cfg.prompts_file, "infer.prompts_file", prompts=True) if cfg.prompts_file else []
    model = load_merged(model_dir, cfg.adapter, model_cfg, inference_dtype())
    result: dict = {}
    if cfg.merge_to:
        result["merged"] = str(save_merged(model, tokenizer, cfg.merge_to))
    if prompts:
        model, placement = place(model, cfg.gpus, memory_gib)
        texts = generate(model, tokenizer, [c.messages for c in prompts], cfg)
        write_text(out, "".join(json.dumps({"line": c.line, "output": text}, ensure_ascii=False) + "\n"
                                for c, text in zip(prompts, texts)))
        result.update(predictions=str(out), count=len(texts),
                      placement={str(k): round(v / GIB, 3) for k, v in placement.items()})
    return result
