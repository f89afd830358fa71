"""Per-document attention of packed rows (models/docattention.py, issue 30 item 2).

On the tiny GLM-4 in fp32: every document of a packed row gets the logits it gets alone, on the segments path
and on what auto runs above DENSE_MASK_MAX; segments and the dense mask give the same logits and gradients
(every parameter, and LoRA's); above DENSE_MASK_MAX no tensor with two dimensions of the row's length is made in
forward or backward, which the same recorder catches on the dense path; the plan names the path auto runs.
Under sequence parallelism (2 and 4 ranks, torchrun on gloo): tests/models/docattn_worker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from glmtune.models.chatglm.configuration import GLMConfig
from glmtune.models.chatglm.modeling import ChatGLMForConditionalGeneration
from glmtune.models.kernels.docattention import DENSE_MASK_MAX, document_spans, packed_path
from glmtune.models.loading import _FAMILY, TINY_ARCH

VOCAB = 128
LONG = DENSE_MASK_MAX + 256  # a row auto must run without any [S, S] tensor


def tiny(family: str = "glm4") -> ChatGLMForConditionalGeneration:
    torch.manual_seed(0)
    config = GLMConfig(**{**TINY_ARCH, **_FAMILY[family]}, padded_vocab_size=VOCAB, torch_dtype="float32")
    return ChatGLMForConditionalGeneration(config).float()


def packed(rows: list[list[int]], length: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """Rows of documents of the given lengths, padded (seq id -1) to `length`, as the collator makes them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(rows), length), generator=g)
    seq = torch.full((len(rows), length), -1)
    pos = torch.zeros(len(rows), length, dtype=torch.long)
    for r, docs in enumerate(rows):
        at = 0
        for i, n in enumerate(docs):
            seq[r, at : at + n], pos[r, at : at + n] = i, torch.arange(n)
            at += n
    labels = ids.masked_fill(seq < 0, -100)
    labels[:, 0] = -100
    return dict(input_ids=ids, position_ids=pos, seq_ids=seq, labels=labels)


def alone(model, batch, row: int, start: int, end: int) -> torch.Tensor:
    """The logits of one document run by itself: its own row, no seq ids, plain causal attention."""
    with torch.no_grad():
        return model(input_ids=batch["input_ids"][row : row + 1, start:end]).logits[0]


def check_documents_alone(model, batch, logits) -> int:
    checked = 0
    for row, spans in enumerate(document_spans(batch["seq_ids"]).rows):
        for start, end in spans:
            if batch["seq_ids"][row, start] >= 0:
                torch.testing.assert_close(
                    logits[row, start:end], alone(model, batch, row, start, end), rtol=1e-5, atol=1e-5
                )
                checked += 1
    return checked


def test_each_document_sees_only_itself_on_the_segments_path():
    model = tiny().eval()
    model.transformer.packed_attention = "segments"
    batch = packed([[5, 9, 7, 3], [11, 8, 2]], 26)
    with torch.no_grad():
        logits = model(**batch).logits
    assert check_documents_alone(model, batch, logits) == 7


@pytest.mark.parametrize("lora", [False, True])
def test_segments_equal_the_dense_mask_in_logits_and_gradients(lora):
    model = tiny()
    if lora:  # non-zero B, so every adapter's gradient depends on the attention output
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, target_modules=["query_key_value", "dense"], init_lora_weights=False)
        )
    batch = packed([[6, 10, 1, 7], [13, 4, 5]], 28)
    out = {}
    for path in ("sdpa", "segments"):
        model.zero_grad(set_to_none=True)
        for module in model.modules():
            if hasattr(module, "packed_attention"):
                module.packed_attention = path
        result = model(**batch)
        result.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        out[path] = result.logits.detach(), result.loss.detach(), grads
    real = batch["seq_ids"] >= 0
    torch.testing.assert_close(out["segments"][0][real], out["sdpa"][0][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["segments"][1], out["sdpa"][1], rtol=1e-5, atol=1e-6)
    assert set(out["sdpa"][2]) == set(out["segments"][2]) and len(out["sdpa"][2]) >= (8 if lora else 10)
    for name, grad in out["sdpa"][2].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(out["segments"][2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


class Allocations(TorchDispatchMode):
    """Every tensor an op returns during forward and backward: (op, shape)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(str(func), tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def square(made, length: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(op, shape) for op, shape in made if sum(d >= length for d in shape) >= 2]


def step_allocations(model, batch) -> tuple[list, int]:
    """(what forward + backward made, how many of those came from backward)."""
    with Allocations() as seen:
        loss = model(**batch).loss
        in_forward = len(seen.made)
        loss.backward()
    return seen.made, len(seen.made) - in_forward


def test_auto_makes_no_seq_by_seq_tensor_above_the_named_length_and_the_check_catches_the_dense_path():
    model = tiny().train()
    assert model.transformer.packed_attention == "auto" and packed_path("auto", LONG) == "segments"
    batch = packed([[550, 450, 750, 350]], LONG)
    made, backward = step_allocations(model, batch)
    assert backward > 50 and len(made) > 200  # the recorder saw both passes
    assert square(made, LONG) == []
    model.transformer.packed_attention = "sdpa"  # the dense path at the same length: caught
    made, _ = step_allocations(model, batch)
    assert square(made, LONG), "the recorder missed the dense [S, S] mask"


def test_documents_alone_on_the_path_auto_runs_at_long_rows():
    model = tiny().eval()
    batch = packed([[650, 500, 800, 200, 10]], LONG, seed=5)  # 2,160 positions + pad to LONG
    with torch.no_grad():
        logits = model(**batch).logits
    assert check_documents_alone(model, batch, logits) == 5


def test_a_document_in_two_spans_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        document_spans(torch.tensor([[0, 0, 1, 1, 0, -1]]))
    spans = document_spans(torch.tensor([[0, 0, 1, 2, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0]]))
    assert spans.rows == (((0, 2), (2, 3), (3, 5), (5, 7)), ((0, 7),)) and spans.largest == 7


@pytest.mark.parametrize("length,path", [(DENSE_MASK_MAX // 2, "sdpa"), (LONG, "segments")])
def test_auto_runs_what_the_plan_names(tmp_path, repo, length, path):
    from helpers.cli import glmtune_in_process

    from glmtune.config import TrainConfig
    from glmtune.train.compile import resolve_packed_attention, set_packed_attention

    out = glmtune_in_process(
        "mode=plan",
        "model=glm4_9b_chat",
        "+hw=a100_80g",
        "data.packing=on",
        f"data.max_length={length}",
        f"hydra.run.dir={tmp_path}",
        cwd=repo,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    row = plan["packing"]["probed_row_positions"]
    assert row == length and plan["packing"]["attention"] == path
    assert plan["packing"]["dense_mask_max"] == DENSE_MASK_MAX
    assert f"no [S, S] tensor in rows above {DENSE_MASK_MAX} positions" in plan["reasons"]["packed_attention"]
    assert "packed attention" in out.stdout and path in out.stdout
    assert ("packed-row attention biases" in plan["breakdown"]) == (path == "sdpa")  # the mask is planned only dense
    # What the trainer sets for auto (no CUDA: no flex), run on a row of the plan's length: the dense path is the
    # one that makes a [S, S] tensor.
    model = tiny().eval()
    set_packed_attention(model, resolve_packed_attention(TrainConfig(packed_attention="auto"), False, 0.0)[0])
    batch = packed([[row // 3, row // 3, row - 2 * (row // 3)]], row)
    with torch.no_grad(), Allocations() as seen:
        model(**batch)
    assert bool(square(seen.made, row)) == (path == "sdpa")


def test_config_takes_segments():
    from glmtune.config import ConfigError, parse_config

    assert parse_config({"train": {"packed_attention": "segments"}}).train.packed_attention == "segments"
    with pytest.raises(ConfigError, match="segments"):  # the error line lists the values
        parse_config({"train": {"packed_attention": "segment"}})


@pytest.mark.slow
def test_sequence_parallel_segments_match_one_process(tmp_path, repo):
    """2 and 4 ranks (torchrun, gloo): documents crossing every shard boundary, the segments path against the
    dense mask and each document alone on one process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    worker = Path(__file__).with_name("docattn_worker.py")
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            "4",
            str(worker),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 6, results.keys()
        for case, diff in results.items():
            assert diff["missing"] == [] and diff["positions"] > 0, case
            assert max(diff["logits"], diff["alone"], diff["loss"], diff["grads"]) <= 1e-5, (rank, case, diff)


def test_compiled_blocks_do_not_recompile_for_each_layout_of_documents():
    """train.compile with segments: a new layout of documents must not compile the blocks again (eager backend:
    dynamo's tracing and guards without inductor's code generation)."""
    from torch._dynamo.utils import counters

    from glmtune.train.compile import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    model = tiny()
    model.transformer.packed_attention = "segments"
    compile_blocks(model, backend="eager")
    layouts = ([10, 20, 30], [5, 5, 40], [30, 30], [1, 2, 3, 4, 5, 6], [60], [7, 7, 7, 7], [3, 3], [9, 9, 9])
    graphs = []
    try:
        for docs in layouts:
            model(**packed([docs], 64)).loss.backward()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert graphs[-1] == graphs[3] and graphs[-1] <= 4, graphs


def test_glm4v_packed_image_rows_segments_equal_the_dense_mask():
    """GLM-4V: the spans are read after the images are spliced in (each row grows by its images' patches)."""
    from glmtune.config import DataConfig
    from glmtune.data.packing import pack, positions
    from glmtune.data.pipeline import DataCollator, build_datasets
    from glmtune.models import load_config, load_model, load_tokenizer
    from glmtune.models.presets import ensure_tiny
    from glmtune.plan.estimate import image_extra_tokens

    model_dir = ensure_tiny("glm4v")
    config, tok = load_config(model_dir), load_tokenizer(model_dir)
    samples = REPO / "data/samples_vision/train.jsonl"
    train, _, _ = build_datasets(DataConfig(train_file=str(samples), val_file=None), tok, config.vision_config)
    extra = image_extra_tokens(config)
    rows = pack(train, sum(positions(e, extra) for e in train) // 2 + 10, extra)
    batch = DataCollator(tok.pad_token_id, image_size=config.vision_config["image_size"])(rows)
    assert len(rows) >= 2 and max(len(r.get("images", ())) for r in rows) >= 2
    model = load_model(model_dir, dtype=torch.float32).eval()
    out = {}
    for path in ("sdpa", "segments"):
        model.zero_grad(set_to_none=True)
        model.transformer.packed_attention = path
        result = model(**batch)
        result.loss.backward()
        out[path] = (
            result.logits.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    torch.testing.assert_close(out["segments"][0], out["sdpa"][0], rtol=1e-5, atol=1e-5)
    assert out["sdpa"][1].keys() == out["segments"][1].keys() and any("vision" in n for n in out["sdpa"][1])
    for name, grad in out["sdpa"][1].items():
        torch.testing.assert_close(out["segments"][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_backward_makes_no_row_sized_tensor_per_document():
    """A row of 32 documents costs backward the same whole-row tensors as a row of 2 (a per-document slice of q,
    k, v would add one zero-filled row-sized gradient per document and layer)."""
    model = tiny().train()
    model.transformer.packed_attention = "segments"
    length, hidden = 256, TINY_ARCH["num_attention_heads"] * TINY_ARCH["kv_channels"]
    counts = []
    for docs in ([128, 128], [8] * 32):
        made, _ = step_allocations(model, packed([docs], length))
        counts.append(sum(shape in ((1, 4, length, 16), (1, length, hidden)) for _, shape in made))
    assert counts[0] == counts[1] and counts[0] > 0, counts
