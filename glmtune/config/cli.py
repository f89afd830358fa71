"""The command line before Hydra sees it: --help, --version, and checks of group choices and extras.

Hydra reports a wrong group option, `hw=` without its `+` or a sweeper plugin that is not installed as a
multi-line error with exit code 1. These checks read the same conf/ folders Hydra composes from and stop
with one line and exit code 2 instead, naming the valid options or the pip command to run.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

from .. import __version__
from ..launch.exits import EXIT_CODES
from .schema import CONF_DIR, MODES
from .validate import ConfigError

# Groups chosen in conf/config.yaml's defaults list (`model=x`), and groups appended to it (`+hw=x`).
DEFAULT_GROUPS = ("model", "data", "lora", "dist", "train")
APPENDED_GROUPS = ("hw", "hparams_search")
# Hydra plugin groups glmtune ships presets for: option -> (plugin module, extra, what it is).
PLUGINS = {
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "sweep", "the Optuna sweeper"),
    ("hparams_search", "lora_optuna"): ("hydra_plugins.hydra_optuna_sweeper", "sweep", "the Optuna sweeper"),
    ("hydra/launcher", "slurm"): ("hydra_plugins.hydra_submitit_launcher", "slurm", "the SLURM launcher"),
    ("hydra/launcher", "submitit_slurm"): ("hydra_plugins.hydra_submitit_launcher", "slurm", "the SLURM launcher"),
}
MODE_HELP = {
    "train": "plan, probe, then fine-tune; the adapter and metrics go to the run dir (default)",
    "plan": "the memory plan only, no weights or GPU needed; writes nothing unless hydra.run.dir=DIR is given "
    'or plan.emit=trainjob (a Kubernetes TrainJob for the plan: README "Run on Kubernetes")',
    "probe": "plan, then a few real optimizer steps that measure the peak; no training",
    "chat": "talk to base + infer.adapter in the terminal (/reset, /exit); infer.prompt=... answers once",
    "infer": "generate for infer.prompts_file with the base model + infer.adapter (or merge: infer.merge_to=DIR)",
    "serve": "an OpenAI-compatible HTTP server for base + infer.adapter (serve.host, serve.port, serve.api_key)",
}


def installed(module: str) -> bool:
    """Whether `module` can be imported. find_spec imports the parents first and raises when one is missing
    (a venv without any Hydra plugin has no `hydra_plugins` namespace at all), or when a parent is broken."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ModuleNotFoundError is an ImportError; ValueError: __spec__ is None
        return False


def options(group: str, extra: tuple[Path, ...] = ()) -> list[str]:
    """The presets of a group: conf/'s and those of each `--config-dir DIR` (Hydra searches both)."""
    return sorted({p.stem for folder in (CONF_DIR, *extra) for p in (folder / group).glob("*.yaml")})


def config_dirs(argv: list[str]) -> tuple[Path, ...]:
    """The folders given with Hydra's --config-dir DIR / --config-dir=DIR / -cd DIR."""
    found = []
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--config-dir="):
            found.append(arg.split("=", 1)[1])
    return tuple(Path(d).expanduser() for d in found)


def extra_install(extra: str) -> str:
    """`pip install ...` for one of glmtune's extras, from the installed package's own metadata."""
    try:
        reqs = [r.split(";")[0].strip() for r in requires("glmtune") or () if f'extra == "{extra}"' in r]
    except PackageNotFoundError:
        reqs = []
    return (
        f"pip install {' '.join(repr(r) if '<' in r or '>' in r else r for r in reqs)}"
        if reqs
        else f'pip install "glmtune[{extra}]"'
    )


def _values(override) -> list[str]:
    """The option names an override selects: one, or each of a comma sweep (`model=a,b`)."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type == ValueType.ELEMENT:
        return [override.get_value_element_as_str()]
    if override.value_type in (ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP):
        return [str(v) for v in override.sweep_string_iterator()]
    return []  # glob(...), range(...), interval(...): left to Hydra


def check_command_line(argv: list[str]) -> None:
    """Raise ConfigError naming every bad group choice, misplaced `+` and missing plugin on the command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    extra = config_dirs(argv)
    missing = [str(d) for d in extra if not d.is_dir()]
    if missing:
        raise ConfigError(
            f"invalid command line: --config-dir {', '.join(missing)} is not a folder — give a folder "
            "holding group folders such as hw/, model/, data/, lora/"
        )
    args = [a for a in argv if "=" in a and not a.startswith("-") and Path(a).expanduser() not in extra]
    parser = OverridesParser.create()
    problems = []
    parsed = []
    for arg in args:
        try:
            parsed += parser.parse_overrides([arg])
        except OverrideParseException as err:
            detail = " ".join(str(err).split())
            problems.append(f"cannot parse '{arg}' ({detail})")
    for o in parsed:
        group, plus = o.key_or_group, o.is_add() and not o.is_force_add()
        if o.is_delete():
            continue
        if group in DEFAULT_GROUPS and plus:
            problems.append(
                f"'+{group}=' adds a group that is already chosen: write {group}={o.input_line.split('=', 1)[1]}"
            )
            continue
        if group in APPENDED_GROUPS and not (o.is_add() or o.is_force_add()):
            problems.append(f"{group} is not in the defaults list, so it needs a '+': write +{o.input_line}")
            continue
        if group in DEFAULT_GROUPS + APPENDED_GROUPS:
            valid = options(group, extra)
            for value in _values(o):
                if value not in valid and value != "null":
                    problems.append(f"unknown {group} '{value}' (options: {', '.join(valid)})")
        for value in _values(o):
            plugin = PLUGINS.get((group, value))
            if plugin and not installed(plugin[0]):
                problems.append(
                    f"{group}={value} needs {plugin[2]}, which is not installed: {extra_install(plugin[1])}"
                )
    if problems:
        raise ConfigError("invalid command line: " + "; ".join(problems))


def is_multirun(argv: list[str]) -> bool:
    return any(
        a in ("-m", "--multirun") or a.lstrip("+").startswith("hparams_search=") or a.startswith("hydra.mode=MULTIRUN")
        for a in argv
    )


def chosen_mode(argv: list[str]) -> str:
    """The mode the command line selects (the last `mode=` wins, as in Hydra); train when none."""
    modes = [a.split("=", 1)[1] for a in argv if re.match(r"^\+{0,2}mode=", a)]
    return modes[-1] if modes else "train"


def emits(argv: list[str]) -> bool:
    """Whether mode=plan is asked for cluster objects (plan.emit=...): they need a run dir that stays."""
    values = [a.split("=", 1)[1] for a in argv if re.match(r"^\+{0,2}plan\.emit=", a)]
    return bool(values) and values[-1] not in ("null", "")


def wants_info(argv: list[str]) -> str | None:
    """The text for --help / -h or --version, printed instead of running; None for anything else."""
    if "--version" in argv:
        return version_text()
    if "--help" in argv or "-h" in argv:
        return help_text()
    return None


def installed_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    stack = ", ".join(
        f"{name} {installed_version(name)}" for name in ("torch", "transformers", "peft", "deepspeed", "hydra-core")
    )
    return f"glmtune {__version__} ({stack})"


def _wrap(label: str, text: str, width: int = 100) -> str:
    return textwrap.fill(
        text,
        width,
        initial_indent=f"  {label:<17}",
        subsequent_indent=" " * 19,
        break_on_hyphens=False,
        break_long_words=False,
    )


def help_text() -> str:
    import dataclasses

    from .schema import RunConfig

    lines = [
        "usage: glmtune [+hw=CARD] [group=option ...] [key=value ...]",
        "       glmtune -m key=a,b [key=c,d ...]      a sweep: one run per combination (Hydra multirun)",
        "       glmtune --version | --help | --cfg job  (--cfg job prints the composed config and exits)",
        "       glmtune --config-dir DIR ...          DIR/<group>/NAME.yaml become presets of every group",
        "       python -m glmtune ...                 the same command",
        "",
        "LoRA fine-tuning of GLM-4-9B-chat, GLM-4V-9B and ChatGLM3-6B that plans GPU memory before it loads",
        "any weights, measures it with a short probe, then trains with the HF Trainer (+ DeepSpeed ZeRO-3).",
        "",
        "modes (mode=NAME):",
    ]
    lines += [_wrap(m, MODE_HELP[m]) for m in MODES]
    lines += ["", "config groups (group=option; the first is the default):"]
    defaults = {"model": "glm4_tiny", "data": "samples", "lora": "default", "dist": "auto", "train": "default"}
    for group in DEFAULT_GROUPS:
        opts = options(group)
        opts.remove(defaults[group])
        lines.append(_wrap(f"{group}=", ", ".join([defaults[group], *opts])))
    lines.append(
        _wrap(
            "+hw=",
            ", ".join(options("hw")) + ". The card to plan for. hw is not in the defaults "
            "list, so write it with a '+': +hw=a100_40g. Without it the plan uses the GPU this process "
            "sees (no budget on CPU); hw.memory_gib=GiB alone sets a budget.",
        )
    )
    lines.append(
        _wrap(
            "+hparams_search=",
            ", ".join(options("hparams_search")) + f": Bayesian LoRA search with Optuna ({extra_install('sweep')})",
        )
    )
    lines.append(_wrap("hydra/launcher=", f"slurm: every run a SLURM job ({extra_install('slurm')})"))
    lines += ["", "options (key=value; see the YAML files under conf/ for defaults and trade-offs):"]
    for group in dataclasses.fields(RunConfig):
        if group.name != "mode":
            keys = ", ".join(f"{group.name}.{f.name}" for f in dataclasses.fields(group.default_factory()))
            lines.append(_wrap(group.name, keys))
    lines += [
        "",
        "precedence: group defaults < conf/config.yaml < the +hw= preset < key=value on the command line",
        "",
        "examples:",
        "  glmtune                                        tiny built-in model on the bundled samples (CPU, ~1 min)",
        "  glmtune mode=plan model=glm4_9b_chat +hw=a100_40g          the memory plan for a 9B model, no weights",
        "  glmtune model=glm4_9b_chat model.path=/models/glm-4-9b-chat +hw=a100_40g \\",
        "          data.train_file=my/train.jsonl data.val_file=my/dev.jsonl train.num_epochs=3",
        "  scripts/torchrun.sh 4 +hw=rtx4090_24g model=glm4_9b_chat model.path=...   4 GPUs (torchrun)",
        "  glmtune -m lora.r=8,16 train.learning_rate=1e-4,5e-4                 a grid sweep",
        "  glmtune mode=infer infer.adapter=outputs/.../adapter infer.prompts_file=prompts.jsonl",
        "",
        "exit codes:",
    ]
    lines += [
        textwrap.fill(
            what,
            100,
            initial_indent=f"  {code}  ",
            subsequent_indent=" " * 5,
            break_on_hyphens=False,
            break_long_words=False,
        )
        for code, what in EXIT_CODES.items()
    ]
    lines += [
        "",
        "Run dirs: outputs/DATE/TIME.mmm-ID (hydra.run.dir=DIR to choose); README.md lists every file in them.",
        "Resume: the same command continues the newest unfinished run of the same config under ./outputs",
        "(train.resume=restart starts a new one); scripts/torchrun.sh and scripts/deepspeed_launch.sh too.",
        "Launchers: scripts/torchrun.sh, torchrun_multinode.sh and deepspeed_launch.sh exit with the ranks' code",
        "and line, once (PYTHON=<venv>/bin/python needs no activated venv). Plain `torchrun -m glmtune` runs the",
        "same ranks, but exits 1 with its own ChildFailedError report on any failure, and on SIGTERM/Ctrl-C with a",
        "SignalException traceback after the ranks saved (re-running still resumes).",
    ]
    return "\n".join(lines)
