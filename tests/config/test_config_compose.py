"""config/compose.py: a plain run composes its config once and gets exactly what hydra.main would have given it.

Both paths run in this process on the real conf/ folders: hydra.main (as before issue 32) and run_once. The
task function records the composed config and the whole Hydra config (task name, search path, overrides,
choices, run dir); a wrapper around Hydra's config loader counts compositions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from glmtune.config import CONF_DIR
from glmtune.config.cli import installed
from glmtune.config.compose import run_once

SEEN: list[tuple[dict, dict]] = []


def capture(cfg) -> None:
    hydra_cfg = OmegaConf.to_container(HydraConfig.get(), resolve=False)
    SEEN.append((OmegaConf.to_container(cfg, resolve=False), hydra_cfg))


@pytest.fixture
def compositions(monkeypatch) -> list[int]:
    count = [0]
    original = ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    return count


def both_paths(argv: list[str], monkeypatch) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    SEEN.clear()
    monkeypatch.setattr(sys, "argv", ["glmtune", *argv])
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(capture)()
    assert run_once(capture, argv, str(CONF_DIR))
    assert len(SEEN) == 2
    return SEEN[0], SEEN[1]


@pytest.mark.parametrize("extra", [[], ["train.learning_rate=3e-4", "lora=all_linear", "data.max_length=2048"]])
def test_plain_run_composes_once_as_hydra_main(tmp_path, monkeypatch, compositions, extra):
    monkeypatch.chdir(tmp_path)
    argv = ["mode=plan", "model=glm4_9b_chat", "+hw=a100_40g", f"hydra.run.dir={tmp_path / 'run'}", *extra]
    compositions[0] = 0
    (cfg_main, hydra_main), (cfg_once, hydra_once) = both_paths(argv, monkeypatch)
    assert compositions[0] == 3  # hydra.main: get_mode + run; run_once: run
    assert cfg_once == cfg_main
    # hydra.main adds `hydra.mode=RUN` to Hydra's own overrides when the config leaves the mode unset; run_once
    # lets Hydra.run set the mode instead (a config may ask for a sweep), so that record is all that differs.
    assert hydra_main["overrides"]["hydra"][-1] == "hydra.mode=RUN"
    hydra_main["overrides"]["hydra"].pop()
    assert hydra_once == hydra_main
    assert str(hydra_once["mode"]) == "RunMode.RUN" and hydra_once["job"]["name"] == "glmtune"


def test_config_dir_joins_the_search_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = tmp_path / "mine"
    (extra / "hw").mkdir(parents=True)
    (extra / "hw" / "my_card.yaml").write_text((CONF_DIR / "hw" / "a100_40g.yaml").read_text())
    argv = ["--config-dir", str(extra), "mode=plan", "+hw=my_card", f"hydra.run.dir={tmp_path / 'run'}"]
    (cfg_main, hydra_main), (cfg_once, hydra_once) = both_paths(argv, monkeypatch)
    hydra_main["overrides"]["hydra"].remove("hydra.mode=RUN")
    assert cfg_once == cfg_main and hydra_once == hydra_main
    assert hydra_once["runtime"]["choices"]["hw"] == "my_card"
    assert any(s["path"] == str(extra) for s in hydra_once["runtime"]["config_sources"])


@pytest.mark.parametrize(
    "argv", [["-m", "train.learning_rate=1e-4,2e-4"], ["--cfg", "job"], ["--info"], ["--config-name", "config"]]
)
def test_everything_but_a_plain_run_is_left_to_hydra_main(argv, compositions):
    assert run_once(capture, argv, str(CONF_DIR)) is False
    assert compositions[0] == 0


@pytest.mark.skipif(not installed("hydra_plugins.hydra_optuna_sweeper"), reason="needs the sweep extra")
def test_a_config_that_asks_for_a_sweep_is_left_to_hydra_main(tmp_path, monkeypatch, compositions):
    """+hparams_search=lora_optuna sets hydra.mode: MULTIRUN in its YAML: without `-m` it is still a sweep."""
    monkeypatch.chdir(tmp_path)
    SEEN.clear()
    assert (
        run_once(capture, ["+hparams_search=lora_optuna", f"hydra.sweep.dir={tmp_path / 's'}"], str(CONF_DIR)) is False
    )
    assert SEEN == [] and compositions[0] == 1


def test_the_command_composes_once(tmp_path):
    """Through `python -m glmtune`: the run dir gets the files hydra.main wrote before (config.yaml, overrides)."""
    import subprocess

    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "glmtune", "mode=plan", "model=glm4_9b_chat", "+hw=a100_40g", f"hydra.run.dir={run}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    overrides = OmegaConf.load(run / ".hydra" / "overrides.yaml")
    assert list(overrides) == ["mode=plan", "model=glm4_9b_chat", "+hw=a100_40g"]  # hydra.* are not the task's
    composed = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert composed.mode == "plan" and Path(run / "plan.json").is_file()
