"""The command that serves an export with vLLM, and the transformers lines that load it: printed after
`infer.merge_to` and written into the folder as SERVE.md.

    vllm serve DIR --served-model-name NAME --generation-config DIR --chat-template DIR/chat_template.jinja
        [--hf-overrides '{"architectures": ["GLM4VForCausalLM"]}']                       GLM-4V (vLLM's choice)
        [--enable-lora --lora-modules NAME-lora=DIR/adapter --max-lora-rank R]          infer.adapter_for=vllm

No `--trust-remote-code`: every export's model class is one vLLM implements itself (ChatGLM, GLM-4V,
GlmForCausalLM, GLM-4-0414's Glm4ForCausalLM) and its tokenizer is tokenizer.json; it is added only for an
architecture outside VLLM_NATIVE.
`--generation-config DIR` makes vLLM stop at every GLM stop id of generation_config.json (without them a
GLM-4 reply runs on into an invented next turn: GLM-4 #297); `--chat-template` is the export's own template
(the base's, byte for byte, or glmtune's where the base had none), so the engine renders what was trained.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

# Architectures vLLM 0.32 runs with its own code (vllm/model_executor/models/registry.py).
VLLM_NATIVE = {
    "ChatGLMModel",
    "ChatGLMForConditionalGeneration",
    "GLM4VForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
}

# The first transformers release with each HF-native class (its model_type glm / glm4).
TRANSFORMERS_SINCE = {"GlmForCausalLM": "4.46", "Glm4ForCausalLM": "4.51.3"}


def vllm_command(folder: Path, name: str, config: dict, adapter_rank: int | None) -> list[str]:
    folder = Path(folder).resolve()
    args = [
        "vllm",
        "serve",
        str(folder),
        "--served-model-name",
        name,
        "--generation-config",
        str(folder),
        "--chat-template",
        str(folder / "chat_template.jinja"),
    ]
    architectures = config.get("architectures") or []
    if config.get("vision_config"):  # vLLM's text ChatGLM refuses a config with vision_config: it says to do this
        args += ["--hf-overrides", json.dumps({"architectures": ["GLM4VForCausalLM"]})]
    elif not set(architectures) & VLLM_NATIVE:
        args.append("--trust-remote-code")
    if adapter_rank is not None:
        args += [
            "--enable-lora",
            "--lora-modules",
            f"{name}-lora={folder / 'adapter'}",
            "--max-lora-rank",
            str(adapter_rank),
        ]
    return args


def transformers_snippet(folder: Path, config: dict, adapter: bool) -> str:
    """Python lines that load the export: no remote code for the HF layout; the remote layout's model is the
    base's own modeling code (its tokenizer is tokenizer.json either way)."""
    folder = Path(folder).resolve()
    if config.get("model_type") == "chatglm" and not config.get("auto_map"):
        return (
            f"# transformers has no class for this folder without the base's modeling_chatglm.py (glmtune's tiny\n"
            f"# checkpoints ship none); glmtune loads it: python -m glmtune mode=chat model.path={folder}"
        )
    remote = ", trust_remote_code=True" if config.get("auto_map") else ""
    lines = [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"tokenizer = AutoTokenizer.from_pretrained({str(folder)!r})",
        f'model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, torch_dtype="auto"{remote})',
    ]
    if adapter:
        lines += [
            "from peft import PeftModel",
            f"model = PeftModel.from_pretrained(model, {str(folder / 'adapter')!r})",
        ]
    lines += [
        'ids = tokenizer.apply_chat_template([{"role": "user", "content": "你好"}], '
        'add_generation_prompt=True, return_tensors="pt", return_dict=True)',
        "out = model.generate(**ids, max_new_tokens=256)  # stops at generation_config.json's stop ids",
        'print(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))',
    ]
    return "\n".join(lines)


def serve_md(folder: Path, command: list[str], snippet: str, config: dict) -> str:
    line = " ".join(shlex.quote(a) for a in command)
    arch = (config.get("architectures") or ["?"])[0]
    how = (
        f"HF-native layout ({arch}): transformers >= {TRANSFORMERS_SINCE.get(arch, '4.46')}, vLLM and SGLang load "
        "it without remote code"
        if config.get("model_type") != "chatglm"
        else "official layout (the base's config.json and weight names): vLLM loads it with its own ChatGLM model"
        + (", transformers with the base's modeling code (auto_map)" if config.get("auto_map") else "")
    )
    return (
        f"# Serving {Path(folder).resolve().name}\n\n{how}; the tokenizer is tokenizer.json (no tokenizer code), "
        "the chat template chat_template.jinja, the stop ids generation_config.json's eos_token_id.\n\n"
        f"## vLLM\n\n```bash\n{line}\n```\n\n## transformers\n\n```python\n{snippet}\n```\n"
    )


def write_serve_md(folder: Path, final: Path, adapter_rank: int | None, name: str | None = None) -> str:
    """SERVE.md in `folder` (the export being written, renamed to `final` when complete); returns the command."""
    config = json.loads((folder / "config.json").read_text())
    name = name or Path(final).resolve().name
    command = vllm_command(final, name, config, adapter_rank)
    snippet = transformers_snippet(final, config, (folder / "adapter").is_dir())
    (folder / "SERVE.md").write_text(serve_md(final, command, snippet, config))
    return " ".join(shlex.quote(a) for a in command)
