"""Tool calls out of a choice's text, as it streams or whole: each block

    <tool_call>
    {"name": "NAME", "arguments": ARGS}
    </tool_call>

becomes a call; the text outside the blocks is the message's content.

One parser serves both, so a whole response's arguments are exactly the streamed fragments joined. Fed text piece by
piece, it gives back what is safe to send: content (holding back what may begin `<tool_call>`), a call's start once
its name is known, then the arguments as they come, ended by a bracket count that knows strings and escapes. A block
in another shape (keys in another order) is read whole at its `</tool_call>`; one that does not parse, or is cut off,
stays text in a whole response (in a stream, what was sent of it stays sent).
"""

import json
import secrets
import string
from dataclasses import dataclass

from kvferry.services.gateway.tools import CALL_BEGIN, CALL_END

WHITESPACE = " \t\n\r"  # JSON's
WS, STRING = object(), object()  # pieces of a pattern: any whitespace, a JSON string
HEAD = (WS, "{", WS, '"name"', WS, ":", WS, STRING, WS, ",", WS, '"arguments"', WS, ":", WS, "{")
TAIL = (WS, "}", WS, CALL_END)
PARTIAL, FAILED, MATCHED = "partial", "failed", "matched"
ID_CHARS = string.ascii_letters + string.digits
TEXT, NAME, ARGUMENTS, CLOSING, OTHER_SHAPE = range(5)  # the parser's states


def call_id() -> str:
    return "call_" + "".join(secrets.choice(ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    index: int  # among the choice's calls, as the stream numbers them
    id: str
    name: str
    arguments: str = ""  # the arguments' JSON text, as generated
    raw: str = ""  # the block's text as generated (what a whole response shows when the call does not complete)
    complete: bool = False

    def as_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    call: ToolCall


@dataclass
class Arguments:
    call: ToolCall
    text: str


class ToolCallParser:
    def __init__(self):
        self.calls: list[ToolCall] = []
        self.state = TEXT
        self.buffer = ""  # received, not yet given back
        self.call: ToolCall | None = None  # the call whose arguments or closing are under way
        self.depth, self.in_string, self.escaped = 0, False, False  # the arguments' bracket count
        self.space = ""  # whitespace held while no other content has come: it is no content if calls follow
        self.has_content = False

    @property
    def num_complete(self) -> int:
        return sum(call.complete for call in self.calls)

    def feed(self, text: str) -> list:
        """The pieces (Content, CallStart, Arguments) that text makes safe to send."""
        out: list = []
        self.buffer += text
        while self._step(out):
            pass
        return out

    def finish(self) -> list:
        """At the end of the text: what was held back. A block not closed stays text if nothing of it was sent."""
        out: list = []
        if self.state in (TEXT, NAME, OTHER_SHAPE):
            self._content(out, (CALL_BEGIN if self.state != TEXT else "") + self.buffer)
        else:  # its start was sent: it stays a call, not complete
            self.call.raw += self.buffer
        self.buffer, self.state = "", TEXT
        if self.space and not self.num_complete:
            out.append(Content(self.space))
            self.space = ""
        return out

    def _step(self, out: list) -> bool:
        """Move on through the buffer; False when it needs more text."""
        if self.state == TEXT:
            at = self.buffer.find(CALL_BEGIN)
            if at < 0:
                keep = _prefix_at_end(self.buffer, CALL_BEGIN)
                self._content(out, self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return False
            self._content(out, self.buffer[:at])
            self.buffer, self.state = self.buffer[at + len(CALL_BEGIN) :], NAME
            return True
        if self.state == NAME:
            status, end, strings = _match(self.buffer, HEAD)
            if status == PARTIAL:
                return False
            name = _loads(strings[0]) if status == MATCHED else None
            if name is None:
                self.state = OTHER_SHAPE
                return True
            end -= 1  # the arguments' "{" is theirs
            self.call = ToolCall(len(self.calls), call_id(), name, raw=CALL_BEGIN + self.buffer[:end])
            self.calls.append(self.call)
            out.append(CallStart(self.call))
            self.buffer, self.state = self.buffer[end:], ARGUMENTS
            self.depth, self.in_string, self.escaped = 0, False, False
            return True
        if self.state == ARGUMENTS:
            end = self._arguments_end()
            piece = self.buffer if end < 0 else self.buffer[:end]
            if piece:
                self.call.arguments += piece
                self.call.raw += piece
                out.append(Arguments(self.call, piece))
            self.buffer = "" if end < 0 else self.buffer[end:]
            if end < 0:
                return False
            self.state = CLOSING
            return True
        if self.state == CLOSING:
            status, end, _ = _match(self.buffer, TAIL)
            if status == PARTIAL:
                return False
            if status == MATCHED:
                self.call.raw += self.buffer[:end]
                self.call.complete = isinstance(_loads(self.call.arguments), dict)
                self.buffer = self.buffer[end:]
            self.call, self.state = None, TEXT  # not closed as it should be: the call stays incomplete
            return True
        return self._other_shape(out)

    def _other_shape(self, out: list) -> bool:
        """A block whose head is not the usual one: read whole once it closes."""
        at = self.buffer.find(CALL_END)
        if at < 0:
            return False
        inner, self.buffer = self.buffer[:at], self.buffer[at + len(CALL_END) :]
        raw, self.state = CALL_BEGIN + inner + CALL_END, TEXT
        parsed = _whole_call(inner)
        if parsed is None:
            self._content(out, raw)
            return True
        call = ToolCall(len(self.calls), call_id(), parsed[0], parsed[1], raw, complete=True)
        self.calls.append(call)
        out += [CallStart(call), Arguments(call, call.arguments)]
        return True

    def _arguments_end(self) -> int:
        """Where the arguments' object closes in the buffer (the index after it), or -1 if not yet."""
        for i, ch in enumerate(self.buffer):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return -1

    def _content(self, out: list, text: str) -> None:
        if not text:
            return
        if not self.has_content:
            if not text.strip(WHITESPACE):
                self.space += text
                return
            text, self.space, self.has_content = self.space + text, "", True
        if out and isinstance(out[-1], Content):
            out[-1].text += text
        else:
            out.append(Content(text))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole choice's text: its content (None when only whitespace is left beside calls) and its complete calls."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    content = "".join(
        piece.text if isinstance(piece, Content) else piece.call.raw
        for piece in pieces
        if isinstance(piece, Content) or (isinstance(piece, CallStart) and not piece.call.complete)
    )
    calls = [call for call in parser.calls if call.complete]
    if calls and not content.strip(WHITESPACE):
        return None, calls
    return content, calls


def delta_pieces(pieces: list) -> list[dict]:
    """Parser pieces as OpenAI chat deltas, in order: {"content": ...} or {"tool_calls": [...]}, one per change of
    kind (a call's start carries its name and empty arguments, the fragments follow)."""
    out: list[dict] = []
    for piece in pieces:
        last = out[-1] if out else {}
        if isinstance(piece, Content):
            if "content" in last:
                last["content"] += piece.text
            else:
                out.append({"content": piece.text})
        elif isinstance(piece, CallStart):
            call = piece.call
            start = {"index": call.index, "id": call.id, "type": "function"}
            out.append({"tool_calls": [{**start, "function": {"name": call.name, "arguments": ""}}]})
        else:
            entry = last["tool_calls"][0] if "tool_calls" in last else {}
            if entry.get("index") == piece.call.index and "id" not in entry:
                entry["function"]["arguments"] += piece.text
            else:
                out.append({"tool_calls": [{"index": piece.call.index, "function": {"arguments": piece.text}}]})
    return out


def _match(text: str, pattern: tuple) -> tuple[str, int, list[str]]:
    """text against pattern from its start: PARTIAL (it may still match once more comes), FAILED or MATCHED, with
    where the match ends and the JSON strings it holds."""
    pos, strings = 0, []
    for piece in pattern:
        if piece is WS:
            while pos < len(text) and text[pos] in WHITESPACE:
                pos += 1
            if pos == len(text):
                return PARTIAL, pos, strings
        elif piece is STRING:
            if pos == len(text):
                return PARTIAL, pos, strings
            if text[pos] != '"':
                return FAILED, pos, strings
            end, escaped = pos + 1, False
            while end < len(text) and (escaped or text[end] != '"'):
                escaped = not escaped and text[end] == "\\"
                end += 1
            if end == len(text):
                return PARTIAL, pos, strings
            strings.append(text[pos : end + 1])
            pos = end + 1
        else:
            part = text[pos : pos + len(piece)]
            if not piece.startswith(part):
                return FAILED, pos, strings
            if len(part) < len(piece):
                return PARTIAL, pos, strings
            pos += len(piece)
    return MATCHED, pos, strings


def _prefix_at_end(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (and is shorter than it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _loads(text: str):
    """text's JSON value; None if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _whole_call(inner: str) -> tuple[str, str] | None:
    """(name, arguments text) from a block's JSON in any key order, or None."""
    value = _loads(inner)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str) and isinstance(_loads(arguments), dict):
        return value["name"], arguments
    if isinstance(arguments, dict):
        return value["name"], json.dumps(arguments, ensure_ascii=False)
    return None
