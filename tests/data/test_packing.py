"""Packing: a packed row trains exactly like its examples run one by one (losses and LoRA gradients, fp32),
with and without images; the packer, the collator's positions and the stats. That a packed step trains the same
examples with the same gradient as unpacked, however it is split: tests/train/test_pack_step.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.lora import lora_model as _lora_model
from helpers.lora import loss_and_grads as _loss_and_grads

from glmtune.config import DataConfig
from glmtune.data.packing import decide_packing, format_packing, pack, positions
from glmtune.data.pipeline import IGNORE_INDEX, DataCollator, build_datasets
from glmtune.models import load_config, load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny
from glmtune.plan.estimate import image_extra_tokens


def _only(batch: dict, row: int, start: int, end: int) -> dict:
    """The batch with targets only in row `row`, text positions start..end (one packed example)."""
    labels = torch.full_like(batch["labels"], IGNORE_INDEX)
    labels[row, start:end] = batch["labels"][row, start:end]
    return {**batch, "labels": labels}


def _check_equivalence(
    model_dir: Path, examples: list[dict], pack_length: int, image_extra: int, image_size: int | None
) -> None:
    model = _lora_model(model_dir)
    collator = DataCollator(load_tokenizer(model_dir).pad_token_id, image_size=image_size)
    rows = pack(examples, pack_length, image_extra)
    assert len(rows) < len(examples)  # really packed
    batch = collator(rows)
    order = []  # (row, start, end) of each example, in the order of `examples`
    for r, row in enumerate(rows):
        start = 0
        for n in row["lengths"]:
            order.append((r, start, start + n))
            start += n
    ids_at = {tuple(batch["input_ids"][r, s:e].tolist()): (r, s, e) for r, s, e in order}
    total_targets = 0
    weighted = torch.zeros(())
    for example in examples:
        r, s, e = ids_at[tuple(example["input_ids"])]
        assert batch["position_ids"][r, s:e].tolist() == list(range(e - s))  # positions restart per example
        packed_loss, packed_grads = _loss_and_grads(model, _only(batch, r, s, e))
        alone_loss, alone_grads = _loss_and_grads(model, collator([example]))
        torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-6)
        for got, want in zip(packed_grads, alone_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        targets = sum(label != IGNORE_INDEX for label in example["labels"][1:])
        weighted += alone_loss * targets
        total_targets += targets
    # The weighting: the packed batch's loss is the mean over all its target tokens, the same as the
    # reference loss of the examples batched unpacked (padded) — each target token weighs the same.
    packed_all, _ = _loss_and_grads(model, batch)
    unpacked_all, _ = _loss_and_grads(model, collator(examples))
    torch.testing.assert_close(packed_all, weighted / total_targets, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_all, unpacked_all, rtol=1e-5, atol=1e-6)


def test_packed_text_rows_match_examples_run_one_by_one():
    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    train, _, _ = build_datasets(
        DataConfig(train_file=str(REPO / "data/samples/train.jsonl"), val_file=None, max_length=120), tok
    )
    examples = train[:9]
    _check_equivalence(model_dir, examples, pack_length=260, image_extra=0, image_size=None)


def test_packed_image_rows_match_examples_run_one_by_one():
    model_dir = ensure_tiny("glm4v")
    config, tok = load_config(model_dir), load_tokenizer(model_dir)
    train, _, _ = build_datasets(
        DataConfig(train_file=str(REPO / "data/samples_vision/train.jsonl"), val_file=None), tok, config.vision_config
    )
    extra = image_extra_tokens(config)
    assert sum(bool(e.get("image")) for e in train) >= 3
    # Rows of ~half the data: some rows carry several images, and the batch's rows grow by different amounts.
    length = sum(positions(e, extra) for e in train) // 2 + 10
    rows = pack(train, length, extra)
    assert max(len(r.get("images", ())) for r in rows) >= 2
    _check_equivalence(model_dir, train, length, extra, config.vision_config["image_size"])


def test_packer_keeps_every_example_once_within_the_length():
    examples = [
        {"input_ids": [i] * n, "labels": [IGNORE_INDEX] + [i] * (n - 1)}
        for i, n in enumerate([50, 30, 200, 120, 80, 70, 10, 300, 5, 60])
    ]
    rows = pack(examples, 300)
    assert sum(len(r["lengths"]) for r in rows) == len(examples)
    assert all(len(r["input_ids"]) == sum(r["lengths"]) <= 300 for r in rows)
    seen = sorted(
        tuple(r["input_ids"][s : s + n])
        for r in rows
        for s, n in zip([sum(r["lengths"][:k]) for k in range(len(r["lengths"]))], r["lengths"])
    )
    assert seen == sorted(tuple(e["input_ids"]) for e in examples)
    assert len(rows) == 4  # 925 tokens: best-fit decreasing reaches the lower bound ceil(925 / 300)
    # An example's first label is never a target (it would be predicted from the previous example).
    examples[0]["labels"][0] = 7
    row = next(r for r in pack(examples, 300) if 7 in r["input_ids"][:1] or 0 in r["input_ids"])
    starts = [sum(row["lengths"][:k]) for k in range(len(row["lengths"]))]
    assert all(row["labels"][s] == IGNORE_INDEX for s in starts)
    # Longer than a row: alone in its own, never cut.
    assert [r["lengths"] for r in pack([{"input_ids": [1] * 400, "labels": [1] * 400}], 300)] == [[400]]


def test_collator_positions_seq_ids_and_images_of_packed_rows():
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5], "lengths": [3, 2], "images": ["a", "b"]},
        {"input_ids": [6, 7], "labels": [-100, 7], "lengths": [2]},
    ]
    collator = DataCollator(pad_id=0, image_size=8)
    collator._load = lambda path: torch.full((3, 8, 8), float(ord(path)))
    batch = collator(rows)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]
    assert batch["seq_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, -1, -1, -1]]
    assert batch["image_rows"].tolist() == [0, 0] and batch["images"][:, 0, 0, 0].tolist() == [97.0, 98.0]
    assert "position_ids" not in DataCollator(pad_id=0)([{"input_ids": [1], "labels": [1]}])


@pytest.mark.parametrize(
    "packing, on_gpu, packs", [("on", False, True), ("off", True, False), ("auto", False, False), ("auto", True, True)]
)
def test_decide_packing_decides_and_reports(packing, on_gpu, packs):
    tok = load_tokenizer(ensure_tiny("glm4"))
    cfg = DataConfig(
        train_file=str(REPO / "data/samples/train.jsonl"),
        val_file=str(REPO / "data/samples/val.jsonl"),
        packing=packing,
        pack_length=1024,
    )
    data = build_datasets(cfg, tok)
    info = decide_packing(cfg, data.train, image_extra=0, micro_batch=4, on_gpu=on_gpu)
    assert info.enabled is packs and info.shape() == ((1024, 0) if packs else None)
    assert (info.packer() is not None) is packs
    if packing == "off" or not on_gpu and packing == "auto":
        assert info.train is None and "rows of" not in format_packing(info, 4)  # off: no packing work at all
        return
    stats = info.train
    assert stats.examples == len(data.train) == 51 and stats.positions == data.stats.train.tokens
    assert stats.micro_steps == 13 and stats.micro_steps <= stats.rows < 51  # 4 examples -> 1-2 rows each
    assert 1 <= stats.most_rows <= 4 and stats.pad_unpacked > stats.pad_packed
    assert "micro-batches of 4 examples -> " in format_packing(info, 4)
    assert "micro-batches of 1 examples -> 1.0 rows" in format_packing(info, 1)  # redrawn at the plan's micro-batch
    # auto needs at least 2 examples per row: a micro-batch of one example never packs.
    assert not decide_packing(replace(cfg, packing="auto"), data.train, 0, 1, on_gpu=True).enabled


@pytest.mark.parametrize("packing", ["off", "on"])
def test_packing_plans_from_the_length_column_without_reading_tokens(packing, monkeypatch):
    """Issue 25: deciding and reporting reads no token list; packing happens per micro-batch, in the collator."""
    from glmtune.data import tokenized

    tok = load_tokenizer(ensure_tiny("glm4"))
    cfg = DataConfig(
        train_file=str(REPO / "data/samples/train.jsonl"),
        val_file=str(REPO / "data/samples/val.jsonl"),
        packing=packing,
        pack_length=1024,
    )
    data = build_datasets(cfg, tok)
    reads = []
    real = tokenized._ListColumn.__getitem__
    monkeypatch.setattr(tokenized._ListColumn, "__getitem__", lambda self, row: reads.append(row) or real(self, row))
    info = decide_packing(cfg, data.train, image_extra=0, micro_batch=2, on_gpu=False)
    format_packing(info, 2)
    assert reads == []


def test_flex_attention_block_mask_matches_the_dense_mask_forward():
    """FlexAttention (the CUDA path for packed rows) gives the dense-mask logits; forward only, as torch has no
    FlexAttention backward on CPU (training with it is measured by bench/throughput.py on a GPU)."""
    model_dir = ensure_tiny("glm4")
    tok = load_tokenizer(model_dir)
    train, _, _ = build_datasets(
        DataConfig(train_file=str(REPO / "data/samples/train.jsonl"), val_file=None, max_length=150), tok
    )
    batch = DataCollator(tok.pad_token_id)(pack(train[:12], 400))
    model = load_model(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        dense = model(**batch)
        model.transformer.packed_attention = "flex"
        flex = model(**batch)
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-5, atol=1e-5)
    real = batch["seq_ids"] >= 0
    torch.testing.assert_close(flex.logits[real], dense.logits[real], rtol=1e-4, atol=1e-4)


def test_planner_and_config_know_the_packed_row():
    from glmtune.config import ConfigError, HwConfig, RunConfig, parse_config
    from glmtune.models import released_config
    from glmtune.plan.planner import make_plan, run_shape

    run = RunConfig(hw=HwConfig(name="a100_80g", memory_gib=80))
    arch = released_config("glm4_9b_chat")
    run.train.per_device_batch_size = 8
    plain = make_plan(run, arch, 1, user_set_max_length=False)
    packed = make_plan(run, arch, 1, user_set_max_length=False, packed=(4096, 0))
    eight = replace(packed.choices, micro_batch_size=8)
    # The fullest micro-step: 8 examples of <= 300 tokens fit one row; of <= 500, rows of 8 x 512 = 4,096.
    assert (
        run_shape(run, arch, eight, 300, packed=(4096, 0)).micro_batch,
        run_shape(run, arch, eight, 300, packed=(4096, 0)).seq_len,
    ) == (1, 2400)
    # Rows up to DENSE_MASK_MAX run the dense mask: the same positions plus the mask; longer rows, per document, none.
    dense = make_plan(run, arch, 1, user_set_max_length=False, packed=(2048, 0))
    assert dense.packing["attention"] == "sdpa" and packed.packing["attention"] == "segments"
    assert dense.peak_bytes >= plain.peak_bytes
    assert (
        packed.packing["probed_rows_per_micro_step"] * packed.packing["probed_row_positions"]
        >= packed.choices.micro_batch_size * packed.choices.max_length
    )
    vision = released_config("glm4v_9b")
    shape = run_shape(run, vision, replace(eight, micro_batch_size=4), 300, packed=(8192, 3))
    assert (shape.micro_batch, shape.seq_len, shape.images_per_sample) == (1, 4 * (300 + 1599), 4)  # one row
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "data": {"packing": "yes", "pack_length": 100, "max_length": 500},
                "train": {"compile": "maybe", "packed_attention": "fast"},
            }
        )
    for part in (
        "data.packing='yes'",
        "data.pack_length=100 is shorter than data.max_length=500",
        "train.compile='maybe'",
        "train.packed_attention='fast'",
    ):
        assert part in str(err.value)


def test_cli_trains_on_packed_rows_with_the_probe(tmp_path, repo):
    from helpers.cli import glmtune_in_process

    out = glmtune_in_process(
        "data.packing=on",
        "data.pack_length=600",
        "train.max_steps=2",
        "train.eval_steps=0",
        "train.per_device_batch_size=4",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=repo,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "packing: on (data.packing=on); each micro-batch's examples in rows of up to 600 positions" in out.stdout
    assert "train: micro-batches of 4 examples -> " in out.stdout and (tmp_path / "run" / "adapter").is_dir()
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["packing"]
    assert plan["examples_per_micro_step"] == 4 and 1 <= plan["expected_rows_per_micro_step"] <= 4
