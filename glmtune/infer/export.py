"""`infer.merge_to=DIR`: base + adapter merged into a checkpoint folder that loads where the base loads.

    DIR/config.json                     the base folder's own (auto_map and all), byte for byte
    DIR/modeling_*.py, tokenization_*.py, tokenizer.model, ...   every other non-weight file of the base, copied
    DIR/model-0000k-of-0000n.safetensors + model.safetensors.index.json   (one model.safetensors when small)
    DIR/generation_config.json          the base's, with GLM-4's stop ids in eos_token_id (GLM-4 #297)
    DIR/tokenizer_config.json           the base's; glmtune's chat template added when it has none

The files are the user's, not glmtune's: with the base's `auto_map` and modeling code, `AutoModelForCausalLM
.from_pretrained(DIR, trust_remote_code=True)`, vLLM and PEFT see the official model. A base without them (the
tiny checkpoints) gets what glmtune writes (its tokenizer_config.json), plus the chat template. The weights are
written in the base's dtype (config.json `torch_dtype`: bf16 for GLM-4) whatever the merge ran in (fp32 on
CPU), with the official tensor names, and `transformer.rotary_pos_emb.inv_freq`, which the official files carry.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..models.chatglm.chat_template import chat_template_for
from ..rundir.atomic import folder_as_one_unit

# transformers' units (10**9 bytes): glm-4-9b-chat's 18.8 GB of bf16 weights become 10 shards, as in the
# official repository; a file per ~2 GB also keeps a failed download or copy cheap to redo.
SHARD_SIZE = "2GB"
# Weight files (and their indexes) of any framework: never copied from the base, the merged ones replace them.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WRITTEN_HERE = ("generation_config.json",)  # merged from the base's copy below, not copied over
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_files(model_dir: Path) -> list[Path]:
    """The base folder's own non-weight files: its top level only (a hub cache's .git or blobs/ are not the
    model), hidden files skipped."""
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix not in _WEIGHT_SUFFIXES
                  and p.name not in _WEIGHT_INDEXES and p.name not in _WRITTEN_HERE)


def save_merged(model, tokenizer, out: str | Path, model_dir: str | Path | None = None,
                shard_size: str | int = SHARD_SIZE) -> Path:
    """Write the merged `model` (glmtune's class, adapter already merged) and the files of its base folder
    (`model_dir`; by default the folder it was loaded from, which load_model records) into `out`, whole or not
    at all (an existing folder is replaced only with infer.overwrite, checked by the caller)."""
    folder, model_dir = Path(out), Path(model_dir or model.config.name_or_path)
    base_config = json.loads((model_dir / "config.json").read_text())
    dtype = _DTYPES.get(base_config.get("torch_dtype") or base_config.get("dtype"), model.dtype)  # 5.x: dtype
    state = {name: (t.to(dtype) if t.is_floating_point() else t) for name, t in model.state_dict().items()}
    if hasattr(model, "transformer"):  # the ChatGLM family (GLM-4-0414's HF-native files carry no rotary buffer)
        rotary = model.transformer.rotary_pos_emb
        # Base 10000, as the official files store it: glmtune computes the buffer at load, not in state_dict.
        state["transformer.rotary_pos_emb.inv_freq"] = (
            1.0 / 10000 ** (torch.arange(0, rotary.dim, 2, dtype=torch.float32) / rotary.dim)).to(dtype)
    with folder_as_one_unit(folder) as tmp:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size=shard_size)
        tokenizer.save_pretrained(tmp)  # glmtune's files first: the base's own, copied next, replace them
        for file in base_files(model_dir):
            shutil.copy2(file, tmp / file.name)
        _add_chat_template(tmp / "tokenizer_config.json", tokenizer)
        write_generation_config(tmp, model_dir, tokenizer)
    return folder


def _add_chat_template(path: Path, tokenizer) -> None:
    """The chat template of the base's tokenizer_config.json stays; glmtune's goes in only where there is none."""
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if isinstance(config.get("chat_template"), (str, list)) and config["chat_template"]:
        return
    config["chat_template"] = chat_template_for(tokenizer)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_generation_config(folder: Path, model_dir: Path, tokenizer) -> None:
    """The base's generation_config.json (sampling defaults and all) with every stop id of glmtune's generation in
    eos_token_id: <|endoftext|>, <|user|>, <|observation|> (GLM-4: 151329, 151336, 151338; ChatGLM3: eos 2 and its
    <|user|>, <|observation|>). Without them vLLM and `generate` stop only on <|endoftext|>, which a chat model
    rarely writes: the reply runs on into a made-up next user turn (GLM-4 #297)."""
    from transformers import GenerationConfig

    source = model_dir / "generation_config.json"
    fields = json.loads(source.read_text()) if source.is_file() else {}
    fields = {k: v for k, v in fields.items() if k not in ("transformers_version", "_from_model_config")}
    eos = fields.get("eos_token_id")
    eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    fields["eos_token_id"] = eos + [i for i in tokenizer.stop_token_ids if i not in eos]
    fields.setdefault("pad_token_id", tokenizer.pad_token_id)
    GenerationConfig(**fields).save_pretrained(folder)
