"""GLM-4-0414 against transformers' own Glm4ForCausalLM (issue 41): glmtune's model on transformers 4.40.2 reads the
tiny checkpoints transformers 5 wrote with save_pretrained (tests/helpers/reference.py), and computes what it computed.

Per checkpoint (attention_bias true/false, 2 and 4 KV heads; fp32, and bf16 once): the logits of a right-padded
batch, the loss and every LoRA gradient with the reference's own PEFT adapter (random A and B, all six Linears)
within 1e-5 in fp32; greedy tokens of left-padded prompts with the KV cache identical. The tokenizer transformers
re-saved (tokenizers 0.23: merges as pairs, the template in chat_template.jinja) loads on tokenizers 0.19 and
encodes as the file glmtune wrote; the chat template's prompt ids equal apply_chat_template's, for GLM-4-0414's
template and GLM-Z1's, with tools, tool calls, system turns and history; the training prompt is the engines' prompt.
"""

from __future__ import annotations

import json

import pytest
import torch
from ref_glm4_0414_worker import LORA_TARGETS, STOPS, VARIANTS, batch, greedy_prompts
from safetensors.torch import load_file

FP32 = [name for name, v in VARIANTS.items() if v[2] == "float32"]


def glmtune_model(folder):
    from glmtune.models import load_model

    return load_model(folder).eval()


def with_reference_lora(model, folder):
    """glmtune's LoRA (train/lora.apply_lora: fp32 adapters) carrying the reference's adapter weights."""
    from peft import set_peft_model_state_dict

    from glmtune.config import LoraConfig
    from glmtune.train.lora import apply_lora

    lora = apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0, target_modules=list(LORA_TARGETS)))
    weights = load_file(folder / "lora" / "adapter_model.safetensors")
    result = set_peft_model_state_dict(lora, weights)
    assert not [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    return lora


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_loss_and_every_lora_gradient_match(reference, name):
    """fp32: within 1e-5. bf16: both implementations round, each its own way, so glmtune's bf16 logits must be as
    close to the reference's as either is to the fp32 computation of the same weights, the loss within one bf16
    step, and every LoRA gradient point the same way (cosine > 0.999)."""
    folder = reference / name
    expected = load_file(folder / "reference.safetensors")
    fp32 = VARIANTS[name][2] == "float32"
    inputs = batch(1266)
    valid = inputs["attention_mask"].bool()
    model = glmtune_model(folder)
    assert model.dtype == (torch.float32 if fp32 else torch.bfloat16)
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.float()
    if fp32:
        torch.testing.assert_close(logits[valid], expected["logits"][valid], rtol=1e-5, atol=1e-5)
    else:
        from glmtune.models import load_model

        with torch.no_grad():
            exact = load_model(folder, dtype="float32")(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
            ).logits[valid]
        ours, theirs = logits[valid], expected["logits"][valid]
        assert (ours - theirs).abs().mean() <= (theirs - exact).abs().mean()
        assert (ours - theirs).abs().max() <= (theirs - exact).abs().max()
    lora = with_reference_lora(model, folder)
    out = lora(**inputs)
    out.loss.backward()
    tol = dict(rtol=1e-5, atol=1e-5) if fp32 else dict(rtol=2**-7, atol=0.0)  # bf16: its 8 significant bits
    torch.testing.assert_close(out.loss.float().reshape(1), expected["loss"], **tol)
    if fp32:
        torch.testing.assert_close(out.logits.float()[valid], expected["lora_logits"][valid], **tol)
    grads = {n.replace(".default", ""): p.grad.float() for n, p in lora.named_parameters() if p.requires_grad}
    wanted = {k[len("grad.") :]: v for k, v in expected.items() if k.startswith("grad.")}
    assert sorted(grads) == sorted(wanted) and len(grads) == 2 * len(LORA_TARGETS) * 2  # A and B, 6 Linears, 2 layers
    for key, grad in grads.items():
        if fp32:
            torch.testing.assert_close(grad, wanted[key], **tol, msg=key)
        else:
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), wanted[key].flatten(), dim=0)
            assert cosine > 0.999, (key, float(cosine))


@pytest.mark.parametrize("name", FP32)
def test_greedy_tokens_with_the_kv_cache_match(reference, name):
    from glmtune.models.kvcache import preallocated_kv_cache

    model = glmtune_model(reference / name)
    prompts, mask = greedy_prompts()
    with torch.no_grad(), preallocated_kv_cache(model, 10):
        got = model.generate(
            input_ids=prompts,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=STOPS,
            pad_token_id=STOPS[0],
            use_cache=True,
        )
    assert got.tolist() == load_file(reference / name / "reference.safetensors")["greedy"].tolist()


def test_tokenizer_json_with_pair_merges_loads_on_tokenizers_019(reference):
    """transformers 5 re-saved the tokenizer with tokenizers 0.23: merges as pairs, which 0.19 alone refuses."""
    import tokenizers

    from glmtune.models import load_tokenizer

    assert tokenizers.__version__.startswith("0.19")
    saved = json.loads((reference / "bias_kv2" / "tokenizer.json").read_text())
    assert isinstance(saved["model"]["merges"][0], list)
    with pytest.raises(Exception):
        tokenizers.Tokenizer.from_file(str(reference / "bias_kv2" / "tokenizer.json"))
    pairs, strings = load_tokenizer(reference / "bias_kv2"), load_tokenizer(reference / "tok")
    text = 'GLM-4 是一个开源的大语言模型。 The quick brown fox, 2024-06-05 {"a": 1}\n\n  def f(x):'
    assert pairs.encode(text) == strings.encode(text) and len(pairs.encode(text)) > 20
    assert pairs.stop_token_ids == STOPS and pairs.decode(pairs.encode(text)) == text


@pytest.mark.parametrize("name,template", [("bias_kv2", "tok"), ("nobias_kv2", "tok_z1")])
def test_chat_template_prompt_ids_match_apply_chat_template(reference, name, template):
    from glmtune.models import load_tokenizer

    tok = load_tokenizer(reference / name)  # chat_template.jinja, where transformers 5 saved it
    cases = json.loads((reference / "conversations.json").read_text())[template]
    expected = json.loads((reference / name / "reference.json").read_text())["template_ids"]
    for case, ids in zip(cases, expected):
        got = tok.encode_prompt(case["glm"]) if case["prompt"] else tok.apply_chat_template(case["glm"])
        assert got == ids, (case["messages"][-1], tok.decode(got), tok.decode(ids))
    # What trains is what an engine renders: the training prompt of the last case is the second case's prompt.
    train_ids, labels = tok.encode_conversation(cases[3]["glm"])
    assert train_ids[: len(expected[1])] == expected[1]
    assert any(label != -100 for label in labels[: len(expected[1])])  # the earlier assistant turn is trained too


def test_an_adapter_glmtune_trains_loads_in_peft_on_the_reference_and_its_merge_in_transformers(reference, tmp_path):
    """`glmtune model=glm4_9b_0414 model.path=<reference checkpoint> train.max_steps=3` trains (the CLI entry point,
    in this process); transformers 5 + PEFT 0.21 load its adapter on their own Glm4ForCausalLM, and transformers
    loads its `infer.merge_to` folder (HF-native: Glm4ForCausalLM, the base's template, GLM's stop ids), each with
    glmtune's logits (1e-5)."""
    from helpers.cli import glmtune_in_process
    from helpers.reference import peft_logits

    from glmtune.infer.adapter import load_adapter
    from glmtune.models import load_model

    base = reference / "bias_kv2"
    run, merged = tmp_path / "run", tmp_path / "merged"
    common = ["model=glm4_9b_0414", f"model.path={base}", "train.precision=fp32", f"data.cache_dir={tmp_path / 'c'}"]
    proc = glmtune_in_process(
        *common,
        "train.max_steps=3",
        "lora=all_linear",
        "train.learning_rate=5e-2",
        "data.val_file=null",
        "probe.enabled=false",
        "train.report_to=[]",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(LORA_TARGETS)
    proc = glmtune_in_process(
        *common,
        "mode=infer",
        f"infer.adapter={run / 'adapter'}",
        'infer.prompt="你好"',
        f"infer.merge_to={merged}",
        f"hydra.run.dir={tmp_path / 'infer'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Glm4ForCausalLM"]
    assert (merged / "chat_template.jinja").read_text() == (base / "chat_template.jinja").read_text()
    assert json.loads((merged / "generation_config.json").read_text())["eos_token_id"] == STOPS
    ids = batch(1266)["input_ids"]
    jobs = [
        {"checkpoint": str(base), "adapter": str(run / "adapter"), "ids": ids.tolist(), "out": str(tmp_path / "a")},
        {"checkpoint": str(merged), "adapter": None, "ids": ids.tolist(), "out": str(tmp_path / "m")},
    ]
    proc = peft_logits(tmp_path / "jobs.json", jobs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        ours = load_adapter(load_model(base), str(run / "adapter")).eval()(input_ids=ids).logits
        before = load_model(base).eval()(input_ids=ids).logits
        ours_merged = load_model(merged).eval()(input_ids=ids).logits
    assert (ours - before).abs().max() > 1e-2  # the adapter changed the model
    torch.testing.assert_close(load_file(tmp_path / "a")["logits"], ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(load_file(tmp_path / "m")["logits"], ours_merged, rtol=1e-5, atol=1e-5)
    # W + BA rounds once where the unmerged model adds x A^T B^T: the merge is the adapter up to that rounding
    torch.testing.assert_close(ours_merged, ours, rtol=1e-4, atol=1e-4)
