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
    child = pexpect.spawn(sys.executable, ["-m", "glmtune", "mode=chat", "infer.max_new_tokens=6",
                                           f"infer.system=\"{SYSTEM}\"", f"hydra.run.dir={run}"],
                          cwd=str(repo), encoding="utf-8", timeout=180)
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
