"""Chat messages as OpenAI sends them, checked before the chat template sees them: each has a role and text content
(null beside an assistant's tool_calls; a tool's also needs its tool_call_id), each error naming where it is.
"""

import json

from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.responses import text_of


def checked_messages(messages) -> list[dict]:
    """The messages with their content as plain text (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} with text content", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def call_arguments(call: dict):
    """A checked tool call's arguments as data (what chat templates that render tool calls expect)."""
    arguments = call["function"]["arguments"]
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def _message(message, where: str) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"'{where}' must be an object with a 'role' and text 'content'", where)
    role, content, calls = message["role"], text_of(message.get("content")), message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ApiError(400, f"'{where}': only assistant messages carry tool_calls", f"{where}.tool_calls")
        if not isinstance(calls, list) or not calls:
            raise ApiError(400, f"'{where}.tool_calls' must be a non-empty list", f"{where}.tool_calls")
        for i, call in enumerate(calls):
            _call(call, f"{where}.tool_calls[{i}]")
    if not isinstance(content, str) and not (calls is not None and content is None):
        raise ApiError(400, f"'{where}.content' must be text", f"{where}.content")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ApiError(400, f"'{where}.tool_call_id' must be the id of the call this answers", f"{where}.tool_call_id")
    return dict(message, content=content)


def _call(call, where: str) -> None:
    shape = '{"id", "type": "function", "function": {"name", "arguments"}}'
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise ApiError(400, f"'{where}' must be {shape}", where)
    if not isinstance(call.get("id", ""), str):
        raise ApiError(400, f"'{where}.id' must be a string", f"{where}.id")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ApiError(400, f"'{where}.function.name' must be a non-empty string", f"{where}.function.name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(
            400, f"'{where}.function.arguments' must be a JSON object, as text", f"{where}.function.arguments"
        )
