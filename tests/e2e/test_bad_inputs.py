"""Every bad input of issue 12 through the real command line: one line on stderr, its exit code, no traceback,
and the inputs (data, model folder, prompts, earlier outputs) left exactly as they were.

One row per case, each through glmtune's entry point in this process (helpers/cli.py glmtune_in_process: the same
argument checks, Hydra, modes and exit paths, without a torch import per row); test_cli checks a bad input's one
line from a real process.
"""

import os
import shutil
import struct
import zlib
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
from helpers import REPO
from helpers.cli import glmtune_in_process

from glmtune.models.presets import ensure_tiny

GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'


class Row(NamedTuple):
    name: str
    setup: Callable[[Path], list[str]]  # writes its files under the folder, returns the command-line arguments
    code: int
    fragments: tuple[str, ...]  # each must be in the one error line
    env: dict = {}


def data_file(folder: Path, *lines: str) -> Path:
    path = folder / "train.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def image_line(image: Path) -> str:
    return (
        '{"messages": [{"role": "user", "content": "what is it?", "image": "%s"}, '
        '{"role": "assistant", "content": "a square"}]}' % image
    )


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def huge_png(folder: Path) -> Path:
    """A valid PNG header for 20000x20000 pixels and almost no data: the size alone must be refused
    (decoding it would take 1.2 GB)."""
    path = folder / "huge.png"
    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )
    return path


def truncated_png(folder: Path) -> Path:
    from PIL import Image

    path = folder / "cut.png"
    Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3)).save(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def vision(image_maker):
    def setup(folder: Path) -> list[str]:
        image = image_maker(folder)
        return [
            "model=glm4v_tiny",
            f"data.train_file={data_file(folder, GOOD, image_line(image))}",
            "data.val_file=null",
        ]

    return setup


def fifo_image(folder: Path) -> Path:
    os.mkfifo(folder / "pipe.png")
    return folder / "pipe.png"


def fifo_train_file(folder: Path) -> list[str]:
    os.mkfifo(folder / "pipe.jsonl")
    return [f"data.train_file={folder / 'pipe.jsonl'}", "data.val_file=null"]


def nested_json(folder: Path) -> list[str]:
    return [f"data.train_file={data_file(folder, GOOD, '[' * 100_000 + ']' * 100_000)}", "data.val_file=null"]


def model_copy(folder: Path) -> Path:
    target = folder / "model"
    shutil.copytree(ensure_tiny("glm4"), target)
    return target


def without_weights(folder: Path) -> list[str]:
    model = model_copy(folder)
    (model / "model.safetensors").unlink()
    return [f"model.path={model}"]


def truncated_weights(folder: Path) -> list[str]:
    model = model_copy(folder)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return [f"model.path={model}"]


class Payload:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def pickled_weights(folder: Path) -> list[str]:
    model = model_copy(folder)
    from safetensors.torch import load_file

    state = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**state, "payload": Payload(folder / "PAYLOAD_RAN")}, model / "pytorch_model.bin")
    return [f"model.path={model}"]


def bad_config_json(folder: Path) -> list[str]:
    model = model_copy(folder)
    (model / "config.json").write_text('{"num_layers": 2,\n  "hidden_size": }\n')
    return [f"model.path={model}"]


def pickled_adapter(folder: Path) -> list[str]:
    adapter = folder / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 8, "lora_alpha": 32, '
        '"target_modules": ["query_key_value"], "task_type": "CAUSAL_LM"}'
    )
    torch.save({"payload": Payload(folder / "PAYLOAD_RAN")}, adapter / "adapter_model.bin")
    prompts = folder / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return ["mode=infer", f"infer.adapter={adapter}", f"infer.prompts_file={prompts}"]


def prompts_file(folder: Path) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return path


def merge_into_model(folder: Path) -> list[str]:
    model = model_copy(folder)
    return ["mode=infer", f"model.path={model}", f"infer.merge_to={model}"]


def output_is_prompts(folder: Path) -> list[str]:
    prompts = prompts_file(folder)
    return ["mode=infer", f"infer.prompts_file={prompts}", f"infer.output_file={prompts}"]


def output_exists(folder: Path) -> list[str]:
    (folder / "old_predictions.jsonl").write_text("earlier results\n")
    return [
        "mode=infer",
        f"infer.prompts_file={prompts_file(folder)}",
        f"infer.output_file={folder / 'old_predictions.jsonl'}",
    ]


def merge_into_existing(folder: Path) -> list[str]:
    (folder / "merged").mkdir()
    (folder / "merged" / "keep.txt").write_text("earlier merge\n")
    return ["mode=infer", f"infer.merge_to={folder / 'merged'}"]


# infer.merge_to onto what holds an input, with infer.overwrite=true (which used to delete the input: issue 39)
def merge_onto_model_parent(folder: Path) -> list[str]:
    model = model_copy(folder)
    return ["mode=infer", f"model.path={model}", f"infer.merge_to={folder}", "infer.overwrite=true"]


def merge_inside_model(folder: Path) -> list[str]:
    model = model_copy(folder)
    return ["mode=infer", f"model.path={model}", f"infer.merge_to={model / 'merged'}", "infer.overwrite=true"]


def merge_onto_adapter_parent(folder: Path) -> list[str]:
    adapter = folder / "train_run" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"the user's trained adapter")
    return ["mode=infer", f"infer.adapter={adapter}", f"infer.merge_to={adapter.parent}", "infer.overwrite=true"]


def merge_onto_prompts_parent(folder: Path) -> list[str]:
    (folder / "prompts").mkdir()
    return [
        "mode=infer",
        f"infer.prompts_file={prompts_file(folder / 'prompts')}",
        f"infer.merge_to={folder / 'prompts'}",
        "infer.overwrite=true",
    ]


def merge_onto_run_dir_parent(folder: Path) -> list[str]:
    (folder / "notes.txt").write_text("the user's notes beside the run dir\n")
    return ["mode=infer", f"infer.merge_to={folder}", "infer.overwrite=true"]  # the run dir is folder/run


def merge_onto_a_file(folder: Path) -> list[str]:
    (folder / "weights.bin").write_bytes(b"a file, not a folder")
    return ["mode=infer", f"infer.merge_to={folder / 'weights.bin'}", "infer.overwrite=true"]


def merge_onto_a_users_folder(folder: Path) -> list[str]:
    (folder / "mine").mkdir()
    (folder / "mine" / "thesis.tex").write_text("not an export\n")
    return ["mode=infer", f"infer.merge_to={folder / 'mine'}", "infer.overwrite=true"]


def args(*values: str) -> Callable[[Path], list[str]]:
    return lambda folder: list(values)


ROWS = [
    Row("huge_png", vision(huge_png), 2, ("train.jsonl:2:", "megapixel limit", "downscale")),
    Row("truncated_png", vision(truncated_png), 2, ("train.jsonl:2:", "image cannot be read", "complete PNG")),
    Row("fifo_image", vision(fifo_image), 2, ("train.jsonl:2:", "not a regular file")),
    Row("fifo_train_file", fifo_train_file, 2, ("pipe.jsonl", "not a regular file")),
    Row("deeply_nested_json", nested_json, 2, ("train.jsonl:2:", "nested too deeply")),
    # parse_config names every bad value in one line, so one launch covers a whole family of keys.
    Row(
        "negative_counts_and_values",
        args(
            "train.weight_decay=-1",
            "train.seed=-1",
            "train.save_steps=-5",
            "train.eval_steps=-1",
            "train.warmup_steps=-1",
            "train.max_steps=-1",
            "train.keep_checkpoints=0",
            "train.resume=maybe",
        ),
        2,
        (
            "train.weight_decay must be >= 0",
            "train.seed must be >= 0",
            "train.save_steps must be >= 0",
            "train.eval_steps must be >= 0",
            "train.warmup_steps must be >= 0",
            "train.max_steps must be >= 0",
            "train.keep_checkpoints must be > 0",
            "train.resume='maybe' is not one of auto, always, restart",
        ),
    ),
    Row(
        "not_finite",
        args("train.learning_rate=nan", "hw.memory_gib=nan"),
        2,
        ("train.learning_rate must be a finite number", "hw.memory_gib must be a finite number"),
    ),
    Row(
        "unknown_group_options",
        args("model=nonexistent", "+hw=nonexistent", "hw=a100_40g"),
        2,
        ("unknown model 'nonexistent'", "glm4_tiny", "unknown hw 'nonexistent'", "a100_40g", "write +hw=a100_40g"),
    ),
    Row("weights_missing", without_weights, 2, ("no weights", "complete checkpoint")),
    Row("weights_truncated", truncated_weights, 2, ("model.safetensors: truncated", "re-download")),
    Row("weights_pickle_refused", pickled_weights, 2, ("weights_only=True", "safetensors")),
    Row("config_json_invalid", bad_config_json, 2, ("config.json:2: invalid JSON",)),
    Row(
        "batch_too_big_for_ram",
        args("train.per_device_batch_size=100000", "probe.enabled=false"),
        3,
        ("GiB available", "lower train.per_device_batch_size"),
    ),
    Row(
        "adapter_pickle_forced_unsafe_env",
        pickled_adapter,
        2,
        ("adapter_model.bin: refused", "safetensors"),
        {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
    ),
    Row("merge_into_model_path", merge_into_model, 2, ("is the model.path folder",)),
    Row("output_is_prompts_file", output_is_prompts, 2, ("is the prompts file",)),
    Row("output_exists", output_exists, 2, ("already exists", "infer.overwrite=true")),
    Row("merge_into_existing_folder", merge_into_existing, 2, ("already holds files", "infer.overwrite=true")),
    Row(
        "merge_onto_model_parent",
        merge_onto_model_parent,
        2,
        ("contains the model.path folder", "whatever infer.overwrite"),
    ),
    Row("merge_inside_model", merge_inside_model, 2, ("lies inside the model.path folder",)),
    Row("merge_onto_adapter_parent", merge_onto_adapter_parent, 2, ("contains the infer.adapter folder",)),
    Row("merge_onto_prompts_parent", merge_onto_prompts_parent, 2, ("contains infer.prompts_file",)),
    Row("merge_onto_run_dir_parent", merge_onto_run_dir_parent, 2, ("contains the run dir folder",)),
    Row("merge_onto_a_file", merge_onto_a_file, 2, ("weights.bin is a file, not a folder",)),
    Row(
        "merge_onto_a_device",
        args("mode=infer", "infer.merge_to=/dev/null", "infer.overwrite=true"),
        2,
        ("infer.merge_to=/dev/null is a device",),
    ),
    Row("merge_onto_proc", args("mode=infer", "infer.merge_to=/proc/glmtune-merged"), 2, ("cannot write in /proc",)),
    Row(
        "merge_with_missing_parent",
        lambda folder: ["mode=infer", f"infer.merge_to={folder / 'no/such/merged'}"],
        2,
        ("parent folder", "does not exist", "create it first"),
    ),
    Row(
        "merge_onto_a_users_folder",
        merge_onto_a_users_folder,
        2,
        ("no glmtune export wrote", "empty this one yourself"),
    ),
    # config values that used to change silently or crash (issue 39, list 8)
    Row(
        "host_memory_absurd",
        args("mode=plan", "hw.host_memory_gib=1e300"),
        2,
        ("hw.host_memory_gib must be <= 1048576",),
    ),
    Row("host_memory_too_small", args("mode=plan", "hw.host_memory_gib=0.001"), 3, ("does not fit", "0.0 GiB budget")),
]
if not torch.cuda.is_available():
    ROWS.append(Row("fp16_on_cpu", args("train.precision=fp16"), 2, ("needs a CUDA GPU", "train.precision=fp32")))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every regular file under the folder (the run dir aside), to show nothing was touched."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "run" not in p.relative_to(folder).parts
    }


def launch(row: Row, folder: Path):
    folder.mkdir()
    argv = row.setup(folder)
    before = snapshot(folder)
    proc = glmtune_in_process(*argv, f"hydra.run.dir={folder / 'run'}", cwd=REPO, env=row.env)
    return proc, before, snapshot(folder)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ensure_tiny("glm4"), ensure_tiny("glm4v")  # built before the rows copy them
    root = tmp_path_factory.mktemp("bad")
    return {row.name: launch(row, root / row.name) for row in ROWS}


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_is_one_line_with_its_exit_code(row, results):
    proc, before, after = results[row.name]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("glmtune: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert proc.returncode == row.code, proc.stderr[-3000:]
    for fragment in row.fragments:
        assert fragment in errors[0], errors[0]
    assert after == before  # inputs, models, prompts and earlier outputs are byte-for-byte as they were
    assert not any(name.endswith("PAYLOAD_RAN") for name in after)  # no pickled code ran
