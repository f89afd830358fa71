"""Prompts and training text of GLM-4-0414 / GLM-Z1-0414, rendered with the checkpoint's own jinja chat template
(tokenizer_config.json `chat_template`), as the engines render it: what trains is what vLLM and transformers put in
front of the model at inference.

The template is compiled as transformers 4.42+ (and so vLLM) compiles chat templates: a sandboxed environment with
trim_blocks and lstrip_blocks, loop controls, `{% generation %}` blocks rendered as their body, a `tojson` filter
that is json.dumps (key order kept, non-ASCII as is: transformers 4.40.2's jinja built-in sorted keys, escaped
non-ASCII and refused `ensure_ascii`, which the GLM-4-0414 templates pass), `raise_exception` and `strftime_now`;
the special tokens (`eos_token`, ...) are template variables. A GLM message's `tools` (on its system message, the
official fine-tune format) become the template's `tools`; a system message that carried only tools is dropped, as an
OpenAI request carries them beside the messages.

Which tokens are trained (data.pipeline's loss mask):
- the last assistant message: the prompt is the template's rendering of the messages before it with the
  generation prompt (`<|assistant|>`; GLM-Z1: `<|assistant|>\\n<think>`), and the trained text is what the model
  writes after that prompt: the rest of the template's rendering of the message, tokenized on its own (an engine
  tokenizes the prompt alone, and the reply follows it token by token), then the terminator;
- every earlier assistant message: the span the template renders for it inside that prompt, after the part the
  generation prompt would have given (so the role token stays context), and the token after the span (the next
  role token: the model learns to stop). Its text is the history's, as the template writes it: GLM-Z1's template
  drops every earlier turn's `<think>...</think>`, so those turns train their answers only;
- GLM-Z1 (a generation prompt that opens `<think>`): the last turn's reasoning is trained (`data.thinking=keep`),
  or dropped (`drop`: `<think></think>` and the answer, so the model learns to answer without reasoning after the
  same prompt); an answer without a `<think>` block trains as one with empty reasoning.
Earlier turns must render as a prefix of later ones (every GLM-4-0414 template does); a template that rewrites
the history otherwise is refused with a ValueError naming the turn.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINKING = ("keep", "drop")


@lru_cache(maxsize=8)
def compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): its body, unmarked."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def template_inputs(messages: list[dict[str, Any]]) -> tuple[list[dict] | None, list[dict]]:
    """(tools, messages) for the template from GLM messages: tools off the system messages (see above)."""
    tools, out = None, []
    for message in messages:
        message = {k: v for k, v in copy.deepcopy(message).items() if v is not None}
        if message.get("role") == "system" and message.get("tools"):
            tools = (tools or []) + list(message.pop("tools"))
            if not message.get("content"):
                continue
        message.pop("tools", None)
        message.setdefault("content", "")
        out.append(message)
    return tools, out


class ChatTemplate:
    """A checkpoint's chat template with the variables its tokenizer gives it."""

    def __init__(self, source: str, variables: dict[str, Any]):
        self.source, self.variables = source, variables
        self.compiled = compile_template(source)

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.compiled.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        """The text an engine puts before the reply to GLM `messages` (ending on the turn to answer)."""
        tools, msgs = template_inputs(messages)
        return self.render(msgs, True, tools)

    def generation_prompt(self, msgs: list[dict], tools) -> tuple[str, str]:
        """(history, what add_generation_prompt appends to it) for template messages `msgs`."""
        history, prompt = self.render(msgs, False, tools), self.render(msgs, True, tools)
        if not prompt.startswith(history):
            raise ValueError(
                "the chat template's generation prompt rewrites the history before it: glmtune cannot "
                "tell the prompt from the reply"
            )
        return history, prompt[len(history) :]

    def training(
        self, messages: list[dict[str, Any]], thinking: str = "keep"
    ) -> tuple[str, list[tuple[int, int]], str]:
        """(prompt text, character spans of the earlier assistant turns trained inside it, the last assistant turn's
        trained text), as the module docstring says."""
        if thinking not in THINKING:
            raise ValueError(f"thinking={thinking!r}: use one of {', '.join(THINKING)}")
        tools, msgs = template_inputs(messages)
        turns = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
        if not turns:
            raise ValueError("a training conversation needs an assistant message")
        last = turns[-1]
        history, gen = self.generation_prompt(msgs[:last], tools)
        prompt = history + gen
        spans = []
        for i in turns[:-1]:
            before, turn_gen = self.generation_prompt(msgs[:i], tools)
            after = self.render(msgs[: i + 1], False, tools)
            if not (after.startswith(before) and prompt.startswith(after)):
                raise ValueError(
                    f"the chat template renders message {i} (an earlier assistant turn) differently "
                    "once later messages follow: glmtune cannot find its span in the prompt"
                )
            block = after[len(before) :]
            # The role token stays context; so does what the generation prompt would give, up to an opened
            # <think>, which the history form of a GLM-Z1 turn does not have.
            given = turn_gen.split(THINK_OPEN, 1)[0]
            spans.append((len(before) + _common_prefix(given, block), len(after)))
        return prompt, spans, self._reply(msgs, tools, last, history, gen, thinking)

    def _reply(self, msgs, tools, last: int, history: str, gen: str, thinking: str) -> str:
        """The text the model writes after the prompt for message `last`."""
        message = msgs[last]
        if THINK_OPEN not in gen:
            block = self.render(msgs[: last + 1], False, tools)[len(history) :]
        else:  # the template strips reasoning from what it renders: render a stand-in, then put the content back
            stand_in = "\x00glmtune-reply\x00"
            block = self.render(msgs[:last] + [{**message, "content": stand_in}], False, tools)[len(history) :]
            if block.count(stand_in) != 1:
                raise ValueError("the chat template does not render an assistant message's content once")
            block = block.replace(stand_in, _with_thinking(str(message.get("content") or ""), thinking))
        if not block.startswith(gen):
            raise ValueError(
                f"the chat template renders the assistant turn as {block[:40]!r}..., which does not "
                f"follow its generation prompt {gen!r}"
            )
        return block[len(gen) :]


def _with_thinking(content: str, thinking: str) -> str:
    """A GLM-Z1 reply as trained: `<think>reasoning</think>answer` (keep) or `<think></think>answer` (drop)."""
    content = content.strip()
    if THINK_CLOSE not in content:
        return THINK_OPEN + THINK_CLOSE + content
    reasoning, answer = content.split(THINK_CLOSE, 1)
    reasoning = reasoning.split(THINK_OPEN, 1)[-1]
    return THINK_OPEN + (reasoning if thinking == "keep" else "") + THINK_CLOSE + answer


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
