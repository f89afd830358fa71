"""Typed run configuration, validated once: `parse_config` turns the composed Hydra config into the dataclasses
of schema.py, checked key by key for type here and value by value in values.py.

`python -m glmtune` composes `conf/` with Hydra and hands the plain dict to `parse_config`. Every unknown key,
wrong type and bad value is collected into one `ConfigError`, so a user fixes a config in one pass instead of
one error per run. Only `glmtune/__main__.py` imports Hydra; everything below it receives these objects.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from .schema import GROUPS, RunConfig
from .values import check_values


class ConfigError(ValueError):
    """Bad configuration or input: reported as one line, exit code 2, no traceback."""


def read_json_object(file: Path, shown: str, fix: str) -> dict[str, Any]:
    """The JSON object a file the config names holds (the user's DeepSpeed config, a checkpoint's config.json);
    a file that cannot be read, is not JSON or holds no object is one ConfigError line: `shown`, what, then `fix`."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{shown}:{err.lineno}: invalid JSON: {err.msg} (column {err.colno}) — {fix}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{shown}: cannot read ({err}) — {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{shown}: holds a JSON {type(data).__name__}, not an object — {fix}")
    return data


def parse_config(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a plain (resolved) dict, reporting every problem at once."""
    problems: list[str] = []
    cfg = _build(RunConfig, raw, "", problems)
    if not problems:
        problems += check_values(cfg)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
    return cfg


def check_override_keys(argv: list[str]) -> None:
    """Reject command-line `key=value` overrides whose key the schema does not have, before Hydra sees them.

    Hydra's own message for `train.lrr=1` is a multi-line error with exit code 1 that names no valid key;
    this one names every unknown key and the valid keys beside it, as parse_config does for YAML."""
    problems = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in GROUPS:  # group options: glmtune.config.cli.check_command_line names the valid ones
            continue
        if key.startswith(("hydra.", "hydra/")) or key == "hydra":
            continue
        cls, parts = RunConfig, key.split(".")
        for i, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(cls)]
            if part not in names:
                where = ".".join(parts[:i]) or "<root>"
                problems.append(f"unknown key '{key}' (valid keys under {where}: {', '.join(names)})")
                break
            hint = typing.get_type_hints(cls)[part]
            if not dataclasses.is_dataclass(hint):
                break
            cls = hint
    if problems:
        raise ConfigError("invalid command line: " + "; ".join(problems))


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    where = prefix.rstrip(".") or "<root>"
    if not isinstance(raw, dict):
        problems.append(f"{where} must be a mapping, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            problems.append(f"unknown key '{prefix}{key}' (valid keys under {where}: {', '.join(names)})")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        kwargs[name] = _coerce(hints[name], raw[name], prefix + name, problems)
    return cls(**{k: v for k, v in kwargs.items() if v is not _BAD})


_BAD = object()


def _coerce(hint: Any, value: Any, key: str, problems: list[str]) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".", problems)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key} must be a list, got {value!r}")
            return _BAD
        return [_coerce(args[0], v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        problems.append(f"{key} must be {hint.__name__}, got {value!r}")
        return _BAD
    return value
