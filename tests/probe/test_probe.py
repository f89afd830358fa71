"""The probe on CPU: measured peak, step-down under a budget, no effect on the run, failure diagnosis."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import REPO
from helpers.cli import glmtune_in_process
from helpers.files import metrics_rows
from safetensors.torch import load_file

from glmtune.config import DataConfig, RunConfig, TrainConfig
from glmtune.data.pipeline import DataCollator, build_datasets, longest_length
from glmtune.models import load_config, load_tokenizer
from glmtune.models.presets import ensure_tiny
from glmtune.plan.estimate import estimate
from glmtune.plan.planner import make_plan, run_shape
from glmtune.probe.diagnose import EXIT, diagnosed
from glmtune.probe.probe import run_probe
from glmtune.probe.track import measure_lora_step
from glmtune.train.trainer import train


def run_cli(*args, cwd):
    return glmtune_in_process(*args, cwd=cwd)  # the command's entry point, in this process


def test_probe_json_measured_peak_matches_an_independent_measurement(tmp_path, repo):
    out = tmp_path / "probe"
    proc = run_cli(
        "mode=probe", "data.val_file=null", "train.per_device_batch_size=2", f"hydra.run.dir={out}", cwd=repo
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "probe.json").read_text())
    assert set(report) >= {
        "device",
        "emulated",
        "budget_bytes",
        "predicted_peak_bytes",
        "measured_peak_bytes",
        "per_rank",
        "attempts",
        "final",
        "seconds",
    }
    assert report["device"] == "cpu" and report["emulated"] is False and len(report["attempts"]) == 1
    assert not (out / "adapter").exists()  # mode=probe does not train
    # the host's side (issue 30): every rank's peak resident set, here one process with torch loaded (> 200 MiB)
    rss = report["attempts"][-1]["detail"]["host_rss_per_rank"]
    assert len(rss) == 1 and 200 * 2**20 < rss[0] < 64 * 2**30
    # Independent measurement: the same model and batch shape, stepped by a plain loop instead of the Trainer.
    arch = load_config(ensure_tiny("glm4"))
    run = RunConfig(train=TrainConfig(per_device_batch_size=2))
    final = report["final"]
    from glmtune.plan.planner import Choices

    shape = replace(run_shape(run, arch, Choices(**final), data_max_tokens=500), device="cpu", gpu_family=None)
    independent, _ = measure_lora_step(arch, shape)
    assert report["measured_peak_bytes"] == pytest.approx(independent, rel=0.05)
    # predicted within the estimator's stated error on CPU tensor terms (5 %)
    assert report["predicted_peak_bytes"] == pytest.approx(report["measured_peak_bytes"], rel=0.05)
    assert report["predicted_peak_bytes"] == estimate(arch, shape).peak_bytes


@pytest.fixture(scope="module")
def tiny_inputs():
    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    run = RunConfig(data=DataConfig(val_file=None), train=TrainConfig(per_device_batch_size=4))
    train_set, _, stats = build_datasets(run.data, tok)
    return model_dir, tok, run, train_set, stats


def test_budget_below_the_measured_peak_steps_down_and_records_attempts(tmp_path, tiny_inputs):
    model_dir, tok, run, _, stats = tiny_inputs
    arch = load_config(model_dir)
    plan = make_plan(run, arch, 1, user_set_max_length=False, data_max_tokens=longest_length(stats))
    assert plan.budget_bytes is None and plan.choices.micro_batch_size == 4
    collator = DataCollator(tok.pad_token_id)
    args = (arch, model_dir, longest_length(stats), tok, collator, tmp_path, 1)
    free = run_probe(run, plan, *args, evaluates=False)
    first_peak = free.measured_peak_bytes
    budget = int(first_peak * 0.8)
    report = run_probe(run, replace(plan, budget_bytes=budget), *args, evaluates=False)
    outcomes = [a.outcome for a in report.attempts]
    assert outcomes[0] == "over budget" and outcomes[-1] == "fits" and report.fits
    assert report.attempts[0].measured_peak_bytes == pytest.approx(first_peak, rel=0.01)
    assert report.final["micro_batch_size"] < 4
    assert report.final["micro_batch_size"] * report.final["grad_accum"] == 4  # global batch kept
    assert report.measured_peak_bytes <= budget
    # below every rung: the ladder is exhausted and the report says it does not fit (dist=ddp keeps the ladder
    # to the single-process rungs: micro-batch, checkpointing, chunked loss)
    ddp = replace(run, dist=replace(run.dist, strategy="ddp"))
    hopeless = run_probe(ddp, replace(plan, budget_bytes=1000), *args, evaluates=False)
    assert not hopeless.fits and len(hopeless.attempts) >= 4
    assert all(a.outcome == "over budget" for a in hopeless.attempts)


def test_budget_below_any_rung_exits_3_with_advice(tmp_path, repo):
    proc = run_cli("mode=probe", "hw.memory_gib=0.000001", f"hydra.run.dir={tmp_path / 'r'}", cwd=repo)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "does not fit" in proc.stderr and "+hw=" in proc.stderr and "Traceback" not in proc.stderr


def _losses(run_dir):
    rows = metrics_rows(run_dir)
    return [r["loss"] for r in rows if "loss" in r]


def test_run_after_probe_equals_run_without_probe(trained):
    with_probe, without = trained.with_probe, trained.without_probe  # the same CLI run, probe on and off
    assert (with_probe / "probe.json").is_file() and not (without / "probe.json").exists()
    assert len(_losses(with_probe)) == 6 and _losses(with_probe) == _losses(without)
    wa = load_file(with_probe / "adapter" / "adapter_model.safetensors")
    wb = load_file(without / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (with_probe / "memory_timeline.png").stat().st_size > 1000


class FailingCollator(DataCollator):
    """Raises on its second call: the error surfaces inside a training step, as a real one would."""

    def __init__(self, pad_id, error):
        super().__init__(pad_id)
        self.error, self.calls = error, 0

    def __call__(self, features):
        self.calls += 1
        if self.calls == 2:
            raise self.error
        return super().__call__(features)


ERRORS = {
    "oom": torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 214.00 MiB (GPU 0; 39.39 GiB total)"),
    "nvml_oom": RuntimeError(
        "r.nvmlDeviceGetNvLinkRemoteDeviceType_ INTERNAL ASSERT FAILED at "
        '"../c10/cuda/driver_api.cpp":27, please report a bug to PyTorch.'
    ),
    "nccl": torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
    "transformers_version": TypeError(
        "GenerationMixin._extract_past_from_model_output() got an unexpected "
        "keyword argument 'standardize_cache_format'"
    ),
}


@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_each_failure_class_inside_a_training_step_is_diagnosed(kind, tmp_path, tiny_inputs, capsys):
    model_dir, tok, run, train_set, _ = tiny_inputs
    run = replace(run, train=TrainConfig(max_steps=4, per_device_batch_size=1))
    choices = make_plan(run, load_config(model_dir), 1, False).choices
    plan_breakdown = {"frozen weights": 1 << 20}
    with pytest.raises(SystemExit) as exited:
        with diagnosed(tmp_path, plan_breakdown, choices.to_dict(), probe_enabled=True):
            train(run, choices, tmp_path, model_dir, train_set, None, FailingCollator(tok.pad_token_id, ERRORS[kind]))
    assert exited.value.code == EXIT[kind]
    err = capsys.readouterr().err
    assert f"glmtune: {kind}: " in err and "try: " in err and "Traceback" not in err
    expected = {
        "oom": "train.gradient_checkpointing=on",
        "nvml_oom": "out-of-memory in disguise",
        "nccl": "NCCL_DEBUG=INFO",
        "transformers_version": "model.trust_remote_code=false",
    }[kind]
    assert expected in err
    if kind in ("oom", "nvml_oom"):
        assert "planned memory (GiB): frozen weights 0.00" in err


def test_unrecognised_errors_propagate_unchanged(tmp_path, tiny_inputs):
    model_dir, tok, run, train_set, _ = tiny_inputs
    run = replace(run, train=TrainConfig(max_steps=4, per_device_batch_size=1))
    choices = make_plan(run, load_config(model_dir), 1, False).choices
    with pytest.raises(KeyError, match="not a memory problem"):
        with diagnosed(tmp_path, {}, choices.to_dict(), probe_enabled=True):
            train(
                run,
                choices,
                tmp_path,
                model_dir,
                train_set,
                None,
                FailingCollator(tok.pad_token_id, KeyError("not a memory problem")),
            )


def test_probe_on_the_tiny_vision_model_includes_the_image(tmp_path, repo):
    out = tmp_path / "v"
    proc = run_cli("mode=probe", "model=glm4v_tiny", "data=samples_vision", f"hydra.run.dir={out}", cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "probe.json").read_text())
    assert (out / "probe" / "probe_image.png").is_file()
    assert report["fits"] and report["predicted_peak_bytes"] == pytest.approx(report["measured_peak_bytes"], rel=0.05)


def test_probe_shortfall_names_measurement_and_what_would_fit():
    """Exit 3 after the probe: the line says what was measured against which budget and which cards hold it
    (it used to end on an empty 'every rung: ')."""
    import yaml

    from glmtune.config import HwConfig
    from glmtune.plan.planner import Choices
    from glmtune.probe.report import Attempt, ProbeReport, probe_shortfall

    run = RunConfig(
        hw=HwConfig(**yaml.safe_load((REPO / "conf/hw/rtx4090_24g.yaml").read_text())),
        data=DataConfig(max_length=65536),
    )
    final = Choices(
        dtype="bf16",
        gradient_checkpointing=True,
        zero_stage=0,
        offload_params=False,
        offload_optimizer=False,
        micro_batch_size=1,
        grad_accum=1,
        max_length=65536,
        world_size=1,
        eval_batch_size=1,
        loss_chunk_tokens=256,
        offload_checkpoints=True,
    )
    measured, budget = 30 * 2**30, int(23.6 * 0.9 * 2**30)
    attempt = Attempt(final.to_dict(), "over budget", 19 * 2**30, measured, [measured], 1.0)
    report = ProbeReport(
        "gpu",
        True,
        "test",
        budget,
        attempt.predicted_peak_bytes,
        measured,
        [measured],
        [attempt],
        final.to_dict(),
        False,
        1.0,
    )
    line = probe_shortfall(report, run)
    assert "measured 30.00 GiB at best" in line and "budget 21.24 GiB" in line
    assert "+hw=a100_40g" in line and "+hw=rtx3090_24g" not in line and not line.rstrip().endswith(":")


def test_memory_timeline_records_plan_and_budget(tmp_path):
    from glmtune.train.timeline import save_timeline

    steps = [{"step": i, "allocated": 1 << 30, "reserved": 2 << 30, "peak_process": 3 << 30} for i in (1, 2, 3)]
    png = save_timeline(steps, tmp_path, planned_bytes=4 << 30, budget_bytes=5 << 30)
    saved = json.loads((tmp_path / "memory_timeline.json").read_text())
    assert png.stat().st_size > 0 and saved["planned_bytes"] == 4 << 30 and saved["budget_bytes"] == 5 << 30
    assert [s["step"] for s in saved["steps"]] == [1, 2, 3]
