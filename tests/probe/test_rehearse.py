"""probe.rehearse (issue 42): mode=probe in one process measures rank 0 of the planned world, over a process group
whose collectives move no data (probe/rehearse.py, train/rehearsal.py) — against rank 0 of real gloo launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import REPO
from helpers.cli import glmtune, glmtune_in_process

WORKER = Path(__file__).with_name("rehearse_worker.py")
PACKED = ["data.packing=on", "train.per_device_batch_size=4"]
MODELS = {"glm4": [], "glm4v": ["model=glm4v_tiny", "data=samples_vision"]}
SHAPES = {  # world: {case: overrides}; the acceptance's layouts, each on packed rows (eval included: the samples' val set)
    2: {
        "SP 2": ["dist.sequence_parallel=2"],
        "ZeRO-3 2": ["dist.strategy=zero3"],
        "ZeRO-3 + SP 2": ["dist.strategy=zero3", "dist.sequence_parallel=2"],
    },
    4: {"SP 4": ["dist.sequence_parallel=4"], "DP 2 x SP 2": ["dist.sequence_parallel=2"]},
}
# Per-document attention reads the gathered seq ids (train/rehearsal.py): rank 0's shard repeated would split a
# document in two and be refused; the rehearsal's group gathers the real row.
EXTRA = {2: {"glm4 SP 2, per-document attention": ["dist.sequence_parallel=2", "train.packed_attention=segments"]}}


def cases(world: int) -> dict[str, list[str]]:
    out = {
        f"{model} {name}": [*args, *PACKED, *extra, f"dist.nproc_per_node={world}"]
        for model, args in MODELS.items()
        for name, extra in SHAPES[world].items()
    }
    out.update(
        {name: [*PACKED, *extra, f"dist.nproc_per_node={world}"] for name, extra in EXTRA.get(world, {}).items()}
    )
    return out


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }


@pytest.mark.slow  # ~3 min on 2 cores: 2 torchrun launches (2 and 4 gloo ranks) and 1 process rehearsing all 13 cases
def test_rehearsed_rank0_peak_matches_a_real_launch(tmp_path):
    """Rank 0's peak (live tensor bytes, every phase of the probe) rehearsed in one process against rank 0 of a real
    torchrun on gloo: within 2 %, never under by more than 1 %; same final choices; nothing written by either."""
    every = {}
    for world in SHAPES:
        (tmp_path / f"cases{world}.json").write_text(json.dumps(cases(world)))
        every.update(cases(world))
    (tmp_path / "all.json").write_text(json.dumps(every))
    rehearsal = subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path / "all.json"), str(tmp_path / "rehearsed.json")],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    real = {}
    for world in SHAPES:  # one launch per world shape, measuring each of its cases in turn
        out = subprocess.run(
            [
                "torchrun",
                "--standalone",
                "--nproc_per_node",
                str(world),
                str(WORKER),
                str(tmp_path / f"cases{world}.json"),
                str(tmp_path / f"real{world}.json"),
            ],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        real.update(json.loads((tmp_path / f"real{world}.json").read_text()))
    log = rehearsal.communicate(timeout=900)[0]
    assert rehearsal.returncode == 0, log[-3000:]
    rehearsed = json.loads((tmp_path / "rehearsed.json").read_text())
    rows = []
    for name, overrides in every.items():
        world = int(overrides[-1].split("=")[1])
        mine, theirs = rehearsed[name], real[name]
        assert mine["rehearsed"] == world and len(mine["per_rank"]) == 1, name
        assert theirs["rehearsed"] == 0 and len(theirs["per_rank"]) == world, name
        assert mine["final"] == theirs["final"] and mine["fits"], name
        err = mine["per_rank"][0] / theirs["per_rank"][0] - 1
        rows.append(f"{name}: rehearsed {mine['per_rank'][0]} B, real rank 0 {theirs['per_rank'][0]} B, {err:+.2%}")
        assert -0.01 <= err <= 0.02, rows[-1]
        assert "unseen" in mine["rehearsal"] and mine["rehearsal"]["added_terms"] == {}  # CPU: nothing to add
    print("\n".join(rows))
    for run_dir in (tmp_path / "runs").iterdir():  # a probe, rehearsed or not, writes no adapter nor checkpoint
        assert not (run_dir / "adapter").exists() and not (run_dir / "checkpoints").exists(), run_dir
        assert not any((run_dir / "probe").glob("checkpoint-*")), run_dir


def test_mode_probe_rehearses_the_planned_world_in_this_process(tmp_path):
    import torch.distributed as dist

    run = tmp_path / "r"
    proc = glmtune_in_process(
        "mode=probe", "dist.nproc_per_node=4", "dist.sequence_parallel=2", "data.val_file=null", f"hydra.run.dir={run}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rehearsed: 4 ranks on 1 device" in proc.stdout and "links' speed" in " ".join(proc.stdout.split())
    report = json.loads((run / "probe.json").read_text())
    assert report["rehearsed"] == 4 and report["rehearsal"]["measured"] == "rank 0" and len(report["per_rank"]) == 1
    assert report["final"]["sequence_parallel"] == 2 and report["final"]["world_size"] == 2  # 2 groups of 2
    assert json.loads((run / "plan.json").read_text())["choices"]["world_size"] == 2  # planned for 4 processes
    assert not (run / "adapter").exists() and not (run / "checkpoints").exists()
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ  # the fake world is gone with the probe
    # probe.rehearse=false: the plan is for the processes running, as before rehearsals existed
    single = tmp_path / "s"
    proc = glmtune_in_process(
        "mode=probe", "dist.nproc_per_node=4", "probe.rehearse=false", "data.val_file=null", f"hydra.run.dir={single}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((single / "probe.json").read_text())
    assert report["rehearsed"] == 0 and report["final"]["world_size"] == 1 and "rehearsed" not in proc.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["mode=probe", "probe.rehearse=maybe"], "probe.rehearse='maybe': use auto, true or false"),
        (["probe.rehearse=true"], "true rehearses a multi-GPU plan in mode=probe only"),
    ],
)
def test_bad_rehearse_settings_are_one_line(args, words):
    out = glmtune_in_process(*args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_rehearsal_over_budget_takes_the_next_rung(tmp_path):
    """The ladder acts on the rehearsed peak as on a real one: a budget under rank 0's peak halves the micro-batch
    (the global batch kept), and the last rung fits it."""
    from glmtune.config import DataConfig, DistConfig, RunConfig, TrainConfig
    from glmtune.data.pipeline import DataCollator, build_datasets, longest_length
    from glmtune.models import load_config, load_tokenizer
    from glmtune.models.presets import ensure_tiny
    from glmtune.plan.planner import make_plan
    from glmtune.probe.probe import run_probe

    model_dir = ensure_tiny("glm4")
    tok, arch = load_tokenizer(model_dir), load_config(model_dir)
    run = RunConfig(
        mode="probe",
        data=DataConfig(val_file=None),
        train=TrainConfig(per_device_batch_size=4),
        dist=DistConfig(nproc_per_node=2, sequence_parallel=2),
    )
    _, _, stats = build_datasets(run.data, tok)
    plan = make_plan(run, arch, 2, user_set_max_length=False, data_max_tokens=longest_length(stats))
    args = (arch, model_dir, longest_length(stats), tok, DataCollator(tok.pad_token_id), tmp_path, 1)
    free = run_probe(run, plan, *args, evaluates=False, rehearsed=2)
    assert free.rehearsed == 2 and free.fits and len(free.attempts) == 1
    budget = int(free.measured_peak_bytes * 0.8)
    report = run_probe(run, replace(plan, budget_bytes=budget), *args, evaluates=False, rehearsed=2)
    assert [a.outcome for a in report.attempts][0] == "over budget" and report.fits
    assert report.final["micro_batch_size"] < 4 and report.final["micro_batch_size"] * report.final["grad_accum"] == 4
    assert report.measured_peak_bytes <= budget and report.attempts[0].measured_peak_bytes == free.measured_peak_bytes
    assert not any(tmp_path.rglob("checkpoint-*")) and not any(tmp_path.rglob("adapter_model.safetensors"))


def test_sequence_groups_gather_the_real_row_layout():
    """A rehearsal's all-gather of this rank's shard of a row the group cut returns the row; anything else repeats
    the input (torch's fake group's rule)."""
    import torch
    import torch.distributed as dist

    from glmtune.models.kernels.ulysses import SequenceGroup, pad_and_shard
    from glmtune.probe.rehearse import rehearsal_world
    from glmtune.train.sequence import sequence_group

    with rehearsal_world(4, 4):
        sp = sequence_group(2)
        assert isinstance(sp, SequenceGroup) and sp.size == 2 and sp.rank == 0 and dist.get_world_size() == 4
        row = torch.tensor([[0, 0, 0, 1, 1, 2, 2, -1, -1]])  # 3 documents and pads, odd length: padded to 10
        shard = pad_and_shard(row, -1, sp)
        parts = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard.contiguous(), group=sp.group)
        assert torch.equal(torch.cat(parts, 1), torch.cat([row, torch.tensor([[-1]])], 1))
        other = torch.tensor([[5, 6, 7, 8, 9]])
        dist.all_gather(parts, other, group=sp.group)
        assert all(torch.equal(p, other) for p in parts)
        out = torch.empty(8)
        dist.all_to_all_single(out, torch.arange(8.0), group=sp.group)
        assert torch.equal(out, torch.arange(8.0))
    assert not dist.is_initialized()


def long_rows(path: Path, words: int) -> Path:
    """Two conversations of a short prompt and a `words`-word answer (~3.7 tiny-tokenizer tokens a word)."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": "summarise this"},
                {"role": "assistant", "content": " ".join(f"w{(i + j) % 997}" for j in range(words))},
            ]
        }
        for i in range(2)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow  # ~15 s: one process, 2 steps of 8K-token rows on 4 rehearsed ranks
def test_issue_command_rehearses_four_ranks_in_one_process(tmp_path):
    """The issue's command (mode=probe +hw=rtx4090_24g dist.nproc_per_node=4 data.max_length=131072) with the tiny
    GLM-4, whose weights are ~1 MB, so on rows of ~8K tokens the per-rank token terms are nearly all of the peak, at
    the 9B plan's SP 4 (the tiny model fits one 24 GB card whole, so the degree is given): one process,
    `rehearsed: 4 ranks`, and rank 0's peak within the estimator's stated SP tolerance (0-4 % over, never under:
    README, plan/longctx.py)."""
    data = long_rows(tmp_path / "long.jsonl", 2200)
    run = tmp_path / "r"
    out = glmtune(
        "mode=probe",
        "model=glm4_tiny",
        "+hw=rtx4090_24g",
        "dist.nproc_per_node=4",
        "data.max_length=131072",
        f"data.train_file={data}",
        "data.val_file=null",
        "dist.sequence_parallel=4",
        f"hydra.run.dir={run}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rehearsed: 4 ranks on 1 device" in out.stdout
    report = json.loads((run / "probe.json").read_text())
    assert report["rehearsed"] == 4 and len(report["per_rank"]) == 1 and report["fits"]
    assert report["final"]["sequence_parallel"] == 4 and report["final"]["dtype"] == "bf16"
    err = report["predicted_peak_bytes"] / report["measured_peak_bytes"] - 1
    assert 0 <= err <= 0.04, (report["predicted_peak_bytes"], report["measured_peak_bytes"], err)
