"""The plan's memory levers never change the result (train.loss_normalization=tokens, the default).

The same global batch split as micro-batch × accumulation, with checkpointing and the chunked loss on or off, must
give the same step losses and the same LoRA gradients, up to floating-point order. LoRA dropout is 0: a split draws
its dropout masks differently. Split across processes and under ZeRO-3, 14 steps of the command: in
test_elastic_resume.py, against the 2-process run its resumed runs must end at.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.files import metrics_rows
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import TrainerCallback

from glmtune.config import CONF_DIR, parse_config
from glmtune.data.pipeline import DataCollator, build_datasets
from glmtune.models import load_tokenizer
from glmtune.models.presets import arch_config, ensure_tiny, resolve_model_dir
from glmtune.plan.planner import make_plan
from glmtune.train.trainer import build_model, make_trainer, training_args

COMMON = [
    "lora=all_linear",
    "lora.dropout=0",
    "train.learning_rate=5e-3",
    "train.logging_steps=1",
    "probe.enabled=false",
    "data.val_file=null",
]


def compose_run(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return parse_config(OmegaConf.to_container(cfg, resolve=True))


def assert_same_adapter(got: dict, want: dict, what: str = "") -> None:
    """Each LoRA tensor within 1e-4 of its norm. Not element by element: Adam divides each entry's step by its own
    gradient scale, so for entries whose gradient is near zero (lora_A starts with a zero gradient, B being 0)
    floating-point order alone moves the update by more than 1e-4 of that entry."""
    assert got.keys() == want.keys() and want
    for key in want:
        error = ((got[key] - want[key]).norm() / want[key].norm().clamp(min=1e-12)).item()
        assert error <= 1e-4, f"{what}: {key}: relative error {error:.2e}"


class StepGradients(TrainerCallback):
    """Each optimizer step's LoRA gradient: the sum of what backward adds to every trainable tensor over the
    step's micro-batches (the Trainer's scaling included), read by tensor hooks before the optimizer clears it."""

    def __init__(self, model) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.current: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.register_hook(lambda grad, name=name: self._add(name, grad))

    def _add(self, name: str, grad: torch.Tensor) -> None:
        self.current[name] = self.current.get(name, 0) + grad.detach().clone()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(self.current)
        self.current = {}


def one_step(split: tuple[int, int], checkpointing: bool, chunk: int, normalization: str = "tokens", steps=1):
    """Step losses and LoRA gradients of the tiny model for a micro-batch × accumulation split (one process)."""
    ensure_tiny("glm4")
    run = compose_run(*COMMON, f"train.loss_normalization={normalization}")
    model_dir = resolve_model_dir(run.model)
    tokenizer = load_tokenizer(model_dir)
    data = build_datasets(run.data, tokenizer, None)
    plan = make_plan(run, arch_config(run.model), 1, False)
    choices = replace(
        plan.choices,
        micro_batch_size=split[0],
        grad_accum=split[1],
        gradient_checkpointing=checkpointing,
        loss_chunk_tokens=chunk,
    )
    run.train.max_steps = steps
    args = training_args(run.train, choices, Path(os.environ.get("TMPDIR", "/tmp")) / "same-math", has_eval=False)
    args.report_to, args.save_strategy = [], "no"
    model = build_model(model_dir, run, choices)
    grads = StepGradients(model)
    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    trainer = make_trainer(
        args,
        model,
        data.train,
        None,
        DataCollator(tokenizer.pad_token_id),
        callbacks=[grads, Losses()],
        normalization=normalization,
    )
    trainer.train()
    return losses, grads.steps


@pytest.fixture(scope="module")
def reference():
    return one_step((4, 1), checkpointing=False, chunk=0, steps=2)


@pytest.mark.parametrize(
    "split,checkpointing,chunk",
    [((1, 4), False, 0), ((2, 2), False, 0), ((1, 4), True, 0), ((2, 2), True, 16), ((4, 1), False, 16)],
)
def test_one_optimizer_step_has_the_same_loss_and_lora_gradient_however_the_batch_is_split(
    reference, split, checkpointing, chunk
):
    ref_losses, ref_grads = reference
    losses, grads = one_step(split, checkpointing, chunk, steps=2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for step, ref in zip(grads, ref_grads):
        assert ref.keys() == step.keys() and len(ref) > 0
        for name in ref:
            torch.testing.assert_close(step[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_demo_normalization_weighs_micro_batches_and_differs_when_split():
    """train.loss_normalization=micro_batch is the official demo's: each micro-batch's own mean. It agrees with
    tokens at 1 × 1 (the existing bit-exact comparisons), and differs once a step is split into uneven parts."""
    tokens_losses, tokens_grads = one_step((1, 1), False, 0, "tokens")
    demo_losses, demo_grads = one_step((1, 1), False, 0, "micro_batch")
    assert tokens_losses == pytest.approx(demo_losses, rel=1e-6)
    name = next(iter(tokens_grads[0]))
    torch.testing.assert_close(tokens_grads[0][name], demo_grads[0][name], rtol=1e-5, atol=1e-8)
    _, split_demo = one_step((1, 4), False, 0, "micro_batch")
    _, whole_demo = one_step((4, 1), False, 0, "micro_batch")
    assert not torch.allclose(split_demo[0][name], whole_demo[0][name], rtol=1e-3)


def step_losses(run_dir: Path, key: str = "loss") -> list[float]:
    rows = metrics_rows(run_dir)
    return [r[key] for r in rows if "loss" in r]


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_step_token_counts_come_from_the_cache_and_match_the_labels():
    """The step sampler weighs each step by its examples' target tokens, read from the cached column, never from token
    lists; it equals what the loss counts (labels[1:] not masked). Packing does not change the examples it counts."""
    from glmtune.config import DataConfig
    from glmtune.train.steps import target_counts

    tokenizer = load_tokenizer(ensure_tiny("glm4"))
    cfg = DataConfig(train_file=str(REPO / "data/samples/train.jsonl"), val_file=None, packing="on")
    data = build_datasets(cfg, tokenizer, None)
    counted = [sum(label != -100 for label in example["labels"][1:]) for example in data.train]
    assert target_counts(data.train).tolist() == counted and sum(counted) > 0
