"""train.compile: compiled blocks compute what eager blocks compute (losses and LoRA gradients), packed or not,
with and without checkpointing; the auto rule."""
from __future__ import annotations

import pytest
import torch

from glmtune.config import DataConfig, TrainConfig
from glmtune.data.packing import pack
from glmtune.data.pipeline import DataCollator, build_datasets
from glmtune.models import enable_checkpointing, load_tokenizer
from glmtune.models.presets import ensure_tiny
from glmtune.train.compile import compile_blocks, resolve_compile
from glmtune.train.lora import trainable_parameters
from tests.test_packing import REPO, _lora_model, _loss_and_grads


@pytest.mark.slow  # ~50 s of dynamo tracing on 2 CPU cores
def test_compiled_blocks_match_eager(checkpointing=True):
    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    train, _, _ = build_datasets(DataConfig(train_file=str(REPO / "data/samples/train.jsonl"), val_file=None,
                                            max_length=100), tok)
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
    on_cuda = torch.cuda.is_available()
    assert resolve_compile(TrainConfig(compile="auto"), zero_stage=0)[0] is on_cuda
    assert resolve_compile(TrainConfig(compile="auto"), zero_stage=3)[0] is False
    assert resolve_compile(TrainConfig(compile="on"), zero_stage=3)[0] is True
    assert resolve_compile(TrainConfig(compile="off"), zero_stage=0)[0] is False
