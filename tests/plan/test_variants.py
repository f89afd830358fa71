"""DoRA, rsLoRA and the 8-bit optimizer: the estimator's terms (plan/variants.py) against live tensor bytes on CPU,
as tests/plan/test_memory.py checks plain LoRA, and the config keys reaching peft and the Trainer."""

from __future__ import annotations

import pytest
import torch
from helpers.files import metrics_rows

from glmtune.config import ConfigError, LoraConfig, parse_config
from glmtune.models import ChatGLMForConditionalGeneration, GLMConfig
from glmtune.models.loading import TINY_ARCH
from glmtune.plan.estimate import RunShape, estimate
from glmtune.plan.variants import optimizer_state_bytes
from glmtune.probe.track import measure_lora_step, optimizer_state_tensors
from glmtune.train.lora import apply_lora, trainable_parameters
from glmtune.train.optim import make_optimizer

ALL = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
TINY = GLMConfig(**TINY_ARCH, padded_vocab_size=1024)


def _check(**kw):
    shape = RunShape(device="cpu", **kw)
    measured, _ = measure_lora_step(TINY, shape)
    predicted = estimate(TINY, shape).peak_bytes
    assert abs(predicted - measured) / measured < 0.05, (kw, predicted, measured)
    return predicted


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize(
    "seq,batch,targets,rank", [(64, 1, ("query_key_value",), 8), (256, 2, ALL, 16), (128, 1, ALL, 4)]
)
def test_dora_within_the_cpu_grid_bound(dtype, ckpt, seq, batch, targets, rank):
    kw = dict(
        dtype=dtype, gradient_checkpointing=ckpt, seq_len=seq, micro_batch=batch, lora_targets=targets, lora_r=rank
    )
    with_dora = _check(use_dora=True, **kw)
    assert with_dora > estimate(TINY, RunShape(device="cpu", **kw)).peak_bytes  # the terms are counted


@pytest.mark.parametrize("targets,rank", [(("query_key_value",), 8), (ALL, 64)])
def test_8bit_optimizer_states_byte_for_byte(targets, rank):
    pytest.importorskip("bitsandbytes")  # the quant extra
    shape = RunShape(device="cpu", dtype="fp32", lora_targets=targets, lora_r=rank, optimizer="adamw_8bit")
    model = apply_lora(ChatGLMForConditionalGeneration(TINY), LoraConfig(r=rank, target_modules=list(targets)))
    params = trainable_parameters(model)
    opt = make_optimizer("adamw_8bit", params, lr=1e-3, weight_decay=0.0)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in optimizer_state_tensors(opt)}
    assert optimizer_state_bytes(TINY, shape, 4) == sum(storages.values())
    torch_bytes = optimizer_state_bytes(TINY, RunShape(lora_targets=targets, lora_r=rank), 4)
    assert torch_bytes == 8 * sum(p.numel() for p in params)
    # The whole step within the grid's bound, at the grid's shapes (states byte for byte above at any rank).
    for seq, batch, r in ((64, 1, 8), (256, 2, 16)):
        _check(dtype="fp32", seq_len=seq, micro_batch=batch, lora_targets=targets, lora_r=r, optimizer="adamw_8bit")


def test_variant_keys_reach_peft_and_are_validated():
    model = apply_lora(ChatGLMForConditionalGeneration(TINY), LoraConfig(r=4, alpha=8, use_dora=True, use_rslora=True))
    layer = model.base_model.model.transformer.encoder.layers[0].self_attention.query_key_value
    assert layer.use_dora["default"] and layer.scaling["default"] == pytest.approx(8 / 4**0.5)
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "train": {
                    "lr_scheduler": "cosine_annealing",
                    "warmup_ratio": 1.5,
                    "optimizer": "sgd",
                    "report_to": ["neptune"],
                }
            }
        )
    for fragment in (
        "train.lr_scheduler='cosine_annealing'",
        "warmup_ratio must be in [0, 1)",
        "train.optimizer='sgd'",
        "'neptune'",
    ):
        assert fragment in str(err.value)


@pytest.mark.slow
def test_cli_trains_with_cosine_warmup_8bit_adamw_and_dora(tmp_path):
    """The three keys through the CLI in one run: the logged learning rates are HF's cosine-with-warmup
    schedule, the optimizer recorded is bitsandbytes' 8-bit AdamW, and the adapter is a DoRA adapter."""
    pytest.importorskip("bitsandbytes")
    import json

    from helpers.cli import glmtune
    from transformers import get_cosine_schedule_with_warmup

    run = tmp_path / "run"
    proc = glmtune(
        "train.lr_scheduler=cosine",
        "train.warmup_ratio=0.1",
        "train.optimizer=adamw_8bit",
        "lora.use_dora=true",
        "lora.use_rslora=true",
        "train.max_steps=10",
        "train.logging_steps=1",
        "train.learning_rate=1e-3",
        "data.val_file=null",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = metrics_rows(run)
    rates = {row["step"]: row["learning_rate"] for row in logged if "learning_rate" in row}
    schedule = get_cosine_schedule_with_warmup(torch.optim.SGD([torch.zeros(1)], lr=1e-3), 1, 10)
    expected = {}
    for step in range(1, 11):
        schedule.step()
        expected[step] = schedule.get_last_lr()[0]
    assert rates and all(rates[s] == pytest.approx(expected[s]) for s in rates), (rates, expected)
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter["use_dora"] and adapter["use_rslora"]
    args = torch.load(run / "adapter" / "training_args.bin", weights_only=False)
    assert args.optim == "adamw_bnb_8bit" and args.lr_scheduler_type == "cosine" and args.warmup_ratio == 0.1


def test_a_tracker_that_is_not_installed_names_the_pip_command(monkeypatch):
    import importlib.util
    import sys

    absent = next((t for t in ("wandb", "mlflow", "swanlab") if importlib.util.find_spec(t) is None), None)
    if absent is None:  # the track extra is installed: None in sys.modules is Python's "cannot be imported"
        absent = "wandb"
        monkeypatch.setitem(sys.modules, absent, None)
    message = str(pytest.raises(ConfigError, parse_config, {"train": {"report_to": ["tensorboard", absent]}}).value)
    assert f"pip install {absent}" in message and "glmtune[track]" in message
    assert parse_config({"train": {"report_to": ["tensorboard"]}}).train.report_to == ["tensorboard"]
