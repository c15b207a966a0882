"""How a conversation with tools reaches the chat template. One that renders tools gets them, with past calls'
arguments as data. One that does not (SmolLM2's) would drop them silently, so they go into the system prompt through
the tool prompt below (or --tool-prompt-template's); an assistant's tool_calls become its content, in the format the
model answers in, and consecutive tool messages one user message of `<tool_response>` blocks. With tool_choice "none" no tool shows.
"""

import json
from pathlib import Path

from kvferry.common import settings
from kvferry.common.errors import ConfigError
from kvferry.common.text_tokenizer import render_template
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.chat_messages import call_arguments
from kvferry.services.gateway.tools import CALL_BEGIN, CALL_END, Tools

# Variables: tools (the request's, as sent), tool_choice ("auto", "required" or {"type": "function", "function":
# {"name": ...}}) and parallel_tool_calls. Rendered in the chat templates' sandbox; surrounding whitespace is trimmed.
DEFAULT_TOOL_PROMPT = """\
# Tools

You may call functions to answer the user. Their descriptions, one JSON object per line:
<tools>
{% for tool in tools %}
{{ tool.function | tojson }}
{% endfor %}
</tools>

To call a function, answer with a JSON object holding its name and its arguments between <tool_call></tool_call> \
tags, one call per block:
<tool_call>
{"name": "the function's name", "arguments": {"an argument": "its value"}}
</tool_call>

{% if tool_choice == "required" %}
You must call at least one function.
{% elif tool_choice is mapping %}
You must call the function {{ tool_choice.function.name }}.
{% endif %}
{% if not parallel_tool_calls %}
Call one function at most.
{% endif %}
"""
SAMPLE = Tools(
    [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
    {"f": {"type": "object"}},
    "auto",
)


class ToolPrompt:
    """The system prompt text that shows the tools to a model whose chat template cannot."""

    def __init__(self, source: str | None = None):
        self.source = source or DEFAULT_TOOL_PROMPT
        self.render(SAMPLE)  # a template that cannot render fails here, when the gateway starts

    @classmethod
    def from_file(cls, path: str | None) -> "ToolPrompt":
        if path is None:
            return cls()
        label = settings.label("tool_prompt_template")
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{label}: cannot read {path}: {exc}") from None
        try:
            return cls(source)
        except Exception as exc:  # jinja2's syntax, undefined and security errors alike
            raise ConfigError(f"{label}: {path} does not render: {type(exc).__name__}: {exc}") from None

    def render(self, tools: Tools) -> str:
        return render_template(
            self.source, tools=tools.definitions, tool_choice=tools.tool_choice, parallel_tool_calls=tools.parallel
        ).strip()


def for_template(messages: list[dict], tools: Tools | None, renders_tools: bool, prompt: ToolPrompt):
    """(messages, tools) to hand the chat template (tools None: none to show)."""
    shown = tools if tools is not None and tools.calls_allowed else None
    if renders_tools:
        messages = [_with_data_arguments(m) if m.get("tool_calls") else m for m in messages]
        return messages, shown.definitions if shown else None
    messages = _without_tool_roles(messages)
    if shown is not None:
        try:
            text = prompt.render(shown)
        except Exception as exc:  # a custom template's raise_exception, or data it did not expect
            raise ApiError(400, f"the tool prompt template rejected the tools: {exc}", "tools") from None
        first = messages[0]
        if first["role"] == "system":
            messages[0] = dict(first, content=f"{text}\n\n{first['content']}" if first["content"] else text)
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages, None


def call_text(name: str, arguments) -> str:
    """A call as the model writes it (tools.py constrains it to this)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f'{CALL_BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{CALL_END}'


def _with_data_arguments(message: dict) -> dict:
    calls = [
        {**call, "function": {**call["function"], "arguments": call_arguments(call)}} for call in message["tool_calls"]
    ]
    return dict(message, tool_calls=calls)


def _without_tool_roles(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    merging = False  # out's last message holds tool results
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if merging:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            merging = True
            continue
        merging = False
        calls = message.get("tool_calls")
        message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            texts = [call_text(call["function"]["name"], call["function"]["arguments"]) for call in calls]
            message["content"] = "\n".join(([message["content"]] if message.get("content") else []) + texts)
        out.append(message)
    return out
