"""The OpenAI response shapes: completion and chat, whole or streamed, with usage and logprobs."""

import json
import time
from json.encoder import encode_basestring_ascii

from kvferry.common.sequence import FinishReason

FINISH_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.DEAD_END: "error",
}
# In a choice that finished "error": its constraint left no token to sample (a grammar at odds with min_tokens, or
# one the vocabulary cannot spell). The text generated until then is kept.
DEAD_END_ERROR = {"message": "the output constraint allows no further token", "type": "constraint_dead_end"}


def text_of(content):
    """Chat content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    return content


def finish_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else FINISH_NAMES[reason]  # STOP is 0: test for None, not truth


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


TEXT_MARK = "\u2603kvferry text\u2603"  # stands for the text in a chunk's template


def usage(num_prompt: int, num_out: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


def _with_error(choice: dict, error: dict | None) -> dict:
    return {**choice, "error": error} if error else choice


class CompletionShape:
    has_role_chunk = False  # a stream's first chunk gives each choice's role
    object_name, chunk_name = "text_completion", "text_completion"

    def __init__(self, rid: str, model: str):
        self.base = {"id": rid, "created": int(time.time()), "model": model}
        self.text_templates: dict[int, tuple[bytes, bytes]] = {}  # choice index -> the bytes around its text

    def text_chunk(self, index: int, text: str) -> bytes:
        """sse(self.chunk(self.delta_choices(index, delta))) for a delta of text alone (no finish reason, logprobs,
        error or pieces), the same bytes without building and dumping the chunk: the text, JSON-encoded as dumps
        does, between the bytes before and after it, made once per choice by dumping a chunk with TEXT_MARK."""
        template = self.text_templates.get(index)
        if template is None:
            made = sse(self.chunk([self.delta_choice(index, TEXT_MARK, None, None)]))
            head, tail = made.rsplit(json.dumps(TEXT_MARK).encode(), 1)  # the last: the text comes after the names
            template = self.text_templates[index] = head, tail
        head, tail = template
        return b"%s%s%s" % (head, encode_basestring_ascii(text).encode(), tail)

    def choice(self, index: int, text: str | None, reason: str | None, logprobs, tool_calls=None, error=None) -> dict:
        return _with_error({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}, error)

    def delta_choice(self, index: int, text: str, reason: str | None, logprobs, error=None, piece=None) -> dict:
        """piece: a chat delta's own content (its role, a tool-call piece) in place of text."""
        return self.choice(index, text, reason, logprobs, error=error)

    def delta_choices(self, index: int, delta) -> list[dict]:
        """One event's Delta as stream choices: one, or (chat with tools) one per content or tool-call piece, the
        logprobs with the first and the finish reason with the last."""
        pieces = [None] if delta.pieces is None else (delta.pieces or [{}])
        last = len(pieces) - 1
        return [
            self.delta_choice(
                index,
                delta.text if piece is None else "",
                delta.reason if i == last else None,
                delta.logprobs if i == 0 else None,
                error=delta.error if i == last else None,
                piece=piece,
            )
            for i, piece in enumerate(pieces)
        ]

    def whole(self, choices: list[dict], use: dict) -> dict:
        return {**self.base, "object": self.object_name, "choices": choices, "usage": use}

    def chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        out = {**self.base, "object": self.chunk_name, "choices": choices}
        return out if use is None else {**out, "usage": use}


class ChatShape(CompletionShape):
    has_role_chunk = True
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def choice(self, index, text, reason, logprobs, tool_calls=None, error=None):
        message = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
        return _with_error({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}, error)

    def delta_choice(self, index, text, reason, logprobs, error=None, piece=None):
        if piece is None:
            piece = {"content": text} if text else {}
        return _with_error({"index": index, "delta": piece, "logprobs": logprobs, "finish_reason": reason}, error)

    def text_chunk(self, index: int, text: str) -> bytes:
        if not text:  # its delta is {}: not the template's
            return sse(self.chunk([self.delta_choice(index, text, None, None)]))
        return super().text_chunk(index, text)


class TokenText:
    """Token ids as the text OpenAI's logprobs show: each token decoded alone, cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


class CompletionLogprobs:
    """The completions API's logprobs object, built a few tokens at a time (a stream chunk, or the whole)."""

    def __init__(self, token_text: TokenText):
        self.token_text = token_text
        self.offset = 0  # characters before the next token, for text_offset

    def part(self, entries: list, token_ids: list[int]) -> dict:
        """entries: a p.Logprob (or None: the prompt's first token) per token id."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry, token_id in zip(entries, token_ids):
            text = self.token_text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            top = None
            if entry is not None:
                top = {self.token_text(i): v for i, v in zip(entry.top_ids, entry.top_logprobs)}
                top.setdefault(text, entry.logprob)  # OpenAI's top_logprobs always hold the chosen token
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(top)
        return out

    @staticmethod
    def join(parts: list[dict]) -> dict:
        return {
            key: [v for part in parts for v in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }


class ChatLogprobs:
    def __init__(self, token_text: TokenText):
        self.token_text = token_text

    def _one(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def part(self, entries: list, token_ids: list[int]) -> dict:
        return {
            "content": [
                {
                    **self._one(entry.token_id, entry.logprob),
                    "top_logprobs": [self._one(i, v) for i, v in zip(entry.top_ids, entry.top_logprobs)],
                }
                for entry in entries
            ]
        }

    @staticmethod
    def join(parts: list[dict]) -> dict:
        return {"content": [item for part in parts for item in part["content"]]}
