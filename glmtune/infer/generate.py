"""mode=infer: generate with base + adapter on one device or several, and optionally save the merged model
(export.py: a folder that loads wherever the base folder loads).

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
import transformers

from ..config import ConfigError, InferConfig, ModelConfig, RunConfig
from ..config.units import GIB
from ..data.validate import Conversation, read_conversations
from ..models import load_config, load_model
from ..models.chatglm.template import reference_text
from ..models.generation import encode_prompt, generate
from ..models.identity import check_adapter_base, write_provenance
from ..models.quantize import load_quantized, weight_storage_bytes
from ..rundir.atomic import write_text
from .adapter import check_outputs, load_adapter
from .adapter_export import check_adapter_for
from .devicemap import bytes_per_device, device_map
from .export import export_folder, export_line, save_merged  # noqa: F401 - callers import save_merged here
from .hf_layout import layout_for
from .sampling import auto_batch_size, check_context, free_gpu_bytes, settings

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


def load_quantized_adapter(model_dir: Path, adapter: str | None, model_cfg: ModelConfig, dtype: torch.dtype):
    """model.quantize=nf4|int8: the quantized base on one device (GPU 0, else CPU) with the adapter beside it,
    not merged: merging into 4/8-bit weights would round the adapter's update into the quantization grid."""
    model = load_quantized(model_dir, model_cfg.quantize, dtype, double_quant=model_cfg.double_quant)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval(), {str(model.device): weight_storage_bytes(model)}


def place(model, gpus: int, memory_gib: float | None):
    """One GPU, several (device map), or the CPU. Returns (model, {device: bytes of weights})."""
    if not torch.cuda.is_available():
        return model, {"cpu": sum(p.numel() * p.element_size() for p in model.parameters())}
    count = gpus or torch.cuda.device_count()
    if count == 1:
        return model.to("cuda:0"), {0: torch.cuda.memory_allocated(0)}
    from accelerate import dispatch_model

    budgets = [
        memory_gib * GIB if memory_gib else torch.cuda.get_device_properties(i).total_memory for i in range(count)
    ]
    mapping = device_map(model, budgets, reserve=RESERVE)  # refuses a map that leaves any tensor unplaced
    return dispatch_model(model, device_map=mapping), bytes_per_device(model, mapping)


def split_reference(messages: list[dict]) -> tuple[list[dict], str | None]:
    """(the prompt, the reference answer): a conversation ending on an assistant message has one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[:-1], reference_text(messages[-1])
    return messages, None


def one_prompt(cfg: InferConfig) -> list[dict]:
    """infer.prompt (with infer.system and infer.image) as a conversation."""
    messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
    user = {"role": "user", "content": cfg.prompt}
    if cfg.image:
        user["image"] = cfg.image
    return messages + [user]


def read_prompts(cfg: InferConfig) -> list[Conversation]:
    if cfg.prompts_file:
        return read_conversations(cfg.prompts_file, "infer.prompts_file", prompts=True)
    if cfg.prompt:
        if cfg.image and not Path(cfg.image).is_file():
            raise ConfigError(f"infer.image={cfg.image}: file not found — give the path of a .png/.jpg")
        return [Conversation(0, one_prompt(cfg))]
    return []


def check_model(cfg: InferConfig, model_dir: Path) -> None:
    """What stops mode=infer or chat before the weights load: a context the model cannot hold, an adapter trained
    on another base."""
    config = load_config(model_dir)
    check_context(cfg, config)
    if cfg.adapter:
        check_adapter_base(cfg.adapter, model_dir, config)


def run_infer(run: RunConfig, model_dir: Path, tokenizer, run_dir: Path, config_sha: str | None = None) -> dict:
    """mode=infer: infer.* over the model in `model_dir`, with model.* (quantization) and hw.memory_gib."""
    cfg, model_cfg, memory_gib = run.infer, run.model, run.hw.memory_gib
    out = check_outputs(cfg, model_dir, run_dir)  # before any weights load: never overwrite an input
    prompts = read_prompts(cfg)  # bad prompts and a mismatched adapter stop the run before the weights load
    check_model(cfg, model_dir)
    unmerged = cfg.adapter_for != "none"  # the base is exported alone, the adapter converted beside it
    if unmerged and not (cfg.merge_to and cfg.adapter):
        raise ConfigError(
            f"infer.adapter_for={cfg.adapter_for} exports infer.adapter beside its base: it needs "
            "infer.adapter=<run>/adapter and infer.merge_to=<folder>"
        )
    if cfg.merge_to:  # a layout or an adapter the engine cannot take: one line now, not after the weights load
        config = load_config(model_dir)
        layout = layout_for(cfg.merge_format, config, tokenizer)
        check_adapter_for(cfg, layout, config)
    quantized = model_cfg.quantize != "none"
    result: dict = {}
    if cfg.merge_to and unmerged:  # the base alone, in its own dtype; the adapter is written beside it
        result["merged"], result["serve"] = map(
            str,
            export_folder(load_merged(model_dir, None, model_cfg, None), tokenizer, cfg.merge_to, model_dir, cfg=cfg),
        )
    if (cfg.merge_to and not unmerged) or (prompts and not quantized):
        # With a quantized base the merge still goes into the full-precision weights (on the CPU, in the
        # checkpoint's own dtype: bf16 for GLM-4), so merge_to is an official-layout checkpoint like any other.
        model = load_merged(model_dir, cfg.adapter, model_cfg, None if quantized else inference_dtype())
    if cfg.merge_to and not unmerged:
        result["merged"], result["serve"] = map(str, export_folder(model, tokenizer, cfg.merge_to, model_dir, cfg=cfg))
    if cfg.merge_to:
        result["merged_line"] = (
            f"{export_line(cfg, layout)} written to {result['merged']}; serve it with vLLM "
            f"(SERVE.md there has this and the transformers lines):\n{result['serve']}"
        )
    if prompts:
        if quantized:  # one device: a quantized 9B model fits one card, so infer.gpus does not split it
            model = None
            model, placement = load_quantized_adapter(model_dir, cfg.adapter, model_cfg, inference_dtype())
        else:
            model, placement = place(model, cfg.gpus, memory_gib)
        pairs = [split_reference(c.messages) for c in prompts]
        batch_size = cfg.batch_size or pick_batch_size(model, tokenizer, [p for p, _ in pairs], cfg, memory_gib)
        transformers.set_seed(cfg.seed)  # sampling draws from torch's generator: same seed, same outputs
        texts = generate(model, tokenizer, [p for p, _ in pairs], cfg, batch_size)
        write_text(
            out,
            "".join(
                json.dumps(
                    {"line": c.line, "prompt": prompt, "reference": reference, "output": text}, ensure_ascii=False
                )
                + "\n"
                for c, (prompt, reference), text in zip(prompts, pairs, texts)
            ),
        )
        provenance = write_provenance(run_dir, model_dir, config_sha, cfg.adapter, settings(cfg, batch_size))
        result.update(
            predictions=str(out),
            count=len(texts),
            batch_size=batch_size,
            provenance=str(provenance),
            placement={str(k): round(v / GIB, 3) for k, v in placement.items()},
        )
    return result


def pick_batch_size(model, tokenizer, prompts: list[list[dict]], cfg: InferConfig, memory_gib: float | None) -> int:
    """infer.batch_size=0: as many rows as the estimator's KV-cache term fits beside the weights."""
    longest = max(len(encode_prompt(p, tokenizer)[0]) for p in prompts)
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.dtype, "fp32")
    return auto_batch_size(
        model.config, dtype, longest, cfg.max_new_tokens, len(prompts), free_gpu_bytes(memory_gib, RESERVE)
    )
