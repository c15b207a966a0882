"""Each token's bytes, for a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, Llama 3, Qwen): its decode of a list
of tokens is their bytes joined and read as UTF-8 (an invalid or cut-off sequence read as U+FFFD), so text can be
decoded a token at a time without calling the tokenizer, through an incremental UTF-8 decoder.

Only where that holds: a decoder that is ByteLevel alone and no clean-up of spaces. Checked once per tokenizer,
every token alone against the tokenizer's own decode; any difference and the caller decodes through the tokenizer.
"""

from functools import lru_cache


def _char_bytes() -> dict[str, int]:
    """Byte-level BPE's table: each byte is written as one printable character (printable bytes as themselves, the
    rest as the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


CHAR_BYTES = _char_bytes()


def _bytes_of(token: str) -> bytes:
    """As the ByteLevel decoder reads a token's string: its characters' bytes, or, where one is not in the table
    (an added token with a space), the string's own UTF-8."""
    try:
        return bytes(CHAR_BYTES[c] for c in token)
    except KeyError:
        return token.encode()


@lru_cache(maxsize=8)
def skipped_ids(tokenizer) -> frozenset[int]:
    """The special tokens that decode skips. They never change the text (decode drops them before it joins the rest),
    so they are dropped at once: a run of them must not grow the window."""
    backend = getattr(tokenizer, "backend", None)  # TextTokenizer's tokenizers.Tokenizer
    if backend is None:
        return frozenset()
    return frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)


@lru_cache(maxsize=8)
def token_bytes(tokenizer) -> tuple[bytes, ...] | None:
    """Token id -> its bytes in decode(..., skip_special_tokens=True) (special tokens: none); None when this
    tokenizer's decode is not a join of its tokens' bytes."""
    backend = getattr(tokenizer, "backend", None)  # TextTokenizer's tokenizers.Tokenizer
    if backend is None or type(backend.decoder).__name__ != "ByteLevel" or tokenizer.clean_up_tokenization_spaces:
        return None
    # Its last id, not its count of tokens (get_vocab_size): ids may leave holes, and a token past one must be in.
    ids = backend.get_vocab(with_added_tokens=True).values()
    size = max(ids, default=-1) + 1
    if size > 2 * len(ids):  # a vocabulary mostly holes: no table that large
        return None
    special = skipped_ids(tokenizer)
    table = tuple(b"" if i in special else _bytes_of(backend.id_to_token(i) or "") for i in range(size))
    alone = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    if any(text != data.decode("utf-8", "replace") for text, data in zip(alone, table)):
        return None
    return table
