"""mode=chat: talk to base + adapter in the terminal, tokens printed as they are generated.

    python -m glmtune mode=chat model.path=/models/glm-4-9b-chat infer.adapter=outputs/.../adapter
    python -m glmtune mode=chat ... infer.system="Answer briefly." infer.tools_file=tools.json
    python -m glmtune mode=chat ... infer.prompt="你好"          # one turn, then exit
    python -m glmtune mode=chat model=glm4v_9b ... infer.image=cat.png   # GLM-4V: image on the first turn

Commands: /reset (forget the conversation, keep the system prompt and tools), /exit (or Ctrl-D),
/observation TEXT (a tool's result, answered by the model), /image PATH (GLM-4V, before the first turn).
Every turn is appended to <run dir>/chat.jsonl: the messages the model saw and its reply.

Tools follow the GLM-4 template: a system message with "tools" (the official list format); the model
answers a call as `name\n{arguments}` (metadata line, then content), kept in the history that way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, TextIO

import torch
from transformers.generation.streamers import BaseStreamer

from ..config import ConfigError, InferConfig, RunConfig
from ..models.generation import encode_prompt, generation_kwargs, prompt_batch
from ..models.kvcache import preallocated_kv_cache
from .generate import check_model, inference_dtype, load_merged, place

PROMPT = "you> "
REPLY = "glm> "


class PrintStreamer(BaseStreamer):
    """Prints the reply as it grows. The whole reply is decoded each step and only the new suffix printed, so a
    character split over several byte tokens appears once complete (never as U+FFFD halves)."""

    def __init__(self, tokenizer, stops: list[int], out: TextIO):
        self.tokenizer, self.stops, self.out = tokenizer, set(stops), out
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        self.ids += [t for t in value.reshape(-1).tolist() if t not in self.stops]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > self.shown:
            self.out.write(text[self.shown :])
            self.out.flush()
            self.shown = len(text)

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def reply(model, tokenizer, messages: list[dict], cfg: InferConfig, out: TextIO) -> dict:
    """Generate the assistant turn for `messages`, streaming it; returns it as a history message."""
    vision = getattr(model.config, "vision_config", None)
    stops = list(tokenizer.stop_token_ids)
    batch = prompt_batch(
        [encode_prompt(messages, tokenizer)],
        tokenizer.pad_token_id,
        vision["image_size"] if vision else None,
        model.get_input_embeddings().weight.device,
    )
    with torch.no_grad(), preallocated_kv_cache(model, cfg.max_new_tokens):
        ids = model.generate(
            **batch,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=stops,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id,
            streamer=PrintStreamer(tokenizer, stops, out),
            **generation_kwargs(cfg),
        )[0, batch["input_ids"].shape[1] :].tolist()
    ids = ids[: next((i for i, t in enumerate(ids) if t in stops), len(ids))]
    raw = tokenizer.decode(ids, skip_special_tokens=True)
    # GLM-4 writes a metadata line first: empty for text, the tool's name for a call.
    metadata, content = raw.split("\n", 1) if "\n" in raw else ("", raw)
    return {"role": "assistant", "metadata": metadata.strip(), "content": content.strip()}


def start_messages(cfg: InferConfig) -> list[dict]:
    tools = None
    if cfg.tools_file:
        path = Path(cfg.tools_file)
        try:
            tools = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"infer.tools_file={path}: {err} — give a JSON list of GLM-4 tools") from None
        if not isinstance(tools, list):
            raise ConfigError(f'infer.tools_file={path}: not a JSON list — write [{{"type": "function", ...}}]')
    if not (cfg.system or tools):
        return []
    system = {"role": "system", "content": cfg.system or ""}
    return [{**system, "tools": tools}] if tools else [system]


COMMANDS = ("/help", "/reset", "/exit", "/image", "/observation")
HELP = (
    "/reset             forget the conversation (the system prompt and tools stay)\n"
    "/image PATH        GLM-4V: an image for the next message (before the first turn)\n"
    "/observation TEXT  a tool's result, for the model to answer\n"
    "/exit, Ctrl-D, Ctrl-C  leave (every turn is in chat.jsonl in the run dir)\n"
)


def run_chat(
    run: RunConfig,
    model_dir: Path,
    tokenizer,
    run_dir: Path,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
) -> int:
    """The chat loop (infer.*, over the model in `model_dir`, with model.* and hw.memory_gib); returns the number of
    replies."""
    cfg, model_cfg, memory_gib = run.infer, run.model, run.hw.memory_gib
    start = start_messages(cfg)
    check_model(cfg, model_dir)
    model, _ = place(load_merged(model_dir, cfg.adapter, model_cfg, inference_dtype()), cfg.gpus, memory_gib)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    transcript = Path(run_dir) / "chat.jsonl"
    history, image, replies = list(start), cfg.image, 0
    turns = [cfg.prompt] if cfg.prompt else None  # one-shot: this turn, then exit
    if turns is None:
        out.write("glmtune chat — /help lists the commands, /exit quits\n")
    while True:
        if turns is not None:
            if not turns:
                break
            line = turns.pop()
        else:
            try:
                line = read(PROMPT).strip()
            except EOFError:
                break
        if not line:
            continue
        if line == "/exit":
            break
        if line == "/help" or (line.startswith("/") and line.split()[0] not in COMMANDS):
            known = line == "/help"
            out.write(("" if known else f"(unknown command {line.split()[0]}; nothing sent to the model)\n") + HELP)
            continue
        if line == "/reset":
            history, image = list(start), cfg.image
            out.write("(history cleared)\n")
            continue
        if line.startswith("/image "):
            image = line[len("/image ") :].strip()
            out.write(f"(image {image} goes with the next message)\n")
            continue
        if line.startswith("/observation "):
            message = {"role": "observation", "content": line[len("/observation ") :]}
        else:
            message = {"role": "user", "content": line}
            if image and not any("image" in m for m in history):
                if not Path(image).is_file():
                    out.write(f"(no image at {image}; message not sent)\n")
                    continue
                message["image"] = image
        history.append(message)
        out.write(REPLY)
        answer = reply(model, tokenizer, history, cfg, out)
        with transcript.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"messages": history, "reply": answer}, ensure_ascii=False) + "\n")
        history.append(answer)
        replies += 1
    return replies
