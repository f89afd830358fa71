"""mode=serve's parts without a server: GLM-4's tool-call format parsed, the streamed text equal to the final
text however the tokens fall, OpenAI messages rendered exactly as the GLM messages they stand for, the batching
engine on the real tiny models (text and GLM-4V image rows in one batch) against generate(), and the config and
port checks before any weights load. tests/serve/test_serve.py talks to real servers."""

import asyncio
import base64
import json
import random
import socket

import pytest
from helpers.cli import glmtune_in_process

from glmtune.config import InferConfig
from glmtune.infer.generate import generate
from glmtune.models import load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny
from glmtune.serve.protocol import ApiError, parse_chat
from glmtune.serve.reply import ReplyText, parse_tool_call

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def stream(text: str, tools=(), stops=(), seed=0):
    """The reply fed as it grows in random steps (as tokens fall): (concatenated deltas + last, tool call)."""
    reply, rng, shown, at = ReplyText(set(tools), list(stops)), random.Random(seed), "", 0
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 4))
        shown += reply.update(text[:at])
        if reply.stopped:
            break
    return shown + reply.finish(text[:at]), reply.tool_call


def test_glm4_tool_call_format_is_parsed():
    call = parse_tool_call('get_weather\n{"city":   "北京"}', {"get_weather"})
    assert (call.name, json.loads(call.arguments), call.arguments) == (
        "get_weather",
        {"city": "北京"},
        '{"city": "北京"}',
    )
    assert call.openai(index=0)["function"] == {"name": "get_weather", "arguments": '{"city": "北京"}'}
    assert call.openai()["id"].startswith("call_") and call.openai()["type"] == "function"
    assert parse_tool_call("get_weather\nnot json", {"get_weather"}).arguments == "not json"  # the client decides
    assert parse_tool_call("\nIt is sunny.", {"get_weather"}) is None  # GLM-4's empty metadata line: text
    assert parse_tool_call('search\n{"q": 1}', {"get_weather"}) is None  # not one of the request's functions
    assert parse_tool_call("get_weather", {"get_weather"}) is None


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_equals_the_final_text(seed):
    assert stream("\n  Hello, world!  \n", seed=seed) == ("Hello, world!", None)
    assert stream("\nIt is 20 degrees.", tools=["get_weather"], seed=seed) == ("It is 20 degrees.", None)
    # a first line that is no tool's name is content, as mode=infer writes it
    assert stream("get_w\nx", tools=["get_weather"], seed=seed) == ("get_w\nx", None)
    text, call = stream('get_weather\n{"city": "Paris"}', tools=["get_weather"], seed=seed)
    assert text == "" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    # a stop string ends the reply and is not returned, even split over several tokens
    assert stream("\nabc END def", stops=["END"], seed=seed)[0] == "abc"
    assert stream("\nabc EN", stops=["END"], seed=seed)[0] == "abc EN"
    assert stream("\nab\ufffd", seed=seed)[0] == "ab\ufffd"  # held back while it may be half a character


def test_openai_messages_render_as_the_glm_messages_they_stand_for(tok):
    body = {
        "model": "m",
        "tools": [WEATHER],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20}'},
        ],
    }
    request = parse_chat(body, InferConfig(), tok, vision=False)
    glm = [
        {"role": "system", "content": "Be brief.", "tools": [WEATHER]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'},
        {"role": "observation", "content": '{"temperature": 20}'},
    ]
    assert request.ids == tok.apply_chat_template(glm, add_generation_prompt=True)
    assert request.tool_names == {"get_weather"} and not request.settings.do_sample
    # tool_choice=none: the model is not told about the tools
    assert "tools" not in parse_chat({**body, "tool_choice": "none"}, InferConfig(), tok, False).messages[0]


def test_sampling_options_and_refusals(tok):
    user = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    request = parse_chat(
        {**user, "temperature": 0.7, "top_p": 0.5, "seed": 3, "stop": "x", "max_tokens": 9}, InferConfig(), tok, False
    )
    s = request.settings
    assert (s.do_sample, s.temperature, s.top_p, request.seed, request.stops, request.max_tokens) == (
        True,
        0.7,
        0.5,
        3,
        ["x"],
        9,
    )
    greedy = parse_chat({**user, "temperature": 0}, InferConfig(do_sample=True), tok, False)
    assert not greedy.settings.do_sample
    for extra, param in [
        ({"n": 2}, "n"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 1}, "presence_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
    ]:
        with pytest.raises(ApiError) as err:
            parse_chat({**user, **extra}, InferConfig(), tok, vision=True)
        assert err.value.status == 400 and err.value.param == param, (extra, err.value.message)


def run_engine(model, tok, bodies, vision=False, max_tokens=10):
    """Every request submitted before the worker starts, so that the engine must batch them; their replies and
    the number of generate() batches it ran."""
    from glmtune.serve.engine import Engine

    async def main():
        engine = Engine(model, tok, max_batch=8, free_bytes=None, default_max_tokens=max_tokens)
        loop = asyncio.get_running_loop()
        jobs = [engine.admit(parse_chat(b, InferConfig(), tok, vision), loop) for b in bodies]
        for job in jobs:
            engine.submit(job)
        engine.start()
        replies = []
        for job in jobs:
            while (event := await job.events.get())[0] == "delta":
                pass
            assert event[0] == "done", event
            replies.append(event[1]["content"])
        engine.stop()
        return replies, engine.batches

    return asyncio.run(main())


def test_engine_batches_concurrent_requests_like_generate(tok):
    folder = ensure_tiny("glm4")
    model = load_model(folder).eval()
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}],
        [{"role": "user", "content": "Add 2 and 3."}],
    ]
    replies, batches = run_engine(model, tok, [{"messages": p} for p in prompts])
    assert batches == 1  # three waiting requests, one generate() call
    assert replies == generate(model, tok, prompts, InferConfig(max_new_tokens=10, batch_size=1))


def test_engine_takes_glm4v_images_as_data_urls(repo):
    folder = ensure_tiny("glm4v")
    model, tok = load_model(folder).eval(), load_tokenizer(folder)
    png = repo / "data" / "samples_vision" / "images" / "red_square.png"
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    bodies = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What shape is this?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ]
        },
        {"messages": [{"role": "user", "content": "Who are you?"}]},
    ]
    replies, _ = run_engine(model, tok, bodies, vision=True)
    expected = generate(
        model,
        tok,
        [
            [{"role": "user", "content": "What shape is this?", "image": str(png)}],
            [{"role": "user", "content": "Who are you?"}],
        ],
        InferConfig(max_new_tokens=10, batch_size=1),
    )
    assert replies == expected and all(replies)


def test_port_in_use_and_bad_serve_keys_exit_2_before_loading(tmp_path, repo):
    pytest.importorskip("uvicorn")  # the extra `serve`: without it the one line says to install it
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        proc = glmtune_in_process("mode=serve", f"serve.port={port}", f"hydra.run.dir={tmp_path / 'a'}", cwd=repo)
    assert proc.returncode == 2 and f"serve.port={port}" in proc.stderr and "in use" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = glmtune_in_process(
        "mode=serve",
        "serve.port=70000",
        "serve.max_batch=0",
        "serve.max_body_mib=0",
        "serve.stop_grace_s=-1",
        "serve.allow_origins=[*]",
        "serve.allow_hosts=[http://x/]",
        f"hydra.run.dir={tmp_path / 'b'}",
        cwd=repo,
    )
    assert proc.returncode == 2 and "serve.port must be in 0..65535" in proc.stderr
    for says in (
        "serve.max_batch must be > 0",
        "serve.max_body_mib must be in",
        "serve.stop_grace_s must be in",
        "serve.allow_origins has '*'",
        "serve.allow_hosts has 'http://x/'",
    ):
        assert says in proc.stderr, (says, proc.stderr)


def test_a_server_open_to_the_network_needs_a_key_and_an_address_of_this_machine(tmp_path, repo):
    """serve.host other than loopback without serve.api_key: one line, exit 2, nothing bound or loaded; an
    address this machine does not have names serve.host (not serve.port) as the key to change."""
    pytest.importorskip("uvicorn")
    proc = glmtune_in_process(
        "mode=serve", "serve.host=0.0.0.0", "serve.port=0", f"hydra.run.dir={tmp_path / 'a'}", cwd=repo
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "serve.host=0.0.0.0 opens the server to the network without a key" in proc.stderr
    assert "serve.allow_unauthenticated=true" in proc.stderr and "Traceback" not in proc.stderr
    proc = glmtune_in_process(
        "mode=serve",
        "serve.host=10.255.255.1",
        "serve.api_key=k",
        "serve.port=0",
        f"hydra.run.dir={tmp_path / 'c'}",
        cwd=repo,
    )
    assert proc.returncode == 2 and "serve.host=10.255.255.1 is not an address of this machine" in proc.stderr
    assert "serve.port" not in proc.stderr


def test_host_names_a_server_answers_to():
    pytest.importorskip("starlette")
    from glmtune.serve.guard import Hosts, host_name

    assert [host_name(h) for h in ("[::1]:8000", "LocalHost:80", "example.com.", "::1", "10.0.0.2")] == [
        "::1",
        "localhost",
        "example.com",
        "::1",
        "10.0.0.2",
    ]
    loopback = Hosts.for_bind("127.0.0.1", [])
    assert all(loopback.allows(h) for h in ("127.0.0.1:8000", "localhost", "[::1]:1"))
    assert not any(loopback.allows(h) for h in ("evil.example", "10.0.0.2", "127.0.0.1.evil.example", "", None))
    wildcard = Hosts.for_bind("0.0.0.0", ["api.example.com"])
    assert all(wildcard.allows(h) for h in ("10.0.0.2:8000", "[fe80::1]", "api.example.com", "localhost"))
    assert not wildcard.allows("evil.example")  # DNS rebinding needs a name, and this one is not the server's


def test_vllm_hint_only_when_installed_and_it_fits(tmp_path):
    pytest.importorskip("uvicorn")
    from glmtune.serve.server import vllm_hint

    gib = 2**30
    assert vllm_hint(False, gib, 80 * gib, None, "m") is None
    assert vllm_hint(True, gib, None, None, "m") is None  # no GPU
    assert vllm_hint(True, 79 * gib, 80 * gib, None, "m") is None  # no room left for the KV cache
    line = vllm_hint(True, gib, 80 * gib, None, "m")
    # an export first (its tokenizer.json, stop ids and SERVE.md), never the remote-code base folder
    assert "infer.merge_to=DIR" in line and "--served-model-name m" in line and "--trust-remote-code" not in line
    assert "infer.adapter=run/adapter infer.merge_to=DIR" in vllm_hint(True, gib, 80 * gib, "run/adapter", "m")
