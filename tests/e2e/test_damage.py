"""Bad values, damaged files and folders, full disks (issue 34, rows 5-9): each ends in one line with its exit code
and leaves nothing behind, an edited weight file is never resumed on, and a run's files all have one mode.

Through glmtune's entry point in this process (helpers/cli.py glmtune_in_process) where no process boundary matters;
full disks in a private mount namespace on a tmpfs of a few MB (skipped where namespaces cannot be made).
"""

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
from helpers import REPO
from helpers.cli import glmtune_in_process
from helpers.files import run_in_tmpfs

from glmtune.models.presets import ensure_tiny

SAMPLES = REPO / "data/samples/train.jsonl"
FILE_MODE = 0o666 & ~(lambda m: (os.umask(m), m)[1])(os.umask(0))  # what open() gives under this umask


def error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("glmtune: error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny training on a private copy of the tiny model: 2 steps, a checkpoint at each."""
    root = tmp_path_factory.mktemp("damage")
    model = root / "model"
    shutil.copytree(ensure_tiny("glm4"), model)
    proc = glmtune_in_process(
        f"model.path={model}",
        "train.max_steps=2",
        "train.save_steps=1",
        "probe.enabled=false",
        f"data.train_file={SAMPLES}",
        "data.val_file=null",
        f"hydra.run.dir={root / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


# ---- row 5: tracebacks ------------------------------------------------------------------------------------------


def test_a_negative_inference_seed_is_one_line(tmp_path):
    proc = glmtune_in_process("mode=infer", "infer.prompt=hi", "infer.seed=-1", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "infer.seed must be >= 0" in error_line(proc)
    assert not (tmp_path / "run").exists()


def test_a_truncated_adapter_is_one_line_naming_the_file(trained, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(trained / "run/adapter", adapter)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = glmtune_in_process(
        f"model.path={trained / 'model'}",
        "mode=infer",
        f"infer.adapter={adapter}",
        "infer.prompt=hi",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 2
    assert f"{weights}: unreadable" in error_line(proc)


def test_a_file_as_run_dir_is_one_line(tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    for run_dir in (taken, taken / "run"):
        proc = glmtune_in_process("mode=plan", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 2 and f"{taken} is a file, not a folder" in error_line(proc)
    assert taken.read_text() == "mine\n"
    if Path("/proc/self").is_dir():  # a folder no one can make
        proc = glmtune_in_process("mode=plan", "hydra.run.dir=/proc/glmtune-run")
        assert proc.returncode == 2 and "hydra.run.dir=/proc/glmtune-run: cannot create it" in error_line(proc)


# ---- row 6: a cache entry without meta.json ---------------------------------------------------------------------


def test_a_cache_entry_without_meta_json_is_built_again(tok, tmp_path):
    from glmtune.config import DataConfig
    from glmtune.data.pipeline import build_datasets

    cfg = DataConfig(train_file=str(SAMPLES), val_file=None, cache_dir=str(tmp_path / "cache"))
    first = build_datasets(cfg, tok)
    expected = list(first.train)
    entry = Path(first.train.path)
    (entry / "meta.json").unlink()  # an entry someone half-deleted
    again = build_datasets(cfg, tok)
    assert again.train.built and Path(again.train.path) == entry and list(again.train) == expected
    assert (entry / "meta.json").is_file() and not build_datasets(cfg, tok).train.built
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []  # nothing left aside


# ---- row 7: misleading lines ------------------------------------------------------------------------------------


def test_the_divergence_advice_names_weight_decay_and_a_sane_learning_rate():
    from glmtune.train.guard import divergence_advice

    advice = divergence_advice(1e30, "fp32", 0.0)
    assert "e.g. train.learning_rate=0.0001" in advice and "1e+29" not in advice
    assert "e.g. train.learning_rate=0.0001" in divergence_advice(1e-3, "bf16", 0.0)
    assert "lower train.weight_decay (now 50" in divergence_advice(5e-4, "bf16", 50.0)
    assert "weight_decay" not in divergence_advice(5e-4, "bf16", 0.01)


def test_values_no_run_can_use_are_one_line(tmp_path):
    """train.weight_decay=1e30 (each step would scale every weight by 1 - 5e26) and train.num_epochs=1e30 (a run
    that never ends; row 9) are refused before anything loads, each named."""
    proc = glmtune_in_process(
        "mode=plan",
        "train.weight_decay=1e30",
        "train.num_epochs=1e30",
        "probe.steps=1000000",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = error_line(proc)
    assert proc.returncode == 2
    assert "train.weight_decay=1e+30 times train.learning_rate=0.0005 must be < 1" in line
    assert "train.num_epochs must be <= 10000" in line and "probe.steps must be <= 100" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_full_cache_disk_names_the_cache_and_leaves_no_run_dir(tmp_path):
    ensure_tiny("glm4")
    big = tmp_path / "big.jsonl"  # ~4 MB of conversations: more than the 3 MB disk holds once tokenized
    big.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"question {i} " * 40},
                        {"role": "assistant", "content": f"answer {i} " * 60},
                    ]
                }
            )
            + "\n"
            for i in range(3000)
        )
    )
    run_dir = tmp_path / "run"
    proc = run_in_tmpfs(
        f"{sys.executable} -m glmtune data.train_file={big} data.val_file=null "
        f"data.cache_dir=$DISK/cache train.max_steps=2 hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc)
    assert "disk full" in line and "/cache: " in line and "data.cache_dir" in line, line
    assert "resume" not in line and str(run_dir) not in line
    assert not run_dir.exists()  # nothing to resume, nothing left


FILL_THEN_FAIL = """
import json, os, sys
from pathlib import Path
from glmtune.rundir.lock import write_state

disk = Path(os.environ["DISK"])
write_state(disk, status="running", config={f"key{i}": list(range(30)) for i in range(30)})
with open(disk / "filler", "wb") as filler:  # every free byte taken, as by the checkpoint that failed
    try:
        while True:
            filler.write(os.urandom(1 << 16))
            filler.flush()
    except OSError:
        pass
write_state(disk, status="failed", error="OSError: [Errno 28] No space left on device")
print(json.loads((disk / "run_state.json").read_text())["status"])
"""


def test_run_state_says_failed_when_the_disk_is_full(tmp_path):
    script = tmp_path / "fill.py"
    script.write_text(FILL_THEN_FAIL)
    proc = run_in_tmpfs(f"{sys.executable} {script}", size="1m", timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "failed", proc.stderr[-3000:]


# ---- row 8: weights edited in place -----------------------------------------------------------------------------


def edit_in_place(weights: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes without changing the size, and put the mtime back."""
    before = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns


def test_a_same_size_weight_edit_with_its_mtime_restored_is_refused_on_resume(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained / "run", run_dir)
    weights = trained / "model/model.safetensors"
    original = weights.read_bytes()
    header = 8 + int.from_bytes(original[:8], "little")
    try:
        # a LoRA merge's kind of edit: one tensor's values rewritten, everything else as it was
        edit_in_place(weights, header + 100, bytes(b ^ 0x55 for b in original[header + 100 : header + 4196]))
        proc = glmtune_in_process(
            f"model.path={trained / 'model'}",
            "train.max_steps=3",
            "train.save_steps=1",
            "probe.enabled=false",
            "train.resume=always",
            f"data.train_file={SAMPLES}",
            "data.val_file=null",
            f"hydra.run.dir={run_dir}",
        )
        line = error_line(proc)
        assert proc.returncode == 2 and "cannot resume" in line and f"weight file {weights}" in line
    finally:
        weights.write_bytes(original)


def test_the_fingerprint_sees_rewritten_large_tensors_and_keeps_old_runs_resumable(tmp_path):
    import torch
    from safetensors.torch import save_file

    from glmtune.rundir.fingerprint import block_offsets, legacy_fingerprint, weight_fingerprint
    from glmtune.rundir.resume import check_inputs

    weights = tmp_path / "model.safetensors"
    save_file({"big": torch.randn(3 << 20), "norm": torch.ones(64)}, str(weights))  # 12 MiB + 256 bytes
    before = weight_fingerprint(weights)
    size = weights.stat().st_size
    gap = max(b - a for a, b in zip(block_offsets(size), block_offsets(size)[1:]))
    raw = weights.read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    # any run of changed bytes longer than the gap between sampled blocks is seen, wherever it lies
    for start in (header, header + size // 3 + 7, size - gap - 1):
        edit_in_place(weights, start, bytes(b ^ 1 for b in raw[start : start + gap + 1]))
        assert weight_fingerprint(weights) != before, start
        edit_in_place(weights, start, raw[start : start + gap + 1])
        assert weight_fingerprint(weights) == before
    norm = next(offset for offset in range(header, size, 4) if raw[offset : offset + 256] == b"\x00\x00\x80\x3f" * 64)
    edit_in_place(weights, norm, b"\x00\x00\x00\x40")  # one float of a small tensor: hashed whole
    assert weight_fingerprint(weights) != before
    edit_in_place(weights, norm, raw[norm : norm + 4])

    # a run recorded with the size-and-mtime form (before this check) still resumes on unchanged weights
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    key = f"weight file {weights}"
    (run_dir / "run_state.json").write_text(json.dumps({"inputs": {key: legacy_fingerprint(weights)}}))
    check_inputs(run_dir, {key: weight_fingerprint(weights)})


# ---- row 9: minor -------------------------------------------------------------------------------------------------


def test_adapters_checkpoints_and_merged_weights_have_the_usual_file_mode(trained, tmp_path):
    files = [p for p in (trained / "run").rglob("*") if p.is_file() and not p.name.startswith(".lock")]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {
        str(p.relative_to(trained)): oct(stat.S_IMODE(p.stat().st_mode))
        for p in files
        if stat.S_IMODE(p.stat().st_mode) != FILE_MODE
    } == {}
    merged = tmp_path / "merged"
    proc = glmtune_in_process(
        f"model.path={trained / 'model'}",
        "mode=infer",
        f"infer.adapter={trained / 'run/adapter'}",
        f"infer.merge_to={merged}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {
        p.name: oct(stat.S_IMODE(p.stat().st_mode))
        for p in merged.iterdir()
        if stat.S_IMODE(p.stat().st_mode) != FILE_MODE
    } == {}


def test_the_tiny_checkpoint_glmtune_builds_has_the_usual_file_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMTUNE_CACHE", str(tmp_path))  # a fresh cache: built here, not found
    folder = ensure_tiny("glm4")
    assert folder.parent == tmp_path and (folder / "model.safetensors").is_file()
    assert {
        p.name: oct(stat.S_IMODE(p.stat().st_mode))
        for p in folder.iterdir()
        if stat.S_IMODE(p.stat().st_mode) != FILE_MODE
    } == {}


def test_bad_data_leaves_no_run_dir_and_an_earlier_runs_log_stays(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"messages": 5}\n'
    )
    proc = glmtune_in_process(f"data.train_file={bad}", "data.val_file=null", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and f"{bad}:2:" in error_line(proc)
    assert not (tmp_path / "run").exists()

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "rank0.log").write_text("an earlier run's log\n")
    proc = glmtune_in_process(f"data.train_file={bad}", "data.val_file=null", f"hydra.run.dir={earlier}")
    assert proc.returncode == 2
    assert (earlier / "rank0.log").read_text().startswith("an earlier run's log\n")


# ---- the hostile pass's findings --------------------------------------------------------------------------------


def test_a_damaged_file_in_the_checkpoint_to_resume_from_is_named(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained / "run", run_dir)
    optimizer = run_dir / "checkpoints/checkpoint-2/optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # cut short by a copy
    proc = glmtune_in_process(
        f"model.path={trained / 'model'}",
        "train.max_steps=3",
        "train.save_steps=1",
        "probe.enabled=false",
        "train.resume=always",
        f"data.train_file={SAMPLES}",
        "data.val_file=null",
        f"hydra.run.dir={run_dir}",
    )
    line = error_line(proc)
    assert proc.returncode == 2 and "checkpoint-2: cannot resume" in line and "optimizer.pt" in line
    assert "delete that folder" in line


def test_a_cut_tokenizer_and_a_damaged_run_state_are_one_line_each(trained, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(trained / "model", model)
    cut = (model / "tokenizer.model").read_bytes()[:100]
    (model / "tokenizer.model").write_bytes(cut)
    proc = glmtune_in_process(f"model.path={model}", "mode=infer", "infer.prompt=hi", f"hydra.run.dir={tmp_path / 'i'}")
    assert proc.returncode == 2 and f"{model / 'tokenizer.model'}: not a complete" in error_line(proc)

    run_dir = tmp_path / "run"
    shutil.copytree(trained / "run", run_dir)
    (run_dir / "run_state.json").write_text('{"status": "runn')  # torn
    proc = glmtune_in_process(
        f"model.path={trained / 'model'}",
        "train.max_steps=3",
        "probe.enabled=false",
        f"data.train_file={SAMPLES}",
        "data.val_file=null",
        f"hydra.run.dir={run_dir}",
    )
    line = error_line(proc)
    assert proc.returncode == 2 and "run_state.json: unreadable" in line and "train.resume=restart" in line


def test_more_new_tokens_than_the_context_is_one_line(tmp_path):
    proc = glmtune_in_process(
        "mode=infer", "infer.prompt=hi", "infer.max_new_tokens=1000000", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 2 and "longer than the model's context (seq_length" in error_line(proc)
    proc = glmtune_in_process(
        "mode=plan",
        "infer.max_new_tokens=1000000000000",
        "train.grad_accum=1000000000000",
        "lora.r=1000000000",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = error_line(proc)
    assert proc.returncode == 2
    for key in ("infer.max_new_tokens must be <=", "train.grad_accum must be <=", "lora.r must be <="):
        assert key in line


def test_a_run_that_did_not_fit_names_its_lever_and_the_fixed_command_reuses_its_dir(tmp_path):
    run_dir = tmp_path / "run"
    # An evaluation batch no host holds (data.pack_length no longer is such a lever: the plan budgets the
    # fullest packed micro-step of the data, whatever the row limit).
    common = [
        f"data.train_file={SAMPLES}",
        f"data.val_file={SAMPLES.with_name('val.jsonl')}",
        "probe.enabled=false",
        "train.max_steps=1",
        f"hydra.run.dir={run_dir}",
    ]
    proc = glmtune_in_process(*common, "train.eval_batch_size=100000000")
    assert proc.returncode == 3 and "lower train.eval_batch_size (now 100000000)" in error_line(proc)
    assert (run_dir / "plan.json").is_file()  # the plan that did not fit, kept to read
    proc = glmtune_in_process(*common)  # the value fixed, the same run dir: no "not a glmtune run" refusal
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / "run_state.json").read_text())["status"] == "done"
