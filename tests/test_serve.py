"""mode=serve as a user runs it: `python -m glmtune mode=serve ...` in a real process on a free port, talked to with
the official `openai` client. The tiny model + an adapter answer exactly as mode=infer does (greedy), streamed or
not, alone or concurrently, with tools and tool results; a tiny model built to always call a tool returns the call
in OpenAI's `tool_calls` shape; GLM-4V takes an image part; bad requests get OpenAI-style 4xx errors; SIGTERM and
Ctrl-C stop the server with exit 0."""
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from glmtune.config import InferConfig
from glmtune.infer.generate import generate, save_merged
from glmtune.models import load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny

from conftest import REPO, glmtune_in_process

# Real server processes (~25 s each to start on a busy 2-core host) and signals: the edit-test loop skips them.
pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-glmtune-test"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# (OpenAI request: messages, tools) and the GLM messages mode=infer is given for the same conversation.
CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], None,
     [{"role": "user", "content": "What is the capital of France?"}]),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，介绍一下你自己"}], None,
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好，介绍一下你自己"}]),
    ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER],
     [{"role": "system", "content": "", "tools": [WEATHER]}, {"role": "user", "content": "Weather in Paris?"}]),
    ([{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20}'}], [WEATHER],
     [{"role": "system", "content": "", "tools": [WEATHER]}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'},
      {"role": "observation", "content": '{"temperature": 20}'}]),
]
NEW_TOKENS = 12


class Server:
    """`python -m glmtune mode=serve ARGS serve.port=0`, its URL read from the start line."""

    def __init__(self, run_dir, *args):
        self.run_dir = run_dir
        self.proc = subprocess.Popen([sys.executable, "-m", "glmtune", "mode=serve", "serve.port=0",
                                      f"hydra.run.dir={run_dir}", *args], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines, self.err = [], []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 300
        while not any("glmtune serve: http://" in line for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines + self.err)[-3000:]
            time.sleep(0.2)
        self.start_line = next(line for line in self.lines if "glmtune serve: http://" in line)
        self.url = self.start_line.split()[2]  # http://127.0.0.1:PORT/v1

    def client(self, key=KEY) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)

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
    model = get_peft_model(load_model(ensure_tiny("glm4")), LoraConfig(
        r=4, lora_alpha=16, target_modules=["query_key_value", "dense_h_to_4h"], init_lora_weights=False))
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter):
    srv = Server(tmp_path_factory.mktemp("serve") / "run", f"infer.adapter={adapter}",
                 f"infer.max_new_tokens={NEW_TOKENS}", f"serve.api_key={KEY}")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(tmp_path_factory, adapter):
    """mode=infer's outputs for CASES with the same adapter and settings (greedy)."""
    folder = tmp_path_factory.mktemp("infer")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": glm}, ensure_ascii=False) + "\n" for *_, glm in CASES))
    proc = glmtune_in_process("mode=infer", f"infer.prompts_file={prompts}", f"infer.adapter={adapter}",
                              f"infer.max_new_tokens={NEW_TOKENS}", f"hydra.run.dir={folder / 'run'}", cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["output"] for line in (folder / "run" / "predictions.jsonl").read_text().splitlines()]


def ask(client, messages, tools=None, stream=False, **options):
    extra = {"tools": tools} if tools else {}
    reply = client.chat.completions.create(model="glm4_tiny-lora", messages=messages, stream=stream,
                                           max_tokens=NEW_TOKENS, **extra, **options)
    if not stream:
        return reply
    chunks = list(reply)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_start_line_and_models(server):
    assert "model \"glm4_tiny-lora\"" in server.start_line and "API key required" in server.start_line
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
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == \
            choice.finish_reason
    # the adapter is applied: the base model alone answers otherwise
    base = load_model(ensure_tiny("glm4")).eval()
    alone = generate(base, load_tokenizer(ensure_tiny("glm4")), [glm for *_, glm in CASES],
                     InferConfig(max_new_tokens=NEW_TOKENS, batch_size=1))
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
    cases = [(dict(messages=[]), 400, "messages"), (dict(messages=[{"role": "bot", "content": "x"}]), 400, "messages"),
             (dict(messages=user, n=2), 400, "n"), (dict(messages=user, max_tokens=10**9), 400, "max_tokens"),
             (dict(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "messages"),
             (dict(messages=user, temperature=5), 400, "temperature"),
             (dict(messages=user, model="gpt-4o"), 404, "model")]
    for kwargs, status, param in cases:
        kwargs = {"model": "glm4_tiny-lora", **kwargs}
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(**kwargs)
        assert err.value.status_code == status and err.value.body["param"] == param, (kwargs.keys(), err.value)
        assert set(err.value.body) == {"message", "type", "param", "code"} and err.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(key="wrong").chat.completions.create(model="glm4_tiny-lora", messages=user)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    raw = httpx.post(server.url + "/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    auth = {"Authorization": f"Bearer {KEY}"}
    raw = httpx.post(server.url + "/chat/completions", json={"messages": user}, headers=auth)  # no model
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/nowhere", headers=auth).status_code == 404
    assert httpx.get(server.url + "/models").status_code == 401  # no key at all
    assert ask(client, user).choices[0].message.content is not None  # and the server still answers


def test_sigterm_stops_cleanly(server):
    assert server.stop(signal.SIGTERM) == 0
    out, err = "".join(server.lines), "".join(server.err)
    assert "glmtune serve: stopped by SIGTERM" in out and "Traceback" not in err
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
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 20}'}]
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
    """GLM-4V: an OpenAI image part (data: URL) answers as mode=infer's generate() does with the image file."""
    import base64

    png = REPO / "data" / "samples_vision" / "images" / "red_square.png"
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    srv = Server(tmp_path / "run", "model=glm4v_tiny", f"infer.max_new_tokens={NEW_TOKENS}")
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="glm4v_tiny", messages=[{"role": "user", "content": [
            {"type": "text", "text": "What shape is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
        with pytest.raises(openai.BadRequestError):  # GLM-4V takes one image per conversation
            client.chat.completions.create(model="glm4v_tiny", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": {"url": url}}]}])
    finally:
        assert srv.stop() == 0
    folder = ensure_tiny("glm4v")
    (expected,) = generate(load_model(folder).eval(), load_tokenizer(folder),
                           [[{"role": "user", "content": "What shape is this?", "image": str(png)}]],
                           InferConfig(max_new_tokens=NEW_TOKENS, batch_size=1))
    assert reply.choices[0].message.content == expected
