"""The pieces of engine-ready exports that need no engine (issue 40; the engines themselves: test_engines.py):
tokenizer.json encodes as glmtune's tokenizers do, text configs carry no vision keys, the HF layout's splits are
exact, the printed serve command, and what an engine would refuse stops the export with one line (exit 2)."""

import json
import shutil

import pytest
import torch
from helpers.cli import glmtune_in_process
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer

from glmtune.config import ConfigError
from glmtune.infer.adapter_export import convert_adapter, renamed_patterns
from glmtune.infer.hf_layout import GLM, hf_state_dict, split_rows
from glmtune.models import load_model, load_tokenizer
from glmtune.models.chatglm.configuration import GLMConfig
from glmtune.models.chatglm.layers import SelfAttention
from glmtune.models.presets import ensure_tiny
from glmtune.models.tokenizer_files import TINY_CORPUS

CHAT = [
    {
        "role": "system",
        "content": "Be brief.",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    },
    {"role": "user", "content": "你好  there,\n  indented"},
    {"role": "assistant", "content": "Hi!  OK 😊"},
    {"role": "user", "content": "Again"},
]


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_tokenizer_json_encodes_like_glmtune(family):
    """tokenizers 0.19 (transformers 4.40.2's) reads the file; every corpus line and a rendered chat (tools block,
    runs of spaces, emoji, newlines) give glmtune's ids. Text that spells a special token is the one difference
    (an HF tokenizer turns "<|user|>" in text into the special id; glmtune keeps it text): left out."""
    folder = ensure_tiny(family)
    ours, theirs = load_tokenizer(folder), Tokenizer.from_file(str(folder / "tokenizer.json"))
    lines = [line for line in TINY_CORPUS.splitlines() if "<|" not in line] + ["  two  spaces  ", "x\n\n  y", ""]
    assert [theirs.encode(t, add_special_tokens=False).ids for t in lines] == [ours.encode(t) for t in lines]
    text = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert theirs.encode(text, add_special_tokens=False).ids == ours.apply_chat_template(
        CHAT, add_generation_prompt=True
    )


def test_text_checkpoints_have_no_vision_keys(tmp_path):
    for family, vision in (("glm4", False), ("chatglm3", False), ("glm4v", True)):
        config = json.loads((ensure_tiny(family) / "config.json").read_text())
        assert ("vision_config" in config) is vision and ("boi_token_id" in config) is vision, family
    # a base written before the fix (null vision keys): its remote export drops them, keeps everything else
    base = tmp_path / "base"
    shutil.copytree(ensure_tiny("glm4"), base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "vision_config": None, "boi_token_id": None}))
    proc = glmtune_in_process(
        "mode=infer", f"model.path={base}", f"infer.merge_to={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config


@pytest.mark.parametrize("mqa", [True, False])
def test_qkv_split_reads_the_rows_the_model_reads(mqa):
    """q_proj/k_proj/v_proj from the fused weight (and bias) give the q, k, v glmtune's attention computes, under
    GQA ([all q | all k | all v]) and full multi-head attention (per head [q_h | k_h | v_h])."""
    config = GLMConfig(
        hidden_size=64, kv_channels=16, num_attention_heads=4, multi_query_attention=mqa, multi_query_group_num=2
    )
    torch.manual_seed(0)
    attn, x = SelfAttention(config), torch.randn(1, 3, 64)
    fused = attn.query_key_value(x)
    hd, heads, groups = 16, 4, config.kv_groups
    if mqa:
        want = fused.split([heads * hd, groups * hd, groups * hd], -1)
    else:
        want = [t.reshape(1, 3, heads * hd) for t in fused.view(1, 3, heads, 3 * hd).split(hd, -1)]
    weights = dict(split_rows(attn.query_key_value.weight, GLM.splits["query_key_value"](config), config))
    biases = dict(split_rows(attn.query_key_value.bias, GLM.splits["query_key_value"](config), config))
    for name, expected in zip(("q_proj", "k_proj", "v_proj"), want):
        torch.testing.assert_close(x @ weights[name].T + biases[name], expected, rtol=0, atol=1e-6)


def test_hf_names_cover_every_tensor_and_lora_split_is_exact(tmp_path):
    model = load_model(ensure_tiny("glm4"), dtype=torch.float32)
    names = set(hf_state_dict(GLM, model.state_dict(), model.config))
    assert "model.layers.0.self_attn.k_proj.bias" in names and "lm_head.weight" in names
    assert not any("transformer" in n or "query_key_value" in n for n in names)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["query_key_value", "dense_h_to_4h"]),
    )
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    saved.update(
        rank_pattern={"query_key_value": 4, "transformer.encoder.layers.1.mlp.dense_h_to_4h": 4},
        alpha_pattern={"dense_h_to_4h": 8},
    )
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(saved))
    layer = peft_model.base_model.model.transformer.encoder.layers[0].self_attention.query_key_value
    fused = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    config = convert_adapter(tmp_path / "adapter", tmp_path / "out", GLM, model.config, "vllm", "BASE")
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0."
    delta = torch.cat(
        [
            got[f"{prefix}self_attn.{p}.lora_B.weight"] @ got[f"{prefix}self_attn.{p}.lora_A.weight"]
            for p in ("q_proj", "k_proj", "v_proj")
        ]
    )
    torch.testing.assert_close(delta, fused, rtol=0, atol=1e-6)
    assert f"{prefix}mlp.gate_up_proj.lora_A.weight" in got
    assert config["target_modules"] == ["gate_up_proj", "k_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == "BASE"
    assert config["rank_pattern"] == {"q_proj": 4, "k_proj": 4, "v_proj": 4, "model.layers.1.mlp.gate_up_proj": 4}
    assert config["alpha_pattern"] == {"gate_up_proj": 8}  # the patterns follow the renames and the q/k/v split
    with pytest.raises(ConfigError, match="rank_pattern key 'layers.0.mlp.dense_h_to_4h' names no module"):
        renamed_patterns({"rank_pattern": {"layers.0.mlp.dense_h_to_4h": 4}}, {}, GLM, model.config, "vllm", "A")


def test_printed_command_and_serve_md(tmp_path):
    out = tmp_path / "export"
    proc = glmtune_in_process(
        "mode=infer", "model=glm4_tiny", f"infer.merge_to={out}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    command = proc.stdout.strip().splitlines()[-1]
    assert command == (
        f"vllm serve {out} --served-model-name export --generation-config {out} "
        f"--chat-template {out}/chat_template.jinja"
    )
    assert command in (out / "SERVE.md").read_text() and "trust_remote_code" not in (out / "SERVE.md").read_text()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (out / "chat_template.jinja").read_text() == config["chat_template"]
    from transformers import AutoTokenizer  # transformers 4.40.2 loads the same folder's tokenizer.json

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok(CHAT[1]["content"], add_special_tokens=False).input_ids == load_tokenizer(out).encode(CHAT[1]["content"])


def test_glm4v_export_keeps_vision_and_names_vllms_glm4v_model(tmp_path):
    """vLLM picks its GLM-4V model by the config's vision_config; its text ChatGLM refuses such a folder and says to
    override the architecture, which the printed command does. (vLLM itself is not run on GLM-4V: README.)"""
    out = tmp_path / "export"
    proc = glmtune_in_process("mode=infer", "model=glm4v_tiny", f"infer.merge_to={out}", f"hydra.run.dir={tmp_path}/r")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["vision_config"]
    assert proc.stdout.strip().endswith('--hf-overrides \'{"architectures": ["GLM4VForCausalLM"]}\'')


def test_glm4_0414_export_is_the_bases_own_layout(tmp_path):
    """GLM-4-0414's checkpoint is HF-native: `remote` and `hf` write the same folder — the weights under the
    checkpoint's own names, config.json from its config, and the base's other files as it ships them (tokenizer.json
    with pair merges, tokenizer_config.json, generation_config.json, a README), the chat template as a file too —
    which reloads with the merged model's logits; the printed command needs no remote code."""
    from safetensors import safe_open

    from glmtune.config import ModelConfig
    from glmtune.infer.generate import load_merged
    from glmtune.models import load_config
    from glmtune.models.glm4_0414.export import check_weight_names, hf_config

    base = tmp_path / "base"
    shutil.copytree(ensure_tiny("glm4_0414"), base)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    tokenizer["model"]["merges"] = [m.split(" ") for m in tokenizer["model"]["merges"]]  # tokenizers >= 0.20's form
    (base / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (base / "README.md").write_text("the user's model card\n")
    folder = adapter(
        tmp_path, "glm4_0414", target_modules=["q_proj", "gate_up_proj", "down_proj"], init_lora_weights=False
    )
    out = {}
    for fmt in ("remote", "hf"):
        out[fmt] = tmp_path / fmt
        proc = glmtune_in_process(
            "mode=infer",
            f"model.path={base}",
            f"infer.adapter={folder}",
            f"infer.merge_to={out[fmt]}",
            f"infer.merge_format={fmt}",
            f"hydra.run.dir={tmp_path / ('run-' + fmt)}",
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"merged base + adapter (hf layout, the base's own) written to {out[fmt]}" in proc.stdout
        command = proc.stdout.strip().splitlines()[-1]
        assert command == (
            f"vllm serve {out[fmt]} --served-model-name {fmt} --generation-config {out[fmt]} "
            f"--chat-template {out[fmt]}/chat_template.jinja"
        )
    own = {".glmtune-export.json", "SERVE.md"}  # they name the folder
    files = sorted(p.name for p in out["hf"].iterdir())
    assert files == sorted(p.name for p in out["remote"].iterdir())
    for name in set(files) - own:
        assert (out["hf"] / name).read_bytes() == (out["remote"] / name).read_bytes(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert (out["hf"] / name).read_bytes() == (base / name).read_bytes(), name
    template = json.loads((base / "tokenizer_config.json").read_text())["chat_template"]
    assert (out["hf"] / "chat_template.jinja").read_text() == template and "tokenizer.model" not in files
    config = load_config(base)
    assert json.loads((out["hf"] / "config.json").read_text()) == json.loads(json.dumps(hf_config(config)))
    with safe_open(str(out["hf"] / "model.safetensors"), "pt") as f:
        assert check_weight_names(f.keys(), config) == ([], [])
    serve_md = (out["hf"] / "SERVE.md").read_text()
    assert "HF-native layout (Glm4ForCausalLM): transformers >= 4.51.3" in serve_md and "trust_remote" not in serve_md
    ids = torch.tensor([load_tokenizer(base).encode_prompt(CHAT)])
    with torch.no_grad():
        merged = load_merged(base, folder, ModelConfig(), torch.float32)(input_ids=ids).logits
        torch.testing.assert_close(load_model(out["hf"], dtype=torch.float32)(input_ids=ids).logits, merged)
        assert (merged - load_model(base, dtype=torch.float32)(input_ids=ids).logits).abs().max() > 1e-3


def adapter(tmp_path, family="glm4", **lora) -> str:
    """A PEFT adapter on the tiny `family`, saved as glmtune's training saves one (no base embedding layers)."""
    torch.manual_seed(0)
    folder = tmp_path / "adapter"
    get_peft_model(load_model(ensure_tiny(family)), LoraConfig(r=4, lora_alpha=8, **lora)).save_pretrained(
        str(folder), save_embedding_layers=False
    )
    return str(folder)


@pytest.mark.parametrize(
    "case,expected",
    [
        ("hf-chatglm3", "infer.merge_format=hf: ChatGLM3 has no HF-native class in transformers"),
        ("dora", "cannot be served by vLLM: it is a DoRA adapter"),
        ("output_layer", "adapts lm_head, which vllm applies no LoRA to in the glm4 layout"),
        ("0414-lm_head", "adapts lm_head, which vllm applies no LoRA to in the glm4_0414 layout"),
        ("no-merge-to", "infer.adapter_for=vllm exports infer.adapter beside its base: it needs"),
        ("bad-format", "infer.merge_format='onnx' is not one of remote, hf"),
    ],
)
def test_what_an_engine_refuses_stops_the_export(tmp_path, case, expected):
    args = {
        "hf-chatglm3": lambda: ["model=chatglm3_tiny", "infer.merge_format=hf"],
        "dora": lambda: [
            f"infer.adapter={adapter(tmp_path, target_modules=['query_key_value'], use_dora=True)}",
            "infer.adapter_for=vllm",
        ],
        "output_layer": lambda: [
            f"infer.adapter={adapter(tmp_path, target_modules=['output_layer'])}",
            "infer.adapter_for=vllm",
            "infer.merge_format=hf",
        ],
        "0414-lm_head": lambda: [
            "model=glm4_0414_tiny",
            "infer.adapter_for=vllm",
            f"infer.adapter={adapter(tmp_path, 'glm4_0414', target_modules=['gate_up_proj', 'lm_head'])}",
        ],
        "no-merge-to": lambda: ["infer.adapter_for=vllm", "infer.prompt=hi"],
        "bad-format": lambda: ["infer.merge_format=onnx"],
    }[case]()
    merge = [] if case == "no-merge-to" else [f"infer.merge_to={tmp_path / 'out'}"]
    proc = glmtune_in_process("mode=infer", *merge, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-2000:])
    assert expected in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
