"""multi_query_attention=false (full multi-head attention): the official files lay out query_key_value's rows per
head, [q_h | k_h | v_h], where GQA checkpoints put all queries, then all keys, then all values. glmtune must compute
what the official code computes from such a checkpoint, and what it exports (merged weights, adapters) must stay in
that layout. The reference below reads the raw safetensors the way the official code splits its projection
(`view(..., heads, 3 * head_dim)` then three head_dim chunks), in float64, independently of glmtune's model."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from test_models import _complex_rotary_reference

from glmtune.infer.adapter import load_adapter
from glmtune.infer.generate import save_merged
from glmtune.models import load_model, load_tokenizer, make_tiny_checkpoint

IDS = torch.tensor([5, 17, 3, 88, 42, 7, 61, 2, 30])


def official_mha_checkpoint(folder: Path, family: str) -> Path:
    """A tiny MHA checkpoint whose qkv biases and norm weights are non-trivial, so no layout error can hide."""
    src = make_tiny_checkpoint(folder, family=family, seed=11, multi_query_attention=False)
    weights = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(4)
    for name, tensor in weights.items():
        if name.endswith("query_key_value.bias"):
            weights[name] = torch.randn(tensor.shape, generator=gen) * 0.5
        elif name.endswith("layernorm.weight"):
            weights[name] = torch.rand(tensor.shape, generator=gen) + 0.5
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    return src


def official_logits(weights: dict[str, torch.Tensor], config, ids: torch.Tensor) -> torch.Tensor:
    """Forward of the official MHA model in float64 from the stored tensors alone."""
    sd = {k: v.double() for k, v in weights.items()}
    nh, hd, eps = config.num_attention_heads, config.kv_channels, config.layernorm_epsilon
    base = 10000.0 * config.rope_ratio

    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    x, pos, s = sd["transformer.embedding.word_embeddings.weight"][ids], torch.arange(len(ids)), len(ids)
    future = torch.ones(s, s).triu(1).bool()
    for i in range(config.num_layers):
        p = f"transformer.encoder.layers.{i}."
        h = norm(x, sd[p + "input_layernorm.weight"])
        qkv = h @ sd[p + "self_attention.query_key_value.weight"].T + sd[p + "self_attention.query_key_value.bias"]
        heads = []
        for head in range(nh):  # per head: hd query rows, hd key rows, hd value rows
            block = qkv[:, head * 3 * hd : (head + 1) * 3 * hd]
            q = _complex_rotary_reference(block[:, :hd], pos, hd // 2, base)
            k = _complex_rotary_reference(block[:, hd : 2 * hd], pos, hd // 2, base)
            scores = (q @ k.T / math.sqrt(hd)).masked_fill(future, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ block[:, 2 * hd :])
        x = x + torch.cat(heads, -1) @ sd[p + "self_attention.dense.weight"].T
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = (h @ sd[p + "mlp.dense_h_to_4h.weight"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.dense_4h_to_h.weight"].T
    return norm(x, sd["transformer.encoder.final_layernorm.weight"]) @ sd["transformer.output_layer.weight"].T


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_mha_checkpoint_in_the_official_layout_gives_the_official_logits(tmp_path, family):
    src = official_mha_checkpoint(tmp_path / "mha", family)
    model = load_model(src).eval()
    want = official_logits(load_file(src / "model.safetensors"), model.config, IDS)
    with torch.no_grad():
        got = model(input_ids=IDS[None]).logits[0]
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(model.double()(input_ids=IDS[None]).logits[0], want)  # float64: to rounding
        # The same weights read in the GQA (blocked) order compute another attention: the check above can fail.
        for layer in model.transformer.encoder.layers:
            layer.self_attention.per_head_qkv = False
        assert (model(input_ids=IDS[None]).logits[0] - want).abs().max() > 0.1


def test_mha_generation_with_cache_equals_without(tmp_path):
    model = load_model(official_mha_checkpoint(tmp_path / "mha", "glm4")).eval()
    prompts = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    kw = dict(
        attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert torch.equal(model.generate(prompts, use_cache=True, **kw), model.generate(prompts, use_cache=False, **kw))


def test_mha_adapter_and_merged_export_stay_in_the_official_layout(tmp_path):
    """LoRA on query_key_value (non-zero B): the adapter file's rows follow the official layout (base + B·A·scale
    from the raw files gives glmtune's logits), and infer's merged export is an official-layout checkpoint."""
    src = official_mha_checkpoint(tmp_path / "mha", "chatglm3")
    model = get_peft_model(load_model(src), LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"]))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        want = model.eval()(input_ids=IDS[None]).logits[0].double()

    base, lora = load_file(src / "model.safetensors"), load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    by_hand = dict(base)
    for i in range(model.config.num_layers):
        key = f"transformer.encoder.layers.{i}.self_attention.query_key_value"
        a, b = (lora[f"base_model.model.{key}.lora_{x}.weight"] for x in "AB")
        by_hand[key + ".weight"] = base[key + ".weight"] + (b @ a) * (8 / 4)
    torch.testing.assert_close(official_logits(by_hand, model.config, IDS), want, rtol=0, atol=1e-5)
    assert (official_logits(base, model.config, IDS) - want).abs().max() > 0.1  # the adapter does something

    # What mode=infer does with infer.adapter and infer.merge_to (test_infer.py runs the command itself).
    merged = load_adapter(load_model(src), str(tmp_path / "adapter")).merge_and_unload().eval()
    out = save_merged(merged, load_tokenizer(src), str(tmp_path / "merged"))
    exported = load_file(out / "model.safetensors")
    torch.testing.assert_close(official_logits(exported, model.config, IDS), want, rtol=0, atol=1e-5)
    with torch.no_grad():  # and glmtune reads its own export back to the same logits
        reloaded = load_model(out).eval()(input_ids=IDS[None]).logits[0].double()
    torch.testing.assert_close(reloaded, want, rtol=0, atol=1e-5)
