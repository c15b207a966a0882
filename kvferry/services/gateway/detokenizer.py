"""Incremental detokenization with stop strings, its work per new token bounded however long the output (decoding
all of it again per token once let one request freeze the event loop).

- A byte-level BPE tokenizer's tokens are decoded without it: their bytes (token_bytes.py) through an incremental
  UTF-8 decoder, which holds back the bytes of a character not yet complete.
- Other tokenizers' tokens are decoded in a short window, as vLLM's and tokenizers' DecodeStream: it starts a token or
  two before the unread ones, so the tokenizer sees the context it needs (a word's leading space, a character's first
  bytes).
- Stop strings are found by one Aho-Corasick automaton; its state is the longest suffix of the text that begins a
  stop string, which is also what must be held back.
"""

import codecs
from collections import deque
from functools import lru_cache

from kvferry.services.gateway.token_bytes import skipped_ids, token_bytes

PARTIAL = "\ufffd"  # what decode shows for the bytes of a character not yet complete (and for invalid bytes)
SETTLE_AFTER = 4  # a UTF-8 character has at most 4 bytes: a window partial for longer is looked into
MAX_UNSETTLED = 32  # a window partial for this many tokens settles anyway (only bytes that never make characters)


class StopStrings:
    """An Aho-Corasick automaton over the stop strings (depth: a state's characters, to hold back). Of the stop
    strings that end at one character, the longest counts, so the text is cut earliest."""

    def __init__(self, stops: tuple[str, ...]):
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.matched = [0]  # the length of the longest stop string that ends the state's text, 0 for none
        for stop in stops:
            node = 0
            for ch in stop:
                if ch not in self.children[node]:
                    self.children[node][ch] = len(self.children)
                    self.children.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.matched.append(0)
                node = self.children[node][ch]
            self.matched[node] = len(stop)
        self.starts = frozenset(self.children[0])  # the first characters of the stop strings
        self.fallback = [0] * len(self.children)  # the state of the longest proper suffix of the state's text
        queue = deque(self.children[0].values())
        while queue:  # breadth first: a state's fallback is shallower, so it is complete by then
            node = queue.popleft()
            self.matched[node] = self.matched[node] or self.matched[self.fallback[node]]
            for ch, child in self.children[node].items():
                self.fallback[child] = self.scan(self.fallback[node], ch)[0]
                queue.append(child)

    def scan(self, state: int, text: str) -> tuple[int, int, int]:
        """Feed text from state: (the state after it, or after its first match; the index just past that match in
        text, -1 for none; the steps taken, each one character compared)."""
        if state == 0 and self.starts.isdisjoint(text):  # most text: nothing in it starts a stop string
            return 0, -1, len(text)
        children, fallback, matched = self.children, self.fallback, self.matched
        steps = 0
        for i, ch in enumerate(text):
            while state and ch not in children[state]:
                state = fallback[state]
                steps += 1
            state = children[state].get(ch, 0)
            steps += 1
            if matched[state]:
                return state, i + 1, steps
        return state, -1, steps


@lru_cache(maxsize=16)
def stop_strings(stops: tuple[str, ...]) -> StopStrings | None:
    """Built once for a request's choices (and for requests that send the same stop strings)."""
    return StopStrings(stops) if stops else None


class IncrementalText:
    """One choice's text, a few tokens at a time. add returns what is safe to send, holding back a partial character
    and what may begin a stop string; with flush's at the end, it is tokenizer.decode(all the tokens,
    skip_special_tokens=True), cut before the stop string that ends first (then `stopped`)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stops = stop_strings(tuple(s for s in stop if s))
        self.token_bytes = token_bytes(tokenizer)
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.skipped = skipped_ids(tokenizer)
        self.token_ids: list[int] = []
        # The window is token_ids[prefix_offset:]; its text starts with prefix_text, the text of the tokens up to
        # read_offset, which was passed on already. Its text after that is `unread`, of which `known` characters
        # were passed on: all but the partial characters at its end.
        self.prefix_offset = self.read_offset = 0
        self.prefix_text = ""
        self.unread = ""
        self.known = 0
        self.state = 0  # of the stop strings' automaton, after all the text passed on
        self.held = ""  # passed on, not sent: it may begin a stop string
        self.stopped = False
        self.tokens_decoded = 0  # given to the tokenizer's decode
        self.chars_decoded = 0  # returned by it
        self.chars_compared = 0  # steps of the stop strings' automaton

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text that is now safe to send."""
        if self.stopped:
            return ""
        if self.token_bytes is not None:
            table, size = self.token_bytes, len(self.token_bytes)
            new = self.utf8.decode(b"".join([table[t] if 0 <= t < size else b"" for t in token_ids]))
            self.tokens_decoded += len(token_ids)
            self.chars_decoded += len(new)
            return self._pass_on(new)
        self.token_ids.extend(t for t in token_ids if t not in self.skipped)
        return self._pass_on(self._read())

    def flush(self) -> str:
        """At the end, whatever was held back (a partial character at the end stays as decode shows it)."""
        if self.stopped:
            return ""
        if self.token_bytes is not None:
            text = self._pass_on(self.utf8.decode(b"", final=True))
        else:
            text = self._pass_on(self.unread[self.known :])
            self.known = len(self.unread)
        if not self.stopped:
            text, self.held = text + self.held, ""
        return text

    def _decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.tokens_decoded += len(token_ids)
        self.chars_decoded += len(text)
        return text

    def _read(self) -> str:
        """Decode the window; return the text newly known (all but the partial characters at its end)."""
        ids = self.token_ids
        window = self._decode(ids[self.prefix_offset :])
        self.unread = window[len(self.prefix_text) :]
        if self.unread and not self.unread.endswith(PARTIAL):
            return self._settle(len(ids), self.unread)
        new = ""
        if len(ids) - self.read_offset > SETTLE_AFTER:
            # Bytes that never make a character (logit_bias can force them) must not grow the window: settle before
            # the last token if decoding it apart gives the same text (its first byte starts a new character).
            head, last = self._decode(ids[self.prefix_offset : -1]), self._decode(ids[-1:])
            if (last and window == head + last) or len(ids) - self.read_offset > MAX_UNSETTLED:
                new = self._settle(len(ids) - 1, head[len(self.prefix_text) :])
                self.unread = window[len(head) :]
        known = self.unread.rstrip(PARTIAL)
        new += known[self.known :]
        self.known = max(self.known, len(known))
        return new

    def _settle(self, upto: int, final: str) -> str:
        """The tokens before upto are read: `final`, their text after read_offset, will not change. Returns the part
        of it not passed on yet."""
        new = final[self.known :]
        self.known = max(0, self.known - len(final))
        self.prefix_offset, self.read_offset = self.read_offset, upto
        self.prefix_text = self._decode(self.token_ids[self.prefix_offset : upto])
        self.unread = ""
        return new

    def _pass_on(self, new: str) -> str:
        """New text through the stop strings: returns what is safe to send, holds back what may begin one."""
        if not new or self.stops is None:
            return new
        state, end, steps = self.stops.scan(self.state, new)
        self.chars_compared += steps
        text = self.held + new
        if end >= 0:
            self.stopped = True
            cut = len(self.held) + end - self.stops.matched[state]
            self.held = ""
            return text[:cut]
        self.state = state
        keep = len(text) - self.stops.depth[state]
        self.held = text[keep:]
        return text[:keep]
