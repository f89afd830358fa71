"""End-to-end training on the tiny model: the loss falls, the adapter reloads, the run dir is complete."""

import json
import math
import re
from dataclasses import replace

import torch
from helpers.cli import glmtune_in_process
from helpers.files import logged_losses, write_fixed
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from peft import PeftModel

from glmtune.config import CONF_DIR, DataConfig, HwConfig, LoraConfig, ModelConfig, RunConfig, TrainConfig, parse_config
from glmtune.data.pipeline import DataCollator, build_datasets
from glmtune.models import load_config, load_model, load_tokenizer
from glmtune.models.presets import arch_config, ensure_tiny
from glmtune.modes.report import optimizer_steps
from glmtune.plan.planner import make_plan
from glmtune.train.trainer import train


def test_finetune_drives_loss_far_down_and_adapter_reproduces_logits(tmp_path):
    model_dir = ensure_tiny("glm4")
    run = RunConfig(
        data=DataConfig(train_file=str(write_fixed(tmp_path / "fixed.jsonl")), val_file=None),
        lora=LoraConfig(target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
        train=TrainConfig(max_steps=80, learning_rate=1e-2, per_device_batch_size=4, logging_steps=1),
    )
    tokenizer = load_tokenizer(model_dir)
    train_set, _, _ = build_datasets(run.data, tokenizer)
    choices = make_plan(run, load_config(model_dir), 1, user_set_max_length=False).choices
    metrics, model = train(
        run, choices, tmp_path / "run", model_dir, train_set, None, DataCollator(tokenizer.pad_token_id)
    )
    losses = logged_losses(tmp_path / "run")
    # A random model starts near-uniform over the 1,280-token vocabulary: ln(1280) = 7.15 nats. Memorising four
    # short replies with all-linear adapters reaches ~1.8 in 80 steps; a pipeline that does not learn (labels
    # masked wrong, no gradient reaching the adapters, optimizer over the wrong parameters) stays above 5.
    assert losses[0] > 0.8 * math.log(1280)
    assert losses[-1] < 0.4 * losses[0], losses
    assert metrics["trainable_parameters"] > 0

    batch = DataCollator(tokenizer.pad_token_id)(train_set)
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        reloaded = PeftModel.from_pretrained(load_model(model_dir), str(tmp_path / "run" / "adapter")).eval()
        again = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        base = load_model(model_dir).eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(again, trained, rtol=1e-5, atol=1e-5)
    assert (again - base).abs().max() > 1.0  # the adapter really changed the model


def test_a_real_model_config_trains_whole_epochs_when_max_steps_is_not_set(tmp_path):
    """The README's real-model command with epochs set and no max_steps: the run is exactly its epochs' steps."""
    data = tmp_path / "train.jsonl"
    data.write_text(write_fixed(tmp_path / "four.jsonl").read_text() * 3, encoding="utf-8")  # 12 examples
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(
            config_name="config",
            overrides=[
                "model=glm4_9b_chat",
                "+hw=a100_40g",
                f"data.train_file={data}",
                "data.val_file=null",
                "train.num_epochs=2",
                "train.per_device_batch_size=2",
                "train.grad_accum=2",
            ],
        )
    run = parse_config(OmegaConf.to_container(cfg, resolve=True))
    assert run.train.max_steps == 0  # no step cap hidden in the defaults
    plan = make_plan(run, arch_config(run.model), 1, user_set_max_length=False)
    assert (plan.choices.micro_batch_size, plan.choices.grad_accum) == (2, 2)
    # 12 examples / micro-batch 2 = 6 micro-batches / accumulation 2 = 3 optimizer steps an epoch, 2 epochs.
    assert optimizer_steps(run.train, plan.choices, 12) == (6, 2)

    # The same train settings on the tiny model (CPU): the Trainer runs those 6 steps and 2 whole epochs.
    model_dir = ensure_tiny("glm4")
    tiny = replace(run, model=ModelConfig(), hw=HwConfig())
    tokenizer = load_tokenizer(model_dir)
    train_set, _, _ = build_datasets(tiny.data, tokenizer)
    choices = make_plan(tiny, load_config(model_dir), 1, user_set_max_length=False).choices
    metrics, _ = train(
        tiny, choices, tmp_path / "run", model_dir, train_set, None, DataCollator(tokenizer.pad_token_id)
    )
    assert (metrics["steps"], metrics["epochs"]) == (6, 2.0)
    assert metrics["tokens_per_s"] > 0 and metrics["measured_peak_bytes"] > 0


def run_cli(*args, cwd):
    return glmtune_in_process(*args, cwd=cwd)  # the command's entry point, in this process


def test_cli_train_writes_a_complete_run_dir(trained, repo):
    out, proc = trained.with_probe, trained.proc
    assert f"adapter saved to {out / 'adapter'}" in proc.stdout
    # the header says the step count overrides the epochs; the last line sums the run up
    assert "6 optimizer steps (train.max_steps=6: 0.23 epochs of 51 examples)" in proc.stdout
    last = proc.stdout[proc.stdout.index("\ndone in ") + 1 :]  # the closing lines sum the run up
    assert "6 steps" in last and "train loss" in last and "eval loss" in last
    assert "tokens/s" in last and "peak" in last
    # noise silenced at its source; the probe prints its table, not the Trainer's closing metrics
    assert "max_steps is given" not in proc.stdout + proc.stderr
    assert "Could not find a config file" not in proc.stdout + proc.stderr
    assert proc.stdout.count("'train_loss'") <= 1  # the real run's progress bar only
    # every file and folder the run leaves is listed in the docs' run-dir table (docs/runs.md)
    page = (repo / "docs" / "runs.md").read_text()
    section = page.split("## What a run leaves in its run dir")[1].split("\n#")[0]
    for entry in out.iterdir():
        assert f"`{re.sub(r'rank[0-9]+', 'rank<N>', entry.name)}" in section, (
            f"{entry.name} is not in docs/runs.md's run-dir table"
        )
    config = (out / ".hydra" / "config.yaml").read_text()
    assert "train_file: data/samples/train.jsonl" in config
    versions = json.loads((out / "versions.json").read_text())
    assert set(versions) >= {"torch", "transformers", "peft", "deepspeed", "glmtune", "model_path", "config_hash"}
    assert versions["transformers"] == "4.40.2"
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 6
    assert list((out / "tensorboard").rglob("events.out.tfevents*"))
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fits"] and plan["choices"]["max_length"] == 500
    assert "examples" in proc.stdout and "p95" in proc.stdout  # dataset statistics before training


def test_cli_plan_for_glm4_9b_on_a100_needs_no_weights(tmp_path, repo):
    out = tmp_path / "plan"
    proc = run_cli("mode=plan", "model=glm4_9b_chat", "+hw=a100_40g", f"hydra.run.dir={out}", cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fits"] and plan["choices"]["zero_stage"] == 0 and plan["choices"]["dtype"] == "bf16"
    assert plan["budget_bytes"] == int(39.4 * 2**30 * 0.9)
    assert plan["breakdown"]["frozen weights"] == 9_399_951_360 * 2


def test_cli_plan_that_cannot_fit_exits_3_with_advice_and_leaves_nothing(tmp_path, repo):
    # launched from another folder, no hydra.run.dir: the configs come from the package, nothing is written
    proc = glmtune_in_process(
        "mode=plan", "model=glm4_9b_chat", "+hw=rtx4090_24g", "data.max_length=131072", cwd=tmp_path
    )
    assert proc.returncode == 3
    assert "does not fit" in proc.stderr and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    # the options: a numbered list on stdout; the line names the best one (it fits in 120 columns here)
    assert "best: data.max_length=" in proc.stderr and "(6 options listed above)" in proc.stderr
    options = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith(("  1. ", "  2. ", "  6. "))]
    # cheapest first: shorter examples, then 4 GPUs sharing each row (ZeRO-3 + sequence parallelism), ..., a card
    assert options[0].startswith("data.max_length=") and options[1] == "dist.nproc_per_node=4:", options
    assert options[2].startswith("+hw=") and options[2].endswith("_80g:"), options
    assert "rtx4090_24g: 23.6 GiB x margin 0.9 = 21.2 GiB budget per GPU" in proc.stdout  # the header
    assert "nothing written (hydra.run.dir=DIR keeps plan.json)" in proc.stdout
    assert not list(tmp_path.iterdir())
