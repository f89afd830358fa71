"""Bring your own: a DeepSpeed JSON merged with the plan (dist.deepspeed_config), and presets added with Hydra's
--config-dir that the command-line checks know."""

import json

import pytest
import torch
from helpers.cli import glmtune

from glmtune.config import ConfigError, RunConfig, userds
from glmtune.models import GLMConfig
from glmtune.models.loading import TINY_ARCH
from glmtune.plan.estimate import PREFETCH_BUCKET, REDUCE_BUCKET
from glmtune.plan.planner import Choices, make_plan
from glmtune.train.zero3 import merged

USER = {
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "offload_optimizer": {"device": "cpu"},
        "overlap_comm": False,
    },
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "wall_clock_breakdown": False,
}
TINY = GLMConfig(**TINY_ARCH, padded_vocab_size=1024)


def choices(**kw) -> Choices:
    base = dict(
        dtype="bf16",
        gradient_checkpointing=False,
        zero_stage=3,
        offload_params=False,
        offload_optimizer=True,
        micro_batch_size=2,
        grad_accum=4,
        max_length=500,
        world_size=2,
        eval_batch_size=4,
    )
    return Choices(**{**base, **kw})


def test_the_plan_fills_every_auto_and_keeps_the_rest():
    out = merged(USER, choices())
    zero = out["zero_optimization"]
    assert zero["reduce_bucket_size"] == REDUCE_BUCKET and zero["stage3_prefetch_bucket_size"] == PREFETCH_BUCKET
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["overlap_comm"] is False  # the user's own
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # the adapter is saved whole
    assert out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"]) == (2, 4)
    assert "train_batch_size" not in out and out["wall_clock_breakdown"] is False
    assert USER["zero_optimization"]["reduce_bucket_size"] == "auto"  # the file's dict is not modified


def test_the_file_s_zero_settings_reach_the_plan(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(USER))
    run = RunConfig()
    run.dist.deepspeed_config = str(path)
    user = userds.load(run)
    assert user.data == USER and (user.stage, user.offload_params, user.offload_optimizer) == (3, False, True)
    assert userds.with_strategy(run, user).dist.strategy == "zero3" and run.dist.strategy == "auto"  # a copy
    assert make_plan(userds.with_strategy(run, user), TINY, 2, False, user_ds=user).choices.offload_optimizer
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    run = RunConfig()
    run.dist.deepspeed_config = str(path)
    assert userds.with_strategy(run, userds.load(run)).dist.strategy == "ddp"  # stage 0-2: planned as stage 0


def test_conflicts_are_one_line_naming_each(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "optimizer": {"type": "AdamW"},
                "scheduler": {"type": "WarmupLR"},
                "train_micro_batch_size_per_gpu": 4,
                "zero_optimization": {"stage": 3},
                "fp16": {"enabled": True},
            }
        )
    )
    run = RunConfig()
    run.dist.deepspeed_config, run.dist.strategy, run.train.precision = str(path), "ddp", "bf16"
    message = str(pytest.raises(ConfigError, userds.load, run).value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    for fragment in (
        '"optimizer" block',
        '"scheduler" block',
        "train_micro_batch_size_per_gpu=4",
        "dist.strategy=ddp",
        "fp16.enabled=true but train.precision=bf16",
    ):
        assert fragment in message
    path.write_text('{"zero_optimization": {"stage": 3,}}')
    assert f"{path}:1: invalid JSON" in str(pytest.raises(ConfigError, userds.load, run).value)


@pytest.mark.slow
def test_cli_trains_with_the_user_s_deepspeed_json(tmp_path):
    """Real DeepSpeed (one process, gloo on CPU) with the user's stage-3 file: it trains, and the config it ran
    with is the file with the plan's values where it said auto."""
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {**USER, "zero_optimization": {**USER["zero_optimization"], "offload_optimizer": {"device": "none"}}}
        )
    )
    run = tmp_path / "run"
    proc = glmtune(
        f"dist.deepspeed_config={path}",
        "train.max_steps=2",
        "data.val_file=null",
        "probe.enabled=false",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = torch.load(run / "adapter" / "training_args.bin", weights_only=False)
    ran = args.deepspeed
    assert ran["zero_optimization"]["stage"] == 3 and ran["zero_optimization"]["reduce_bucket_size"] == REDUCE_BUCKET
    assert ran["bf16"]["enabled"] is False  # the plan's dtype on CPU is fp32
    plan = json.loads((run / "plan.json").read_text())
    assert plan["choices"]["zero_stage"] == 3


PRESET = """# @package hw
name: a800_80g
memory_gib: 79.3
bf16: true
interconnect: nvlink
gpus_per_node: 8
margin: 0.9
"""


def test_config_dir_adds_a_preset_the_checks_know(tmp_path):
    (tmp_path / "mine" / "hw").mkdir(parents=True)
    (tmp_path / "mine" / "hw" / "a800_80g.yaml").write_text(PRESET)
    (tmp_path / "mine" / "lora").mkdir()
    (tmp_path / "mine" / "lora" / "wide.yaml").write_text(
        "r: 32\nalpha: 64\ndropout: 0.05\ntarget_modules: [query_key_value, dense]\n"
    )
    proc = glmtune(
        "--config-dir",
        str(tmp_path / "mine"),
        "mode=plan",
        "model=glm4_9b_chat",
        "+hw=a800_80g",
        "lora=wide",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a800_80g: 79.3 GiB" in proc.stdout
    typo = glmtune("--config-dir", str(tmp_path / "mine"), "mode=plan", "+hw=a800_80", cwd=tmp_path)
    assert typo.returncode == 2 and "unknown hw 'a800_80'" in typo.stderr and "a800_80g" in typo.stderr
    missing = glmtune("--config-dir", str(tmp_path / "nowhere"), "mode=plan", cwd=tmp_path)
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
