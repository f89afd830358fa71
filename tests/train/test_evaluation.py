"""eval.generate end to end on the tiny model, the best adapter, early stopping, and the plan's generate phase."""

import json
import subprocess
import sys

import pytest
from helpers.cli import glmtune_in_process, glmtune_inspected
from helpers.files import metrics_rows
from transformers import TrainerControl

from glmtune.config import ConfigError, EvalConfig, parse_config
from glmtune.models import released_config
from glmtune.plan.planner import make_plan
from glmtune.train.evaluation import BestTracker, eval_examples
from glmtune.train.metrics import generation_metrics

VAL = "data/samples/val.jsonl"


def test_eval_generate_writes_metrics_keeps_best_and_stops_early(tmp_path, repo):
    run = tmp_path / "run"
    # Exact match stays 0 on an untrained tiny model: the first evaluation (step 2) is the best, the second
    # (step 4) is not better, and patience 1 ends the 10-step run there.
    proc = glmtune_in_process(
        f"data.val_file={VAL}",
        "eval.generate=true",
        "eval.max_new_tokens=8",
        "eval.max_examples=4",
        "train.max_steps=10",
        "train.eval_steps=2",
        "eval.metric_for_best=eval_exact_match",
        "eval.early_stopping_patience=1",
        "probe.enabled=false",
        f"hydra.run.dir={run}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    for key in (
        "eval_loss",
        "eval_perplexity",
        "eval_rouge-1",
        "eval_rouge-2",
        "eval_rouge-l",
        "eval_bleu-4",
        "eval_exact_match",
    ):
        assert isinstance(metrics[key], float), key
    assert metrics["steps"] == 4
    assert metrics["best"]["step"] == 2 and metrics["best"]["stopped_early"]
    assert (run / "adapter_best" / "adapter_model.safetensors").is_file()
    assert (run / "adapter_best" / "glmtune_base.json").is_file()

    # The numbers are those of the replies written beside them (the step-4 evaluation is the final one).
    rows = [json.loads(line) for line in (run / "eval" / "eval_predictions_step4.jsonl").read_text().splitlines()]
    examples = eval_examples(VAL, 4)
    assert [r["prompt"] for r in rows] == [p for _, p, _ in examples]
    assert [r["reference"] for r in rows] == [ref for _, _, ref in examples]
    recomputed = generation_metrics([r["output"] for r in rows], [r["reference"] for r in rows])
    for key, value in recomputed.items():
        assert metrics[f"eval_{key}"] == pytest.approx(value)
    assert (run / "eval" / "eval_predictions_step2.jsonl").is_file()

    logged = metrics_rows(run)
    assert [r["step"] for r in logged if "eval_rouge-l" in r] == [2, 4]
    assert "rouge-l" in proc.stdout.splitlines()[-1] or "rouge-l" in proc.stdout  # the final line

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = [p.parent for p in (run / "tensorboard").rglob("events.out.tfevents.*")][:1]
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert {"eval/rouge-1", "eval/bleu-4", "eval/perplexity"} <= set(acc.Tags()["scalars"])


def test_best_tracker():
    tracker, control = BestTracker(EvalConfig(metric_for_best="eval_loss", early_stopping_patience=2)), TrainerControl()
    assert tracker.update({"eval_loss": 2.0}, 10, control) and control.should_save
    control.should_save = False
    assert not tracker.update({"eval_loss": 2.5}, 20, control) and not control.should_training_stop
    assert tracker.update({"eval_loss": 1.5}, 30, control)
    tracker.update({"eval_loss": 1.6}, 40, control)
    tracker.update({"eval_loss": 1.5}, 50, control)  # equal is not better
    assert control.should_training_stop and tracker.summary() == {
        "metric": "eval_loss",
        "value": 1.5,
        "step": 30,
        "stopped_early": True,
    }
    higher = BestTracker(EvalConfig(generate=True, metric_for_best="eval_rouge-l"))
    higher.update({"eval_rouge-l": 10.0}, 1)
    assert higher.update({"eval_rouge-l": 12.0}, 2) and higher.step == 2


def test_generation_metric_for_best_needs_eval_generate():
    with pytest.raises(ConfigError, match="eval.generate=true"):
        parse_config({"eval": {"metric_for_best": "eval_rouge-l"}})
    parse_config({"eval": {"metric_for_best": "eval_rouge-l", "generate": True}})


def test_plan_counts_the_generate_phase():
    base = {"data": {"val_file": VAL}, "hw": {"name": "a100_80g", "memory_gib": 80.0}}
    plain = make_plan(parse_config(base), released_config("glm4_9b_chat"), 1, user_set_max_length=False)
    gen = make_plan(
        parse_config({**base, "eval": {"generate": True, "max_new_tokens": 512}}),
        released_config("glm4_9b_chat"),
        1,
        user_set_max_length=False,
    )
    assert "eval KV cache" not in plain.breakdown
    # 40 layers x 2 groups x 128 x K,V x 2 B = 40,960 B per token, for eval batch x (prompt + 512 new tokens)
    c = gen.choices
    assert gen.breakdown["eval KV cache"] == 40_960 * c.eval_batch_size * (c.max_length + 512)


@pytest.mark.slow
def test_eval_generate_under_zero3_on_two_ranks(tmp_path, repo):
    """Every ZeRO-3 forward gathers weights from both ranks, so generation runs in lock-step (synced_gpus)."""
    from pathlib import Path

    out = tmp_path / "z3"
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "glmtune",
            "dist=zero3",
            f"data.val_file={VAL}",
            "eval.generate=true",
            "eval.max_new_tokens=6",
            "eval.max_examples=3",
            "train.max_steps=2",
            "train.eval_batch_size=2",
            "probe.enabled=false",
            f"hydra.run.dir={out}",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"eval_rouge-1", "eval_bleu-4", "eval_exact_match"} <= set(metrics)
    (written,) = list((out / "eval").glob("*.jsonl"))  # rank 0 alone writes the replies
    assert len(written.read_text().splitlines()) == 3


# Records every file the process opens (io.open, os.open): glmtune_inspected's setup.
_OPENS = """opened = set()
sys.addaudithook(lambda event, args: opened.add(str(args[0])) if event == "open" and args and args[0] else None)"""


def test_a_users_own_train_file_is_evaluated_on_no_bundled_sample_file(tmp_path, repo):
    """`python -m glmtune data.train_file=<own file> train.max_steps=2`: no data.val_file, no data.val_size, so no
    evaluation, and the process opens no file of the bundled sample sets (data/samples*/) at all; the header says
    so. (The demo keeps its val set: conf/data/samples.yaml, tests/config/test_config.py.)"""
    own = tmp_path / "mine" / "train.jsonl"
    own.parent.mkdir()
    own.write_text((repo / "data/samples/train.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    run = tmp_path / "run"
    code, opened, stdout = glmtune_inspected(
        [f"data.train_file={own}", "train.max_steps=2", f"hydra.run.dir={run}"],
        repo,
        report="sorted(opened)",
        setup=_OPENS,
    )
    assert code == 0, stdout[-3000:]
    assert str(own) in opened  # the hook sees the data files the run reads
    samples = [repo / "data" / name for name in ("samples", "samples_vision")]
    assert [p for p in opened if any(str(folder) in str((repo / p).resolve()) for folder in samples)] == []
    assert "  val    none (data.val_file or data.val_size to evaluate)" in stdout.splitlines()
    metrics = json.loads((run / "metrics.json").read_text())
    assert "eval_loss" not in metrics and not (run / "adapter_best").exists()
