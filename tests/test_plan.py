"""Planner decisions for released models on conf/hw presets, without weights or a GPU."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from glmtune.config import DataConfig, DistConfig, HwConfig, RunConfig, TrainConfig
from glmtune.models import released_config
from glmtune.plan.planner import make_plan, step_down

HW = Path(__file__).resolve().parents[1] / "glmtune" / "conf" / "hw"


def run_on(hw: str, max_length: int = 500, **train) -> RunConfig:
    return RunConfig(hw=HwConfig(**yaml.safe_load((HW / f"{hw}.yaml").read_text())),
                     data=DataConfig(max_length=max_length), train=TrainConfig(**train))


def test_glm4_9b_on_a100_40g_fits_without_zero():
    t0 = time.perf_counter()
    plan = make_plan(run_on("a100_40g"), released_config("glm4_9b_chat"), 1, user_set_max_length=False)
    assert time.perf_counter() - t0 < 3
    assert plan.fits and plan.choices.zero_stage == 0 and plan.choices.dtype == "bf16"
    assert plan.choices.max_length == 500 and not plan.choices.gradient_checkpointing
    data = json.loads(plan.to_json())
    assert set(data["choices"]) >= {"dtype", "gradient_checkpointing", "zero_stage", "offload_params",
                                    "offload_optimizer", "micro_batch_size", "grad_accum", "max_length", "world_size"}


def test_glm4v_on_a100_40g_fits_with_checkpointing():
    plan = make_plan(run_on("a100_40g"), released_config("glm4v_9b"), 1, user_set_max_length=False)
    assert plan.fits
    # 13.9B frozen params (LM + ViT) = 26 GiB; 2,099 tokens of activations need checkpointing, not ZeRO.
    assert plan.choices.gradient_checkpointing and plan.choices.zero_stage == 0 and not plan.choices.offload_params
    assert plan.breakdown["frozen weights"] > 25 * 2**30


def test_glm4_8k_on_two_4090_turns_zero3_on():
    plan = make_plan(run_on("rtx4090_24g", 8192), released_config("glm4_9b_chat"), 2, user_set_max_length=True)
    assert plan.fits and plan.choices.zero_stage == 3 and plan.choices.max_length == 8192
    assert not plan.choices.offload_params


def test_v100_picks_fp16():
    plan = make_plan(run_on("v100_32g"), released_config("glm4_9b_chat"), 1, user_set_max_length=False)
    assert plan.choices.dtype == "fp16" and plan.fits


def test_cannot_fit_gives_advice():
    plan = make_plan(run_on("t4_16g", 131072), released_config("glm4_9b_chat"), 1, user_set_max_length=True)
    assert not plan.fits and plan.choices.max_length == 131072
    assert any("data.max_length=" in a for a in plan.advice) and any("+hw=" in a for a in plan.advice)


def test_forced_choices_respected():
    run = run_on("rtx4090_24g", 4096, gradient_checkpointing="off", precision="fp32")
    run.dist = DistConfig(strategy="ddp")
    plan = make_plan(run, released_config("glm4_9b_chat"), 2, user_set_max_length=True)
    assert plan.choices.dtype == "fp32" and not plan.choices.gradient_checkpointing
    assert plan.choices.zero_stage == 0 and not plan.choices.offload_params and not plan.fits


def test_step_down_keeps_global_batch():
    run = run_on("a100_40g", per_device_batch_size=4, grad_accum=2)
    plan = make_plan(run, released_config("glm4_9b_chat"), 1, user_set_max_length=False)
    c = plan.choices
    seen = 0
    while (c := step_down(c, run, released_config("glm4_9b_chat"), 1)) is not None:
        assert c.micro_batch_size * c.grad_accum == 8
        seen += 1
    assert seen >= 3
