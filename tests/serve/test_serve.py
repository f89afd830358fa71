"""mode=serve as a user runs it: `python -m glmtune mode=serve ...` in a real process on a free port, talked to with
the official `openai` client and httpx. The tiny model + an adapter answer exactly as mode=infer does (greedy),
streamed or not, alone or concurrently, with tools and tool results; a tiny model built to always call a tool
returns the call in OpenAI's `tool_calls` shape; GLM-4V takes an image part; bad requests get OpenAI-style 4xx
errors; SIGTERM and Ctrl-C stop the server with exit 0.

Issue 39, on the same module server (started twice at the same instant on one port: one serves, the other exits 2
before loading anything): a path-valued `image` is a 400 that leaves the file as it was; a web page's request
(foreign Origin, text/plain) and a foreign Host are refused; a 100 MB chunked body is a 413 with the server's RSS
flat; /health answers while a 50 MB body is refused; SIGTERM mid-stream ends the stream with an error and [DONE]."""

import hashlib
import json
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.cli import glmtune_in_process

from glmtune.config import InferConfig
from glmtune.infer.generate import generate, save_merged
from glmtune.models import load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny

# Real server processes (~25 s each to start on a busy 2-core host) and signals: the edit-test loop skips them.
pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-glmtune-test"
APP = "http://app.example"  # the one web page origin the module's server lets call it
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# (OpenAI request: messages, tools) and the GLM messages mode=infer is given for the same conversation.
CASES = [
    (
        [{"role": "user", "content": "What is the capital of France?"}],
        None,
        [{"role": "user", "content": "What is the capital of France?"}],
    ),
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，介绍一下你自己"}],
        None,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，介绍一下你自己"}],
    ),
    (
        [{"role": "user", "content": "Weather in Paris?"}],
        [WEATHER],
        [{"role": "system", "content": "", "tools": [WEATHER]}, {"role": "user", "content": "Weather in Paris?"}],
    ),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20}'},
        ],
        [WEATHER],
        [
            {"role": "system", "content": "", "tools": [WEATHER]},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'},
            {"role": "observation", "content": '{"temperature": 20}'},
        ],
    ),
]
NEW_TOKENS = 12


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m glmtune mode=serve ARGS serve.port=PORT`, its URL read from the start line; every output line
    kept with the moment it arrived."""

    def __init__(self, run_dir, *args, port=0, wait=True):
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glmtune", "mode=serve", f"serve.port={port}", f"hydra.run.dir={run_dir}", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines, self.err, self.arrived = [], [], {}
        self.readers = [
            threading.Thread(target=self._read, args=(stream, into), daemon=True)
            for stream, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()
        if wait:
            assert self.wait(), "".join(self.lines + self.err)[-3000:]

    def _read(self, stream, into):
        for line in stream:
            self.arrived.setdefault(line, time.monotonic())
            into.append(line)

    def wait(self, timeout=300) -> bool:
        """True once the start line is out, False if the process ended without one."""
        deadline = time.monotonic() + timeout
        while not any("glmtune serve: http://" in line for line in self.lines):
            if self.proc.poll() is not None:
                for reader in self.readers:
                    reader.join(10)
                return False
            assert time.monotonic() < deadline, "".join(self.lines + self.err)[-3000:]
            time.sleep(0.05)
        self.start_line = next(line for line in self.lines if "glmtune serve: http://" in line)
        self.url = self.start_line.split()[2]  # http://127.0.0.1:PORT/v1
        return True

    def client(self, key=KEY) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def rss(self) -> int:
        """The server process's resident memory, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A LoRA adapter folder for the tiny model, with both matrices random so that it changes the replies."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        load_model(ensure_tiny("glm4")),
        LoraConfig(r=4, lora_alpha=16, target_modules=["query_key_value", "dense_h_to_4h"], init_lora_weights=False),
    )
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def race(tmp_path_factory, adapter):
    """Two identical servers started at the same instant on one port: (the one that serves, the other)."""
    root, port = tmp_path_factory.mktemp("serve"), free_port()
    args = (
        f"infer.adapter={adapter}",
        f"infer.max_new_tokens={NEW_TOKENS}",
        f"serve.api_key={KEY}",
        f"serve.allow_origins=[{APP}]",
        "serve.stop_grace_s=2",
    )
    both = [Server(root / f"run{i}", *args, port=port, wait=False) for i in range(2)]
    started = [srv.wait() for srv in both]
    assert started.count(True) == 1, ["".join(srv.lines + srv.err)[-2000:] for srv in both]
    winner, loser = both[started.index(True)], both[started.index(False)]
    yield winner, loser
    winner.stop()


@pytest.fixture(scope="module")
def server(race):
    return race[0]


@pytest.fixture(scope="module")
def expected(tmp_path_factory, adapter):
    """mode=infer's outputs for CASES with the same adapter and settings (greedy)."""
    folder = tmp_path_factory.mktemp("infer")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": glm}, ensure_ascii=False) + "\n" for *_, glm in CASES))
    proc = glmtune_in_process(
        "mode=infer",
        f"infer.prompts_file={prompts}",
        f"infer.adapter={adapter}",
        f"infer.max_new_tokens={NEW_TOKENS}",
        f"hydra.run.dir={folder / 'run'}",
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["output"] for line in (folder / "run" / "predictions.jsonl").read_text().splitlines()]


def ask(client, messages, tools=None, stream=False, **options):
    extra = {"tools": tools} if tools else {}
    reply = client.chat.completions.create(
        model="glm4_tiny-lora", messages=messages, stream=stream, max_tokens=NEW_TOKENS, **extra, **options
    )
    if not stream:
        return reply
    chunks = list(reply)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_start_line_and_models(server):
    assert 'model "glm4_tiny-lora"' in server.start_line and "API key required" in server.start_line
    assert [m.id for m in server.client().models.list().data] == ["glm4_tiny-lora"]


def test_replies_equal_mode_infer_streamed_or_not(server, expected):
    client = server.client()
    for (messages, tools, glm), infer_output in zip(CASES, expected):
        reply = ask(client, messages, tools, temperature=0)
        choice = reply.choices[0]
        assert choice.message.content == infer_output and choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
        tok = load_tokenizer(ensure_tiny("glm4"))
        assert reply.usage.prompt_tokens == len(tok.apply_chat_template(glm, add_generation_prompt=True))
        text, chunks = ask(client, messages, tools, stream=True)  # the server's default sampling: greedy
        assert text == infer_output
        assert (
            chunks[0].choices[0].delta.role == "assistant"
            and chunks[-1].choices[0].finish_reason == choice.finish_reason
        )
    # the adapter is applied: the base model alone answers otherwise
    base = load_model(ensure_tiny("glm4")).eval()
    alone = generate(
        base,
        load_tokenizer(ensure_tiny("glm4")),
        [glm for *_, glm in CASES],
        InferConfig(max_new_tokens=NEW_TOKENS, batch_size=1),
    )
    assert alone != expected


def test_two_concurrent_requests(server, expected):
    client = server.client()
    with ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(ask, client, m, t) for m, t, _ in CASES[:2]]
        streamed = [pool.submit(ask, client, m, t, True) for m, t, _ in CASES[:2]]
        assert [f.result().choices[0].message.content for f in plain] == expected[:2]
        assert [f.result()[0] for f in streamed] == expected[:2]


def test_bad_requests_get_openai_errors(server):
    client = server.client()
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(messages=[]), 400, "messages"),
        (dict(messages=[{"role": "bot", "content": "x"}]), 400, "messages"),
        (dict(messages=user, n=2), 400, "n"),
        (dict(messages=user, max_tokens=10**9), 400, "max_tokens"),
        (dict(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "messages"),
        (dict(messages=user, temperature=5), 400, "temperature"),
        (dict(messages=user, model="gpt-4o"), 404, "model"),
    ]
    for kwargs, status, param in cases:
        kwargs = {"model": "glm4_tiny-lora", **kwargs}
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(**kwargs)
        assert err.value.status_code == status and err.value.body["param"] == param, (kwargs.keys(), err.value)
        assert set(err.value.body) == {"message", "type", "param", "code"} and err.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(key="wrong").chat.completions.create(model="glm4_tiny-lora", messages=user)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = httpx.post(server.url + "/chat/completions", content=b"{not json", headers=auth)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    # Python's json takes NaN/Infinity (they would pass every range check) and lone surrogates (every reply
    # echoing them would fail to encode): refused as the JSON they are not; a message that is no object says so
    body = {"model": "glm4_tiny-lora", "messages": user}
    for text, says in [
        (json.dumps({**body, "temperature": float("nan")}), "NaN is not a JSON number"),
        (json.dumps({**body, "top_p": float("nan")}), "NaN is not a JSON number"),
        (json.dumps({**body, "max_tokens": float("inf")}), "Infinity is not a JSON number"),
        ('{"model": "\\ud800", "messages": []}', "lone UTF-16 surrogate"),
        (json.dumps({**body, "messages": ["hi"]}), "messages[0] is a string, not an object"),
    ]:
        raw = httpx.post(server.url + "/chat/completions", content=text.encode(), headers=auth)
        assert raw.status_code == 400 and says in raw.json()["error"]["message"], (text, raw.text)
    raw = httpx.post(server.url + "/chat/completions", json={"messages": user}, headers=auth)  # no model
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/nowhere", headers=auth).status_code == 404
    assert httpx.get(server.url + "/models").status_code == 401  # no key at all
    assert ask(client, user).choices[0].message.content is not None  # and the server still answers


def test_two_servers_started_at_once_one_serves_the_other_exits_2_before_loading(race):
    winner, loser = race
    assert loser.proc.wait(60) == 2 and not loser.lines
    (line,) = [line for line in loser.err if line.strip()]
    assert f"serve.port={winner.url.rsplit(':', 1)[1].split('/')[0]}" in line and "is in use" in line
    # It gave up at the port: nothing on stdout. When it gave up is not compared with the winner's start (a tiny
    # model loads in well under the time a loaded machine may take to schedule the loser's imports); that the port
    # comes before the weights: test_a_port_in_use_is_found_before_the_weights_are_read.
    assert httpx.get(winner.url.replace("/v1", "/health")).json()["status"] == "ok"


def _weights_that_fail_only_when_loaded(folder: Path) -> Path:
    """A copy of the tiny GLM-4 whose first 2-D tensor has its shape transposed in the safetensors header: the same
    bytes, so every check of the files passes, and only loading that tensor fails."""
    shutil.copytree(ensure_tiny("glm4"), folder)
    file = folder / "model.safetensors"
    data = bytearray(file.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    name = next(k for k, v in header.items() if k != "__metadata__" and len(set(v["shape"])) == 2)
    header[name]["shape"] = header[name]["shape"][::-1]
    raw = json.dumps(header, separators=(",", ":")).encode()
    data[8 : 8 + length] = raw + b" " * (length - len(raw))
    file.write_bytes(bytes(data))
    return folder


def test_a_port_in_use_is_found_before_the_weights_are_read(race, tmp_path):
    """'Before loading' without a clock: on a free port these weights fail to load (exit 2, the weights' line); on
    the serving port the same command is the port's line, so it never got to the weights."""
    broken = _weights_that_fail_only_when_loaded(tmp_path / "model")
    port = race[0].url.rsplit(":", 1)[1].split("/")[0]
    lines = {}
    for name, chosen in (("free", "0"), ("taken", port)):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "glmtune",
                "mode=serve",
                f"model.path={broken}",
                f"serve.port={chosen}",
                f"hydra.run.dir={tmp_path / name}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2 and not proc.stdout.strip(), proc.stdout[-2000:] + proc.stderr[-2000:]
        (lines[name],) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "weights cannot be read" in lines["free"]
    assert f"serve.port={port}" in lines["taken"] and "is in use" in lines["taken"], lines


def test_a_path_valued_image_is_a_400_that_touches_no_file(server, tmp_path):
    """A GLM-format `"image": "<path>"` in a request: refused without opening, reading or deleting the file,
    and in the same words whether the path exists or not (no map of the server's disk)."""
    victim = tmp_path / "secret.png"
    victim.write_bytes(b"\x89PNG not really an image, but the user's file")
    digest = hashlib.sha256(victim.read_bytes()).hexdigest()
    messages = []
    for path in (victim, tmp_path / "missing.png", tmp_path):
        with pytest.raises(openai.BadRequestError) as err:
            server.client().chat.completions.create(
                model="glm4_tiny-lora", messages=[{"role": "user", "content": "describe it", "image": str(path)}]
            )
        assert err.value.body["param"] == "messages[0].image" and "data:image/png;base64" in err.value.body["message"]
        messages.append(err.value.body["message"])
    assert len(set(messages)) == 1 and str(tmp_path) not in messages[0]
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == digest  # still there, byte for byte


def test_browser_pages_and_foreign_hosts_are_refused(server):
    url, chat = server.url, server.url + "/chat/completions"
    body = json.dumps({"model": "glm4_tiny-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    auth = {"Authorization": f"Bearer {KEY}"}
    # a page on another site: a "simple" text/plain POST (no preflight) is refused before the route runs
    raw = httpx.post(
        chat, content=body, headers={**auth, "Content-Type": "text/plain", "Origin": "http://evil.example"}
    )
    assert raw.status_code == 403 and raw.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in raw.headers
    raw = httpx.post(chat, content=body, headers={**auth, "Content-Type": "text/plain"})  # not from a page: 415
    assert raw.status_code == 415 and raw.json()["error"]["code"] == "unsupported_media_type"
    # DNS rebinding: the page's requests name the attacker's host
    for path in ("/health", "/chat/completions"):
        raw = httpx.post(
            url + path, content=body, headers={**auth, "Host": "evil.example", "Content-Type": "application/json"}
        )
        assert raw.status_code == 421 and raw.json()["error"]["code"] == "misdirected_request"
    assert httpx.get(url + "/models", headers={**auth, "Host": "localhost:1"}).status_code == 200
    # serve.allow_origins: that page's preflight is answered and it may read the replies
    raw = httpx.options(
        chat,
        headers={
            "Origin": APP,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert raw.status_code == 204 and raw.headers["access-control-allow-origin"] == APP
    assert "authorization" in raw.headers["access-control-allow-headers"]
    raw = httpx.post(chat, content=body, headers={**auth, "Content-Type": "application/json", "Origin": APP})
    assert raw.status_code == 200 and raw.headers["access-control-allow-origin"] == APP
    assert (
        httpx.options(
            chat, headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        ).status_code
        == 403
    )


def big_body(megabytes: int, sent: threading.Event, pause_s: float = 0.0):
    """`megabytes` MB of JSON-looking bytes as a chunked upload (no Content-Length), 1 MB a chunk."""
    yield b'{"model": "glm4_tiny-lora", "messages": [{"role": "user", "content": "'
    sent.set()
    for _ in range(megabytes):
        yield b"x" * 10**6
        time.sleep(pause_s)
    yield b'"}]}'


def refuse_big_body(server, megabytes: int, pause_s: float = 0.0):
    """POST a chunked body of `megabytes` MB while sampling the server's RSS and timing /health: (response,
    RSS growth in bytes, /health latencies in seconds measured while the body was in flight)."""
    baseline, peak, health, sent, done = server.rss(), [0], [], threading.Event(), threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], server.rss())
            time.sleep(0.005)

    def poll_health():
        sent.wait(60)
        while not done.is_set():
            started = time.monotonic()
            assert httpx.get(server.url.replace("/v1", "/health"), timeout=30).status_code == 200
            health.append(time.monotonic() - started)
            time.sleep(0.02)

    threads = [threading.Thread(target=sample), threading.Thread(target=poll_health)]
    for thread in threads:
        thread.start()
    try:
        response = httpx.post(
            server.url + "/chat/completions",
            content=big_body(megabytes, sent, pause_s),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            timeout=120,
        )
    finally:
        done.set()
        for thread in threads:
            thread.join()
    return response, peak[0] - baseline, health


def test_a_100_mb_chunked_body_is_refused_as_it_arrives(server):
    response, growth, _ = refuse_big_body(server, 100)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert growth < 200e6, f"the server's RSS grew by {growth / 1e6:.0f} MB"  # 16 MiB kept at most, then dropped


def test_health_answers_within_1_s_while_a_50_mb_body_is_refused(server):
    response, _, health = refuse_big_body(server, 50, pause_s=0.02)  # ~1 s of upload: /health asked meanwhile
    assert response.status_code == 413
    assert len(health) >= 3 and max(health) < 1.0, health


def test_sigterm_mid_stream_ends_it_with_an_error_and_done_then_exit_0(server):
    """A stop during a streamed reply: once serve.stop_grace_s (2 s here) is over, a reply still decoding gets
    an error event and [DONE]; the server exits 0 without a traceback."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = {
        "model": "glm4_tiny-lora",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": 8000,
        "temperature": 0,
    }  # the whole context: far longer than the grace
    lines, first = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/chat/completions", json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert not reader.is_alive()
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "server_shutdown" and "not finished" in error["message"]
    assert all(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in events[:-2])  # cut, not finished
    assert server.proc.wait(60) == 0
    out, err = "".join(server.lines), "".join(server.err)
    assert "glmtune serve: stopped by SIGTERM" in out and "Traceback" not in err, err[-3000:]
    assert "batch " in (server.run_dir / "rank0.log").read_text()  # the engine logs each batch it ran


def forced_tool_checkpoint(folder, reply: str):
    """The tiny model made into a bigram machine that, after <|assistant|>, writes `reply` and <|observation|>:
    attention and MLP outputs zeroed (each position's state is its token's embedding), and the output layer
    mapping each token of the chain to the next one."""
    base = ensure_tiny("glm4")
    model, tok = load_model(base).eval(), load_tokenizer(base)
    chain = [tok.get_command("<|assistant|>"), *tok.encode(reply), tok.get_command("<|observation|>")]
    assert len(set(chain)) == len(chain), "the chain's tokens must differ for a bigram machine"
    with torch.no_grad():
        for layer in model.transformer.encoder.layers:
            layer.self_attention.dense.weight.zero_()
            layer.mlp.dense_4h_to_h.weight.zero_()
        model.transformer.encoder.final_layernorm.weight.fill_(1.0)
        embeddings, head = model.transformer.embedding.word_embeddings.weight, model.transformer.output_layer.weight
        head.zero_()
        for token, following in zip(chain, chain[1:]):
            head[following] = 10 * embeddings[token] / embeddings[token].norm()
    return save_merged(model, tok, str(folder))


def test_tool_call_round_trip_with_a_model_that_calls(tmp_path):
    model_dir = forced_tool_checkpoint(tmp_path / "caller", 'get_weather\n{"city": "Paris"}')
    srv = Server(tmp_path / "run", f"model.path={model_dir}", "serve.model_name=caller", "infer.max_new_tokens=32")
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        reply = client.chat.completions.create(model="caller", messages=messages, tools=[WEATHER])
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        # streamed: no content, one tool-call delta, finish_reason tool_calls
        chunks = list(client.chat.completions.create(model="caller", messages=messages, tools=[WEATHER], stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert not "".join(d.content or "" for d in deltas)
        (streamed,) = [t for d in deltas for t in (d.tool_calls or [])]
        assert streamed.function.name == "get_weather" and json.loads(streamed.function.arguments) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the call goes back with its result, as an OpenAI client sends it; the model answers (it calls again)
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 20}'},
        ]
        again = client.chat.completions.create(model="caller", messages=messages, tools=[WEATHER])
        assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert again.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result are in the prompt
        # without tools in the request, the same output is plain text: exactly what the model wrote, ended by
        # GLM-4's stop id <|observation|> (12 tokens of the 32 allowed)
        plain = client.chat.completions.create(model="caller", messages=messages[:1]).choices[0]
        assert plain.message.content == 'get_weather\n{"city": "Paris"}' and plain.finish_reason == "stop"
    finally:
        assert srv.stop(signal.SIGINT) == 0, "".join(srv.err)[-2000:]


def test_glm4v_image_part_through_the_api(tmp_path):
    """GLM-4V: an OpenAI image part (data: URL) answers as mode=infer's generate() does with the image file; a
    GLM-format image path in a request (a real image this time, which the model could take) is refused, the
    file untouched."""
    import base64

    png = REPO / "data" / "samples_vision" / "images" / "red_square.png"
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    victim = tmp_path / "photo.png"
    victim.write_bytes(png.read_bytes())
    srv = Server(tmp_path / "run", "model=glm4v_tiny", f"infer.max_new_tokens={NEW_TOKENS}")
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="glm4v_tiny", messages=[{"role": "user", "content": "What shape is this?", "image": str(victim)}]
            )
        assert err.value.body["param"] == "messages[0].image"
        assert victim.read_bytes() == png.read_bytes()
        reply = client.chat.completions.create(
            model="glm4v_tiny",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What shape is this?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
        )
        with pytest.raises(openai.BadRequestError):  # GLM-4V takes one image per conversation
            client.chat.completions.create(
                model="glm4v_tiny",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "image_url", "image_url": {"url": url}},
                        ],
                    }
                ],
            )
    finally:
        assert srv.stop() == 0
    folder = ensure_tiny("glm4v")
    (expected,) = generate(
        load_model(folder).eval(),
        load_tokenizer(folder),
        [[{"role": "user", "content": "What shape is this?", "image": str(png)}]],
        InferConfig(max_new_tokens=NEW_TOKENS, batch_size=1),
    )
    assert reply.choices[0].message.content == expected
