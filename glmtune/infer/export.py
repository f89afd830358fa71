"""`infer.merge_to=DIR`: base + adapter merged into a checkpoint folder that loads where the base loads.

    DIR/config.json                     the base folder's own (auto_map and all), byte for byte (a text model's
                                        null vision keys dropped: engines read them as GLM-4V)
    DIR/modeling_*.py, tokenization_*.py, tokenizer.model, ...   every other non-weight file of the base, copied
    DIR/model-0000k-of-0000n.safetensors + model.safetensors.index.json   (one model.safetensors when small)
    DIR/generation_config.json          the base's, with GLM-4's stop ids in eos_token_id (GLM-4 #297); byte for
                                        byte when it has them
    DIR/tokenizer_config.json           the base's; glmtune's chat template added when it has none; its
                                        tokenizer_class PreTrainedTokenizerFast (auto_map kept, see below)
    DIR/tokenizer.json, chat_template.jinja   the tokenizer as data and the template as a file: no engine needs
                                        tokenizer code (models/chatglm/tokenizer_json.py)
    DIR/.glmtune-export.json            glmtune wrote this folder: infer.overwrite may replace it (targets.py)
    DIR/SERVE.md                        the vllm serve command and transformers lines for DIR (serve_command.py)

`infer.merge_format=hf` writes the HF-native layout instead (hf_layout.py: GlmForCausalLM config and weight
names, no remote code files); `infer.adapter_for=peft|vllm` writes the base unmerged plus DIR/adapter/ converted
for that engine (adapter_export.py).

A GLM-4-0414 / GLM-Z1 base is HF-native already (its Layout's base_is_hf), so both formats write one folder: the
weights under its own names, config.json from the family's hf_config, and every other non-weight file of the base
as it ships it (tokenizer.json in either merges format, tokenizer_config.json, generation_config.json when it holds
the stop ids); only what it lacks is written (chat_template.jinja from its template, unchanged).

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

from ..config import InferConfig
from ..models.chatglm.chat_template import chat_template_for
from ..models.chatglm.configuration import TEXT_MODEL_DROPS
from ..rundir.atomic import folder_as_one_unit
from .adapter_export import convert_adapter, vllm_rank_flag
from .hf_layout import REMOTE, Layout, hf_state_dict, layout_for
from .serve_command import write_serve_md
from .targets import mark_export, writing_export

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
    return sorted(
        p
        for p in Path(model_dir).iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.suffix not in _WEIGHT_SUFFIXES
        and p.name not in _WEIGHT_INDEXES
        and p.name not in _WRITTEN_HERE
    )


def save_merged(
    model, tokenizer, out: str | Path, model_dir: str | Path | None = None, shard_size: str | int = SHARD_SIZE
) -> Path:
    """The remote-layout merge of `model` into `out` (export_folder with the default infer settings)."""
    return export_folder(model, tokenizer, out, model_dir, shard_size)[0]


def export_folder(
    model,
    tokenizer,
    out: str | Path,
    model_dir: str | Path | None = None,
    shard_size: str | int = SHARD_SIZE,
    cfg: InferConfig | None = None,
) -> tuple[Path, str]:
    """Write `model` (glmtune's class; the adapter merged, or the base alone with infer.adapter_for) and the files
    of its base folder (`model_dir`; by default the folder it was loaded from, which load_model records) into
    `out` in cfg.merge_format's layout, whole or not at all (an existing folder is replaced only with
    infer.overwrite, checked by the caller). Returns the folder and its vllm serve command."""
    cfg = cfg or InferConfig(merge_to=str(out))
    folder, model_dir = Path(out), Path(model_dir or model.config.name_or_path)
    layout = layout_for(cfg.merge_format, model.config, tokenizer)
    base_config = json.loads((model_dir / "config.json").read_text())
    dtype = _DTYPES.get(base_config.get("torch_dtype") or base_config.get("dtype"), model.dtype)  # 5.x: dtype
    state = {name: (t.to(dtype) if t.is_floating_point() else t) for name, t in model.state_dict().items()}
    with writing_export("infer.merge_to", folder), folder_as_one_unit(folder) as tmp:
        mark_export(
            tmp, "merged" if cfg.adapter_for == "none" else "base+adapter", base=model_dir, format=cfg.merge_format
        )  # first: a merge killed from here on is found stale by its pid
        tokenizer.save_pretrained(tmp)  # glmtune's files first: the base's own, copied next, replace them
        if layout is REMOTE:
            rotary = model.transformer.rotary_pos_emb
            # Base 10000, as the official files store it: glmtune computes the buffer at load (not in state_dict).
            state["transformer.rotary_pos_emb.inv_freq"] = (
                1.0 / 10000 ** (torch.arange(0, rotary.dim, 2, dtype=torch.float32) / rotary.dim)
            ).to(dtype)
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size=shard_size)
            for file in base_files(model_dir):
                shutil.copy2(file, tmp / file.name)
            _drop_vision_keys(tmp / "config.json")
        else:  # HF names and config; none of the base's remote code, nor the tiktoken file only it reads
            model.save_pretrained(
                tmp,
                state_dict=hf_state_dict(layout, state, model.config),
                safe_serialization=True,
                max_shard_size=shard_size,
            )
            if layout.base_is_hf:  # the base's own tokenizer files, chat template, README, ... as it ships them
                for file in base_files(model_dir):
                    shutil.copy2(file, tmp / file.name)
            hf = {**layout.hf_config(model.config), "torch_dtype": str(dtype).removeprefix("torch.")}
            if "dtype" in hf:  # transformers 5's name for it, which GLM-4-0414's config carries too
                hf["dtype"] = hf["torch_dtype"]
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            # tokenizer_config.json stays glmtune's (it holds the base's chat template); tokenizer.model only glmtune reads
            (tmp / "tokenizer.model").unlink(missing_ok=True)
        if layout.base_is_hf:
            _template_file(tmp, tokenizer)
        else:
            _fast_tokenizer_config(tmp, tokenizer)
        write_generation_config(tmp, model_dir, tokenizer)
        rank = None
        if cfg.adapter_for != "none":
            adapter = convert_adapter(
                cfg.adapter, tmp / "adapter", layout, model.config, cfg.adapter_for, str(folder.resolve())
            )
            rank = vllm_rank_flag(adapter) if cfg.adapter_for == "vllm" else None
        command = write_serve_md(tmp, folder, rank)
    return folder, command


def _drop_vision_keys(path: Path) -> None:
    """A text model's config.json without `vision_config`/boi/eoi ids: vLLM reads the key's presence (even null)
    as GLM-4V and refuses the folder. Rewritten only when such null keys are there, else left byte for byte."""
    config = json.loads(path.read_text())
    if config.get("vision_config") is None and any(k in config for k in TEXT_MODEL_DROPS):
        for key in TEXT_MODEL_DROPS:
            config.pop(key, None)
        path.write_text(json.dumps(config, indent=2) + "\n")


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _fast_tokenizer_config(folder: Path, tokenizer) -> None:
    """tokenizer_config.json for tokenizer.json: the base's chat template (glmtune's where it has none), also as
    chat_template.jinja, and tokenizer_class PreTrainedTokenizerFast. A base's auto_map stays: transformers
    loads its remote tokenizer class only with trust_remote_code=True, and tokenizer.json otherwise (vLLM,
    transformers 5.x), where the official tokenization_chatglm.py may not run (`_pad() ... 'padding_side'`)."""
    path = folder / "tokenizer_config.json"
    config = _read(path)
    if not (isinstance(config.get("chat_template"), (str, list)) and config["chat_template"]):
        config["chat_template"] = chat_template_for(tokenizer)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    template = config["chat_template"]
    if isinstance(template, list):  # named templates: the default one is what engines render chats with
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")


def _template_file(folder: Path, tokenizer) -> None:
    """chat_template.jinja (what --chat-template names) for a base whose tokenizer files are kept as shipped: the
    base's own file, or the template of its tokenizer_config.json, which the tokenizer renders with, unchanged."""
    path = folder / "chat_template.jinja"
    if not path.is_file():
        path.write_text(tokenizer.chat_template, encoding="utf-8")


def write_generation_config(folder: Path, model_dir: Path, tokenizer) -> None:
    """The base's generation_config.json (sampling defaults and all) with every stop id of glmtune's generation in
    eos_token_id: <|endoftext|>, <|user|>, <|observation|> (GLM-4: 151329, 151336, 151338; ChatGLM3: eos 2 and its
    <|user|>, <|observation|>). Without them vLLM and `generate` stop only on <|endoftext|>, which a chat model
    rarely writes: the reply runs on into a made-up next user turn (GLM-4 #297). A base file that already holds
    them all and a pad id (GLM-4-0414's, glm-4-9b-chat's) is copied byte for byte."""
    from transformers import GenerationConfig

    source = model_dir / "generation_config.json"
    fields = json.loads(source.read_text()) if source.is_file() else {}
    eos = fields.get("eos_token_id")
    eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    if set(tokenizer.stop_token_ids) <= set(eos) and fields.get("pad_token_id") is not None:
        shutil.copy2(source, folder / source.name)  # it says all glmtune would add: the user's file, as it is
        return
    fields = {k: v for k, v in fields.items() if k not in ("transformers_version", "_from_model_config")}
    fields["eos_token_id"] = eos + [i for i in tokenizer.stop_token_ids if i not in eos]
    fields.setdefault("pad_token_id", tokenizer.pad_token_id)
    GenerationConfig(**fields).save_pretrained(folder)


def export_line(cfg: InferConfig, layout: Layout | None = None) -> str:
    """What infer.merge_to holds, as the line after an export names it."""
    what = (
        f"base, with its adapter for {cfg.adapter_for},"
        if cfg.adapter_for != "none"
        else "merged base + adapter"
        if cfg.adapter
        else "base"
    )
    fmt = "hf layout, the base's own" if layout is not None and layout.base_is_hf else f"{cfg.merge_format} layout"
    return f"{what} ({fmt})"
