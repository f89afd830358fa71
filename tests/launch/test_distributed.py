"""Distributed launches on CPU (gloo): torchrun ZeRO-3, two torchrun agents on loopback, the deepspeed launcher.

Each rank logs `adapter fingerprint <sha256>` (glmtune.train.zero3.adapter_fingerprint: its own view of every LoRA
tensor, gathered under ZeRO-3) to its rank<N>.log. Equal fingerprints across ranks, and equal to the saved
adapter reloaded here in one process, are the evidence that ranks agree and the saved adapter is the whole one.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import BIN
from helpers.files import metrics_rows, write_fixed
from helpers.launch import FINGERPRINT, free_port, ranks_env
from peft import PeftModel

from glmtune.config import DataConfig
from glmtune.data.pipeline import DataCollator, build_datasets
from glmtune.models import load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny
from glmtune.plan.planner import Choices
from glmtune.train.zero3 import adapter_fingerprint, deepspeed_config


def fingerprints(run_dir: Path) -> dict[int, str]:
    found = {}
    for log in run_dir.glob("rank*.log"):
        for digest, rank, world in FINGERPRINT.findall(log.read_text()):
            assert log.name == f"rank{rank}.log" and world == "2"  # each rank wrote its own file
            found[int(rank)] = digest
    return found


def test_deepspeed_config_is_zero3_from_the_plan():
    base = dict(
        dtype="bf16",
        gradient_checkpointing=True,
        zero_stage=3,
        offload_params=False,
        offload_optimizer=False,
        micro_batch_size=1,
        grad_accum=4,
        max_length=500,
        world_size=4,
        eval_batch_size=1,
    )
    assert deepspeed_config(Choices(**{**base, "zero_stage": 0})) is None
    ds = deepspeed_config(Choices(**base))
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert "offload_param" not in zero and "offload_optimizer" not in zero
    assert "train_batch_size" not in ds and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    offload = deepspeed_config(Choices(**{**base, "offload_params": True, "offload_optimizer": True}))
    assert offload["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.slow
def test_zero3_two_ranks_train_agree_and_the_saved_adapter_is_the_trained_one(tmp_path, repo):
    data = write_fixed(tmp_path / "fixed.jsonl")
    out = tmp_path / "run"
    # Where torch keeps JIT-built extensions: DeepSpeed's CPU shared-memory all-reduce would be compiled here
    # (~60 s), and glmtune tells it not to (train/zero3.skip_shm_build).
    extensions = tmp_path / "torch_extensions"
    proc = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "glmtune",
            "dist=zero3",
            "lora=all_linear",
            f"data.train_file={data}",
            f"data.val_file={data}",
            "train.max_steps=24",
            "train.learning_rate=1e-2",
            "train.per_device_batch_size=2",
            "train.eval_batch_size=1",
            "train.logging_steps=1",
            "probe.enabled=false",
            f"hydra.run.dir={out}",
        ],
        cwd=repo,
        env=ranks_env(TORCH_EXTENSIONS_DIR=str(extensions)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((out / "plan.json").read_text())["choices"]["zero_stage"] == 3
    assert not extensions.exists() or not any(extensions.iterdir()), "a C++ extension was built for the run"

    # Rank 0 alone wrote metrics: one line per step, not one per rank.
    logged = metrics_rows(out)
    losses = [row["loss"] for row in logged if "loss" in row]
    assert len(losses) == 24, losses
    assert losses[-1] < 0.6 * losses[0], losses  # ~7.1 -> ~3: the adapters learn under ZeRO-3

    prints = fingerprints(out)
    assert set(prints) == {0, 1} and prints[0] == prints[1]
    model_dir = ensure_tiny("glm4")
    reloaded = PeftModel.from_pretrained(load_model(model_dir), str(out / "adapter")).eval()
    assert adapter_fingerprint(reloaded) == prints[0]  # the saved adapter is the full, gathered one

    # Same logits: the distributed run's eval loss (ZeRO-3 forward, one example per batch, averaged over
    # both ranks' examples) equals the reloaded adapter's loss computed here in one process.
    tokenizer = load_tokenizer(model_dir)
    examples, _, _ = build_datasets(DataConfig(train_file=str(data)), tokenizer)
    collate = DataCollator(tokenizer.pad_token_id)
    with torch.no_grad():
        per_example = [reloaded(**collate([ex])).loss.item() for ex in examples]
        base = load_model(model_dir).eval()
        base_loss = sum(base(**collate([ex])).loss.item() for ex in examples) / len(examples)
    eval_loss = json.loads((out / "metrics.json").read_text())["eval_loss"]
    assert sum(per_example) / len(per_example) == pytest.approx(eval_loss, rel=1e-4)
    assert eval_loss < base_loss - 1.0  # the adapter changed the model


@pytest.mark.slow
def test_two_torchrun_agents_on_loopback_share_one_run_dir(tmp_path, repo):
    port, run_id = free_port(), "loopback-run"
    data = repo / "data" / "samples"
    agents = [
        subprocess.Popen(
            [
                str(BIN / "torchrun"),
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                run_id,
                "-m",
                "glmtune",
                f"data.train_file={data / 'train.jsonl'}",
                "data.val_file=null",
                "train.max_steps=3",
                "probe.enabled=false",
            ],
            cwd=tmp_path,
            env=ranks_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    # No hydra.run.dir given: both agents' workers named the run dir after --rdzv_id (TORCHELASTIC_RUN_ID).
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [run_id]
    out = tmp_path / "outputs" / run_id
    assert {"rank0.log", "rank1.log", "plan.json", "versions.json", "metrics.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "plan.json").read_text())["choices"]["world_size"] == 2
    prints = fingerprints(out)  # plain data parallel: each rank's own copy, kept equal by DDP's all-reduce
    assert set(prints) == {0, 1} and prints[0] == prints[1]


@pytest.mark.slow
def test_deepspeed_launcher_on_localhost(tmp_path, repo):
    proc = subprocess.run(
        [
            "bash",
            str(repo / "scripts" / "deepspeed_launch.sh"),
            "dist=zero3",
            "train.max_steps=2",
            f"data.train_file={repo / 'data/samples/train.jsonl'}",
            "data.val_file=null",
            "probe.enabled=false",
        ],
        cwd=tmp_path,
        env={**ranks_env(), "NUM_GPUS": "2", "RUN_ID": "ds-run", "MASTER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "outputs" / "ds-run"
    # Module mode with no --local_rank for Hydra to reject: the ranks' command lines as Hydra recorded them.
    assert "local_rank" not in (out / ".hydra" / "overrides.yaml").read_text()
    # The launcher's lines (its command, world info, one per process spawned and exited, its CPU-accelerator
    # notice at import) stay off the console: glmtune/launch/quiet.py, scripts/deepspeed_launch.sh.
    foreign = [line for line in (proc.stdout + proc.stderr).splitlines() if re.match(r"\[\d{4}-", line)]
    assert not foreign, foreign
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["ds-run"]
    prints = fingerprints(out)
    assert set(prints) == {0, 1} and prints[0] == prints[1]
    assert (
        adapter_fingerprint(PeftModel.from_pretrained(load_model(ensure_tiny("glm4")), str(out / "adapter")))
        == prints[0]
    )


@pytest.mark.slow
def test_probe_under_zero3_on_two_ranks_then_training(tmp_path, repo):
    """The probe runs unchanged under ZeRO-3 with 2 ranks: one peak per rank, the maximum reported, and the
    run that follows (a second DeepSpeed engine in the same processes) trains and agrees across ranks."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "glmtune",
            "dist=zero3",
            "data.val_file=null",
            "train.max_steps=3",
            f"hydra.run.dir={out}",
        ],
        cwd=repo,
        env=ranks_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Neither DeepSpeed's notices and prints nor torch's deprecation warnings about DeepSpeed's calls (they were
    # 40 of the console's lines, glmtune/launch/quiet.py) reach the console; they are in the rank logs or nowhere.
    noise = re.compile(r"Warning|warn\(|\[WARNING\]|built successfully|Traceback")
    assert not [line for line in (proc.stdout + proc.stderr).splitlines() if noise.search(line)]
    report = json.loads((out / "probe.json").read_text())
    assert len(report["per_rank"]) == 2 and all(p > 0 for p in report["per_rank"])
    assert report["measured_peak_bytes"] == max(report["per_rank"])
    assert report["final"]["zero_stage"] == 3 and report["final"]["world_size"] == 2
    assert report["predicted_peak_bytes"] == pytest.approx(report["measured_peak_bytes"], rel=0.05)
    prints = fingerprints(out)
    assert set(prints) == {0, 1} and prints[0] == prints[1]
