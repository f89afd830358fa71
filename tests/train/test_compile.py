"""train.compile: compiled blocks compute what eager blocks compute (losses and LoRA gradients), packed or not,
with and without checkpointing; the auto rule."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO
from helpers.lora import lora_model as _lora_model
from helpers.lora import loss_and_grads as _loss_and_grads

from glmtune.config import DataConfig, TrainConfig
from glmtune.data.packing import pack
from glmtune.data.pipeline import DataCollator, build_datasets
from glmtune.models import enable_checkpointing, load_tokenizer
from glmtune.models.presets import ensure_tiny
from glmtune.train import compile as compile_mod
from glmtune.train.compile import compile_blocks, resolve_compile, resolve_packed_attention
from glmtune.train.lora import trainable_parameters


@pytest.mark.slow  # ~50 s of dynamo tracing on 2 CPU cores
def test_compiled_blocks_match_eager(checkpointing=True):
    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    train, _, _ = build_datasets(
        DataConfig(train_file=str(REPO / "data/samples/train.jsonl"), val_file=None, max_length=100), tok
    )
    collator = DataCollator(tok.pad_token_id)
    batches = [collator(train[:3]), collator(pack(train[:8], 300))]  # padded (mask None) and packed (mask)
    eager = _lora_model(model_dir)
    compiled = _lora_model(model_dir)  # same seed: same adapters
    if checkpointing:
        for m in (eager, compiled):
            enable_checkpointing(m, use_reentrant=True)
            m.enable_input_require_grads()
            m.train()  # checkpointing engages in training mode only; LoRA dropout is 0, attention dropout 0
    # aot_eager traces the blocks through dynamo and AOTAutograd as inductor would, without a C++ build.
    assert compile_blocks(compiled, backend="aot_eager") == 2
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for batch in batches:
        want_loss, want = _loss_and_grads(eager, batch)
        got_loss, got = _loss_and_grads(compiled, batch)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        assert len(got) == len(want) == len(trainable_parameters(eager))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks really ran as compiled graphs


def test_compile_auto_rule():
    assert resolve_compile(TrainConfig(compile="auto"), zero_stage=3)[0] is False
    assert resolve_compile(TrainConfig(compile="on"), zero_stage=3)[0] is True
    assert "probe's measurement" in resolve_compile(TrainConfig(compile="on"), zero_stage=0)[1]
    assert resolve_compile(TrainConfig(compile="off"), zero_stage=0)[0] is False


@pytest.fixture
def cuda_h100(monkeypatch):
    """What resolve_* read of CUDA, as on an H100 (nothing else runs on the mocked device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_auto_is_off_on_a_gpu_until_a_row_measures_it(cuda_h100, monkeypatch):
    """auto is a measured path: with CUDA present, compiled blocks and FlexAttention stay off/sdpa unless
    MEASURED_* names this GPU (a bench/RESULTS.md row); on/flex still work."""
    on, why = resolve_compile(TrainConfig(compile="auto"), zero_stage=0)
    assert on is False and "RESULTS.md" in why and "H100" in why
    assert resolve_packed_attention(TrainConfig(packed_attention="auto"), True, 0.0)[0] == "auto"  # sdpa/segments
    assert resolve_packed_attention(TrainConfig(packed_attention="flex"), False, 0.0)[0] == "flex"
    monkeypatch.setattr(compile_mod, "MEASURED_COMPILE", ("H100",))
    monkeypatch.setattr(compile_mod, "MEASURED_FLEX", ("H100",))
    on, why = resolve_compile(TrainConfig(compile="auto"), zero_stage=0)
    assert on is True and "measured on H100" in why
    assert resolve_compile(TrainConfig(compile="auto"), zero_stage=3)[0] is False
    assert resolve_packed_attention(TrainConfig(packed_attention="auto"), True, 0.0)[0] == "flex"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    assert resolve_compile(TrainConfig(compile="auto"), zero_stage=0)[0] is False  # another GPU: not measured


@pytest.mark.slow  # inductor builds the blocks' C++ kernels on CPU: ~1 min on 2 cores
def test_probe_runs_the_compiled_blocks(tmp_path):
    """train.compile=on: the plan's memory for it is the probe's, so the probe must run the compiled blocks."""
    import json

    from helpers.cli import glmtune

    out = glmtune("mode=probe", "train.compile=on", "data.max_length=64", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "probe's measurement" in out.stdout
    attempts = json.loads((tmp_path / "probe.json").read_text())["attempts"]
    assert attempts[0]["detail"]["compiled_blocks"] == 2  # the tiny model's two GLM blocks
