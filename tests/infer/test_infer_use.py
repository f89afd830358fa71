"""mode=infer for real use: prompt and reference beside each prediction, provenance, one-shot prompt, sampling
settings, and an adapter trained on another base refused with exit 2."""

import json
import shutil

import pytest
from helpers.cli import glmtune_in_process

from glmtune.infer.generate import reference_text
from glmtune.models import make_tiny_checkpoint
from glmtune.models.presets import ensure_tiny

SAMPLE_PROMPTS = "data/samples/prompts.jsonl"


def run_cli(*args, cwd):
    return glmtune_in_process(*args, cwd=cwd)  # the command's entry point, in this process


@pytest.fixture(scope="module")
def adapter(trained):
    return trained.without_probe / "adapter"  # a CLI training (helpers/cli.py TRAINED), shared with other files


def test_predictions_carry_prompt_and_reference_and_the_run_records_provenance(tmp_path, repo, adapter):
    out = tmp_path / "inf"
    proc = run_cli(
        "mode=infer",
        f"infer.prompts_file={SAMPLE_PROMPTS}",
        f"infer.adapter={adapter}",
        "infer.max_new_tokens=6",
        "infer.do_sample=true",
        "infer.top_k=20",
        "infer.seed=7",
        f"hydra.run.dir={out}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    sample = [json.loads(line) for line in (repo / SAMPLE_PROMPTS).read_text(encoding="utf-8").splitlines() if line]
    assert len(rows) == len(sample)
    for row, line in zip(rows, sample):
        with_reference = line["messages"][-1]["role"] == "assistant"
        assert row["prompt"] == (line["messages"][:-1] if with_reference else line["messages"])
        assert row["reference"] == (reference_text(line["messages"][-1]) if with_reference else None)
        assert isinstance(row["output"], str)
    assert any(r["reference"] for r in rows) and any(r["reference"] is None for r in rows)
    assert {"reference": 'get_weather\n{"city": "北京"}'}.items() <= rows[4].items()  # a tool call: name, arguments

    prov = json.loads((out / "provenance.json").read_text())
    assert prov["base"]["path"] == str(ensure_tiny("glm4")) and len(prov["base"]["config_sha256"]) == 16
    assert prov["base"]["run_config_sha256"]
    trained = json.loads((adapter.parent / "metrics.json").read_text())["adapter_sha256"]
    assert prov["adapter"]["trained_fingerprint"] == trained and prov["adapter"]["file_sha256"]
    assert prov["settings"] == {
        "max_new_tokens": 6,
        "batch_size": min(len(sample), 8),
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.0,
        "seed": 7,
    }

    again = tmp_path / "again"  # same seed: same samples
    assert (
        run_cli(
            "mode=infer",
            f"infer.prompts_file={SAMPLE_PROMPTS}",
            f"infer.adapter={adapter}",
            "infer.max_new_tokens=6",
            "infer.do_sample=true",
            "infer.top_k=20",
            "infer.seed=7",
            f"hydra.run.dir={again}",
            cwd=repo,
        ).returncode
        == 0
    )
    assert (again / "predictions.jsonl").read_text() == (out / "predictions.jsonl").read_text()


def test_one_shot_prompt(tmp_path, repo, adapter):
    out = tmp_path / "one"
    proc = run_cli(
        "mode=infer",
        'infer.prompt="你好"',
        'infer.system="Be brief."',
        f"infer.adapter={adapter}",
        "infer.max_new_tokens=5",
        f"hydra.run.dir={out}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert row["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    assert row["output"] in proc.stdout


def test_adapter_of_another_base_exits_2(tmp_path, repo, adapter):
    # Same architecture, other weights (e.g. glm-4-9b vs glm-4-9b-chat): the recorded base identity differs.
    other = make_tiny_checkpoint(tmp_path / "other", "glm4", seed=1)
    proc = run_cli(
        "mode=infer",
        "infer.prompt=hi",
        f"infer.adapter={adapter}",
        f"model.path={other}",
        f"hydra.run.dir={tmp_path / 'a'}",
        cwd=repo,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "was trained on" in proc.stderr and "weights" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "a" / "predictions.jsonl").exists()

    # Another family's tiny model (ChatGLM3: other rope and norms): the architecture hash differs.
    proc = run_cli(
        "mode=infer",
        "model=chatglm3_tiny",
        "infer.prompt=hi",
        f"infer.adapter={adapter}",
        f"hydra.run.dir={tmp_path / 'b'}",
        cwd=repo,
    )
    assert proc.returncode == 2 and "architecture" in proc.stderr, proc.stderr[-2000:]

    # An adapter without glmtune's record (trained elsewhere) on a base of another width: the shapes say no.
    foreign = tmp_path / "foreign"
    shutil.copytree(adapter, foreign)
    (foreign / "glmtune_base.json").unlink()
    wide = make_tiny_checkpoint(tmp_path / "wide", "glm4", hidden_size=96)
    proc = run_cli(
        "mode=infer",
        "infer.prompt=hi",
        f"infer.adapter={foreign}",
        f"model.path={wide}",
        f"hydra.run.dir={tmp_path / 'c'}",
        cwd=repo,
    )
    assert proc.returncode == 2 and "trained on another model" in proc.stderr, proc.stderr[-2000:]
    # ... and on its own base it is accepted
    proc = run_cli(
        "mode=infer",
        "infer.prompt=hi",
        f"infer.adapter={foreign}",
        "infer.max_new_tokens=2",
        f"hydra.run.dir={tmp_path / 'd'}",
        cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
