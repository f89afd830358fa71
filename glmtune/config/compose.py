"""Compose once for a plain run: Hydra's own run of one job, without the composition that only asks for the mode.

`hydra.main` (hydra-core 1.3.8, `_internal/utils.py: _run_hydra`) composes the whole config twice before a
single run: `Hydra.get_mode` composes it as a multirun to read `hydra.mode`, then `Hydra.run` composes it again
to run. glmtune's command line already says whether it is a multirun (`cli.is_multirun`), so the first one is
waste: 0.5-0.6 s of `mode=plan`'s ~4 s on a 2-core VM, which is the whole point of an "instant" plan
(`bench/plan_import.py`). A plain run is handed to the same `Hydra.run` hydra.main would call, with the same
task name and search path (`--config-dir` included). Everything else (`-m`, a config that sets
`hydra.mode: MULTIRUN` such as `+hparams_search=`, --cfg, --info, --hydra-help, shell completion,
--experimental-rerun, --config-path/--config-name) still goes through `hydra.main`, unchanged.

Hydra's `_internal` helpers are used on purpose: they are what hydra.main itself runs, so a run composed here
gets the same run dir, logging, `.hydra/` files and HydraConfig as before. The version is pinned in
pyproject.toml; tests/config/test_config_compose.py compares both paths' composed configs and Hydra settings.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from omegaconf import DictConfig

CONFIG_NAME = "config"


def run_once(task_function: Callable[[DictConfig], Any], argv: list[str], config_path: str) -> bool:
    """Run `task_function` as hydra.main would for a plain run, composing the config once.

    `task_function` is the undecorated function (`main.__wrapped__`); returns False, running nothing, when the
    command line asks for anything but a plain run, so the caller hands it to hydra.main.
    """
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        detect_task_name,
        get_args_parser,
    )
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    args = get_args_parser().parse_args(argv)
    special = (
        args.multirun,
        args.cfg,
        args.info,
        args.help,
        args.hydra_help,
        args.shell_completion,
        args.experimental_rerun,
        args.resolve,
        args.config_path,
        args.config_name,
        args.package,
    )
    if any(v not in (None, False) for v in special):
        return False
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
    if args.config_dir is not None:  # cli.check_command_line has checked it is a folder
        search_path.prepend(
            provider="command-line",
            path=f"file://{os.path.abspath(args.config_dir)}",
            anchor=SearchPathQuery(provider="schema"),
        )
    hydra = Hydra.create_main_hydra2(
        task_name=detect_task_name(calling_file, calling_module), config_search_path=search_path
    )
    entered = []

    def task(cfg: DictConfig) -> Any:
        entered.append(True)
        return task_function(cfg)

    try:
        # No `hydra.mode=RUN` override (hydra.main adds one when the config leaves the mode unset): a config that
        # sets MULTIRUN (+hparams_search=..., or a user's group) must stay a sweep. Hydra.run sets RUN itself
        # when the mode is unset, and asserts it is RUN before running anything, so a config that asks for a
        # sweep without `-m` ends here, the task unrun, and goes to hydra.main.
        hydra.run(config_name=CONFIG_NAME, task_function=task, overrides=list(args.overrides))
    except AssertionError:
        if entered:
            raise  # raised by the run itself, not by Hydra's mode check
        return False
    finally:
        GlobalHydra.instance().clear()
    return True
