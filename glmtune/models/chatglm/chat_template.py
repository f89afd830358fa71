"""The jinja chat template glmtune writes into an export whose base folder had none (the tiny checkpoints, or a
folder stripped of its tokenizer_config.json): other tools (transformers' `apply_chat_template`, vLLM's chat
endpoint) render prompts from it, so it must write the same text as glmtune's own tokenizers
(`render_message`): the text the adapter was trained on.

Built from the tokenizers' own pieces (the GLM-4 tools block's sentences, ChatGLM3's tools JSON), not copied
from a checkpoint. Jinja details that decide the text: transformers compiles templates with trim_blocks and
lstrip_blocks, so every newline here is inside a `{{ ... }}` string (a literal newline after a `%}` would be
dropped); a string literal is Python-escaped text, which `json.dumps` writes.

    GLM-4     [gMASK]<sop> + per message: (<|system|> tools block) (<|role|>metadata\\ncontent) + <|assistant|>
    ChatGLM3  [gMASK]sop   + per message: <|role|>metadata\\n content                          + <|assistant|>

GLM-4V's image prefix is not in the template (its official checkpoint renders images in Python, not jinja).
`tojson(indent=4)` is the tools' JSON: on transformers >= 4.42 the same text as glmtune's (key order kept,
non-ASCII as is); 4.40's jinja sorts keys and escapes non-ASCII, as it does for the official template too.
"""

from __future__ import annotations

import json

from .tokenization_glm4 import _BUILTIN_TOOLS, _FUNCTION_SUFFIX, _TOOLS_INTRO


def _literal(text: str) -> str:
    """A jinja string literal holding `text` exactly (JSON's escapes are jinja's)."""
    return json.dumps(text, ensure_ascii=False)


def glm4_template(assistant_name: str = "GLM-4") -> str:
    builtins = "".join(
        f"{{% elif tool['type'] == {_literal(kind)} %}}{{{{ {_literal(chr(10) + '## ' + kind + chr(10) * 2 + text)} }}}}"
        for kind, text in _BUILTIN_TOOLS.items()
    )
    tools = (
        "{% if item['tools'] is defined and item['tools'] is not none %}<|system|>"
        f"{{{{ {_literal(chr(10) + _TOOLS_INTRO.format(name=assistant_name))} }}}}"
        "{% for tool in item['tools'] %}{% if tool['type'] == 'function' %}"
        "{{ '\\n## ' ~ tool['function']['name'] ~ '\\n\\n' }}{{ tool['function'] | tojson(indent=4) }}"
        f"{{{{ {_literal(_FUNCTION_SUFFIX)} }}}}{builtins}{{% endif %}}{{% endfor %}}{{% endif %}}"
    )
    message = (
        "{% if item['content'] %}<|{{ item['role'] }}|>{{ item['metadata'] or '' }}{{ '\\n' }}"
        "{{ item['content'] }}{% endif %}"
    )
    return (
        "[gMASK]<sop>{% for item in messages %}" + tools + message + "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def chatglm3_template() -> str:
    content = (
        "{% set content = item['content'] or '' %}"
        "{% if item['role'] == 'system' and item['tools'] is defined and item['tools'] is not none %}"
        "{% set content = content ~ '\\n' ~ (item['tools'] | tojson(indent=4)) %}{% endif %}"
    )
    return (
        "[gMASK]sop{% for item in messages %}"
        + content
        + "<|{{ item['role'] }}|>{{ item['metadata'] or '' }}{{ '\\n' }}{% if content %} {{ content }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def chat_template_for(tokenizer) -> str:
    """The template for one of glmtune's tokenizers (GLM-4 / GLM-4V or ChatGLM3)."""
    if tokenizer.family == "chatglm3":
        return chatglm3_template()
    return glm4_template(getattr(tokenizer, "tools_assistant_name", "GLM-4"))
