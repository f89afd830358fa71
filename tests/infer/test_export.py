"""infer.merge_to: the merged folder carries the base's own files (auto_map, modeling code), the stop ids and a chat
template, reloads with base + adapter's logits in glmtune, in transformers (trust_remote_code) and under PEFT, and
generation from it stops at a stop id because generation_config.json says so."""

import json
import shutil

import pytest
import torch
from helpers.cli import glmtune_in_process
from jinja2.sandbox import ImmutableSandboxedEnvironment
from peft import PeftModel
from safetensors import safe_open

from glmtune.infer.export import save_merged
from glmtune.models import load_model, load_tokenizer
from glmtune.models.chatglm.chat_template import chat_template_for
from glmtune.models.presets import ensure_tiny
from glmtune.models.tokenizer_files import write_tiny_tokenizer

# Stand-ins for the official checkpoint's remote code: what `auto_map` names, importable by transformers'
# dynamic-module loader. They build glmtune's model under the official class names and constructor signature.
CONFIGURATION = """from glmtune.models.chatglm.configuration import GLMConfig


class ChatGLMConfig(GLMConfig):
    model_type = "chatglm"
"""
MODELING = """from glmtune.models.chatglm.modeling import ChatGLMForConditionalGeneration as _GLM

from .configuration_chatglm import ChatGLMConfig


class ChatGLMForConditionalGeneration(_GLM):
    config_class = ChatGLMConfig

    def __init__(self, config, empty_init=True, device=None):
        super().__init__(config)
"""
AUTO_MAP = {
    "AutoConfig": "configuration_chatglm.ChatGLMConfig",
    "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
}
# Every reply is "OK": a few steps teach the tiny model to end it with <|user|>, the terminator glmtune trains.
QUESTIONS = ["Say OK.", "Reply OK please.", "Just OK.", "你好", "Answer with OK.", "Is it fine?", "Ready?", "OK?"]
PROMPT = [{"role": "user", "content": "Say OK."}]
# Official tensor names (glm4-facts §2): every name the merged files hold must be one of these.
OFFICIAL = (
    "transformer.embedding.word_embeddings.weight",
    "transformer.rotary_pos_emb.inv_freq",
    "transformer.encoder.final_layernorm.weight",
    "transformer.output_layer.weight",
)
LAYER = (
    "input_layernorm.weight",
    "self_attention.query_key_value.weight",
    "self_attention.query_key_value.bias",
    "self_attention.dense.weight",
    "post_attention_layernorm.weight",
    "mlp.dense_h_to_4h.weight",
    "mlp.dense_4h_to_h.weight",
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A base folder with stand-in remote code and auto_map, an adapter trained on it by the CLI, and the CLI's
    merge of the two."""
    root = tmp_path_factory.mktemp("export")
    base = root / "base"
    shutil.copytree(ensure_tiny("glm4"), base)
    (base / "configuration_chatglm.py").write_text(CONFIGURATION)
    (base / "modeling_chatglm.py").write_text(MODELING)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}, indent=2) + "\n")
    data = root / "ok.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "OK"}]}) + "\n"
            for q in QUESTIONS
        )
    )
    train = glmtune_in_process(
        f"model.path={base}",
        f"data.train_file={data}",
        "data.val_file=null",
        "lora=all_linear",
        "train.learning_rate=2e-2",
        "train.max_steps=25",
        "train.per_device_batch_size=4",
        "probe.enabled=false",
        f"hydra.run.dir={root / 'run'}",
    )
    assert train.returncode == 0, train.stderr[-3000:]
    merged = root / "merged"
    merge = glmtune_in_process(
        "mode=infer",
        f"model.path={base}",
        f"infer.adapter={root / 'run' / 'adapter'}",
        f"infer.merge_to={merged}",
        f"hydra.run.dir={root / 'infer'}",
    )
    assert merge.returncode == 0, merge.stderr[-3000:]
    return base, root / "run" / "adapter", merged


def test_export_carries_the_base_files_stop_ids_and_chat_template(exported):
    base, _, merged = exported
    for name in ("config.json", "configuration_chatglm.py", "modeling_chatglm.py", "tokenizer.model"):
        assert (merged / name).read_bytes() == (base / name).read_bytes(), name  # the user's files, not ours
    assert json.loads((merged / "config.json").read_text())["auto_map"] == AUTO_MAP
    tok = load_tokenizer(base)
    generation = json.loads((merged / "generation_config.json").read_text())
    stops = [tok.get_command(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert generation["eos_token_id"] == stops and generation["pad_token_id"] == tok.pad_token_id
    template = json.loads((merged / "tokenizer_config.json").read_text())["chat_template"]
    assert template == chat_template_for(tok)  # the base had none
    names = set()
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.float32}  # the base's torch_dtype
    layers = {f"transformer.encoder.layers.{i}.{n}" for i in range(2) for n in LAYER}
    assert names == set(OFFICIAL) | layers


def test_export_reloads_with_base_plus_adapter_logits_everywhere(exported):
    from transformers import AutoModelForCausalLM

    base, adapter, merged = exported
    tok = load_tokenizer(base)
    ids = torch.tensor([tok.apply_chat_template(PROMPT + [{"role": "assistant", "content": "OK then"}])])
    with torch.no_grad():
        expected = PeftModel.from_pretrained(load_model(base), str(adapter)).eval()(input_ids=ids).logits
        # glmtune: model.path=<merged>
        torch.testing.assert_close(load_model(merged).eval()(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        # transformers with the folder's own code (auto_map -> the stand-in modeling file)
        remote = AutoModelForCausalLM.from_pretrained(str(merged), trust_remote_code=True).eval()
        assert type(remote).__module__.endswith("modeling_chatglm")
        torch.testing.assert_close(remote(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        # PEFT: the run's adapter folder on the remote-code base
        official = AutoModelForCausalLM.from_pretrained(str(base), trust_remote_code=True)
        peft_logits = PeftModel.from_pretrained(official, str(adapter)).eval()(input_ids=ids).logits
        torch.testing.assert_close(peft_logits, expected, rtol=1e-5, atol=1e-5)


def test_generation_stops_at_a_stop_id_from_generation_config(exported):
    from transformers import AutoModelForCausalLM

    base, _, merged = exported
    tok = load_tokenizer(base)
    stops = set(tok.stop_token_ids)
    model = AutoModelForCausalLM.from_pretrained(str(merged), trust_remote_code=True).eval()
    prompt = torch.tensor([tok.apply_chat_template(PROMPT, add_generation_prompt=True)])
    with torch.no_grad():
        # No eos_token_id passed: transformers takes it from the folder's generation_config.json, as vLLM does.
        stopped = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1] :].tolist()
        # The same model told to stop only at [MASK], which it never writes: it runs on to max_new_tokens.
        unstopped = model.generate(
            prompt,
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=[tok.get_command("[MASK]")],
        )[0, prompt.shape[1] :].tolist()
    assert stopped[-1] in stops and len(stopped) < 20, tok.decode(stopped)
    assert tok.decode(stopped[:-1]).strip() == "OK"
    assert unstopped[: len(stopped)] == stopped and len(unstopped) == 20


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_sharded_export_with_index_reloads(tmp_path, family):
    """Above the shard size the weights are split as the official repo splits them, with the index glmtune (and
    transformers) read; a base with its own chat template and generation settings keeps them."""
    base = tmp_path / "base"
    shutil.copytree(ensure_tiny(family), base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'mine' }}"}))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, "top_p": 0.8, "do_sample": True}))
    model, tok = load_model(base).eval(), load_tokenizer(base)
    merged = save_merged(model, tok, tmp_path / "merged", shard_size="100KB")  # base: where it loaded from
    index = json.loads((merged / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0].startswith("model-00001-of-")
    assert "transformer.rotary_pos_emb.inv_freq" in index["weight_map"]
    ids = torch.tensor([tok.apply_chat_template(PROMPT, add_generation_prompt=True)])
    with torch.no_grad():
        torch.testing.assert_close(load_model(merged)(input_ids=ids).logits, model(input_ids=ids).logits)
    assert json.loads((merged / "tokenizer_config.json").read_text())["chat_template"] == "{{ 'mine' }}"
    generation = json.loads((merged / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [5, *tok.stop_token_ids] and generation["top_p"] == 0.8
    assert tok.stop_token_ids == [tok.eos_token_id, tok.get_command("<|user|>"), tok.get_command("<|observation|>")]


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_chat_template_renders_what_glmtune_trains_on(tmp_path, family):
    """The exported template, rendered as transformers renders templates (sandbox, trim_blocks, lstrip_blocks),
    gives the text of glmtune's tokenizer for chats with tools, tool calls and observations."""
    write_tiny_tokenizer(tmp_path, family)
    tok = load_tokenizer(tmp_path)
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template_for(tok))
    tools = [
        {
            "function": {
                "description": "Weather",
                "name": "get_weather",  # keys sorted: jinja 3's tojson sorts
                "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
            },
            "type": "function",
        }
    ]
    chats = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "你好"},
            {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "More"},
        ],
        [
            {"role": "system", "content": "", "tools": tools},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'},
            {"role": "observation", "content": '{"t": 21}'},
            {"role": "assistant", "content": "21 degrees"},
        ],
    ]
    if family == "glm4":
        chats.append(
            [
                {"role": "system", "content": "", "tools": [{"type": "python"}, {"type": "cogview"}]},
                {"role": "user", "content": "Draw"},
            ]
        )
    for chat in chats:
        for generation_prompt in (False, True):
            assert template.render(messages=chat, add_generation_prompt=generation_prompt) == tok.apply_chat_template(
                chat, add_generation_prompt=generation_prompt, tokenize=False
            )
