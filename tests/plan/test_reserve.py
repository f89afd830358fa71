"""Every phase's allocator reserve (training step, evaluation, generation), and the allocator in force: the plan
against the recorded H100 rows, and the command line with PYTORCH_CUDA_ALLOC_CONF set."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import REPO

from glmtune.config import parse_config
from glmtune.config.units import GIB
from glmtune.models import released_config
from glmtune.plan.estimate import RunShape, estimate
from glmtune.plan.planner import make_plan, run_shape
from glmtune.plan.reserve import RESERVE_FLOOR, RESERVE_PER_LARGEST, allocator_in_force


def _gpu_memory_bench():
    spec = importlib.util.spec_from_file_location("gpu_memory", REPO / "bench" / "gpu_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_allocator_in_force_reads_the_variable_as_the_training_process_sees_it():
    assert allocator_in_force(None) == "expandable"  # unset: glmtune's entry point sets expandable segments
    assert allocator_in_force("expandable_segments:True") == "expandable"
    assert allocator_in_force("max_split_size_mb:512, expandable_segments:true") == "expandable"
    assert allocator_in_force("max_split_size_mb:512") == "default"
    assert allocator_in_force("garbage_collection_threshold:0.6,expandable_segments:False") == "default"


def test_every_phase_of_the_32k_a100_plan_fits_with_its_own_reserve(monkeypatch):
    """glm-4-9b-chat at 32,768 tokens on an A100-40G with the default val file: the evaluation's SwiGLU output
    alone is eval_batch x 32,768 x 27,392 x 2 B (7.2 GB at 4), so evaluation at batch 4 does not fit on its own
    terms; the plan lowers the eval batch until every phase's tensors plus its reserve fit."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    run = parse_config(
        {
            "model": {"name": "glm4_9b_chat"},
            "data": {"max_length": 32768, "val_file": "data/samples/val.jsonl"},
            "hw": {"name": "a100_40g", "memory_gib": 39.4},
        }
    )
    arch = released_config("glm4_9b_chat")
    plan = make_plan(run, arch, 1, user_set_max_length=True)
    assert plan.fits and 1 <= plan.choices.eval_batch_size < 4
    est = estimate(arch, run_shape(run, arch, plan.choices))
    outside = est.peak_bytes - est.phases[est.phase] - est.reserves[est.phase]
    assert set(est.reserves) == set(est.phases) >= {"loss", "backward", "eval"}
    for phase, tensors in est.phases.items():
        assert est.peak_bytes >= tensors + est.reserves[phase] + outside, phase
    swiglu = plan.choices.eval_batch_size * 32768 * 2 * arch.ffn_hidden_size * 2
    assert est.reserves["eval"] >= RESERVE_FLOOR + int(RESERVE_PER_LARGEST * swiglu)
    assert est.peak_bytes <= plan.budget_bytes
    at4 = estimate(arch, replace(run_shape(run, arch, plan.choices), eval_batch=4))
    assert at4.phases["eval"] + at4.reserves["eval"] + outside > plan.budget_bytes  # why it was lowered


def test_default_allocator_rows_are_covered_and_expandable_rows_unchanged():
    """bench/gpu_calib_2026-11-23.jsonl: for the three rows run with the default allocator the estimate (with
    the default-allocator reserve) is at least the NVML whole-process peak, the evaluation after training
    (1.21 x the training's allocated peak) included; the expandable rows stay within +-2.5 % of NVML."""
    bench = _gpu_memory_bench()
    rows = [json.loads(line) for line in (REPO / "bench" / "gpu_calib_2026-11-23.jsonl").read_text().splitlines()]
    default = [r for r in rows if r["alloc"] == "default"]
    assert len(default) == 3
    for r in rows:
        if r["zero"]:
            continue  # ZeRO-3 rows: NCCL and gathered weights, not the allocator's question
        arch, _, _, shape = bench.plan_for(r)
        est = estimate(arch, replace(shape, allocator=r["alloc"]))
        nvml = max(p["nvml"] for p in r["measured"].values())
        if r["alloc"] == "default":
            assert est.peak_bytes >= nvml, (bench.label(r), est.peak_bytes / GIB, nvml / GIB)
            assert est.peak_bytes >= estimate(arch, shape).peak_bytes
        else:
            assert abs(est.peak_bytes / nvml - 1) < 0.025, bench.label(r)


def test_plan_with_another_allocator_setting_plans_more_and_says_why(tmp_path):
    def plan(conf):
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "glmtune",
                "mode=plan",
                "model=glm4_9b_chat",
                "+hw=a100_40g",
                "data.max_length=8192",
                f"hydra.run.dir={tmp_path / str(conf)}",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout, json.loads((tmp_path / str(conf) / "plan.json").read_text())

    stdout, default = plan("max_split_size_mb:512")
    _, expandable = plan(None)
    assert default["peak_bytes"] > expandable["peak_bytes"]
    assert "the default caching allocator (PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512)" in stdout
    assert "planned larger" in default["reasons"]["allocator"]
    assert "expandable segments" in expandable["reasons"]["allocator"]


def test_cpu_estimates_have_no_reserve():
    est = estimate(released_config("glm4_9b_chat"), RunShape(device="cpu", eval_batch=2))
    assert est.reserves == {} and "allocator reserve" not in est.breakdown


@pytest.mark.parametrize("allocator", ["expandable", "default"])
def test_generation_phase_gets_its_own_reserve(allocator):
    arch = released_config("glm4_9b_chat")
    shape = RunShape(
        gpu_family="hopper",
        seq_len=4096,
        eval_batch=2,
        eval_max_new_tokens=512,
        allocator=allocator,
        gradient_checkpointing=True,
        loss_chunk_tokens=1024,
        autocast=True,
    )
    est = estimate(arch, shape)
    assert est.reserves["generate"] >= RESERVE_FLOOR + int(
        RESERVE_PER_LARGEST * 2 * 4096 * 2 * arch.ffn_hidden_size * 2
    )
