"""Packing inside the optimizer step (issue 31): packed and unpacked train the same examples per step with the same
gradient, however the global batch of 8 is split.

Data: 44 conversations of 3-250 target tokens, so a step's 8 examples pack into a few rows of 600 positions and an
epoch ends with a step of 4 real examples and 4 null slots (train/steps.py). Reference: unpacked, 8 x 1, one
process. Every other run packs (data.packing=on) and must log the same step losses (rtol 1e-5), the same LoRA
gradients (rtol 1e-5; across processes: the gradient norm the Trainer logs), the same example ids per step
(GLMTUNE_EXAMPLE_LOG) and, after 10 steps, the same adapter (1e-4 of each tensor's norm). fp32, LoRA dropout 0.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BIN
from test_same_math import COMMON, REPO, StepGradients, adapter, assert_same_adapter, compose_run, step_losses
from transformers import TrainerCallback

from glmtune.data.packing import RowPacker, decide_packing, first_fit
from glmtune.data.pipeline import DataCollator, build_datasets
from glmtune.models import load_tokenizer
from glmtune.models.presets import arch_config, ensure_tiny, resolve_model_dir
from glmtune.plan.packrows import fullest_micro_step, most_rows
from glmtune.plan.planner import make_plan
from glmtune.train.steps import NULL, StepCollator
from glmtune.train.trainer import build_model, make_trainer, training_args

STEPS, PACK_LENGTH, EXAMPLES = 10, 600, 44
WORDS = "the model reads each example once and learns to answer short questions with care".split()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """44 conversations: replies of 1-115 words (3-250 target tokens with the tiny tokenizer)."""
    rng = random.Random(31)
    lines = []
    for i in range(EXAMPLES):
        words = 1 if i % 10 == 0 else rng.randint(2, 115)
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        reply = " ".join(rng.choice(WORDS) for _ in range(words))
        lines.append(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"question {i}: {prompt}"},
                        {"role": "assistant", "content": reply},
                    ]
                }
            )
        )
    path = tmp_path_factory.mktemp("packdata") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def overrides(data_file: Path, packing: str) -> list[str]:
    return [
        f"data.train_file={data_file}",
        f"data.cache_dir={data_file.parent / 'cache'}",
        f"data.packing={packing}",
        f"data.pack_length={PACK_LENGTH}",
    ]


def in_process(data_file: Path, packing: str, split: tuple[int, int], log: Path) -> dict:
    """Step losses, per-step LoRA gradients, example ids per step, the final LoRA tensors and the rows per micro-step
    of STEPS steps through the run's Trainer (one process)."""
    ensure_tiny("glm4")
    run = compose_run(*COMMON, *overrides(data_file, packing))
    run.train.max_steps = STEPS
    model_dir = resolve_model_dir(run.model)
    tokenizer = load_tokenizer(model_dir)
    data = build_datasets(run.data, tokenizer, None)
    packing = decide_packing(run.data, data.train, 0, split[0], on_gpu=False)
    choices = replace(
        make_plan(run, arch_config(run.model), 1, False).choices, micro_batch_size=split[0], grad_accum=split[1]
    )
    args = training_args(run.train, choices, log / "run", has_eval=False)
    args.report_to, args.save_strategy = [], "no"
    model = build_model(model_dir, run, choices)
    grads, losses, rows = StepGradients(model), [], []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    os.environ["GLMTUNE_EXAMPLE_LOG"] = str(log)
    try:
        trainer = make_trainer(
            args,
            model,
            data.train,
            None,
            DataCollator(tokenizer.pad_token_id),
            callbacks=[grads, Record()],
            packer=packing.packer(),
        )
    finally:
        del os.environ["GLMTUNE_EXAMPLE_LOG"]
    collate = trainer.data_collator

    def counting(features):
        batch = collate(features)
        rows.append(len(batch["input_ids"]))
        return batch

    trainer.data_collator = counting
    trainer.train()
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "grads": grads.steps, "ids": example_ids(log), "adapter": lora, "rows": rows}


def example_ids(log: Path) -> dict[int, list[int]]:
    """Optimizer step -> the sorted example ids every rank trained in it."""
    steps: dict[int, list[int]] = {}
    for path in log.glob("examples.rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["ids"])
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


@pytest.fixture(scope="module")
def reference(data_file, tmp_path_factory):
    return in_process(data_file, "off", (8, 1), tmp_path_factory.mktemp("ref"))


def test_the_data_spans_3_to_250_target_tokens(data_file, reference):
    tokenizer = load_tokenizer(ensure_tiny("glm4"))
    data = build_datasets(compose_run(*COMMON, *overrides(data_file, "on")).data, tokenizer, None)
    counts = data.train.target_counts()
    assert len(counts) == EXAMPLES and 3 <= counts.min() <= 5 and 200 <= counts.max() <= 250
    ids = reference["ids"]
    assert len(ids) == STEPS and all(len(v) == 8 for s, v in ids.items() if s != 6)
    assert len(ids[6]) == EXAMPLES - 5 * 8  # the epoch's last step: 4 examples, 4 null slots
    assert sorted(i for s in range(1, 7) for i in ids[s]) == list(range(EXAMPLES))  # an epoch: each example once


# 8 x 1 packs a whole step into a few rows; 2 x 4 and 1 x 8 (accumulation: ~2-4 min each on 2 CPU cores) are slow.
@pytest.mark.parametrize(
    "split", [(8, 1), pytest.param((2, 4), marks=pytest.mark.slow), pytest.param((1, 8), marks=pytest.mark.slow)]
)
def test_packed_steps_train_the_same_examples_with_the_same_gradient(data_file, reference, tmp_path, split):
    got = in_process(data_file, "on", split, tmp_path)
    assert got["ids"] == reference["ids"]
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert len(got["grads"]) == len(reference["grads"]) == STEPS
    for step, (mine, ref) in enumerate(zip(got["grads"], reference["grads"])):
        assert mine.keys() == ref.keys() and ref
        for name in ref:
            torch.testing.assert_close(mine[name], ref[name], rtol=1e-5, atol=1e-7, msg=f"step {step + 1}: {name}")
    assert_same_adapter(got["adapter"], reference["adapter"], f"packed {split}")
    # Packed for real: at 8 x 1 each step's 8 examples (or 4 and their null slots) become fewer rows.
    rows = got["rows"][: STEPS * split[1]]  # the loader collates one micro-batch ahead
    assert len(rows) == STEPS * split[1]
    if split[0] == 8:
        assert max(rows) < 8 and sum(rows) < 8 * STEPS / 2
    assert max(rows) <= split[0]


def test_the_collator_packs_the_micro_batch_and_leaves_null_slots_out():
    examples = [{"input_ids": [i + 1] * n, "labels": [-100] + [i + 1] * (n - 1)} for i, n in enumerate([5, 4, 3, 6])]
    collate = StepCollator(DataCollator(pad_id=0), RowPacker(10))
    features = [{**e, "example_id": i, "step_tokens": 14} for i, e in enumerate(examples)]
    features[2]["example_id"] = NULL
    batch = collate(features)
    assert batch["seq_ids"].tolist() == [[0] * 5 + [1] * 4, [0] * 6 + [-1] * 3]  # first-fit: [5, 4], [6]
    assert batch["example_ids"].tolist() == [0, 1, NULL, 3] and batch["step_tokens"].item() == 14
    # A micro-batch of null slots only: one row of one of them, without a target, so every rank still runs a forward.
    nulls = collate(
        [{**e, "example_id": NULL, "step_tokens": 0, "labels": [-100] * len(e["labels"])} for e in examples[:2]]
    )
    assert nulls["input_ids"].shape[0] == 1 and (nulls["labels"] == -100).all()
    assert first_fit([300, 250, 400, 50, 200], 600) == [[0, 1, 3], [2, 4]]


def test_the_probed_micro_step_is_the_fullest_the_packer_makes():
    """The probe's equal examples, packed by the run's packer, give the planned rows; no micro-step of examples no
    longer than the longest makes more rows than most_rows, and the probed row is within one example of full."""
    rng = np.random.default_rng(0)
    for micro, longest, length in [(8, 500, 2048), (16, 300, 2048), (4, 1100, 2048), (3, 100, 2048), (1, 500, 600)]:
        layout = fullest_micro_step(micro, longest, length)
        rows = first_fit([layout.example_positions] * micro, length)
        assert (len(rows), max(len(r) for r in rows) * layout.example_positions) == (layout.rows, layout.row_positions)
        assert layout.row_positions > min(length, micro * longest) - longest
        for _ in range(200):
            assert len(first_fit(rng.integers(1, longest + 1, micro).tolist(), length)) <= most_rows(
                micro, longest, length
            )


def test_the_plan_says_how_many_rows_a_step_becomes(data_file, tmp_path, repo):
    from helpers.cli import glmtune_in_process

    out = glmtune_in_process(
        *overrides(data_file, "on"),
        "mode=plan",
        "train.per_device_batch_size=8",
        "data.max_length=300",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=repo,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    packing = json.loads((tmp_path / "run" / "plan.json").read_text())["packing"]
    assert packing["examples_per_micro_step"] == 8 and packing["pack_length"] == PACK_LENGTH
    assert (packing["probed_rows_per_micro_step"], packing["probed_row_positions"]) == (4, 600)  # 2 x 300 a row
    assert packing["most_rows_per_step"] == 8 and "8 examples per micro-step" in out.stdout


@pytest.mark.slow
def test_packed_runs_on_two_processes_and_zero3_match_the_unpacked_run(data_file, tmp_path):
    """One launch per layout, each against one single-process unpacked run: DDP 2 x 2 x 2 processes and ZeRO-3
    4 x 1 x 2 processes, packed."""
    runs = {
        "unpacked 8x1x1": ("off", 8, 1, 1, []),
        "packed ddp 2x2x2": ("on", 2, 2, 2, []),
        "packed zero3 4x1x2": ("on", 4, 1, 2, ["dist=zero3"]),
    }
    results = {}
    for name, (packing, micro, accum, nproc, extra) in runs.items():
        out, log = tmp_path / name.replace(" ", "-"), tmp_path / f"{name.replace(' ', '-')}-ids"
        log.mkdir()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GLMTUNE_EXAMPLE_LOG": str(log),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        }
        launcher = (
            [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), "-m", "glmtune"]
            if nproc > 1
            else [sys.executable, "-m", "glmtune"]
        )
        proc = subprocess.run(
            [
                *launcher,
                *COMMON,
                *overrides(data_file, packing),
                f"train.max_steps={STEPS}",
                f"train.per_device_batch_size={micro}",
                f"train.grad_accum={accum}",
                *extra,
                f"hydra.run.dir={out}",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        results[name] = (step_losses(out), step_losses(out, "grad_norm"), adapter(out), example_ids(log))
    ref_losses, ref_norms, ref_adapter, ref_ids = results["unpacked 8x1x1"]
    assert len(ref_losses) == STEPS and len(ref_ids) == STEPS
    for name, (losses, norms, weights, ids) in results.items():
        assert ids == ref_ids, name
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        assert norms == pytest.approx(ref_norms, rel=1e-5), name
        assert_same_adapter(weights, ref_adapter, name)


def test_the_probe_runs_the_planned_micro_step_through_the_runs_packer(tmp_path):
    """run_probe with packing: its training micro-batches are the plan's fullest micro-step (rows x positions), laid
    out by the same collator and packer the run uses; its evaluation batches stay unpacked."""
    from glmtune.config import DataConfig, RunConfig, TrainConfig
    from glmtune.data.pipeline import longest_length
    from glmtune.models import load_config
    from glmtune.probe.probe import run_probe

    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    run = RunConfig(
        data=DataConfig(packing="on", pack_length=600), train=TrainConfig(per_device_batch_size=4, eval_batch_size=2)
    )
    data = build_datasets(run.data, tok)
    arch, longest = load_config(model_dir), longest_length(data.stats)
    plan = make_plan(run, arch, 1, user_set_max_length=False, data_max_tokens=longest, packed=(600, 0))
    shapes = []
    collate = DataCollator(tok.pad_token_id)

    def recording(features):
        batch = collate(features)
        shapes.append(("packed" if "seq_ids" in batch else "unpacked", *batch["input_ids"].shape))
        return batch

    report = run_probe(
        run, plan, arch, model_dir, longest, tok, recording, tmp_path, 1, evaluates=True, packed=(600, 0)
    )
    assert report.fits
    layout = fullest_micro_step(4, longest, 600)
    assert (plan.packing["probed_rows_per_micro_step"], plan.packing["probed_row_positions"]) == layout[:2]
    assert {s for s in shapes if s[0] == "packed"} == {("packed", layout.rows, layout.row_positions)}
    assert {s for s in shapes if s[0] == "unpacked"} == {("unpacked", 2, longest)}
