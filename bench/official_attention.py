"""glmtune vs the official modeling code on tiny checkpoints of each attention layout (issue 31, D6).

    python bench/official_attention.py --official /models/chatglm3-6b     # a folder holding modeling_chatglm.py

The official Python files are not part of glmtune (and never run by it): point --official at a downloaded
ChatGLM3 / GLM-4 checkpoint folder; only its modeling_chatglm.py, configuration_chatglm.py and quantization.py
are copied. For GQA (2 groups), GQA with as many groups as heads, and full multi-head attention
(multi_query_attention=false, whose query_key_value rows are laid out per head), a tiny checkpoint in the given
family is written, loaded by glmtune and by the official code (trust_remote_code), and the largest logit
difference printed; then a LoRA adapter with non-zero B on query_key_value and dense is merged and exported by
glmtune (what infer.merge_to writes) and that export reloaded by the official code, against glmtune's base +
adapter. Measured results: bench/RESULTS.md; the suite's check without the official files: tests/models/test_mha_layout.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from glmtune.infer.generate import save_merged
from glmtune.models import load_model, load_tokenizer, make_tiny_checkpoint

LAYOUTS = {
    "GQA, 2 groups": dict(multi_query_attention=True, multi_query_group_num=2),
    "GQA, groups = heads": dict(multi_query_attention=True, multi_query_group_num=4),
    "MHA (multi_query_attention=false)": dict(multi_query_attention=False),
}
IDS = torch.tensor([[1, 5, 9, 33, 2, 17, 40, 8]])
CODE = ("modeling_chatglm.py", "configuration_chatglm.py", "quantization.py")


def with_official_code(src: Path, dst: Path, official: Path) -> Path:
    shutil.copytree(src, dst)
    for name in CODE:
        if (official / name).is_file():
            shutil.copy(official / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    config.update(
        model_type="chatglm",
        auto_map={
            "AutoConfig": "configuration_chatglm.ChatGLMConfig",
            "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
        },
    )
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def official_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, torch_dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits.float()


def merged_with_adapter(src: Path, out: Path) -> tuple[Path, torch.Tensor]:
    """glmtune's base + a random adapter: its logits, and its merged export."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(src), LoraConfig(r=4, target_modules=["query_key_value", "dense"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
        logits = model.eval()(input_ids=IDS).logits.float()
    return save_merged(model.merge_and_unload(), load_tokenizer(src), str(out)), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", type=Path, required=True, help="folder with the official modeling_chatglm.py")
    parser.add_argument(
        "--family",
        default="chatglm3",
        choices=["glm4", "chatglm3"],
        help="the family whose code --official holds (ChatGLM3-6B's ignores rope_ratio)",
    )
    args = parser.parse_args()
    if not (args.official / "modeling_chatglm.py").is_file():
        parser.error(
            f"--official {args.official}: no modeling_chatglm.py there — point it at a downloaded "
            "ChatGLM3 / GLM-4 checkpoint folder"
        )  # exit 2
    print(f"| layout ({args.family}, fp32) | max abs logit diff, load | max abs logit diff, merged export |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, arch) in enumerate(LAYOUTS.items()):
            src = make_tiny_checkpoint(Path(tmp) / f"tiny{i}", family=args.family, seed=5, **arch)
            with torch.no_grad():
                ours = load_model(src).eval()(input_ids=IDS).logits.float()
            theirs = official_logits(with_official_code(src, Path(tmp) / f"official{i}", args.official))
            export, want = merged_with_adapter(src, Path(tmp) / f"merged{i}")
            exported = official_logits(with_official_code(export, Path(tmp) / f"official-merged{i}", args.official))
            load, merged = (ours - theirs).abs().max().item(), (exported - want).abs().max().item()
            print(f"| {label} | {load:.2e} | {merged:.2e} |")


if __name__ == "__main__":
    main()
