"""GLM-4V: official parameter names and count, image-token layout, mixed image/text training, data errors, plan."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO
from helpers.files import logged_losses
from peft import PeftModel

from glmtune.config import DataConfig, HwConfig, LoraConfig, RunConfig, TrainConfig
from glmtune.data.pipeline import DataCollator, DataError, build_datasets, encode_conversation
from glmtune.models import build_meta_model, load_config, load_model, load_tokenizer, released_config
from glmtune.models.chatglm.vision import CLIP_MEAN, CLIP_STD, load_image, num_image_tokens
from glmtune.models.presets import ensure_tiny
from glmtune.plan.estimate import frozen_params, image_extra_tokens, vision_params
from glmtune.plan.planner import make_plan
from glmtune.train.lora import _targets
from glmtune.train.trainer import train

SAMPLES = REPO / "data" / "samples_vision"


def test_glm4v_9b_meta_names_and_exact_parameter_count():
    model = build_meta_model(released_config("glm4v_9b"))
    params = dict(model.named_parameters())
    # Language model: glm-4-9b's 9,399,951,360 = 40 blocks x 203,960,832 + 2 x 151,552 x 4,096 (embedding and
    # untied output layer) + 4,096 (final RMSNorm).
    lm = 40 * 203_960_832 + 2 * 151_552 * 4_096 + 4_096
    assert lm == 9_399_951_360
    # Vision tower (official visual.py), w = 1792, i = 15360:
    layer = (1792 * 5376 + 5376) + (1792 * 1792 + 1792) + (1792 * 15360 + 15360) + (15360 * 1792 + 1792) + 4 * 1792
    assert layer == 67_926_784  # qkv, dense, fc1, fc2 (all biased) + 2 LayerNorms
    patch = 3 * 1792 * 14 * 14 + 1792 + 1792 + 6401 * 1792  # conv 14x14 + bias, CLS, 6,401 positions
    conv = 1792 * 4096 * 2 * 2 + 4096  # 2x2 stride-2 conv into the LM width
    glu = 4096 * 4096 + 2 * 4096 + 3 * 4096 * 13696  # linear_proj, norm1, dense_h_to_4h/gate_proj/dense_4h_to_h
    vision = 63 * layer + patch + conv + glu + 2 * 4096  # + boi, eoi
    assert vision == 4_506_369_536
    total = sum(p.numel() for p in params.values())
    assert total == lm + vision == 13_906_320_896  # ~13.9 B
    assert sum(p.numel() for n, p in params.items() if n.startswith("transformer.vision.")) == vision
    assert frozen_params(released_config("glm4v_9b")) == total and vision_params(released_config("glm4v_9b")) == vision
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    expected = {
        "transformer.embedding.word_embeddings.weight": (151552, 4096),
        "transformer.encoder.layers.39.self_attention.query_key_value.bias": (4608,),
        "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight": (27392, 4096),
        "transformer.encoder.final_layernorm.weight": (4096,),
        "transformer.output_layer.weight": (151552, 4096),
        "transformer.vision.patch_embedding.proj.weight": (1792, 3, 14, 14),
        "transformer.vision.patch_embedding.cls_embedding": (1, 1792),
        "transformer.vision.patch_embedding.position_embedding.weight": (6401, 1792),
        "transformer.vision.transformer.layers.62.attention.query_key_value.weight": (5376, 1792),
        "transformer.vision.transformer.layers.62.attention.dense.bias": (1792,),
        "transformer.vision.transformer.layers.0.mlp.fc1.weight": (15360, 1792),
        "transformer.vision.transformer.layers.0.mlp.fc2.weight": (1792, 15360),
        "transformer.vision.transformer.layers.0.input_layernorm.bias": (1792,),
        "transformer.vision.transformer.layers.0.post_attention_layernorm.weight": (1792,),
        "transformer.vision.conv.weight": (4096, 1792, 2, 2),
        "transformer.vision.linear_proj.linear_proj.weight": (4096, 4096),
        "transformer.vision.linear_proj.norm1.weight": (4096,),
        "transformer.vision.linear_proj.gate_proj.weight": (13696, 4096),
        "transformer.vision.linear_proj.dense_h_to_4h.weight": (13696, 4096),
        "transformer.vision.linear_proj.dense_4h_to_h.weight": (4096, 13696),
        "transformer.vision.boi": (1, 1, 4096),
        "transformer.vision.eoi": (1, 1, 4096),
    }
    assert {n: shapes.get(n) for n in expected} == expected
    assert "transformer.vision.transformer.layers.63.mlp.fc1.weight" not in shapes
    assert num_image_tokens(released_config("glm4v_9b").vision_config) == 1600
    assert image_extra_tokens(released_config("glm4v_9b")) == 1599


def test_lora_targets_skip_the_vision_tower():
    model = build_meta_model(released_config("glm4v_9b"))
    pattern = _targets(model, LoraConfig(target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]))
    hits = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    assert len(hits) == 40 * 4 and not any(".vision." in n for n in hits)
    text = build_meta_model(released_config("glm4_9b_chat"))
    assert _targets(text, LoraConfig()) == ["query_key_value"]  # text models keep peft's plain suffix match


@pytest.fixture(scope="module")
def tiny():
    model_dir = ensure_tiny("glm4v")
    return model_dir, load_config(model_dir), load_tokenizer(model_dir)


def test_preprocessing_matches_clip_normalisation(tmp_path):
    from PIL import Image

    Image.new("RGB", (30, 20), (255, 0, 128)).save(tmp_path / "solid.png")
    x = load_image(tmp_path / "solid.png", 56)
    assert x.shape == (3, 56, 56) and x.dtype == torch.float32
    for c, value in enumerate((255, 0, 128)):  # a solid image stays solid through a bicubic resize
        torch.testing.assert_close(x[c], torch.full((56, 56), (value / 255 - CLIP_MEAN[c]) / CLIP_STD[c]))


def test_image_tokens_positions_and_labels_are_placed_as_the_official_model(tiny):
    model_dir, config, tok = tiny
    n = num_image_tokens(config.vision_config)
    assert n == 4  # 56 px / 14 px = 4x4 patches -> 2x2 after the stride-2 conv
    boi, eot, eoi = (tok.get_command(t) for t in ("<|begin_of_image|>", "<|endoftext|>", "<|end_of_image|>"))
    user, assistant = tok.get_command("<|user|>"), tok.get_command("<|assistant|>")
    messages = [{"role": "user", "content": "Hi", "image": "x.png"}, {"role": "assistant", "content": "Red."}]
    ids, labels = encode_conversation(messages, tok)
    reply = tok.encode("\nRed.")
    # Hand-written: [gMASK] <sop> <|user|> "\n" boi eot eoi "Hi" <|assistant|> "\nRed." <|user|>
    assert ids == [
        *tok.prefix_ids(),
        user,
        *tok.encode("\n"),
        boi,
        eot,
        eoi,
        *tok.encode("Hi"),
        assistant,
        *reply,
        user,
    ]
    text_ids, text_labels = encode_conversation(
        [{"role": "user", "content": "Hello there friend"}, {"role": "assistant", "content": "Hi."}], tok
    )
    model = load_model(model_dir).eval()
    batch = DataCollator(tok.pad_token_id, image_size=56)(
        [
            {"input_ids": ids, "labels": labels, "image": str(SAMPLES / "images/red_square.png")},
            {"input_ids": text_ids, "labels": text_labels},
        ]
    )
    assert batch["images"].shape == (1, 3, 56, 56) and batch["image_rows"].tolist() == [0]
    s = batch["input_ids"].shape[1]
    with torch.no_grad():
        embeds, pos, mask, lab, _ = model.transformer.merge_images(
            batch["input_ids"],
            None,
            None,
            batch["attention_mask"],
            batch["labels"],
            batch["images"],
            batch["image_rows"],
        )
        features = model.transformer.vision(batch["images"])
        words = model.transformer.embedding(batch["input_ids"])
    assert embeds.shape[:2] == (2, s + n - 1)
    b = ids.index(boi)  # = 4
    tail = len(ids) - (b + 3)  # tokens after eoi
    # Row 0 (image): positions 0..b, then b+1 for all N patches, then eoi at b+2 and onwards.
    assert pos[0].tolist()[: len(ids) + n - 1] == [*range(b + 1), *[b + 1] * n, *range(b + 2, len(ids))]
    assert lab[0].tolist()[: len(ids) + n - 1] == [*labels[: b + 1], *[-100] * n, *labels[b + 2 :]]
    assert mask[0].tolist() == [1] * (len(ids) + n - 1) + [0] * (s - len(ids))
    torch.testing.assert_close(embeds[0, :b], words[0, :b])  # text before the image
    torch.testing.assert_close(embeds[0, b : b + n + 2], features[0])  # boi, N patches, eoi from the tower
    torch.testing.assert_close(embeds[0, b + n + 2 : b + n + 2 + tail], words[0, b + 3 : len(ids)])
    # Row 1 (text only, no placeholder image): unchanged, right-padded by N - 1 masked, unlabelled positions.
    assert lab[1].tolist() == batch["labels"][1].tolist() + [-100] * (n - 1)
    assert mask[1].tolist() == batch["attention_mask"][1].tolist() + [0] * (n - 1)
    torch.testing.assert_close(embeds[1, :s], words[1])
    # The full forward takes the loss over the expanded labels: same value as a hand-built input.
    with torch.no_grad():
        out = model(**batch)
        ref = model(inputs_embeds=embeds, input_ids=None, position_ids=pos, attention_mask=mask, labels=lab)
    assert out.logits.shape[1] == s + n - 1
    torch.testing.assert_close(out.loss, ref.loss)


def test_image_and_text_samples_train_together_and_adapter_reloads(tiny, tmp_path):
    model_dir, config, tok = tiny
    run = RunConfig(
        data=DataConfig(train_file=str(SAMPLES / "train.jsonl"), val_file=None),
        lora=LoraConfig(target_modules=["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
        train=TrainConfig(max_steps=40, learning_rate=1e-2, per_device_batch_size=4, logging_steps=1),
    )
    train_set, _, stats = build_datasets(run.data, tok, config.vision_config)
    assert stats.train.images == 5 and stats.train.kept == 7 and stats.train.image_tokens == 5 * (n_emb := 6)
    collator = DataCollator(tok.pad_token_id, image_size=config.vision_config["image_size"])
    batch = collator(train_set[3:7])  # 1 image row among text rows: one batch mixes both
    assert batch["image_rows"].tolist() == [0, 3] and n_emb == num_image_tokens(config.vision_config) + 2
    choices = make_plan(run, config, 1, user_set_max_length=False).choices
    metrics, model = train(run, choices, tmp_path / "run", model_dir, train_set, None, collator)
    losses = logged_losses(tmp_path / "run")
    assert losses[0] > 0.8 * math.log(1280) and losses[-1] < 0.5 * losses[0], losses
    assert not any(".vision." in n for n, p in model.named_parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        trained = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        reloaded = PeftModel.from_pretrained(load_model(model_dir), str(tmp_path / "run" / "adapter")).eval()
        again = reloaded(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(again, trained, rtol=1e-5, atol=1e-5)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows), encoding="utf-8")
    return path


A = {"role": "assistant", "content": "ok"}


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [[{"role": "user", "content": "q", "image": "missing.png"}, A]],
            r"bad\.jsonl:1: image not found: .*missing\.png",
        ),
        (
            [[{"role": "user", "content": "q"}, A], [{"role": "user", "content": "q", "image": "junk.png"}, A]],
            r"bad\.jsonl:2: image cannot be read: .*junk\.png",
        ),
        (
            [[{"role": "user", "content": "q"}, A, {"role": "user", "content": "q", "image": "ok.png"}, A]],
            r"bad\.jsonl:1: messages\[2\] has an \"image\", but only the first user message",
        ),
        (
            [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "image": "ok.png"}]],
            r"bad\.jsonl:1: messages\[1\] \(assistant\) has an \"image\"",
        ),
    ],
)
def test_bad_images_are_one_line_data_errors(tmp_path, tiny, rows, message):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match=message):
        build_datasets(DataConfig(train_file=str(_write(tmp_path / "bad.jsonl", rows))), tiny[2], tiny[1].vision_config)


def test_relative_image_paths_resolve_against_the_data_file_and_text_models_refuse_images(tiny):
    train_set, _, _ = build_datasets(
        DataConfig(train_file=str(SAMPLES / "train.jsonl")), tiny[2], tiny[1].vision_config
    )
    assert train_set[0]["image"] == str((SAMPLES / "images" / "red_square.png").resolve())
    with pytest.raises(DataError, match=r"train\.jsonl:1: has an \"image\" but this model has no vision tower"):
        build_datasets(DataConfig(train_file=str(SAMPLES / "train.jsonl")), tiny[2], None)


def _run_on(hw: str) -> RunConfig:
    return RunConfig(hw=HwConfig(**yaml.safe_load((REPO / "conf" / "hw" / f"{hw}.yaml").read_text())))


def test_glm4v_plan_one_a100_40g():
    plan = make_plan(_run_on("a100_40g"), released_config("glm4v_9b"), 1, user_set_max_length=False)
    # 13.9 B frozen bf16 params = 25.9 GiB incl. the 4.5 B tower; 500 text + 1,599 image tokens need
    # checkpointing but no ZeRO, no offload, the reference loss.
    assert plan.fits and plan.choices.zero_stage == 0 and plan.choices.gradient_checkpointing
    assert not plan.choices.offload_params and plan.choices.micro_batch_size == 1
    assert plan.breakdown["frozen weights"] == 13_906_320_896 * 2
    assert 0.3 * 2**30 < plan.breakdown["vision tower working set"] < 1 * 2**30


def test_glm4v_plan_two_rtx3090_shards_with_zero3():
    plan = make_plan(_run_on("rtx3090_24g"), released_config("glm4v_9b"), 2, user_set_max_length=False)
    # 25.9 GiB of weights exceed one 23.6 GiB card: ZeRO-3 halves them, without offload.
    assert plan.fits and plan.choices.zero_stage == 3 and not plan.choices.offload_params
    assert plan.breakdown["frozen weights (ZeRO-3 shard)"] == 13_906_320_896 * 2 // 2
