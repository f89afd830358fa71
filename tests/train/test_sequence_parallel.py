"""Training under sequence parallelism (dist.sequence_parallel, train/sequence.py) trains what one process trains.

Each layout is one real launch of the command (torchrun on gloo, CPU, the tiny GLM-4 in fp32, LoRA dropout 0)
with a global batch of 4 examples, against one single-process run of the same global batch: the same example
ids in every step (each sequence-parallel group's ranks alike, the groups together = the reference's), the step
losses and gradient norms within rtol 1e-5, the adapter within 1e-4 of each tensor's largest value; DP 2 x SP 2
also evaluates, to a 2-process data-parallel run's eval loss. Then a run stopped under SP 2 resumes in one process
with the uninterrupted run's adapter.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.files import metrics_rows
from helpers.launch import ranks_env
from safetensors.torch import load_file

from glmtune.models.kernels.ulysses import SequenceGroup
from glmtune.train.sequence import shard_batch

STEPS = 4
COMMON = [
    "train.precision=fp32",
    "lora.dropout=0",
    "train.logging_steps=1",
    "probe.enabled=false",
    "train.report_to=[]",
    f"data.train_file={REPO / 'data/samples/train.jsonl'}",
]
NO_EVAL = ["data.val_file=null"]
# Evaluations at steps 2 and 4, the 8 val examples in batches of 3, 3 and 2: a short last batch on each group.
EVAL = [f"data.val_file={REPO / 'data/samples/val.jsonl'}", "train.eval_steps=2", "train.eval_batch_size=3"]


def launch(out: Path, nproc: int, *args: str, wait: bool = True):
    log = out.parent / f"{out.name}-ids"
    log.mkdir(parents=True, exist_ok=True)
    env = ranks_env(GLMTUNE_EXAMPLE_LOG=str(log))
    # scripts/torchrun.sh: the supervisor carries a stop's exit 7 (plain torchrun turns SIGTERM into exit 1)
    launcher = [str(REPO / "scripts" / "torchrun.sh"), str(nproc)] if nproc > 1 else [sys.executable, "-m", "glmtune"]
    env["PYTHON"] = sys.executable
    cmd = [*launcher, *COMMON, *args, f"hydra.run.dir={out}"]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (out.name, proc.stderr[-3000:])
    return proc


def logged(out: Path, key: str = "loss") -> list[float]:
    rows = metrics_rows(out)
    return [r[key] for r in rows if key in r and "train_runtime" not in r]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter" / "adapter_model.safetensors")


def ids_per_rank(out: Path) -> dict[int, dict[int, list[int]]]:
    """rank -> optimizer step -> the example ids that rank trained in it."""
    found: dict[int, dict[int, list[int]]] = {}
    for path in (out.parent / f"{out.name}-ids").glob("examples.rank*.jsonl"):
        rank = int(path.stem.removeprefix("examples.rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found.setdefault(rank, {}).setdefault(record["step"], []).extend(record["ids"])
    return found


def steps_of(ranks: dict[int, dict[int, list[int]]], sp: int) -> dict[int, list[int]]:
    """The examples each step trained: the ranks of a sequence-parallel group must agree; the groups add up."""
    steps: dict[int, list[int]] = {}
    for first in range(0, len(ranks), sp):
        group = [ranks[r] for r in range(first, first + sp)]
        assert all(g == group[0] for g in group), f"ranks {first}..{first + sp - 1} trained different examples"
        for step, ids in group[0].items():
            steps.setdefault(step, []).extend(ids)
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


def stop_at_checkpoint(proc: subprocess.Popen, out: Path, step: int) -> None:
    """SIGTERM the launch `proc` once its checkpoint-<step> is complete; it must stop with exit 7."""
    deadline = time.monotonic() + 600
    while not list((out / "checkpoints").glob(f"checkpoint-{step}/COMPLETE")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 7, err[-3000:]


def assert_same_adapter(mine: dict, ref: dict, name: str) -> None:
    assert mine.keys() == ref.keys(), name
    for key in ref:
        scale = float(ref[key].abs().max())
        assert float((mine[key] - ref[key]).abs().max()) <= 1e-4 * scale, (name, key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "reference"
    launch(out, 1, f"train.max_steps={STEPS}", "train.per_device_batch_size=4", *NO_EVAL)
    return out


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    """2 processes, no SP, evaluating: what DP 2 x SP 2 must evaluate to (data parallel shards the eval batches,
    so its eval loss is not one process's)."""
    out = tmp_path_factory.mktemp("sp") / "dp2"
    launch(out, 2, f"train.max_steps={STEPS}", "train.per_device_batch_size=2", *EVAL)
    return out


# Packed rows under SP 2 and 4, with evaluation, are each family's case in test_sequence_parallel_models.py.
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, nproc, args",
    [
        ("sp2", 2, ["dist.sequence_parallel=2", "train.per_device_batch_size=4", *NO_EVAL]),
        ("dp2 x sp2", 4, ["dist.sequence_parallel=2", "train.per_device_batch_size=2", *EVAL]),
        ("sp4, KV groups replicated", 4, ["dist.sequence_parallel=4", "train.per_device_batch_size=4", *NO_EVAL]),
        (
            "zero3 + sp2",
            2,
            ["dist.sequence_parallel=2", "dist=zero3", "train.per_device_batch_size=2", "train.grad_accum=2", *NO_EVAL],
        ),
    ],
)
def test_a_layout_trains_what_one_process_trains(reference, request, tmp_path, name, nproc, args):
    out = tmp_path / name.split(",")[0].replace(" ", "-")
    launch(out, nproc, f"train.max_steps={STEPS}", *args)
    sp = int(next(a for a in args if a.startswith("dist.sequence_parallel=")).split("=")[1])
    ref_ids = steps_of(ids_per_rank(reference), 1)
    assert len(ref_ids) == STEPS and steps_of(ids_per_rank(out), sp) == ref_ids, name
    assert logged(out) == pytest.approx(logged(reference), rel=1e-5), name
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-5), name
    assert_same_adapter(adapter(out), adapter(reference), name)
    if EVAL[0] in args:  # the eval loss of each SP group's shards is the data-parallel run's, at steps 2 and 4
        want = logged(request.getfixturevalue("data_parallel"), "eval_loss")
        assert len(want) == 2 and logged(out, "eval_loss") == pytest.approx(want, rel=1e-5), name


@pytest.mark.slow
def test_a_run_stopped_under_sp2_resumes_in_one_process(tmp_path):
    steps = 8
    args = [f"train.max_steps={steps}", "train.per_device_batch_size=4", "train.save_steps=1", *NO_EVAL]
    whole = tmp_path / "whole"
    launch(whole, 1, *args)
    out = tmp_path / "stopped"
    stop_at_checkpoint(launch(out, 2, *args, "dist.sequence_parallel=2", wait=False), out, 2)
    state = json.loads((out / "run_state.json").read_text())
    assert state["status"] != "done" and 2 <= state["step"] < steps, state
    launch(out, 1, *args)  # the same run dir, one process, sequence parallelism off: it resumes
    assert json.loads((out / "run_state.json").read_text())["status"] == "done"
    assert_same_adapter(adapter(out), adapter(whole), "stopped under SP 2, resumed in one process")


def test_shard_batch_shifts_before_cutting_and_pads_to_a_multiple():
    """A row of 5 over 2 ranks: targets shifted on the whole row, one padded position with no target."""
    batch = {
        "input_ids": torch.tensor([[10, 11, 12, 13, 14]]),
        "labels": torch.tensor([[-100, 11, 12, 13, 14]]),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
    }
    first, second = (shard_batch(batch, SequenceGroup(None, 2, r)) for r in (0, 1))
    assert first["input_ids"].tolist() == [[10, 11, 12]] and second["input_ids"].tolist() == [[13, 14, 0]]
    # position 2 (token 12) predicts token 13, the first token of the other shard
    assert first["labels"].tolist() == [[11, 12, 13]] and second["labels"].tolist() == [[14, -100, -100]]
    assert second["attention_mask"].tolist() == [[1, 1, 0]]


def test_the_plan_counts_groups_and_keeps_the_global_batch(tmp_path):
    """4 processes sharing rows in pairs: the plan's width is 2 groups (global batch micro x accum x 2), said
    in the header; a degree that does not divide the processes is one line, exit 2."""
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
            "train.per_device_batch_size=2",
            f"hydra.run.dir={run}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    choices = json.loads((run / "plan.json").read_text())["choices"]
    assert choices["world_size"] == 2
    assert "x 2 group(s) of 2 GPUs sharing each row (dist.sequence_parallel) = global batch " in " ".join(
        out.stdout.split()
    )
    bad = subprocess.run(
        [sys.executable, "-m", "glmtune", "mode=plan", "dist.nproc_per_node=3", "dist.sequence_parallel=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "must divide the 3 processes" in bad.stderr
