"""The `model` config group: which checkpoint folder a preset name means.

Released models (glm4_9b_chat, glm4v_9b, chatglm3_6b; glm4_9b_0414, glm4_32b_0414, glmz1_9b_0414,
glmz1_32b_0414) need `model.path` to train, and nothing to plan: their architecture is built in.
The tiny presets are random checkpoints glmtune writes itself, once, into a cache folder ($GLMTUNE_CACHE, default ~/.cache/glmtune), so a fresh clone runs with no download.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..config import ConfigError, ModelConfig
from .chatglm.configuration import RELEASED as RELEASED_CHATGLM
from .chatglm.configuration import GLMConfig
from .chatglm.configuration import released_config as released_chatglm
from .glm4_0414.configuration import RELEASED as RELEASED_0414
from .glm4_0414.configuration import released_config as released_0414
from .loading import load_config, make_tiny_checkpoint, tiny_recipe

TINY = {"glm4_tiny": "glm4", "chatglm3_tiny": "chatglm3", "glm4v_tiny": "glm4v", "glm4_0414_tiny": "glm4_0414"}
RELEASED = sorted([*RELEASED_CHATGLM, *RELEASED_0414])
KNOWN = sorted([*RELEASED, *TINY])


def released_config(name: str):
    """Architecture of a released model by preset name (either family), without any download."""
    return released_0414(name) if name in RELEASED_0414 else released_chatglm(name)


def cache_root() -> Path:
    return Path(os.environ.get("GLMTUNE_CACHE", Path.home() / ".cache" / "glmtune"))


def ensure_tiny(family: str) -> Path:
    """Build the tiny checkpoint once; a changed architecture gets a new folder (hash in the name)."""
    # The tokenizer sources (tokenization*.py, and tokenizer_files.py with the tiny corpus) are part of what the
    # tiny checkpoint depends on.
    here = Path(__file__).parent
    sources = [
        p.read_text()
        for p in sorted([*here.glob("tokeni*.py"), *here.glob("*/tokeni*.py"), here / "glm4_0414" / "tiny.py"])
    ]
    recipe = json.dumps([*tiny_recipe(family), sources], sort_keys=True)
    target = cache_root() / f"tiny-{family}-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"
    if (target / "model.safetensors").is_file():
        return target
    # Build beside the target and rename, so concurrent ranks never read a half-written folder.
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    make_tiny_checkpoint(tmp, family=family)
    plain_modes(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def plain_modes(folder: Path) -> None:
    """The modes plain open() gives (0644 under umask 022): safetensors writes 0600, which leaves the weights
    unreadable to the group that shares the cache."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)


def resolve_model_dir(cfg: ModelConfig) -> Path:
    """Folder to load for training; a clear ConfigError when there is none."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.path={cfg.path}: no config.json in that folder — point model.path at the "
                "downloaded checkpoint folder (config.json, *.safetensors, tokenizer.model)"
            )
        return path
    if cfg.name in TINY:
        return ensure_tiny(TINY[cfg.name])
    raise ConfigError(
        f"model={cfg.name} needs its weights to train: download the checkpoint and pass "
        f"model.path=/path/to/it (mode=plan works without)"
    )


def arch_config(cfg: ModelConfig) -> GLMConfig:
    """Architecture without weights: from model.path's config.json, the built-in facts, or the tiny model."""
    if cfg.path:
        return load_config(resolve_model_dir(cfg))
    if cfg.name in RELEASED:
        return released_config(cfg.name)
    if cfg.name in TINY:
        return load_config(ensure_tiny(TINY[cfg.name]))
    raise ConfigError(
        f"model.name={cfg.name!r} is not a known preset ({', '.join(KNOWN)}) and model.path is not "
        "set — set model.path to a checkpoint folder"
    )
