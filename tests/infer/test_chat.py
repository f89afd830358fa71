"""mode=chat in a real pseudo-terminal: two turns, a reset, a third turn, exit; and what each reply saw."""

import json
import sys

import pytest

from glmtune.config import InferConfig
from glmtune.infer.generate import generate
from glmtune.models import load_model, load_tokenizer
from glmtune.models.presets import ensure_tiny

pexpect = pytest.importorskip("pexpect")

SYSTEM = "You are terse."


def test_chat_two_turns_reset_exit(tmp_path, repo):
    run = tmp_path / "chat"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "glmtune", "mode=chat", "infer.max_new_tokens=6", f'infer.system="{SYSTEM}"', f"hydra.run.dir={run}"],
        cwd=str(repo),
        encoding="utf-8",
        timeout=180,
    )
    child.expect_exact("you> ")
    child.sendline("Hello there")
    child.expect_exact("glm> ")
    child.expect_exact("you> ")
    child.sendline("你好")
    child.expect_exact("you> ")
    child.sendline("/reset")
    child.expect_exact("(history cleared)")
    child.expect_exact("you> ")
    child.sendline("Hello there")
    child.expect_exact("you> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    turns = [json.loads(line) for line in (run / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    system = {"role": "system", "content": SYSTEM}
    first, second, third = turns
    assert first["messages"] == [system, {"role": "user", "content": "Hello there"}]
    # the second turn sees the first exchange: multi-turn history
    assert second["messages"] == [*first["messages"], first["reply"], {"role": "user", "content": "你好"}]
    # after /reset only the system prompt is left
    assert third["messages"] == first["messages"] and third["reply"] == first["reply"]

    # each reply is what generate() gives for that history (greedy), independently of the terminal
    folder = ensure_tiny("glm4")
    model, tok = load_model(folder).eval(), load_tokenizer(folder)
    cfg = InferConfig(max_new_tokens=6, batch_size=1)
    for turn in (first, second):
        (expected,) = generate(model, tok, [turn["messages"]], cfg)
        reply = turn["reply"]
        got = f"{reply['metadata']}\n{reply['content']}" if reply["metadata"] else reply["content"]
        assert got.strip() == expected.strip()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_chat_tools_observation_and_one_shot(tmp_path):
    import io

    from glmtune.config import RunConfig
    from glmtune.infer.chat import run_chat

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    folder = ensure_tiny("glm4")
    tok = load_tokenizer(folder)
    lines = iter(["北京天气？", '/observation {"temp": 20}', "/exit"])
    out = io.StringIO()
    cfg = InferConfig(max_new_tokens=4, tools_file=str(tools))
    assert run_chat(RunConfig(infer=cfg), folder, tok, tmp_path / "a", read=lambda _: next(lines), out=out) == 2
    first, second = [json.loads(x) for x in (tmp_path / "a" / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    assert first["messages"][0] == {"role": "system", "content": "", "tools": TOOLS}
    assert second["messages"][-1] == {"role": "observation", "content": '{"temp": 20}'}
    assert second["messages"][-2] == first["reply"]
    # the streamed text is the reply (the tiny model's words, whatever they are)
    assert first["reply"]["content"] in out.getvalue()

    one = io.StringIO()
    assert (
        run_chat(
            RunConfig(infer=InferConfig(max_new_tokens=3, prompt="hi")),
            folder,
            tok,
            tmp_path / "b",
            read=lambda _: pytest.fail("one-shot must not read"),
            out=one,
        )
        == 1
    )

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    from glmtune.config import ConfigError

    with pytest.raises(ConfigError, match="tools_file"):
        run_chat(RunConfig(infer=InferConfig(tools_file=str(bad))), folder, tok, tmp_path / "c")
