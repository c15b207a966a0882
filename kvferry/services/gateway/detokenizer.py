"""Incremental detokenization with stop strings, as the gateway streams a request's text."""


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far, up to a stop string if one was hit
        self.emitted = 0  # characters already handed out
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; return the text that is now safe to send."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        # A stop string can span tokens: search the whole tail that could hold a new match.
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        self.text = text
        # Hold back what may still change: a partial UTF-8 character, or the start of a stop string.
        safe = len(text) if self.stopped else len(text.rstrip("\ufffd"))
        if not self.stopped:
            for s in self.stop:
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:k]):
                        safe = min(safe, len(text[:safe]) - k)
                        break
        delta = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def flush(self) -> str:
        """At the end, whatever was held back."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
