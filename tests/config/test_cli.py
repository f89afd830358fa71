"""The command: --help and --version, one-line exit-2 errors for bad group choices and missing extras,
no run dir for mode=plan or for a run that stops on bad input, readable launch ids, the wheel's contents."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from glmtune import __main__ as entry
from glmtune import __version__
from glmtune.config import CONF_DIR, MODES
from glmtune.launch import run_name


def cli(argv, monkeypatch, capsys):
    """Run the `glmtune` entry point in this process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["glmtune", *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # cli() sets it; this way it is unset again afterwards
    code = 0
    try:
        entry.cli()
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def glmtune(*args, cwd, repo):
    env = {**os.environ, "PYTHONPATH": str(repo)}  # this checkout's glmtune, launched from another folder
    return subprocess.run(
        [sys.executable, "-m", "glmtune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_help_lists_modes_groups_the_hw_rule_examples_and_exit_codes(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, text, _ = cli(["--help"], monkeypatch, capsys)
    assert code == 0 and not list(tmp_path.iterdir())
    for mode in MODES:
        assert f"  {mode} " in text
    for group in ("model=", "data=", "lora=", "dist=", "train=", "+hw=", "+hparams_search="):
        assert group in text
    for option in [p.stem for p in (CONF_DIR / "model").glob("*.yaml")] + ["a100_40g", "h200_141g"]:
        assert option in text
    assert "write it with a '+'" in text and "train.max_steps" in text and "lora.target_modules" in text
    assert "examples:" in text and "glmtune mode=plan model=glm4_9b_chat +hw=a100_40g" in text
    for code in (0, 2, 3, 4, 5, 6):
        assert f"\n  {code}  " in text
    assert "Hydra" not in text.splitlines()[0]  # not Hydra's generic page


def test_version_names_glmtune_and_its_stack(monkeypatch, capsys):
    code, out, _ = cli(["--version"], monkeypatch, capsys)
    assert code == 0 and out.startswith(f"glmtune {__version__} (torch ")
    assert "transformers 4.40.2" in out and "peft" in out


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["model=nonexistent"], ["unknown model 'nonexistent'", "glm4_9b_chat", "glm4_tiny"]),
        (["model=glm4_9b"], ["unknown model 'glm4_9b'", "glm4_9b_chat"]),
        (["hw=a100_40g"], ["needs a '+'", "+hw=a100_40g"]),
        (["+hw=nonexistent"], ["unknown hw 'nonexistent'", "a100_40g", "t4_16g"]),
        (["-m", "+hw=a100_40g,b200"], ["unknown hw 'b200'"]),
        (["+model=glm4_9b_chat"], ["write model=glm4_9b_chat"]),
        (["lora.target_modules=[a,b"], ["cannot parse 'lora.target_modules=[a,b'"]),
    ],
)
def test_composition_errors_exit_2_with_one_line_and_the_valid_options(argv, needles, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(argv, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("glmtune: error: invalid command line: "), err
    for needle in needles:
        assert needle in err
    assert not list(tmp_path.iterdir())  # stopped before Hydra made a run dir


@pytest.mark.parametrize(
    "argv,module,package",
    [
        (["+hparams_search=lora_optuna"], "hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
        (
            ["-m", "hydra/launcher=slurm", "lora.r=8,16"],
            "hydra_plugins.hydra_submitit_launcher",
            "hydra-submitit-launcher",
        ),
    ],
)
def test_a_missing_extra_names_the_pip_command(argv, module, package, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # what Python sees when the plugin is not installed
    code, _, err = cli(argv, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "pip install" in err and package in err, err


def test_other_hydra_composition_errors_exit_2_in_one_line(monkeypatch, capsys, tmp_path):
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    try:
        code, _, err = cli(["hydra/sweeper=nonexistent"], monkeypatch, capsys)  # Hydra itself finds this one
    finally:
        GlobalHydra.instance().clear()
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1 and "nonexistent" in err, err
    assert not list(tmp_path.iterdir())


def test_bad_input_leaves_no_run_dir_and_samples_are_found_from_any_folder(tmp_path, repo):
    # The default data.train_file (data/samples/train.jsonl) is not in tmp_path: the shipped copy is read,
    # and the run stops on the missing validation file given here, leaving no outputs/ behind.
    proc = glmtune("data.val_file=missing.jsonl", "mode=probe", cwd=tmp_path, repo=repo)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("glmtune: error: missing.jsonl: validation file not found")
    assert not list(tmp_path.iterdir())


def test_launch_ids_are_readable_and_agree_across_ranks(monkeypatch):
    monkeypatch.delenv("GLMTUNE_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2b8c1de4a94f0bb1c2d3e4f5a6b7c8")  # torchrun --standalone
    assert run_name("2026-11-23/10-00-00") == "2026-11-23/torchrun-3f2b8c1d"
    assert run_name("2026-11-23/10-00-01") == "2026-11-23/torchrun-3f2b8c1d"  # a rank a second later
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")  # --rdzv_id job42: the user's own name is kept
    assert run_name("2026-11-23/10-00-00") == "job42"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    # A lone process: the time plus milliseconds and a short random id, so two launches never share a dir.
    lone = run_name("2026-11-23/10-00-00")
    assert re.fullmatch(r"2026-11-23/10-00-00\.\d{3}-[0-9a-f]{4}", lone) and run_name("2026-11-23/10-00-00") == lone


@pytest.mark.slow
def test_the_wheel_ships_configs_samples_and_the_command_and_runs_from_anywhere(tmp_path, repo):
    """pip builds a (non-editable) wheel; installed without the repo on the path, `glmtune` plans from /tmp."""
    # What a clean clone holds (the tracked files, as they are now), copied so that setuptools' build/ folder is not
    # left in the checkout: conf/ and data/samples*/ at the top level must land inside the wheel.
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (repo / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("glmtune-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "glmtune/conf/config.yaml",
        "glmtune/conf/hw/a100_40g.yaml",
        "glmtune/conf/model/glm4_9b_chat.yaml",
        "glmtune/conf/hydra/launcher/slurm.yaml",
        "glmtune/data/samples/train.jsonl",
        "glmtune/data/samples_vision/images/red_square.png",
    } <= names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "glmtune = glmtune.__main__:cli" in zipfile.ZipFile(wheel).read(entry_points).decode()
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [str(site / "bin" / "glmtune"), "mode=plan", "model=glm4_9b_chat", "+hw=a100_40g"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "memory plan: fits" in proc.stdout and not list(elsewhere.iterdir())
    where = subprocess.run(
        [sys.executable, "-c", "import glmtune; print(glmtune.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(site))  # the installed copy, not this checkout
    # The demo from there too (two steps of it): the bundled samples and the tiny model come from the wheel.
    demo = subprocess.run(
        [
            str(site / "bin" / "glmtune"),
            "train.max_steps=2",
            "probe.enabled=false",
            f"hydra.run.dir={tmp_path / 'demo'}",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert (tmp_path / "demo" / "adapter" / "adapter_config.json").exists()


# A venv without any extra has no `hydra_plugins` namespace at all: importing it fails, so find_spec of a
# plugin below it raises instead of returning None. The child process hides the namespace from its importer
# (the whole package, as a fresh quick-start venv has it) and runs the real command line.
_WITHOUT_PLUGINS = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "hydra_plugins" or name.startswith("hydra_plugins."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.argv = ["glmtune", *sys.argv[1:]]
from glmtune.__main__ import cli
cli()
"""


@pytest.mark.parametrize(
    "argv,package",
    [
        (["+hparams_search=lora_optuna"], "hydra-optuna-sweeper"),
        (["-m", "hydra/launcher=slurm", "lora.r=8,16"], "hydra-submitit-launcher"),
    ],
)
def test_without_any_hydra_plugin_an_extra_is_one_line_and_exit_2(argv, package, tmp_path, repo):
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PLUGINS, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "pip install" in proc.stderr and package in proc.stderr
    assert not list(tmp_path.iterdir())


def test_help_lists_every_exit_code_the_code_uses(capsys):
    from glmtune.config.cli import help_text
    from glmtune.launch.exits import EXIT_DIVERGED, EXIT_INTERRUPTED

    listed = {
        int(line.split()[0]) for line in help_text().split("exit codes:")[1].splitlines() if line[:3].strip().isdigit()
    }
    assert {0, 2, 3, 4, 5, 6, EXIT_INTERRUPTED, EXIT_DIVERGED, 9} <= listed
