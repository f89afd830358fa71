"""Sequence parallelism (train/sequence.py) for each GLM family, and evaluation under it, against one process.

Each layout is one real launch (torchrun on gloo, CPU, fp32, LoRA dropout 0) of a tiny model on packed rows:
a micro-batch's 4 examples share one row, so documents cross the shard boundaries of 2 and of 4 ranks. SP 2
(2 processes) and SP 4 (4 processes) against one process: the same examples in every step, each step's loss
and gradient norm within rtol 1e-5, the adapter after 5 steps within 1e-4 of each tensor's largest value, and
the final evaluation's loss within rtol 1e-5. GLM-4V's micro-batches carry images (merged before the rows are
cut); its 7 examples make 2 steps an epoch, so the 5 steps also cross epochs.

Evaluation: the Trainer's eval loss (the mean of per-batch mean token losses, train/evaluation.py) under SP is
one process's: an eval batch of 3 leaves a short last batch, so the loader's remainder bookkeeping is compared
too, under SP 2 and 4 (DDP) for each family above, and below under ZeRO-3 + SP 2 (DP 2 x SP 2 against a
2-process data-parallel run: test_sequence_parallel.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from helpers.files import metrics_rows
from helpers.launch import ranks_env
from test_sequence_parallel import adapter, assert_same_adapter, ids_per_rank, logged, steps_of

from glmtune.train.steps import NULL, StepSampler

STEPS = 5
COMMON = [
    "train.precision=fp32",
    "lora.dropout=0",
    "probe.enabled=false",
    "train.report_to=[]",
    "train.per_device_batch_size=4",
    "train.eval_batch_size=3",  # the 8 text val examples in batches of 3, 3 and 2: a short last one under SP too
]
TEXT = [f"data.train_file={REPO / 'data/samples/train.jsonl'}", f"data.val_file={REPO / 'data/samples/val.jsonl'}"]
MODELS = {
    "glm4": ["model=glm4_tiny", *TEXT],
    "chatglm3": ["model=chatglm3_tiny", *TEXT],
    "glm4v": ["model=glm4v_tiny", "data=samples_vision"],
}


def launch(out: Path, nproc: int, *args: str) -> None:
    log = out.parent / f"{out.name}-ids"
    log.mkdir(parents=True, exist_ok=True)
    env = ranks_env(GLMTUNE_EXAMPLE_LOG=str(log), PYTHON=sys.executable)
    launcher = [str(REPO / "scripts" / "torchrun.sh"), str(nproc)] if nproc > 1 else [sys.executable, "-m", "glmtune"]
    proc = subprocess.run(
        [*launcher, *COMMON, *args, f"hydra.run.dir={out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (out.name, proc.stderr[-3000:])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One single-process run per model, made on first use."""
    made: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in made:
            made[model] = tmp_path_factory.mktemp("sp-models") / f"{model}-reference"
            launch(
                made[model],
                1,
                *MODELS[model],
                "data.packing=on",
                f"train.max_steps={STEPS}",
                f"train.eval_steps={STEPS}",
                "train.logging_steps=1",
            )
        return made[model]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("model", list(MODELS))
def test_each_family_trains_and_evaluates_under_sp_as_one_process(references, tmp_path, model, sp):
    reference = references(model)
    out = tmp_path / f"{model}-sp{sp}"
    launch(
        out,
        sp,
        *MODELS[model],
        "data.packing=on",
        f"train.max_steps={STEPS}",
        f"train.eval_steps={STEPS}",
        "train.logging_steps=1",
        f"dist.sequence_parallel={sp}",
    )
    ref_ids = steps_of(ids_per_rank(reference), 1)
    assert len(ref_ids) == STEPS and steps_of(ids_per_rank(out), sp) == ref_ids
    assert all(loss > 0 for loss in logged(reference)), "a step without targets compares nothing"
    assert logged(out) == pytest.approx(logged(reference), rel=1e-5)
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-5)
    assert len(logged(reference, "eval_loss")) == 1
    assert logged(out, "eval_loss") == pytest.approx(logged(reference, "eval_loss"), rel=1e-5)
    assert_same_adapter(adapter(out), adapter(reference), f"{model} sp{sp}")


@pytest.mark.slow
def test_the_eval_loss_under_sp_is_the_one_without(tmp_path):
    """ZeRO-3 + SP 2: evaluations at steps 2 and 4 with an eval batch of 3 (8 val examples: batches of 3, 3 and 2).
    One log, at step 3: the final train_loss adds step 4's loss, under SP the mean over the ranks, not rank 0's
    shard's share (plain data parallel keeps the Trainer's rank-0 figure for that tail)."""
    args = [
        *MODELS["glm4"],
        "train.max_steps=4",
        "train.eval_steps=2",
        "train.eval_batch_size=3",
        "train.per_device_batch_size=2",
        "train.logging_steps=3",
    ]
    runs = {}
    for name, nproc, extra in [
        ("one", 1, ["train.grad_accum=2"]),
        ("zero3sp2", 2, ["dist=zero3", "dist.sequence_parallel=2", "train.grad_accum=2"]),
    ]:
        runs[name] = tmp_path / name
        launch(runs[name], nproc, *args, *extra)
    one = logged(runs["one"], "eval_loss")
    assert len(one) == 2
    assert logged(runs["zero3sp2"], "eval_loss") == pytest.approx(one, rel=1e-5)
    # the same training in both: the evaluations score the same adapter, and the closing loss is the same
    assert logged(runs["zero3sp2"]) == pytest.approx(logged(runs["one"]), rel=1e-5)
    assert train_loss(runs["zero3sp2"]) == pytest.approx(train_loss(runs["one"]), rel=1e-5)


def train_loss(out: Path) -> float:
    rows = metrics_rows(out)
    return next(r["train_loss"] for r in rows if "train_runtime" in r)


def test_an_sp_epoch_is_the_epoch_each_micro_batch_repeated():
    """Under SP N the sampler yields each micro-batch N times in a row and nothing else: as many steps per epoch as
    without (no steps of null slots after the epoch's real ones)."""
    counts = np.arange(1, 8)  # 7 examples, global batch 4: a real block and a block of 3 + 1 null slot
    plain, repeated = StepSampler(counts, 4, 0, 2), StepSampler(counts, 4, 0, 2, repeat=2)
    once, twice = list(plain), list(repeated)
    assert len(twice) == len(repeated) == 2 * len(once) == 16
    pairs = [twice[i : i + 2] for i in range(0, 16, 2)]
    assert [p for k, p in enumerate(pairs) if k % 2 == 0] == [p for k, p in enumerate(pairs) if k % 2 == 1]
    assert [x for k, p in enumerate(pairs) if k % 2 == 0 for x in p] == once
    assert sum(index == NULL for index, _ in once) == 1


def test_the_plan_says_the_eval_loss_is_sharded_and_generation_is_not(tmp_path):
    run = tmp_path / "plan"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "glmtune",
            "mode=plan",
            "model=glm4_9b_chat",
            "+hw=a100_80g",
            "dist.nproc_per_node=4",
            "dist.sequence_parallel=2",
            "eval.generate=true",
            f"hydra.run.dir={run}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    why = json.loads((run / "plan.json").read_text())["reasons"]["eval_batch_size"]
    assert "eval loss is sharded over each group's 2 GPUs" in why and "eval.generate decodes whole rows" in why
