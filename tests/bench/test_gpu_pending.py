"""bench/gpu_pending.py, the one command for the next GPU, runs every part on CPU with the tiny model, so it is
never found broken on the day a GPU is there."""

import subprocess
import sys

import pytest


def _part(repo, tmp_path, part) -> str:
    out = subprocess.run(
        [sys.executable, "bench/gpu_pending.py", "--tiny", "--part", str(part), "--work", str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith(f"## gpu_pending part {part} (tiny, CPU): ")
    return out.stdout


def test_part_1_prints_the_memory_table_of_the_recorded_rows(repo, tmp_path):
    rows = [
        line for line in _part(repo, tmp_path, 1).splitlines() if line.startswith("| glm") or line.startswith("| chat")
    ]
    assert len(rows) == 21 and sum("default alloc" in r for r in rows) == 3


@pytest.mark.slow  # ~45 s on 2 cores: three quantized loads and a probe + 2 training steps
def test_part_2_quantized_rows_and_a_probed_run(repo, tmp_path):
    out = _part(repo, tmp_path, 2)
    assert [
        line.split("|")[1].strip() for line in out.splitlines() if line.startswith(("| bf16", "| int8", "| nf4"))
    ] == ["bf16", "int8", "nf4"]
    assert "done in " in out and "adapter saved" in out and '"outcome": "fits"' in out


@pytest.mark.slow  # ~30 s: the Trainer on demo-like rows, packed and not, then generation
def test_part_3_throughput_and_generation_rows(repo, tmp_path):
    out = _part(repo, tmp_path, 3)
    assert sum(line.startswith("| demo |") for line in out.splitlines()) == 2
    assert sum(line.startswith("| batch ") for line in out.splitlines()) == 3


@pytest.mark.slow  # ~60 s on 2 cores: six glmtune commands (plan, probe, a few steps) on the tiny models
def test_part_cli_runs_the_six_commands_each_within_its_probe(repo, tmp_path):
    out = subprocess.run(
        [sys.executable, "bench/gpu_pending.py", "--tiny", "--part", "cli", "--work", str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout[out.stdout.index("## gpu_pending --part cli (tiny, CPU): ") :]
    rows = [
        line.split("|") for line in table.splitlines() if line.startswith("| ") and not line.startswith("| command")
    ]
    assert len(rows) == 6 and all(r[2].strip() == "0" and r[-2].strip() == "ok" for r in rows), table
    trained = [float(r[7]) for r in rows if r[7].strip() != "-"]  # run peak / probe peak, measured alike
    assert len(trained) == 5 and max(trained) <= 1.01, table


@pytest.mark.slow  # ~20 s: two short runs of the tiny model with the tiled MLP, each probed
def test_part_4_long_rows_with_the_tiled_mlp(repo, tmp_path):
    out = _part(repo, tmp_path, 4)
    assert out.count("tiled MLP on (") == 2 and out.count("adapter saved") == 2, out
    attempts = [line for line in out.splitlines() if "probe attempts: " in line]
    assert len(attempts) == 2 and all('"mlp_tile_tokens": 128' in a and '"outcome": "fits"' in a for a in attempts)


@pytest.mark.slow  # ~40 s on 2 cores: two plans of GLM-4-32B-0414 and a probed run of the tiny GLM-4-0414
def test_part_0414_plans_32b_and_trains_the_0414_model(repo, tmp_path):
    out = subprocess.run(
        [sys.executable, "bench/gpu_pending.py", "--tiny", "--part", "0414", "--work", str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith("## gpu_pending part 0414 (tiny, CPU): ")
    assert out.stdout.count("exit 0)") == 3, out.stdout
    assert "adapter saved" in out.stdout and '"outcome": "fits"' in out.stdout


def _phase_rows(out: str, prefix: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith(f"| {prefix}")]


@pytest.mark.slow  # ~40 s on 2 cores: three rehearsals of the tiny model (SP over DDP; ZeRO-3 + SP on 2 and 4 ranks)
def test_part_rehearse_prints_planned_vs_rehearsed_phases(repo, tmp_path):
    rows = _phase_rows(_part(repo, tmp_path, "rehearse"), "rehearse-")
    assert [r[1] for r in rows] == ["2 rehearsed", "2 rehearsed", "4 rehearsed"] and all(r[4] == "train" for r in rows)
    assert "no ZeRO" in rows[0][3] and all("ZeRO-3" in r[3] for r in rows[1:]) and all(r[-1] == "fits" for r in rows)
    # planned vs rank 0's peak, loosely: the tiny rows hold a few MB (the rehearsal's own precision: test_rehearse.py)
    assert all(abs(float(r[7].rstrip("%"))) < 20 for r in rows), rows


@pytest.mark.slow  # ~60 s: four quantized probes (nf4, int8 x GLM-4, GLM-4V tiny)
def test_part_qlora_prints_planned_vs_measured_phases(repo, tmp_path):
    rows = _phase_rows(_part(repo, tmp_path, "qlora"), "qlora-")
    assert sorted(r[0] for r in rows) == [
        "qlora-glm4_9b_chat-int8",
        "qlora-glm4_9b_chat-nf4",
        "qlora-glm4v_9b-int8",
        "qlora-glm4v_9b-nf4",
    ]
    assert all(r[-1] == "fits" and abs(float(r[7].rstrip("%"))) < 5 for r in rows), rows


@pytest.mark.slow  # ~15 s: the tiny model's packed rows, dense mask and per document
def test_part_docattn_times_both_paths_and_suggests_a_limit(repo, tmp_path):
    out = _part(repo, tmp_path, "docattn")
    rows = [line for line in out.splitlines() if line.startswith(("| 256 |", "| 512 |"))]
    assert sorted(line.split("|")[3].strip() for line in rows) == ["sdpa", "sdpa", "segments", "segments"]
    assert "suggested DENSE_MASK_MAX: " in out


@pytest.mark.slow  # ~30 s on 2 cores: a few tiny rows in one call, the next in a second
def test_session_runs_rows_by_priority_and_a_second_call_goes_on(repo, tmp_path):
    """bench/gpu_session.py: a call starts rows while 30 s are left of its deadline and leaves the rest; a second call
    on the same machine runs only what the first did not (done.json), so a 15-minute device budget loses nothing."""

    def call(deadline):
        out = subprocess.run(
            [sys.executable, "bench/gpu_session.py", "--tiny", "--deadline-s", str(deadline), "--work", str(tmp_path)],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return [line.split(":")[0] for line in out.stdout.splitlines() if ": exit " in line and "###" not in line]

    first = call(31)  # one row starts (31 s left), none after it
    assert first == ["rehearse-1"]
    second = call(45)
    assert second and second[0] == "rehearse-2" and "rehearse-1" not in second
    report = (tmp_path / "session.md").read_text()
    assert "### rehearse-1: rehearsal:" in report and "| rehearse-1 | 2 rehearsed |" in report
    assert "left for the next call" in report
