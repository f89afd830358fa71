"""The request side of /v1/chat/completions: OpenAI's JSON body -> GLM messages, prompt ids and sampling.

Messages go through the data stage's own OpenAI mapping and checks (`data.validate.check_line` with
`data.format=openai`): tools onto the system message, each tool call an assistant message whose metadata is
the function's name and content its arguments, a `tool` result an observation; the same roles, tool and image
rules as a training file. So a conversation reaches the model exactly as a training record or a `mode=infer`
prompt with the same messages. Images (GLM-4V) come only as OpenAI image parts with a `data:` URL (base64),
decoded in memory: the server fetches nothing from the network and opens no path a request names (a GLM-format
`"image": "<path>"` key is a 400 that touches no file), so no request can make it read, reveal or delete a file.
The body itself must be strict JSON (no NaN/Infinity, no lone UTF-16 surrogates) before any field is looked at.

Sampling: `temperature` 0 is greedy, > 0 samples; without `temperature` the server's infer.do_sample /
infer.temperature apply (greedy by default, so a request gives what `mode=infer` gives). `top_p`, `seed`,
`stop` (up to 4 strings) and `max_tokens` (or `max_completion_tokens`) are honoured; `n` must be 1. Options
that would change the output and that glmtune does not implement are refused with a 400, never ignored.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import InferConfig
from ..data.images import decode_problem
from ..data.validate import check_line
from ..models.generation import encode_prompt

MAX_STOPS = 4  # OpenAI's limit on `stop` strings
IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
IMAGE_FORM = (
    'an OpenAI image part on the first user message: {"type": "image_url", "image_url": {"url": '
    '"data:image/png;base64,..."}}'
)
# check_line resolves a GLM `image` against a folder; requests never carry one (refused before), so this one is
# never read: a folder that cannot exist, should a later format ever map something onto `image`.
NO_FOLDER = Path("/nonexistent/glmtune-serve-requests-carry-no-paths")
# Options whose only accepted value is "off": anything else would silently change what the client gets.
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "prediction": (None,),
}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status and the body {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    messages: list[dict]  # GLM messages, as a training record holds them
    ids: list[int]  # the prompt, ending on <|assistant|>
    image: io.BytesIO | None  # GLM-4V: the data: URL's image, decoded in memory (no file is ever written)
    settings: InferConfig  # the server's infer.* with the request's sampling options
    max_tokens: int | None  # as asked; None = infer.max_new_tokens, capped by the context left
    seed: int | None = None  # sampling only: reseed before this request (it then runs in a batch of its own)
    stops: list[str] = field(default_factory=list)
    tool_names: set[str] = field(default_factory=set)
    stream: bool = False
    include_usage: bool = False


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate(value: Any) -> bool:
    """Whether a string (or key) anywhere in `value` holds half of a UTF-16 pair (JSON's "\\ud800"): Python
    parses it, but it is no Unicode text and cannot be encoded back (every reply echoing it would fail)."""
    if isinstance(value, str):
        return not value.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    return False


def parse_json(raw: bytes) -> Any:
    """The body as strict JSON: Python's parser also takes NaN and Infinity (temperature=NaN would then pass
    every range check) and lone surrogates; ApiError (400) for those and for anything that does not parse."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
        surrogate = _lone_surrogate(body)
    except ValueError as err:  # JSONDecodeError, a UnicodeDecodeError of the bytes, or NaN/Infinity
        why = str(err) if "JSON number" in str(err) else "not valid JSON"
        raise bad(
            f"We could not parse the JSON body of your request ({why}): send a JSON object "
            "(Content-Type: application/json)",
            None,
            "invalid_json",
        ) from None
    except RecursionError:
        raise bad("the JSON body is nested too deeply", None, "invalid_json") from None
    if surrogate:
        raise bad(
            "the JSON body holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair): send Unicode text",
            None,
            "invalid_json",
        )
    return body


def _number(body: dict, key: str, low: float, high: float, integer: bool = False, low_open: bool = False):
    value = body.get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or value < low
        or value > high
        or (low_open and value == low)
    ):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad(f"{key}={value!r} is not {'an integer' if integer else 'a number'} in {interval}", key)
    return value


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad(f"stop must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return [s for s in stops if s]


def _image(url: Any, where: str) -> io.BytesIO:
    """A `data:image/...;base64,...` URL decoded in memory and checked whole; ApiError for anything else."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise bad(
            f"{where}: only data: URLs are accepted (data:image/png;base64,...); this server fetches "
            "nothing from the network and reads no file",
            where,
        )
    header, _, payload = url[len("data:") :].partition(",")
    mime, _, encoding = header.partition(";")
    if encoding != "base64" or mime.lower() not in IMAGE_TYPES:
        raise bad(f"{where}: expected data:<{'|'.join(IMAGE_TYPES)}>;base64,<data>", where)
    try:
        image = io.BytesIO(base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError):
        raise bad(f"{where}: the base64 data does not decode", where) from None
    problem = decode_problem(image, "the data: URL")
    if problem is not None:
        raise bad(f"{where}: {problem[0]} — {problem[1]}", where)
    return image


def _content_parts(turn: dict, i: int, vision: bool, first_user: bool) -> tuple[dict, io.BytesIO | None]:
    """A message whose content is a list of parts: the text parts kept, and its image part decoded."""
    content, image = turn.get("content"), None
    if not isinstance(content, list):
        return turn, None
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(part)
        elif kind == "image_url":
            if not vision:
                raise bad(f"{where}: this model has no vision tower (serve a GLM-4V model for images)", where)
            if image is not None or not first_user:
                raise bad(f"{where}: GLM-4V takes one image per conversation, on the first user message", where)
            image_url = part.get("image_url")
            image = _image(image_url.get("url") if isinstance(image_url, dict) else image_url, where)
        else:
            raise bad(f"{where}: part type {kind!r} is not supported (text, image_url)", where)
    return {**turn, "content": texts}, image


def glm_messages(body: dict, vision: bool) -> tuple[list[dict], set[str]]:
    """The request's messages as GLM messages (checked like a prompts file), and the names of its functions."""
    turns, tools = body.get("messages"), body.get("tools")
    if not isinstance(turns, list) or not turns:
        raise bad('messages must be a non-empty list of {"role", "content"} objects', "messages")
    if body.get("tool_choice") == "none":
        tools = None  # the model is not told about them, so it cannot call one
    elif body.get("tool_choice") not in (None, "auto"):
        raise bad(
            'tool_choice: only "auto" and "none" (GLM-4 decides itself whether to call a tool)',
            "tool_choice",
            "unsupported_value",
        )
    if tools is not None and not isinstance(tools, list):
        raise bad('tools must be a list of {"type": "function", "function": {...}}', "tools")
    for i, turn in enumerate(turns):  # before anything reads the messages: a path is never looked at
        if isinstance(turn, dict) and "image" in turn:
            raise bad(
                f"messages[{i}].image: this server takes no file paths — send the image as {IMAGE_FORM}",
                f"messages[{i}].image",
                "unsupported_parameter",
            )
    first_user = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("role") == "user"), None)
    parts = [
        _content_parts(t, i, vision, i == first_user) if isinstance(t, dict) else (t, None) for i, t in enumerate(turns)
    ]
    turns, image = [t for t, _ in parts], next((im for _, im in parts if im is not None), None)
    record = json.dumps({"messages": turns, **({"tools": tools} if tools else {})}, ensure_ascii=False)
    checked = check_line(record.encode(), 1, 0, NO_FOLDER, prompts=True, fmt="openai")
    if checked is None or not isinstance(checked, list):
        what, fix = (checked.what, checked.fix) if checked is not None else ("no messages", "send messages")
        raise bad(f"{what} — {fix}", "messages")
    if checked[-1]["role"] == "assistant":
        raise bad("the messages end on an assistant message — end on the user (or tool) message to answer", "messages")
    if image is not None:  # on the first user message, where GLM-4V's template puts it
        next(m for m in checked if m["role"] == "user")["image"] = image
    names = {t["function"]["name"] for t in (checked[0].get("tools") or []) if t.get("type") == "function"}
    return checked, names


def parse_chat(body: Any, infer: InferConfig, tokenizer, vision: bool) -> ChatRequest:
    """The request, checked whole; ApiError (400) names the first parameter at fault."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, None)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise bad(f"n={n!r} must be a positive integer", "n")
    if n is not None and n > 1:
        raise bad(
            f"n={n}: this server returns one choice per request; send {n} requests instead", "n", "unsupported_value"
        )
    for key, allowed in UNSUPPORTED.items():
        if body.get(key) not in allowed:
            raise bad(
                f"{key}={body.get(key)!r} is not supported by glmtune's server; leave it out",
                key,
                "unsupported_parameter",
            )
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad('response_format: only {"type": "text"}', "response_format", "unsupported_parameter")
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    seed = _number(body, "seed", -(2**63), 2**63 - 1, integer=True)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, 1, 2**63 - 1, integer=True)
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise bad("stream must be true or false, stream_options an object", "stream")
    messages, tool_names = glm_messages(body, vision)
    try:
        ids, image = encode_prompt(messages, tokenizer)
    except (ValueError, KeyError, TypeError) as err:  # e.g. a tool type the template cannot render
        raise bad(f"messages cannot be rendered with GLM-4's chat template: {err}", "messages") from None
    sample = infer.do_sample if temperature is None else temperature > 0
    settings = replace(
        infer,
        do_sample=sample,
        temperature=temperature or infer.temperature,
        top_p=top_p if top_p is not None else infer.top_p,
    )
    seed = seed % 2**32 if seed is not None and sample else None  # numpy's seed range, as infer.seed
    return ChatRequest(
        messages,
        ids,
        image,
        settings,
        max_tokens,
        seed,
        _stops(body.get("stop")),
        tool_names,
        stream,
        bool(options.get("include_usage")),
    )
