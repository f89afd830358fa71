"""Planner decisions for released models on conf/hw presets, without weights or a GPU."""

from __future__ import annotations

import json
import time

import yaml
from helpers import REPO

from glmtune.config import DataConfig, DistConfig, HwConfig, RunConfig, TrainConfig
from glmtune.models import released_config
from glmtune.plan.planner import make_plan, step_down

HW = REPO / "conf" / "hw"


def run_on(hw: str, max_length: int = 500, **train) -> RunConfig:
    return RunConfig(
        hw=HwConfig(**yaml.safe_load((HW / f"{hw}.yaml").read_text())),
        data=DataConfig(max_length=max_length),
        train=TrainConfig(**train),
    )


def test_glm4_9b_on_a100_40g_fits_without_zero():
    t0 = time.perf_counter()
    plan = make_plan(run_on("a100_40g"), released_config("glm4_9b_chat"), 1, user_set_max_length=False)
    assert time.perf_counter() - t0 < 3
    assert plan.fits and plan.choices.zero_stage == 0 and plan.choices.dtype == "bf16"
    assert plan.choices.max_length == 500 and not plan.choices.gradient_checkpointing
    data = json.loads(plan.to_json())
    assert set(data["choices"]) >= {
        "dtype",
        "gradient_checkpointing",
        "zero_stage",
        "offload_params",
        "offload_optimizer",
        "micro_batch_size",
        "grad_accum",
        "max_length",
        "world_size",
    }


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
    plan = make_plan(run_on("rtx4090_24g", 131072), released_config("glm4_9b_chat"), 1, user_set_max_length=True)
    assert not plan.fits and plan.choices.max_length == 131072
    assert any("data.max_length=" in a for a in plan.advice) and any("+hw=" in a for a in plan.advice)


def test_no_length_is_advised_when_the_weights_alone_do_not_fit():
    """17.5 GiB of bf16 weights on a 16 GB T4: no data.max_length alone can fit, so none is suggested alone (with a
    quantized base, one is: plan/advice.py's combinations)."""
    plan = make_plan(run_on("t4_16g", 131072), released_config("glm4_9b_chat"), 1, user_set_max_length=True)
    assert not plan.fits and not any(a.startswith("data.max_length=") for a in plan.advice)


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


def test_glm4_8k_on_one_4090_fits_without_parameter_offload():
    """The H100-measured rungs: 8K tokens on a 24 GB card need checkpointing, a 256-token loss chunk and the
    checkpointed inputs in CPU memory, not ZeRO-3 (measured on the H100: 20.76 GiB for this configuration)."""
    plan = make_plan(run_on("rtx4090_24g", 8192), released_config("glm4_9b_chat"), 1, user_set_max_length=True)
    c = plan.choices
    assert plan.fits and c.zero_stage == 0 and not c.offload_params
    assert c.gradient_checkpointing and c.loss_chunk_tokens == 256 and c.offload_checkpoints
    assert plan.peak_bytes <= plan.budget_bytes


def test_eval_batch_shrinks_before_training_pays():
    """Evaluation at 4 x 8K tokens does not fit a 24 GB card; halving the eval batch costs training nothing, so
    it must happen before any training rung that a run without evaluation would not take."""
    arch = released_config("glm4_9b_chat")
    without = make_plan(run_on("rtx4090_24g", 8192), arch, 1, user_set_max_length=True)
    run = run_on("rtx4090_24g", 8192)
    run.data.val_file = "val.jsonl"
    with_eval = make_plan(run, arch, 1, user_set_max_length=True)
    assert with_eval.fits and with_eval.choices.eval_batch_size < 4
    same = ("gradient_checkpointing", "loss_chunk_tokens", "offload_checkpoints", "zero_stage", "micro_batch_size")
    assert all(getattr(with_eval.choices, k) == getattr(without.choices, k) for k in same)


def test_ladder_cheapest_first_and_never_offloads_parameters():
    run = run_on("t4_16g", 8192, per_device_batch_size=2)
    c = make_plan(run, released_config("glm4_9b_chat"), 1, user_set_max_length=True).choices
    from dataclasses import replace

    c = replace(
        c,
        micro_batch_size=2,
        grad_accum=1,
        gradient_checkpointing=False,
        loss_chunk_tokens=0,
        offload_checkpoints=False,
        zero_stage=0,
    )
    seen = []
    while (c := step_down(c, run, released_config("glm4_9b_chat"), 2)) is not None:
        seen.append(
            (c.micro_batch_size, c.loss_chunk_tokens, c.gradient_checkpointing, c.offload_checkpoints, c.zero_stage)
        )
        assert not c.offload_params
    assert seen == [
        (1, 0, False, False, 0),
        (1, 1024, False, False, 0),
        (1, 1024, True, False, 0),
        (1, 256, True, False, 0),
        (1, 256, True, True, 0),
        (1, 256, True, True, 3),
    ]


def test_a_resume_that_changes_only_the_sequence_parallel_degree_says_so():
    """SP 2 -> 1 on one process: the data-parallel width and the micro-batch stay; the line names the degree
    (it said `resumed with micro-batch 1 instead of 1`)."""
    from dataclasses import replace

    from glmtune.plan.elastic import elastic_choices
    from glmtune.plan.planner import Choices

    recorded = Choices(
        dtype="fp32",
        gradient_checkpointing=False,
        zero_stage=0,
        offload_params=False,
        offload_optimizer=False,
        micro_batch_size=1,
        grad_accum=2,
        max_length=64,
        world_size=1,
        eval_batch_size=1,
        sequence_parallel=2,
    )
    choices, line = elastic_choices(recorded, replace(recorded, sequence_parallel=1), 1, batch_set=False)
    assert choices.micro_batch_size == 1 and choices.grad_accum == 2 and choices.sequence_parallel == 1
    assert line.startswith("resumed with sequence parallelism 1 instead of 2:") and "micro-batch 1 instead" not in line
    _, line = elastic_choices(recorded, replace(recorded, world_size=2, micro_batch_size=4), 2, batch_set=False)
    assert "on 2 data-parallel processes instead of 1" in line and "micro-batch 1 instead of 1" not in line


def test_a_cpu_host_memory_too_small_for_the_run_does_not_fit():
    """No GPU: hw.host_memory_gib is the whole run's budget (it said `fits` with a 0.0 GiB budget)."""
    plan = make_plan(RunConfig(hw=HwConfig(host_memory_gib=0.001)), _tiny_arch(), 1, False)
    assert not plan.fits and not plan.host["fits"] and plan.host["bytes"] > plan.peak_bytes
    assert make_plan(RunConfig(hw=HwConfig(host_memory_gib=512.0)), _tiny_arch(), 1, False).fits


def _tiny_arch():
    from glmtune.models.presets import arch_config

    return arch_config(RunConfig().model)
