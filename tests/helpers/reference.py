"""The GLM-4-0414 reference checkpoints the parity tests read (tests/models/test_glm4_0414_reference.py and
tests/train/test_glm4_0414_cli.py): written once per session by transformers 5's own Glm4ForCausalLM in the engines
venv (tests/models/ref_glm4_0414_worker.py), one engines process for all of them; under pytest-xdist the first worker to ask
writes them and the others wait on its lock, as conftest's `trained` does."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import pytest

from . import REPO
from .engines import run_in_engines

WORKER = REPO / "tests" / "models" / "ref_glm4_0414_worker.py"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "天气预报",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "城市名"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"role": "assistant", "metadata": "get_weather", "content": '{"city": "北京"}'}


def conversations(thinking: bool) -> list[dict]:
    """Each as the reference gets it (`messages`, `tools`, `prompt`: add_generation_prompt) and as glmtune's data
    has it (`glm`: tools on the system message)."""
    answer = ("<think>\nThe user greets me.\n</think>\n\n" if thinking else "") + "Hello! How can I help?"
    chat = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "What's the weather in Beijing?"},
    ]
    tool_turns = [
        {"role": "user", "content": "北京天气怎么样？"},
        CALL,
        {"role": "observation", "content": '{"t": 21}'},
    ]
    cases = [
        dict(messages=[{"role": "user", "content": "你好"}], prompt=True),
        dict(messages=chat, prompt=True),
        dict(
            messages=tool_turns,
            tools=TOOLS,
            prompt=True,
            glm=[{"role": "system", "content": "", "tools": TOOLS}, *tool_turns],
        ),
        dict(messages=[*chat, {"role": "assistant", "content": "Sunny, 21 degrees."}], prompt=False),
    ]
    return [{**case, "glm": case.get("glm", case["messages"])} for case in cases]


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The folder of reference checkpoints (one per worker VARIANTS entry) with their reference outputs."""
    from glmtune.models.glm4_0414.tiny import CHAT_TEMPLATE, CHAT_TEMPLATE_Z1
    from glmtune.models.tokenizer_files import write_tiny_fast_tokenizer

    shared = os.environ.get("PYTEST_XDIST_WORKER") is not None
    root = tmp_path_factory.getbasetemp().parent / "glm4_0414_ref" if shared else tmp_path_factory.mktemp("ref")
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = root / "written.json"
        if not done.is_file():
            write_tiny_fast_tokenizer(root / "tok", CHAT_TEMPLATE)
            write_tiny_fast_tokenizer(root / "tok_z1", CHAT_TEMPLATE_Z1)
            (root / "conversations.json").write_text(
                json.dumps({"tok": conversations(False), "tok_z1": conversations(True)}, ensure_ascii=False)
            )
            proc = run_in_engines(str(WORKER), "write", str(root), timeout=900)
            done.write_text(json.dumps({"returncode": proc.returncode, "stderr": proc.stderr[-4000:]}))
        record = json.loads(done.read_text())
    assert record["returncode"] == 0, record["stderr"]
    return root


def peft_logits(jobs_file: Path, jobs: list[dict]) -> subprocess.CompletedProcess:
    """The reference model (+ PEFT adapter) logits of each job ({checkpoint, adapter, ids, out}): one process."""
    jobs_file.write_text(json.dumps(jobs))
    return run_in_engines(str(WORKER), "peft", str(jobs_file), timeout=900)
