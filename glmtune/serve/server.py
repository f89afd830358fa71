"""mode=serve: an OpenAI-compatible HTTP server for base + adapter, loaded as mode=infer loads them.

    python -m glmtune mode=serve model=glm4_9b_chat model.path=/models/glm-4-9b-chat \\
        infer.adapter=outputs/.../adapter                       # http://127.0.0.1:8000/v1
    python -m glmtune mode=serve model.path=/models/glm-4-9b-mine serve.port=0   # a merged folder, any free port
    python -m glmtune mode=serve ... serve.host=0.0.0.0 serve.api_key='${oc.env:GLMTUNE_API_KEY}'

The port is held (port.py) before the weights load, so a port in use is one line (exit 2) instead of minutes of
loading first; while they load it answers 503. One line says where the server listens and under which model
name. Ctrl-C or SIGTERM stops it (exit 0): requests in flight get serve.stop_grace_s to finish, then decoding
stops at the next token and every unfinished reply ends with a 503 error (a stream: an error event and
[DONE]) before the connections close.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
from pathlib import Path

import torch
import uvicorn

from ..config import RunConfig
from ..config.units import MIB
from ..infer.generate import RESERVE, inference_dtype, load_merged, load_quantized_adapter, place
from ..infer.sampling import free_gpu_bytes
from ..launch.console import console
from ..models import load_config
from ..models.identity import check_adapter_base
from .app import Service, make_app
from .engine import Engine
from .guard import Hosts
from .port import Loading, listen

# Seconds past serve.stop_grace_s that the replies cut by the stop get to reach their clients before uvicorn
# cancels what is left (a generation step that is still running, a client that reads nothing).
CLOSE_S = 10


def model_id(run: RunConfig, model_dir: Path) -> str:
    """The name clients pass as `model`: serve.model_name, else the model folder's (or preset's) + "-lora"."""
    if run.serve.model_name:
        return run.serve.model_name
    base = Path(model_dir).name if run.model.path else run.model.name
    return base + ("-lora" if run.infer.adapter else "")


def vllm_hint(installed: bool, weight_bytes: int, gpu_bytes: int | None, adapter: str | None, name: str) -> str | None:
    """One line on serving the same model with vLLM, when it is installed and the weights fit one GPU (90 %)."""
    if not installed or not gpu_bytes or weight_bytes > 0.9 * gpu_bytes:
        return None
    adapter_arg = f" infer.adapter={adapter}" if adapter else ""
    # An export, not the base folder: the official folders' tokenizer needs their remote code, an export ships
    # tokenizer.json, the stop ids and the chat template, and SERVE.md holds the exact command (infer/serve_command.py).
    return (
        f"vLLM is installed and the model fits one GPU: for more throughput under load, export it "
        f"(mode=infer{adapter_arg} infer.merge_to=DIR) and run the `vllm serve` command it prints "
        f"(DIR/SERVE.md), with --served-model-name {name}"
    )


def load(run: RunConfig, model_dir: Path):
    """base + infer.adapter exactly as mode=infer loads them: merged and placed, or a quantized base beside it."""
    infer = run.infer
    if infer.adapter:
        check_adapter_base(infer.adapter, model_dir, load_config(model_dir))
    if run.model.quantize != "none":
        return load_quantized_adapter(model_dir, infer.adapter, run.model, inference_dtype())[0]
    return place(load_merged(model_dir, infer.adapter, run.model, inference_dtype()), infer.gpus, run.hw.memory_gib)[0]


def free_bytes(memory_gib: float | None) -> int | None:
    """Bytes the KV caches may take: free GPU memory after the weights, or available host RAM; minus RESERVE."""
    free = free_gpu_bytes(memory_gib, RESERVE)
    if free is not None:
        return free
    try:
        import psutil
    except ImportError:
        return None
    return max(0, psutil.virtual_memory().available - RESERVE)


def run_serve(run: RunConfig, model_dir: Path, tokenizer, run_dir: Path) -> None:
    cfg = run.serve
    sock = listen(cfg)
    engine = server = None
    try:
        with Loading(sock):
            model = load(run, model_dir)
            name = model_id(run, model_dir)
            engine = Engine(model, tokenizer, cfg.max_batch, free_bytes(run.hw.memory_gib), run.infer.max_new_tokens)
            engine.start()
        port = sock.getsockname()[1]
        where = (
            "this machine only"
            if cfg.host in ("127.0.0.1", "localhost", "::1")
            else "every interface"
            if cfg.host in ("0.0.0.0", "::")
            else cfg.host
        )
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host  # an IPv6 address in a URL
        line = (
            f'glmtune serve: http://{host}:{port}/v1 ({where}) — model "{name}" = {model_dir}'
            + (f" + adapter {run.infer.adapter}" if run.infer.adapter else "")
            + ("; API key required" if cfg.api_key else "")
            + "; Ctrl-C stops"
        )
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        hint = vllm_hint(importlib.util.find_spec("vllm") is not None, weights, gpu, run.infer.adapter, name)
        service = Service(engine, name, cfg.api_key, run.infer, int(cfg.max_body_mib * MIB))
        app = make_app(service, Hosts.for_bind(cfg.host, cfg.allow_hosts), cfg.allow_origins)
        server = QuietServer(
            uvicorn.Config(
                app, log_config=None, lifespan="off", ws="none", timeout_graceful_shutdown=cfg.stop_grace_s + CLOSE_S
            ),
            [line] + ([hint] if hint else []),
            engine,
            cfg.stop_grace_s,
        )
        server.run(sockets=[sock])
    finally:
        if engine is not None:
            engine.stop()
        sock.close()
    how = f" by {server.stopped_by}" if server.stopped_by else ""
    console.print(f"glmtune serve: stopped{how} after {engine.batches} batches; the log is in {run_dir}", markup=False)


class QuietServer(uvicorn.Server):
    """uvicorn's server that prints glmtune's start line once it listens, and takes Ctrl-C / SIGTERM as the normal
    way to stop: uvicorn re-raises the signal after shutting down (so that a default handler ends the process),
    where glmtune's own handler would report an interrupted run (exit 7). At the stop, the engine is halted once
    the grace is over, so that every open reply ends with its error (a stream: an error event and [DONE]) and
    its connection closes, instead of being cancelled mid-write by uvicorn (a traceback, a cut stream)."""

    def __init__(self, config: uvicorn.Config, lines: list[str], engine: Engine, grace_s: float):
        super().__init__(config)
        self.lines, self.engine, self.grace_s, self.stopped_by = lines, engine, grace_s, None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            for line in self.lines:
                console.print(line, markup=False)

    async def shutdown(self, sockets=None) -> None:
        halt = asyncio.get_running_loop().call_later(self.grace_s, self.engine.halt)
        try:
            await super().shutdown(sockets)
        finally:
            halt.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, sig, frame) -> None:
        self.stopped_by = self.stopped_by or signal.Signals(sig).name
        self.handle_exit(sig, frame)  # a second Ctrl-C forces the exit, as in uvicorn
