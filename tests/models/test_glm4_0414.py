"""GLM-4-0414 / GLM-Z1-0414 in glmtune alone (issue 41): its config.json read in either transformers layout, the
released shapes, the chat template's training labels (Z1's thinking), the levers on its model (packed rows,
checkpointing, chunked loss, tiled MLP, LoRA targets by HF name), the estimator against live tensor bytes, the
plans for 32B, and the vLLM split of the fused MLP adapter. Reference parity: tests/models/test_glm4_0414_reference.py."""

from __future__ import annotations

import json

import pytest
import torch

from glmtune.config import ConfigError, LoraConfig
from glmtune.models.glm4_0414.configuration import Glm4Config
from glmtune.models.glm4_0414.modeling import Glm4ForCausalLM
from glmtune.models.glm4_0414.tiny import CHAT_TEMPLATE, CHAT_TEMPLATE_Z1, TINY_ARCH

TINY = Glm4Config(**TINY_ARCH, vocab_size=1280)


def tiny_model(seed: int = 0, **arch) -> Glm4ForCausalLM:
    torch.manual_seed(seed)
    return Glm4ForCausalLM(Glm4Config(**{**TINY_ARCH, **arch}, vocab_size=1280)).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer folders with GLM-4-0414's template and GLM-Z1's."""
    from glmtune.models.tokenizer_files import write_tiny_fast_tokenizer

    out = {}
    for name, template in (("glm4", CHAT_TEMPLATE), ("z1", CHAT_TEMPLATE_Z1)):
        out[name] = tmp_path_factory.mktemp(name)
        write_tiny_fast_tokenizer(out[name], template)
    return out


# --- configuration ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["4.51", "5.x"])
def test_every_value_comes_from_config_json_in_either_layout(tmp_path, layout):
    from glmtune.models import build_meta_model, load_config

    rope = (
        {"rope_theta": 5000.0, "partial_rotary_factor": 0.25}
        if layout == "4.51"
        else {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25}}
    )
    dtype = {"torch_dtype": "bfloat16"} if layout == "4.51" else {"dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "glm4",
                "architectures": ["Glm4ForCausalLM"],
                "vocab_size": 640,
                "hidden_size": 96,
                "intermediate_size": 160,
                "num_hidden_layers": 3,
                "num_attention_heads": 6,
                "num_key_value_heads": 3,
                "head_dim": 16,
                "attention_bias": False,
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 4096,
                **rope,
                **dtype,
            }
        )
    )
    config = load_config(tmp_path)
    assert (config.rope_theta, config.rotary_dim, config.rms_norm_eps, config.seq_length) == (5000.0, 4, 1e-6, 4096)
    assert config.torch_dtype in ("bfloat16", torch.bfloat16) and config.kv_groups == 3 and config.num_layers == 3
    model = build_meta_model(config)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is None and attn.k_proj.out_features == 48 and len(model.model.layers) == 3
    assert model.model.rotary_emb.dim == 4 and model.model.rotary_emb.base == 5000.0
    assert model.model.norm.eps == 1e-6 and model.model.layers[2].post_mlp_layernorm.eps == 1e-6


def test_a_scaled_rotary_embedding_is_refused_naming_the_file(tmp_path):
    from glmtune.models import load_config

    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "glm4", "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}
        )
    )
    with pytest.raises(ConfigError, match=r"config.json: rope_type 'yarn'"):
        load_config(tmp_path)


def test_released_shapes_count_their_parameters():
    from glmtune.models import build_meta_model, released_config
    from glmtune.plan.archsize import frozen_params

    for name, count in (
        ("glm4_9b_0414", 9_400_279_040),
        ("glm4_32b_0414", 32_566_081_536),
        ("glmz1_32b_0414", 32_566_081_536),
    ):
        arch = released_config(name)
        assert frozen_params(arch) == count == sum(p.numel() for p in build_meta_model(arch).parameters())
    big = released_config("glm4_32b_0414")
    assert (big.num_layers, big.num_attention_heads, big.kv_groups, big.attention_bias) == (61, 48, 2, False)


# --- tokenizer and template ---------------------------------------------------------------------------------------


def trained_text(tok, messages) -> tuple[str, str]:
    ids, labels = tok.encode_conversation(messages)
    assert len(ids) == len(labels)
    return tok.decode(ids), tok.decode([t for t in labels if t != -100])


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "你好"},
    {"role": "assistant", "content": "<think>\ngreeting\n</think>\n\nHi!"},
    {"role": "user", "content": "Weather in Beijing?"},
    {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Beijing"}'},
    {"role": "observation", "content": "sunny"},
    {"role": "assistant", "content": "<think>\nit said sunny\n</think>\n\nSunny."},
]


def test_loss_covers_exactly_the_assistant_spans_and_the_token_after_each(folders):
    from glmtune.models import load_tokenizer

    tok = load_tokenizer(folders["glm4"])
    text, trained = trained_text(tok, CHAT)
    assert text == (
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\n你好<|assistant|>\n<think>\ngreeting\n</think>\n\nHi!"
        '<|user|>\nWeather in Beijing?<|assistant|>get_weather\n{"city": "Beijing"}<|observation|>\n'
        "sunny<|assistant|>\n<think>\nit said sunny\n</think>\n\nSunny.<|user|>"
    )
    # the role token is context; the reply, then the token that ends it (the next role token), are targets
    assert trained == (
        '\n<think>\ngreeting\n</think>\n\nHi!<|user|>get_weather\n{"city": "Beijing"}'
        "<|observation|>\n<think>\nit said sunny\n</think>\n\nSunny.<|user|>"
    )


@pytest.mark.parametrize("thinking", ["keep", "drop"])
def test_z1_drops_earlier_thinking_and_trains_or_drops_the_last(folders, thinking):
    from glmtune.models import load_tokenizer

    tok = load_tokenizer(folders["z1"], thinking=thinking)
    text, trained = trained_text(tok, CHAT)
    last = "\nit said sunny\n" if thinking == "keep" else ""
    prompt = (
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\n你好<|assistant|>\nHi!<|user|>\nWeather in Beijing?"
        '<|assistant|>get_weather\n{"city": "Beijing"}<|observation|>\nsunny<|assistant|>\n<think>'
    )
    assert text == prompt + last + "</think>\n\nSunny.<|user|>"
    assert trained == (
        'Hi!<|user|>get_weather\n{"city": "Beijing"}<|observation|>' + last + "</think>\n\nSunny.<|user|>"
    )
    # the training prompt is the engines' prompt, tokenized on its own
    ids, _ = tok.encode_conversation(CHAT)
    assert ids[: len(tok.encode_prompt(CHAT[:-1]))] == tok.encode_prompt(CHAT[:-1])
    # an answer without reasoning trains as empty reasoning; the cache key follows data.thinking
    _, plain = trained_text(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}])
    assert plain == "</think>Hello.<|user|>"
    other = load_tokenizer(folders["z1"], thinking="drop" if thinking == "keep" else "keep")
    assert tok.files_sha256 != other.files_sha256


def test_a_template_that_rewrites_the_history_is_refused(folders, tmp_path):
    from glmtune.models import load_tokenizer

    config = json.loads((folders["glm4"] / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<|{{ m.role }}|>{% if loop.last %}{{ m.content }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((folders["glm4"] / "tokenizer.json").read_bytes())
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="message 1"):
        tok.encode_conversation(
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"},
            ]
        )


def test_a_folder_without_a_chat_template_is_refused(folders, tmp_path):
    from glmtune.models import load_tokenizer

    (tmp_path / "tokenizer.json").write_bytes((folders["glm4"] / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    with pytest.raises(ValueError, match="no chat_template"):
        load_tokenizer(tmp_path)


# --- the levers on the model --------------------------------------------------------------------------------------


def test_packed_rows_attend_one_document_at_a_time_on_every_path():
    model = tiny_model()
    docs = [torch.randint(0, 1266, (1, n)) for n in (7, 12, 5)]
    alone = torch.cat([model(input_ids=d).logits for d in docs], dim=1)
    ids = torch.cat(docs, dim=1)
    seq_ids = torch.cat([torch.full((1, d.shape[1]), k) for k, d in enumerate(docs)], dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    for path in ("sdpa", "segments"):
        model.model.packed_attention = path
        packed = model(input_ids=ids, position_ids=positions, seq_ids=seq_ids).logits
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def lora_step(model, **levers):
    """Loss and LoRA gradients of one step of glmtune's LoRA on every Linear, with the given levers on."""
    from glmtune.models import enable_checkpointing
    from glmtune.models.kernels.layers import set_offload_checkpoints
    from glmtune.models.kernels.tiling import set_mlp_tile_tokens
    from glmtune.train.lora import apply_lora

    model.train()
    model.loss_chunk_tokens = levers.get("chunk", 0)
    set_mlp_tile_tokens(model, levers.get("tile", 0))
    set_offload_checkpoints(model, levers.get("offload", False))
    lora = apply_lora(
        model,
        LoraConfig(
            r=4, alpha=8, dropout=0.0, target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
        ),
    )
    for p in lora.parameters():  # B nonzero, so every A has a gradient too
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    if levers.get("ckpt"):
        enable_checkpointing(lora, use_reentrant=True)
        lora.enable_input_require_grads()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1266, (2, 40), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    loss = lora(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss, {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}


def test_checkpointing_offload_chunked_loss_and_tiled_mlp_change_nothing_trained():
    loss, grads = lora_step(tiny_model())
    assert len(grads) == 2 * 6 * 2  # q, k, v, o, gate_up, down in 2 layers: lora=all_linear's names, mapped
    assert any(".q_proj." in n for n in grads) and any(".gate_up_proj." in n for n in grads)
    loss2, grads2 = lora_step(tiny_model(), ckpt=True, offload=True, chunk=16, tile=24)
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads2[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_estimate_of_the_lora_parameters_is_the_models_count():
    from glmtune.plan.estimate import RunShape, lora_params
    from glmtune.train.lora import apply_lora, trainable_parameters

    for names in (
        ["query_key_value"],
        ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
        ["q_proj", "down_proj", "lm_head"],
    ):
        model = apply_lora(tiny_model(), LoraConfig(r=8, target_modules=names))
        counted = sum(p.numel() for p in trainable_parameters(model))
        assert lora_params(TINY, RunShape(lora_r=8, lora_targets=TINY.lora_modules(names))) == counted, names


@pytest.mark.parametrize(
    "kw",
    [
        dict(dtype="fp32", seq_len=128, micro_batch=2, lora_targets=("q_proj", "k_proj", "v_proj")),
        dict(
            dtype="fp32",
            seq_len=96,
            micro_batch=1,
            gradient_checkpointing=True,
            lora_dropout=0.0,
            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
        ),
        dict(dtype="bf16", seq_len=128, micro_batch=2, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        dict(
            dtype="bf16",
            seq_len=128,
            micro_batch=1,
            gradient_checkpointing=True,
            lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
        ),
    ],
)
def test_the_estimate_is_within_5_percent_of_live_tensor_bytes(kw):
    """The sandwich norms and the split q/k/v LoRA inputs in the estimator, against one real step on CPU."""
    from glmtune.plan.estimate import RunShape, estimate
    from glmtune.probe.track import measure_lora_step

    arch = Glm4Config(
        **{**TINY_ARCH, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "head_dim": 32},
        vocab_size=1280,
    )
    shape = RunShape(device="cpu", **kw)
    measured, _ = measure_lora_step(arch, shape)
    predicted = estimate(arch, shape).peak_bytes
    assert abs(predicted - measured) / measured < 0.05, (kw, predicted, measured)


# --- exports ------------------------------------------------------------------------------------------------------


def test_the_vllm_split_of_the_fused_mlp_adapter_is_exact(tmp_path):
    """infer/'s one adapter conversion (hf_layout.GLM4_0414, adapter_for=vllm): gate_proj and up_proj with A copied
    and B's rows split compute the fused adapter's MLP exactly; rank_pattern follows the split; PEFT's form keeps
    the fused name; lm_head, which vLLM has no LoRA for, is refused."""
    import torch.nn.functional as F
    from safetensors.torch import load_file

    from glmtune.infer.adapter_export import adapter_names, convert_adapter
    from glmtune.infer.hf_layout import GLM4_0414
    from glmtune.train.lora import apply_lora

    model = tiny_model()
    lora = apply_lora(model, LoraConfig(r=4, alpha=16, dropout=0.0, target_modules=["gate_up_proj", "down_proj"]))
    for p in lora.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    lora.save_pretrained(str(tmp_path / "adapter"))
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    adapter_config.update(rank_pattern={"gate_up_proj": 4}, alpha_pattern={"model.layers.1.mlp.gate_up_proj": 16})
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    mlp = lora.base_model.model.model.layers[0].mlp
    x = torch.randn(3, 5, 128)
    config = convert_adapter(tmp_path / "adapter", tmp_path / "vllm", GLM4_0414, model.config, "vllm", "BASE")
    split = load_file(str(tmp_path / "vllm" / "adapter_model.safetensors"))
    assert config["target_modules"] == ["down_proj", "gate_proj", "up_proj"]
    assert config["rank_pattern"] == {"gate_proj": 4, "up_proj": 4} and config["base_model_name_or_path"] == "BASE"
    assert config["alpha_pattern"] == {"model.layers.1.mlp.gate_proj": 16, "model.layers.1.mlp.up_proj": 16}
    assert not [k for k in split if "gate_up_proj" in k] and len(split) == 2 * 2 * 3  # 2 layers, A and B, 3 Linears
    scale, prefix = 16 / 4, "base_model.model.model.layers.0.mlp."
    with torch.no_grad():
        fused = mlp(x)
        w_gate, w_up = mlp.gate_up_proj.base_layer.weight.chunk(2)

        def adapted(w, name):  # a Linear of vLLM's layout with its own LoRA
            return F.linear(x, w) + scale * F.linear(
                F.linear(x, split[f"{prefix}{name}.lora_A.weight"]), split[f"{prefix}{name}.lora_B.weight"]
            )

        out = mlp.down_proj(F.silu(adapted(w_gate, "gate_proj")) * adapted(w_up, "up_proj"))
        swapped = mlp.down_proj(F.silu(adapted(w_gate, "up_proj")) * adapted(w_up, "gate_proj"))
    torch.testing.assert_close(out, fused, rtol=1e-6, atol=1e-6)
    assert (swapped - fused).abs().max() > 1e-3  # the halves differ: a split in the wrong order would show
    peft = convert_adapter(tmp_path / "adapter", tmp_path / "peft", GLM4_0414, model.config, "peft", "BASE")
    assert peft["target_modules"] == ["down_proj", "gate_up_proj"] and peft["rank_pattern"] == {"gate_up_proj": 4}
    with pytest.raises(ConfigError, match="adapts lm_head, which vllm applies no LoRA to in the glm4_0414 layout"):
        adapter_names(["base_model.model.lm_head.lora_A.weight"], "A", GLM4_0414, model.config, "vllm")


def test_the_weight_name_table_is_the_checkpoints(tmp_path):
    from safetensors import safe_open

    from glmtune.models import load_config, make_tiny_checkpoint
    from glmtune.models.glm4_0414.export import check_weight_names, hf_config

    folder = make_tiny_checkpoint(tmp_path / "t", family="glm4_0414", attention_bias=False)
    config = load_config(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert check_weight_names(names, config) == ([], [])
    assert check_weight_names([*names, "model.layers.0.self_attn.q_proj.bias"], config)[1]
    written = json.loads((folder / "config.json").read_text())
    assert written == json.loads(json.dumps(hf_config(config))) and written["architectures"] == ["Glm4ForCausalLM"]


def test_inference_splits_the_32b_model_over_gpus_by_whole_layers():
    from glmtune.infer.devicemap import bytes_per_device, device_map
    from glmtune.models import build_meta_model, released_config

    model = build_meta_model(released_config("glm4_32b_0414"), dtype=torch.bfloat16)
    mapping = device_map(model, [40 * 2**30, 40 * 2**30])  # refuses a map that leaves a tensor unplaced
    assert mapping["model.embed_tokens"] == 0 and mapping["lm_head"] == 1 and len(mapping) == 61 + 4
    assert 0 <= sum(bytes_per_device(model, mapping).values()) - 32_566_081_536 * 2 < 1024  # + the rotary table


# --- the command --------------------------------------------------------------------------------------------------


def test_qlora_nf4_trains_the_tiny_0414_model(tmp_path):
    pytest.importorskip("bitsandbytes")
    from helpers.cli import glmtune_in_process

    proc = glmtune_in_process(
        "model=glm4_0414_tiny",
        "model.quantize=nf4",
        "train.max_steps=2",
        "data.val_file=null",
        "probe.enabled=false",
        "train.report_to=[]",
        f"data.cache_dir={tmp_path / 'c'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train_loss"] > 0 and (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "args,fits,frozen_gib",
    [
        (["+hw=a100_80g"], True, 32_566_081_536 * 2 / 2**30),
        (["+hw=rtx4090_24g", "model.quantize=nf4"], True, None),
        (["+hw=rtx4090_24g"], False, None),
    ],
)
def test_plans_for_32b_give_its_weights_and_say_what_fits(tmp_path, args, fits, frozen_gib):
    from helpers.cli import glmtune_in_process

    proc = glmtune_in_process("mode=plan", "model=glm4_32b_0414", *args, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == (0 if fits else 3), proc.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    frozen = plan["breakdown"]["frozen weights"] / 2**30
    if frozen_gib is not None:
        assert abs(frozen - frozen_gib) < 1e-6  # 65.13 GB
    else:
        assert 17 < frozen < 19 if "model.quantize=nf4" in args else frozen > 60
    if not fits:
        assert "dist.nproc_per_node=4" in proc.stdout + proc.stderr and "model.quantize=nf4" in proc.stdout


def test_plan_of_a_0414_preset_imports_no_model_code_nor_tokenizer(tmp_path):
    """mode=plan reads the architecture (configuration.py) only: no model code, tokenizer, tokenizers or jinja."""
    import subprocess
    import sys

    code = (
        "import runpy, sys\nsys.argv = ['glmtune', 'mode=plan', 'model=glm4_32b_0414', '+hw=a100_80g']\n"
        "try:\n    runpy.run_module('glmtune', run_name='__main__')\nexcept SystemExit as stop:\n"
        "    assert not stop.code, stop.code\n"
        "print('LOADED=' + ','.join(sorted(m for m in sys.modules if m.startswith(('glmtune.models.', 'tokenizers',"
        " 'jinja2')))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("LOADED=")), None)
    assert line is not None, proc.stderr[-3000:]
    loaded = line[len("LOADED=") :].split(",")
    assert "glmtune.models.glm4_0414.configuration" in loaded
    assert not [
        m
        for m in loaded
        if m.endswith(("modeling", "layers", "kernels.attention"))
        or "tokenization" in m
        or m.startswith(("tokenizers", "jinja2"))
    ], loaded
