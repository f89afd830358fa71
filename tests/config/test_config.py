"""Every file in conf/ composes and validates; `+hw=` precedence; unknown keys and wrong types are named."""

import pytest
from helpers import REPO
from helpers.cli import composed

from glmtune.config import ConfigError, RunConfig, parse_config

CONF = REPO / "conf"
GROUPS = ["model", "data", "lora", "dist", "train"]


def test_defaults_compose_and_validate():
    run = parse_config(composed())
    assert isinstance(run, RunConfig)
    assert run.model.name == "glm4_tiny" and run.data.max_length == 500
    assert (run.lora.r, run.lora.alpha, run.lora.dropout, run.lora.target_modules) == (8, 32, 0.1, ["query_key_value"])
    assert run.train.learning_rate == 5e-4 and run.hw.name == "local"


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))])
def test_every_group_option_composes_and_validates(group, option):
    run = parse_config(composed([f"{group}={option}"]))
    assert run is not None


@pytest.mark.parametrize("card", sorted(p.stem for p in (CONF / "hw").glob("*.yaml")))
def test_every_hw_preset_composes_and_validates(card):
    run = parse_config(composed([f"+hw={card}"]))
    assert run.hw.name == card and run.hw.memory_gib > 0


def test_hw_preset_beats_main_config_and_command_line_beats_both():
    main = composed()
    assert main["hw"]["memory_gib"] is None and main["hw"]["bf16"] is True
    preset = composed(["+hw=v100_32g"])
    assert preset["hw"]["memory_gib"] == 31.7 and preset["hw"]["bf16"] is False  # preset over conf/config.yaml
    both = composed(["+hw=v100_32g", "hw.memory_gib=20"])
    assert both["hw"]["memory_gib"] == 20 and both["hw"]["bf16"] is False  # command line over the preset
    # order on the command line does not matter: key=value overrides are applied after the defaults list
    assert composed(["hw.memory_gib=20", "+hw=v100_32g"])["hw"]["memory_gib"] == 20


def test_budget_without_a_preset():
    assert parse_config(composed(["hw.memory_gib=12.5"])).hw.memory_gib == 12.5


def test_unknown_keys_and_wrong_types_are_all_named_in_one_message():
    raw = composed(["+train.lrr=0.1", "+lora.rank=4", "train.max_steps=ten", "lora.dropout=2.0", "mode=fly"])
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    msg = str(err.value)
    assert "\n" not in msg
    assert "unknown key 'train.lrr'" in msg and "learning_rate" in msg  # valid keys are listed
    assert "unknown key 'lora.rank'" in msg and "target_modules" in msg
    assert "train.max_steps must be int, got 'ten'" in msg


def test_bad_values_are_all_named():
    with pytest.raises(ConfigError) as err:
        parse_config(composed(["lora.dropout=2.0", "mode=fly", "train.per_device_batch_size=0", "dist.strategy=fsdp"]))
    msg = str(err.value)
    for needle in ("lora.dropout", "mode='fly'", "train.per_device_batch_size", "dist.strategy='fsdp'"):
        assert needle in msg


def test_unknown_lora_target_is_a_config_error_naming_the_valid_layers():
    with pytest.raises(ConfigError, match="'no_such_layer'.*query_key_value, dense, dense_h_to_4h"):
        parse_config(composed(["lora.target_modules=[query_key_value,no_such_layer]"]))


def test_command_line_typo_exits_2_naming_the_valid_keys(tmp_path, repo):
    from helpers.cli import glmtune_in_process

    proc = glmtune_in_process(
        "train.lrr=1", "+lora.rank=4", "+hw=a100_40g", "hw.memory_gib=30", f"hydra.run.dir={tmp_path / 'r'}", cwd=repo
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line
    assert "unknown key 'train.lrr'" in line and "learning_rate" in line
    assert "unknown key 'lora.rank'" in line and "target_modules" in line
    assert "hw.memory_gib" not in line and not (tmp_path / "r").exists()  # stopped before Hydra made the run dir


def test_a_negative_max_steps_is_said_once_and_absurd_memory_sizes_are_refused():
    with pytest.raises(ConfigError) as err:
        parse_config(composed(["train.max_steps=-5", "hw.host_memory_gib=1e300", "hw.memory_gib=1e300"]))
    message = str(err.value)
    assert message.count("train.max_steps must be >= 0") == 1, message
    assert "hw.host_memory_gib must be <= 1048576" in message and "hw.memory_gib must be <= 16384" in message


@pytest.mark.parametrize(
    "overrides,val_file",
    [
        ([], "data/samples/val.jsonl"),  # the demo evaluates on the bundled val set
        (["data=samples_vision", "model=glm4v_tiny"], "data/samples_vision/val.jsonl"),
        (["data.train_file=my/train.jsonl"], None),  # a user's own train file: their val set or none
        (["data.train_file=[a.jsonl,b.jsonl]", "data.mix=[3,1]"], None),
        (["data=samples_vision", "data.train_file=my/images.jsonl"], None),
        (["data.train_file=my/train.jsonl", "data.val_file=my/dev.jsonl"], "my/dev.jsonl"),
        (["data.train_file=my/train.jsonl", "data.val_size=0.1"], None),  # held out of their file, no conflict
        (["data.val_size=5"], None),  # the demo's own held-out split, without data.val_file=null
        (["data.val_file=null"], None),
        # named explicitly, the bundled file is the user's choice
        (["data.train_file=my/train.jsonl", "data.val_file=data/samples/val.jsonl"], "data/samples/val.jsonl"),
    ],
)
def test_the_bundled_val_set_pairs_only_with_the_bundled_train_set(overrides, val_file):
    run = parse_config(composed(overrides))
    assert run.data.val_file == val_file
