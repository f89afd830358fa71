"""model.quantize=nf4|int8: bitsandbytes base weights on CPU — storage vs the estimator, QLoRA training, the adapter
on the unquantized base, inference and merging with a quantized base, the plan on 24 GB cards."""

import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("bitsandbytes")

from helpers.files import logged_losses, metrics_rows, write_fixed  # noqa: E402
from peft import PeftModel  # noqa: E402

from glmtune.config import ConfigError, DataConfig, LoraConfig, ModelConfig, RunConfig, TrainConfig, parse_config  # noqa: E402
from glmtune.data.pipeline import DataCollator, build_datasets  # noqa: E402
from glmtune.models import load_config, load_model, load_tokenizer  # noqa: E402
from glmtune.models.presets import ensure_tiny  # noqa: E402
from glmtune.models.quantize import load_quantized, quantized_linear_names, weight_storage_bytes  # noqa: E402
from glmtune.plan.estimate import RunShape, estimate, frozen_params  # noqa: E402
from glmtune.plan.planner import make_plan  # noqa: E402
from glmtune.train.trainer import train  # noqa: E402


@pytest.mark.parametrize("family", ["glm4", "glm4v"])
@pytest.mark.parametrize("quantize,double_quant", [("nf4", True), ("nf4", False), ("int8", True)])
def test_estimator_weight_bytes_equal_the_quantized_models_storage(family, quantize, double_quant):
    """Byte for byte: packed codes, absmax (nested or not), code tables, int8 row scales, and everything the
    loader keeps unquantized (embedding, output layer, norms, biases, the vision tower)."""
    path = ensure_tiny(family)
    model = load_quantized(path, quantize, torch.float32, device="cpu", double_quant=double_quant)
    arch = load_config(path)
    shape = RunShape(dtype="fp32", quantize=quantize, double_quant=double_quant, device="cpu")
    assert estimate(arch, shape).breakdown["frozen weights"] == weight_storage_bytes(model)
    unquantized = estimate(arch, RunShape(dtype="fp32", device="cpu")).breakdown["frozen weights"]
    assert unquantized == frozen_params(arch) * 4 == weight_storage_bytes(load_model(path, dtype="float32"))
    assert weight_storage_bytes(model) < unquantized
    # Only the GLM blocks' Linears are quantized: the head, and GLM-4V's tower, keep the compute dtype.
    names = quantized_linear_names(model)
    assert len(names) == 4 * arch.num_layers and not any(".vision." in n for n in names)
    assert model.transformer.output_layer.weight.dtype == torch.float32
    if family == "glm4v":
        assert {p.dtype for p in model.transformer.vision.parameters()} == {torch.float32}


def test_quantized_model_computes_what_the_full_model_does_within_quantization_error():
    path = ensure_tiny("glm4")
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = load_model(path, dtype="float32").eval()(input_ids=ids).logits
        errors = {
            q: ((load_quantized(path, q, torch.float32)(input_ids=ids).logits - full).norm() / full.norm()).item()
            for q in ("int8", "nf4")
        }
    # Relative logit error on random weights: int8 ~3%, NF4 ~30% (4 bits on a Gaussian); a wrong layout or
    # scale (transposed weight, absmax of the wrong block) gives ~100% or more.
    assert errors["int8"] < 0.08 and errors["nf4"] < 0.5 and errors["int8"] < errors["nf4"], errors


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_qlora_finetune_loss_falls_and_adapter_loads_on_the_unquantized_base(tmp_path, quantize):
    model_dir = ensure_tiny("glm4")
    run = RunConfig(
        model=ModelConfig(quantize=quantize),
        data=DataConfig(train_file=str(write_fixed(tmp_path / "fixed.jsonl")), val_file=None),
        lora=LoraConfig(target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
        train=TrainConfig(max_steps=40, learning_rate=1e-2, per_device_batch_size=4, logging_steps=1),
    )
    tokenizer = load_tokenizer(model_dir)
    train_set, _, _ = build_datasets(run.data, tokenizer)
    choices = make_plan(run, load_config(model_dir), 1, user_set_max_length=False).choices
    metrics, model = train(
        run, choices, tmp_path / "run", model_dir, train_set, None, DataCollator(tokenizer.pad_token_id)
    )
    losses = logged_losses(tmp_path / "run")
    # Near ln(1280) = 7.15 at the start; the adapters memorise four replies on top of the quantized base.
    assert losses[0] > 0.8 * math.log(1280)
    assert losses[-1] < 0.5 * losses[0], losses
    lora_layers = [m for n, m in model.named_modules() if n.endswith("query_key_value") and hasattr(m, "lora_A")]
    assert lora_layers and all(type(m).__module__ == "peft.tuners.lora.bnb" for m in lora_layers)

    adapter = tmp_path / "run" / "adapter"
    batch = DataCollator(tokenizer.pad_token_id)(train_set)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    model.eval()
    with torch.no_grad():
        trained = model(**inputs).logits
        # The same adapter on a freshly quantized base reproduces the trained model ...
        requantized = PeftModel.from_pretrained(load_quantized(model_dir, quantize, torch.float32), str(adapter))
        torch.testing.assert_close(requantized.eval()(**inputs).logits, trained, rtol=1e-4, atol=1e-4)
        # ... and it is a standard PEFT adapter: it loads on the unquantized base, with the trained weights.
        full = PeftModel.from_pretrained(load_model(model_dir, dtype="float32"), str(adapter)).eval()
        trained_lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
        loaded_lora = {n: p for n, p in full.named_parameters() if "lora_" in n}
        assert trained_lora.keys() == loaded_lora.keys() and len(trained_lora) == 4 * 2 * 2
        for name, p in trained_lora.items():
            torch.testing.assert_close(loaded_lora[name], p)
        labels = batch["labels"]
        base_loss = load_model(model_dir, dtype="float32").eval()(**inputs, labels=labels).loss
        assert full(**inputs, labels=labels).loss < base_loss  # what was learnt carries over to the full weights


def test_quantize_is_validated_with_every_other_problem():
    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"quantize": "nf3"}, "train": {"learning_rate": -1}})
    assert "model.quantize='nf3' is not one of none, nf4, int8" in str(err.value)
    assert "train.learning_rate" in str(err.value)
    with pytest.raises(ConfigError, match="ZeRO-3"):
        parse_config({"model": {"quantize": "nf4"}, "dist": {"strategy": "zero3"}})


def _plan(*args, cwd, tmp_path):
    from helpers.cli import glmtune_in_process

    return glmtune_in_process("mode=plan", *args, f"hydra.run.dir={tmp_path}", cwd=cwd)


def test_glm4v_plans_on_one_24gb_card_with_nf4_and_advice_names_it(tmp_path, repo):
    out = _plan("model=glm4v_9b", "+hw=rtx4090_24g", "model.quantize=nf4", cwd=repo, tmp_path=tmp_path / "a")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["fits"] and plan["choices"]["zero_stage"] == 0 and not plan["choices"]["offload_params"]
    # NF4 language model (~4 GiB) + bf16 embedding, head (2.3 GiB) and vision tower (8.4 GiB)
    assert 13 * 2**30 < plan["breakdown"]["frozen weights"] < 16 * 2**30
    # Where bf16 cannot fit without offload or ZeRO-3 (strategy ddp), the advice names the quantized base.
    out = _plan("model=glm4v_9b", "+hw=rtx4090_24g", "dist=ddp", cwd=repo, tmp_path=tmp_path / "b")
    assert out.returncode == 3
    options = out.stdout + out.stderr  # the numbered options under the plan table, the best one in the line
    assert "model.quantize=int8" in options or "model.quantize=nf4" in options, options


def test_glm4_32k_plans_on_one_24gb_card_with_nf4(tmp_path, repo):
    """40 x 32,768 tokens x 4096 x 2 B = 10.7 GiB of checkpointed block inputs: it fits because the plan also
    keeps those in pinned CPU memory (offload_checkpoints)."""
    out = _plan(
        "model=glm4_9b_chat",
        "+hw=rtx4090_24g",
        "model.quantize=nf4",
        "data.max_length=32768",
        cwd=repo,
        tmp_path=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_infer_with_a_quantized_base_and_merge_into_the_full_weights(tmp_path, repo):
    """mode=infer with model.quantize=nf4: predictions come from the NF4 base + unmerged adapter; merge_to writes
    the full-precision base + adapter in the official layout (not dequantized NF4 weights)."""
    import peft
    from helpers.files import PROMPTS, write_jsonl

    from glmtune.config import InferConfig
    from glmtune.infer.generate import generate, run_infer

    base_dir = ensure_tiny("glm4")
    torch.manual_seed(0)  # an adapter with non-zero B, so it changes the outputs
    lora = peft.LoraConfig(
        r=4, lora_alpha=32, target_modules=["query_key_value", "dense_h_to_4h"], init_lora_weights=False
    )
    peft.get_peft_model(load_model(base_dir), lora).save_pretrained(tmp_path / "adapter")
    cfg = InferConfig(
        prompts_file=str(write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)),
        adapter=str(tmp_path / "adapter"),
        max_new_tokens=8,
        batch_size=2,
        merge_to=str(tmp_path / "merged"),
    )
    run_dir = tmp_path / "run"  # an export never lies inside the run dir (infer/targets.py)
    run_dir.mkdir()
    run = RunConfig(infer=cfg, model=ModelConfig(name="glm4_tiny", quantize="nf4"))
    result = run_infer(run, base_dir, load_tokenizer(base_dir), run_dir)
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert result["count"] == 3 and [r["line"] for r in rows] == [1, 2, 3]
    assert list(result["placement"]) == ["cpu"]

    tok = load_tokenizer(base_dir)
    nf4 = PeftModel.from_pretrained(load_quantized(base_dir, "nf4", torch.float32), str(tmp_path / "adapter")).eval()
    expected = generate(nf4, tok, [p["messages"] for p in PROMPTS], InferConfig(max_new_tokens=8, batch_size=1))
    assert [r["output"] for r in rows] == expected

    full = PeftModel.from_pretrained(load_model(base_dir), str(tmp_path / "adapter")).eval()
    merged = load_model(tmp_path / "merged").eval()
    ids = torch.tensor([tok.apply_chat_template(PROMPTS[0]["messages"], add_generation_prompt=True)])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, full(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert (merged(input_ids=ids).logits - nf4(input_ids=ids).logits).abs().max() > 1e-2  # not the NF4 weights
    assert merged.transformer.encoder.layers[0].mlp.dense_h_to_4h.weight.dtype == torch.float32  # tiny: fp32 on disk


def test_quantized_bench_runs_on_cpu_with_the_tiny_architecture(tmp_path, repo):
    out = subprocess.run(
        [
            sys.executable,
            "bench/quantized.py",
            "--tiny",
            "--lengths",
            "32",
            "--steps",
            "1",
            "--modes",
            "bf16,nf4",
            "--ckpt",
            str(tmp_path / "ckpt"),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| bf16 |", "| nf4 |"))]
    assert len(rows) == 2
    stored, estimated = rows[1].split("|")[3].split()  # NF4 weights: real storage and the estimator's, MiB
    assert stored == estimated.strip("()")


# NF4 on CPUs with and without AVX512-BF16 (evaluation, then training): tests/models/test_nf4_cpu.py.


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_quantized_cli_run_trains_evaluates_generates_and_saves(tmp_path, quantize):
    """The whole command on this machine's CPU: probe (its eval batch), evaluation during training (loss and
    generated replies), training after it, the final evaluation, the adapter."""
    from helpers.cli import glmtune

    run = tmp_path / "run"
    out = glmtune(
        f"model.quantize={quantize}",
        "train.max_steps=4",
        "train.eval_steps=2",
        "eval.generate=true",
        "eval.max_examples=2",
        "eval.max_new_tokens=4",
        f"hydra.run.dir={run}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    lines = metrics_rows(run)
    losses = [e["eval_loss"] for e in lines if "eval_loss" in e]
    rouge = [e["step"] for e in lines if "eval_rouge-l" in e]
    assert len(losses) >= 2 and all(map(math.isfinite, losses)) and rouge[:2] == [2, 4], lines
    assert sorted(p.name for p in (run / "eval").iterdir())[:1] == ["eval_predictions_step2.jsonl"]


def test_a_run_that_does_not_quantize_prints_no_bitsandbytes_warning(trained):
    """A run that does not quantize never imports bitsandbytes (tests/test_lazy_imports.py), so no 'kernels' warning."""
    assert "kernels" not in trained.proc.stderr + trained.proc.stdout
