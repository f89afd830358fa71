"""mode=infer: base + adapter generation, batching with images, the merged checkpoint, bad prompt files."""

import json

import torch
from helpers.cli import glmtune_in_process
from helpers.files import PROMPTS, write_jsonl
from peft import PeftModel
from safetensors import safe_open

from glmtune.config import InferConfig
from glmtune.infer.generate import generate
from glmtune.models import load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny


def run_cli(*args, cwd):
    return glmtune_in_process(*args, cwd=cwd)  # the command's entry point, in this process


def test_infer_with_adapter_and_merged_checkpoint(tmp_path, repo, trained):
    run = trained.without_probe  # a CLI training: lora=all_linear, lr 5e-3
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    merged, out = tmp_path / "merged", tmp_path / "inf"
    proc = run_cli(
        "mode=infer",
        f"infer.prompts_file={prompts}",
        f"infer.adapter={run / 'adapter'}",
        "infer.max_new_tokens=12",
        "infer.batch_size=2",
        f"infer.merge_to={merged}",
        f"hydra.run.dir={out}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3]

    base_dir = ensure_tiny("glm4")
    tok = load_tokenizer(base_dir)
    unmerged = PeftModel.from_pretrained(load_model(base_dir), str(run / "adapter")).eval()
    # independent path: the unmerged PEFT model, one prompt at a time
    expected = generate(unmerged, tok, [p["messages"] for p in PROMPTS], InferConfig(max_new_tokens=12, batch_size=1))
    assert [r["output"] for r in rows] == expected

    # the merged folder is an official-layout checkpoint that reproduces base + adapter
    reloaded = load_model(merged).eval()
    ids = torch.tensor([tok.apply_chat_template(PROMPTS[0]["messages"], add_generation_prompt=True)])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, unmerged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    with safe_open(merged / "model.safetensors", "pt") as f:
        assert "transformer.rotary_pos_emb.inv_freq" in f.keys()
    assert load_tokenizer(merged).encode("hello") == tok.encode("hello")


def test_vision_batches_with_and_without_images_match_single_prompts(repo):
    model_dir = ensure_tiny("glm4v")
    model, tok = load_model(model_dir).eval(), load_tokenizer(model_dir)
    image = str(repo / "data" / "samples_vision" / "images" / "red_square.png")
    prompts = [
        [{"role": "user", "content": "What shape is this?", "image": image}],
        [{"role": "user", "content": "Who are you? Answer in one sentence."}],
        [{"role": "user", "content": "图片里是什么？", "image": image}],
    ]
    batched = generate(model, tok, prompts, InferConfig(max_new_tokens=10, batch_size=3))
    single = generate(model, tok, prompts, InferConfig(max_new_tokens=10, batch_size=1))
    assert batched == single and all(batched)


def test_bad_prompt_file_exits_2_with_file_and_line(tmp_path, repo):
    bad = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[0], {"messages": [{"role": "assistant", "content": "hi"}]}])
    proc = run_cli("mode=infer", f"infer.prompts_file={bad}", f"hydra.run.dir={tmp_path / 'r'}", cwd=repo)
    assert proc.returncode == 2
    assert f"{bad}:2:" in proc.stderr and "Traceback" not in proc.stderr
    missing = run_cli("mode=infer", f"hydra.run.dir={tmp_path / 'r2'}", cwd=repo)
    assert missing.returncode == 2 and "infer.prompts_file" in missing.stderr
