"""mode=serve: an OpenAI-compatible HTTP server for base + adapter, loaded as mode=infer loads them.

    python -m glmtune mode=serve model=glm4_9b_chat model.path=/models/glm-4-9b-chat \\
        infer.adapter=outputs/.../adapter                       # http://127.0.0.1:8000/v1
    python -m glmtune mode=serve model.path=/models/glm-4-9b-mine serve.port=0   # a merged folder, any free port
    python -m glmtune mode=serve ... serve.host=0.0.0.0 serve.api_key='${oc.env:GLMTUNE_API_KEY}'

The port is bound before the weights load, so a port in use is one line (exit 2) instead of minutes of loading
first. One line says where the server listens and under which model name; Ctrl-C or SIGTERM stops it (exit 0):
requests in flight get up to GRACE_S to finish, then decoding stops at the next token.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import torch
import uvicorn

from ..config import ConfigError, RunConfig
from ..infer.generate import RESERVE, inference_dtype, load_merged, load_quantized_adapter, place
from ..infer.sampling import free_gpu_bytes
from ..models import load_config
from ..models.identity import check_adapter_base
from ..plan.estimate import GIB
from ..rundir.files import console
from .app import Service, make_app
from .engine import Engine

GRACE_S = 5  # seconds requests in flight may take to finish after Ctrl-C / SIGTERM


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: one the OS picks), or ConfigError saying what to change."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise ConfigError(f"serve.host={host}: not an address of this machine ({err.strerror}) — use 127.0.0.1 "
                          "or 0.0.0.0") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may bind while old sockets linger
    try:
        # bound now, listening once the model is loaded (asyncio's create_server calls listen): until then a
        # client is refused at once instead of waiting in the backlog for minutes
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        why = {errno.EADDRINUSE: "is in use by another process", errno.EACCES: "needs privileges (ports < 1024)",
               errno.EADDRNOTAVAIL: "is not an address of this machine"}.get(err.errno, err.strerror)
        raise ConfigError(f"serve.port={port} on serve.host={host} {why} — choose another serve.port "
                          "(0 = any free port)") from None
    return sock


def model_id(run: RunConfig, model_dir: Path) -> str:
    """The name clients pass as `model`: serve.model_name, else the model folder's (or preset's) + "-lora"."""
    if run.serve.model_name:
        return run.serve.model_name
    base = Path(model_dir).name if run.model.path else run.model.name
    return base + ("-lora" if run.infer.adapter else "")


def vllm_hint(installed: bool, weight_bytes: int, gpu_bytes: int | None, model_dir: Path, adapter: str | None,
              name: str) -> str | None:
    """One line on serving the same model with vLLM, when it is installed and the weights fit one GPU (90 %)."""
    if not installed or not gpu_bytes or weight_bytes > 0.9 * gpu_bytes:
        return None
    folder = "DIR" if adapter else str(model_dir)
    merge = f"merge first (mode=infer infer.adapter={adapter} infer.merge_to=DIR), then " if adapter else ""
    return (f"vLLM is installed and the model fits one GPU: for more throughput under load, {merge}"
            f"vllm serve {folder} --trust-remote-code --served-model-name {name}")


def load(run: RunConfig, model_dir: Path):
    """base + infer.adapter exactly as mode=infer loads them: merged and placed, or a quantized base beside it."""
    infer = run.infer
    if infer.adapter:
        check_adapter_base(infer.adapter, model_dir, load_config(model_dir))
    if run.model.quantize != "none":
        return load_quantized_adapter(model_dir, infer.adapter, run.model, inference_dtype())[0]
    return place(load_merged(model_dir, infer.adapter, run.model, inference_dtype()), infer.gpus,
                 run.hw.memory_gib)[0]


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
    sock = listen(cfg.host, cfg.port)
    images_dir = Path(tempfile.mkdtemp(prefix="glmtune-serve-images-"))
    engine = None
    try:
        model = load(run, model_dir)
        name = model_id(run, model_dir)
        engine = Engine(model, tokenizer, cfg.max_batch, free_bytes(run.hw.memory_gib), run.infer.max_new_tokens)
        port = sock.getsockname()[1]
        where = "every interface" if cfg.host in ("0.0.0.0", "::") else "this machine only"
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host  # an IPv6 address in a URL
        line = (f"glmtune serve: http://{host}:{port}/v1 ({where}) — model \"{name}\" = {model_dir}"
                + (f" + adapter {run.infer.adapter}" if run.infer.adapter else "")
                + ("; API key required" if cfg.api_key else "") + "; Ctrl-C stops")
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        gpu = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        hint = vllm_hint(importlib.util.find_spec("vllm") is not None, weights, gpu, model_dir, run.infer.adapter,
                         name)
        service = Service(engine, name, cfg.api_key, run.infer, images_dir)
        server = QuietServer(uvicorn.Config(make_app(service), log_config=None, lifespan="off", ws="none",
                                            timeout_graceful_shutdown=GRACE_S), [line] + ([hint] if hint else []))
        engine.start()
        server.run(sockets=[sock])
    finally:
        if engine is not None:
            engine.stop()
        sock.close()
        shutil.rmtree(images_dir, ignore_errors=True)
    how = f" by {server.stopped_by}" if server.stopped_by else ""
    console.print(f"glmtune serve: stopped{how} after {engine.batches} batches; the log is in {run_dir}",
                  markup=False)


class QuietServer(uvicorn.Server):
    """uvicorn's server that prints glmtune's start line once it listens, and takes Ctrl-C / SIGTERM as the normal
    way to stop: uvicorn re-raises the signal after shutting down (so that a default handler ends the process),
    where glmtune's own handler would report an interrupted run (exit 7)."""

    def __init__(self, config: uvicorn.Config, lines: list[str]):
        super().__init__(config)
        self.lines, self.stopped_by = lines, None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            for line in self.lines:
                console.print(line, markup=False)

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
