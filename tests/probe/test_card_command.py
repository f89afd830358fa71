"""Issue 33 on CPU: the run the probe certifies is the run that trains.

The step-1 crash itself needs CUDA (bench/ckpt_early_stop.py shows it on an H200); here: the model never asks a
non-reentrant checkpoint to stop early, packed rows with a chunked loss train and evaluate with checkpointing on
and off, the probe and the run hand their batches to the same collate and loss code, the evaluation batch is
halved before any training rung, and a crash during training is one line, exit 1, the traceback in the log.
"""

import json
from dataclasses import replace

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from helpers import REPO
from helpers.cli import glmtune_in_process
from helpers.files import metrics_rows

from glmtune.config import DataConfig, RunConfig, TrainConfig
from glmtune.data.packing import decide_packing
from glmtune.data.pipeline import DataCollator, build_datasets, longest_length
from glmtune.models import load_config, load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny
from glmtune.plan.planner import make_plan
from glmtune.probe.probe import run_probe
from glmtune.train import lora_trainer
from glmtune.train.trainer import train


def test_the_loss_chunks_and_blocks_never_stop_their_recomputation_early():
    """Early stop raises from inside a C++ op in backward; under the run's allocator history that exception was
    lost on CUDA (SystemError). Both checkpointed paths must run with it off, reentrant or not."""
    model = load_model(ensure_tiny("glm4"))
    model.loss_chunk_tokens = 8
    seen = []
    model.transformer.output_layer.register_forward_hook(
        lambda *_: seen.append(("head", torch_checkpoint._enable_checkpoint_early_stop))
    )
    model.transformer.encoder.layers[0].register_forward_hook(
        lambda *_: seen.append(("block", torch_checkpoint._enable_checkpoint_early_stop))
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 1000, (1, 40))
    loss = model(input_ids=ids, labels=ids).loss  # early stop is read when the forward runs
    assert {k for k, _ in seen} == {"head", "block"} and all(flag is False for _, flag in seen), seen
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def packed_data():
    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    samples = REPO / "data" / "samples"
    data_cfg = DataConfig(
        train_file=str(samples / "train.jsonl"), val_file=str(samples / "val.jsonl"), packing="on", pack_length=600
    )
    data = build_datasets(data_cfg, tok)
    packing = decide_packing(data_cfg, data.train, 0, 4, on_gpu=False)
    assert packing.enabled
    return model_dir, tok, data_cfg, data, packing


@pytest.mark.parametrize("checkpointing", [True, False])
def test_packed_rows_with_a_chunked_loss_train_and_evaluate(tmp_path, packed_data, checkpointing):
    model_dir, tok, data_cfg, data, packing = packed_data
    run = RunConfig(
        data=data_cfg,
        train=TrainConfig(max_steps=2, eval_steps=1, logging_steps=1, save_minutes=0, use_reentrant=not checkpointing),
    )
    choices = replace(
        make_plan(run, load_config(model_dir), 1, user_set_max_length=False).choices,
        loss_chunk_tokens=64,
        gradient_checkpointing=checkpointing,
        micro_batch_size=4,
    )
    metrics, _ = train(
        run, choices, tmp_path, model_dir, data.train, data.val, DataCollator(tok.pad_token_id), packer=packing.packer()
    )
    assert metrics["steps"] == 2 and metrics["eval_loss"] > 0
    assert set(metrics["phase_peak_bytes"]) == {"train", "eval", "save"}
    evals = metrics_rows(tmp_path)
    assert sum("eval_loss" in e for e in evals) == 2  # after step 1 and after step 2


def test_the_probe_and_the_run_batch_through_the_same_collate_and_loss(tmp_path, repo, monkeypatch):
    """Every batch either one trains or evaluates on, recorded where the loss is computed: the same keys, dtypes
    and loss path. A change to the run's collator or loss that the probe does not share shows here."""
    seen = []
    compute_loss = lora_trainer.LoraTrainer.compute_loss

    def record(self, model, inputs, return_outputs=False):
        kind = "probe" if self.args.output_dir.endswith("probe") else "run"
        training = "step_tokens" in inputs
        glm = self.glm
        seen.append(
            (
                kind,
                training,
                tuple(sorted((k, str(v.dtype), v.dim()) for k, v in inputs.items())),
                type(self.data_collator).__name__,
                glm.loss_chunk_tokens,
            )
        )
        return compute_loss(self, model, inputs, return_outputs)

    monkeypatch.setattr(lora_trainer.LoraTrainer, "compute_loss", record)
    out = glmtune_in_process(
        "data.packing=on",
        "data.pack_length=600",
        "train.max_steps=2",
        "train.eval_steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=repo,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for training in (True, False):
        probe = {s[2:] for s in seen if s[0] == "probe" and s[1] == training}
        run = {s[2:] for s in seen if s[0] == "run" and s[1] == training}
        assert probe and probe == run, (training, probe, run)
    probe = json.loads((tmp_path / "run" / "probe.json").read_text())
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert set(probe["attempts"][-1]["detail"]["phase_peak_bytes"]) == {"train", "eval"}
    # Measured alike (live tensor bytes on CPU), the run stays within its certificate.
    assert max(metrics["phase_peak_bytes"].values()) <= probe["measured_peak_bytes"] * 1.01
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None  # the CPU meter is on torch's stack during its phases only


def test_evaluation_over_budget_halves_the_evaluation_batch_before_any_training_rung(tmp_path):
    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    run = RunConfig(data=DataConfig(), train=TrainConfig(eval_batch_size=8))
    data = build_datasets(run.data, tok)
    arch = load_config(model_dir)
    plan = make_plan(run, arch, 1, user_set_max_length=False, data_max_tokens=longest_length(data.stats))
    args = (arch, model_dir, longest_length(data.stats), tok, DataCollator(tok.pad_token_id), tmp_path, 1)
    free = run_probe(run, plan, *args, evaluates=True)
    peaks = free.attempts[0].detail["phase_peak_bytes"]
    assert peaks["eval"] > peaks["train"]  # 8 x 500 tokens of evaluation outweigh one 500-token training step
    # A budget between the two: training fits, evaluation does not.
    budget = (peaks["train"] + peaks["eval"]) // 2
    report = run_probe(run, replace(plan, budget_bytes=budget), *args, evaluates=True)
    rungs = [
        (
            a.choices["eval_batch_size"],
            a.choices["micro_batch_size"],
            a.choices["loss_chunk_tokens"],
            a.choices["gradient_checkpointing"],
        )
        for a in report.attempts
    ]
    assert report.fits and rungs[0] == (8, 1, 0, False)
    assert all(r[1:] == (1, 0, False) for r in rungs), rungs  # no training rung was taken
    assert rungs[-1][0] < 8 and "evaluation was the phase over budget" in report.attempts[0].detail["next_rung"]


def test_a_crash_in_training_is_one_line_exit_1_traceback_in_the_log(tmp_path, repo, monkeypatch):
    calls = {"n": 0}
    compute_loss = lora_trainer.LoraTrainer.compute_loss

    def crash_in_the_runs_second_step(self, model, inputs, return_outputs=False):
        if not self.args.output_dir.endswith("probe") and "step_tokens" in inputs:
            calls["n"] += 1
            if calls["n"] == 2:
                raise SystemError("<built-in function cross_entropy_loss> returned NULL without setting an exception")
        return compute_loss(self, model, inputs, return_outputs)

    monkeypatch.setattr(lora_trainer.LoraTrainer, "compute_loss", crash_in_the_runs_second_step)
    run_dir = tmp_path / "run"
    out = glmtune_in_process("train.max_steps=3", f"hydra.run.dir={run_dir}", cwd=repo)
    assert out.returncode == 1
    lines = [line[line.index("glmtune: error") :] for line in out.stderr.splitlines() if "glmtune: error" in line]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr  # besides it: the progress bar only
    assert lines[0].startswith("glmtune: error: training failed in step 2: SystemError: <built-in function")
    assert str(run_dir / "rank0.log") in lines[0]
    log = (run_dir / "rank0.log").read_text()
    assert "Traceback (most recent call last)" in log and "crash_in_the_runs_second_step" in log
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "failed" and "SystemError" in state["error"]
    # The run's CPU meter (a dispatch mode) came off torch's stack with the crash: nothing later runs through it.
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


def test_the_estimate_counts_the_packed_rows_mask_as_the_attention_keeps_it():
    """Packed rows under SDPA: each block's attention turns the bool mask into an additive bias of the compute
    dtype and keeps it for backward (the 0.31 GiB the H200's row 1 measured beyond the estimate, RESULTS §11).
    Live tensor bytes after the forward, packed (one document, so the same attention) minus unpacked, are what
    the estimator adds for the mask."""
    from glmtune.plan.estimate import RunShape, estimate
    from glmtune.train.livebytes import LiveTensorTracker

    model_dir = ensure_tiny("glm4")
    model = load_model(model_dir).train()
    arch, seq = load_config(model_dir), 256
    ids = torch.randint(0, 1000, (1, seq))

    def after_forward(seq_ids):
        with LiveTensorTracker(baseline=[*model.parameters(), *model.buffers()]) as tracker:
            loss = model(input_ids=ids, labels=ids, seq_ids=seq_ids, position_ids=torch.arange(seq)[None]).loss
            kept = tracker.current_bytes
            del loss
        return kept

    measured = after_forward(torch.zeros(1, seq, dtype=torch.long)) - after_forward(None)
    shape = RunShape(dtype="fp32", seq_len=seq, lora_dropout=0.0, device="cpu")
    planned = estimate(arch, replace(shape, document_mask=True)).phases["loss"] - estimate(arch, shape).phases["loss"]
    assert planned == arch.num_layers * seq * seq * 4
    assert measured == pytest.approx(planned, abs=8192), (measured, planned)
