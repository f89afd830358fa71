"""The reference side of the GLM-4-0414 parity tests (tests/models/test_glm4_0414_reference.py), run by the engines venv's
interpreter (tests/helpers/engines.py: transformers 5.x with its own Glm4ForCausalLM, peft; nothing of glmtune).

    python ref_glm4_0414_worker.py write ROOT     tiny checkpoints written by transformers' save_pretrained, with the
                                                  tokenizer glmtune wrote into ROOT/tok* re-saved by transformers
                                                  (tokenizers >= 0.20: merges as pairs, chat_template.jinja), and
                                                  ROOT/<variant>/reference.safetensors + reference.json: logits,
                                                  loss and every LoRA gradient of a fixed batch, greedy tokens with a
                                                  KV cache, and the chat template's ids of ROOT/conversations.json
    python ref_glm4_0414_worker.py peft ROOT JOBS  for each job of the JSON file JOBS ({checkpoint, adapter, ids,
                                                  out}): the reference model with glmtune's adapter through PEFT, its
                                                  logits into `out`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

# Each variant: (attention_bias, KV heads, dtype, template). Both bias values, 2 and 4 KV heads, fp32 and bf16.
VARIANTS = {
    "bias_kv2": (True, 2, "float32", "tok"),
    "nobias_kv4": (False, 4, "float32", "tok"),
    "nobias_kv2": (False, 2, "float32", "tok_z1"),
    "bias_kv4": (True, 4, "float32", "tok"),
    "bias_kv2_bf16": (True, 2, "bfloat16", "tok"),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]


STOPS = [1266, 1273, 1275]  # the tiny tokenizer's <|endoftext|>, <|user|>, <|observation|>


def greedy_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded by 4."""
    return (
        torch.tensor([[STOPS[0]] * 4 + list(range(40, 48)), list(range(100, 112))]),
        torch.tensor([[0] * 4 + [1] * 8, [1] * 12]),
    )


def batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of 24 tokens, the second right-padded by 6; labels skip the pads and the first 3 positions."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def write(root: Path) -> None:
    from transformers import AutoTokenizer, Glm4Config, Glm4ForCausalLM

    tokenizers = {name: AutoTokenizer.from_pretrained(root / name) for name in ("tok", "tok_z1")}
    conversations = json.loads((root / "conversations.json").read_text())
    special = tokenizers["tok"].convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    for index, (name, (bias, kv, dtype, tok)) in enumerate(VARIANTS.items()):
        out = root / name
        torch.manual_seed(index)
        config = Glm4Config(
            vocab_size=1280,
            hidden_size=128,
            intermediate_size=224,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv,
            head_dim=32,
            attention_bias=bias,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            pad_token_id=special[0],
            eos_token_id=special,
            initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
        model = Glm4ForCausalLM(config)
        with torch.no_grad():  # every norm and bias away from its init, so each is checked
            for pname, param in model.named_parameters():
                if pname.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.1)
                elif pname.endswith("bias"):
                    param.normal_(0.0, 0.1)
        model = model.to(getattr(torch, dtype)).eval()
        model.save_pretrained(out)
        tokenizers[tok].save_pretrained(out)
        results, info = run_reference(model, config, out)
        info["template_ids"] = [
            tokenizers[tok].apply_chat_template(
                c["messages"],
                tools=c.get("tools"),
                add_generation_prompt=c.get("prompt", True),
                tokenize=True,
                return_dict=False,
            )
            for c in conversations[tok]
        ]
        save_file(results, str(out / "reference.safetensors"))
        (out / "reference.json").write_text(json.dumps(info))


def run_reference(model, config, out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from peft import LoraConfig, get_peft_model

    inputs = batch(1266)
    with torch.no_grad():
        base = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    # Greedy decoding of two left-padded prompts with the KV cache, 10 new tokens, GLM's stop ids.
    prompts, prompt_mask = greedy_prompts()
    greedy = model.generate(
        input_ids=prompts,
        attention_mask=prompt_mask,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=STOPS,
        pad_token_id=STOPS[0],
        use_cache=True,
    )
    torch.manual_seed(11)
    lora = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, init_lora_weights=False)
    )
    for param in lora.parameters():  # the adapters in fp32 (glmtune trains them so), the base as saved
        if param.requires_grad:
            param.data = param.data.float()
    lora.save_pretrained(out / "lora")
    output = lora(**inputs)
    output.loss.backward()
    results = {
        "logits": base.float().contiguous(),
        "lora_logits": output.logits.detach().float().contiguous(),
        "loss": output.loss.detach().float().reshape(1),
        "greedy": greedy.contiguous(),
    }
    for name, param in lora.named_parameters():
        if param.requires_grad:
            results["grad." + name.replace(".default", "")] = param.grad.float().contiguous()
    return results, {"dtype": str(model.dtype)}


def peft_logits(jobs_file: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for job in json.loads(jobs_file.read_text()):
        model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32).eval()
        if job.get("adapter"):
            model = PeftModel.from_pretrained(model, job["adapter"]).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(job["ids"])).logits
        save_file({"logits": logits.float().contiguous()}, job["out"])


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif sys.argv[1] == "peft":
        peft_logits(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
