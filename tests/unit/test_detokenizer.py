import functools
import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.model_files import resolve_model
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason
from kvferry.common.text_tokenizer import TextTokenizer
from kvferry.services.gateway.choices import Choices
from kvferry.services.gateway.detokenizer import PARTIAL, IncrementalText
from kvferry.services.gateway.request_parsing import Generation
from kvferry.services.gateway.responses import TokenText


class PieceTokenizer:
    """Token i decodes to PIECES[i]; enough to drive the incremental text logic."""

    PIECES = ["Hel", "lo", " wor", "ld", "!", " bye", "\ufffd"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


def run(ids, stop):
    text = IncrementalText(PieceTokenizer(), stop)
    out = []
    for i in ids:
        out.append(text.add([i]))
        if text.stopped:
            break
    out.append(text.flush())
    return "".join(out), text.stopped, out


def test_plain_text_streams_whole():
    assert run([0, 1, 2, 3, 4], [])[0] == "Hello world!"


def test_stop_string_across_tokens_is_cut_and_never_leaked():
    text, stopped, pieces = run([0, 1, 2, 3, 4, 5], ["o wo"])
    assert text == "Hell" and stopped
    assert all("o wo" not in "".join(pieces[:k]) for k in range(len(pieces) + 1))


def test_a_possible_stop_prefix_is_held_back_then_released():
    text = IncrementalText(PieceTokenizer(), ["ld?"])
    assert text.add([0, 1, 2]) == "Hello wor"
    assert text.add([3]) == ""  # "ld" may become "ld?"
    assert text.add([4]) == "ld!"  # it did not
    assert not text.stopped


def test_partial_characters_wait_for_the_next_token():
    text = IncrementalText(PieceTokenizer(), [])
    assert text.add([0, 6]) == "Hel"


def longest_stops(alphabet_of_the_text: str) -> list[str]:
    """As many stop strings as the default limits allow, each of the longest allowed length. Each starts like the
    text (partial matches at every period) and goes on with a character the text never has, so none matches."""
    limits = GatewayConfig()
    count = min(limits.max_stop, limits.max_stop_chars // limits.max_stop_length)
    starts = [alphabet_of_the_text[i:] for i in range(count)]
    return [(s + "#" * limits.max_stop_length)[: limits.max_stop_length] for s in starts]


def work_per_period(tokenizer, pattern: list[int], stops: list[str], checkpoints: list[int]) -> list[tuple]:
    """Feed the pattern of token ids over and over, one token per add; at each checkpoint (a multiple of the
    pattern's length), the tokens and characters decoded and the characters compared over the next period. Checked
    as it goes, so that code whose work grows fails at the first checkpoint past it, not after 20,000 tokens."""
    text = IncrementalText(tokenizer, stops)
    measured = []
    for i in range(max(checkpoints) + len(pattern) + 1):
        if i in checkpoints:
            before = (text.tokens_decoded, text.chars_decoded, text.chars_compared)
        if i - len(pattern) in checkpoints:
            now = (text.tokens_decoded, text.chars_decoded, text.chars_compared)
            measured.append(tuple(b - a for a, b in zip(before, now)))
            assert measured[-1] == measured[0], (i - len(pattern), measured)
        text.add([pattern[i % len(pattern)]])
        assert not text.stopped
    assert len(measured) == len(checkpoints)
    return measured


def test_the_work_per_token_does_not_grow_with_the_output():
    pattern = [0, 1, 2, 3, 4]  # "Hello world!"
    measured = work_per_period(PieceTokenizer(), pattern, longest_stops("Hello world!"), [100, 1_000, 20_000])
    assert all(measured[0])  # the counters count


def test_a_stop_string_that_ends_first_cuts_and_of_those_ending_together_the_longest():
    assert run([0, 1, 2, 3, 4], ["llo world", "o w"])[:2] == ("Hell", True)  # "o w" ends first
    assert run([0, 1, 2, 3, 4], ["o w", "lo w"])[:2] == ("Hel", True)  # both end at "w": cut at the earlier start
    text = IncrementalText(PieceTokenizer(), ["ld!"])
    assert text.add([0, 1, 2, 3, 4, 5]) == "Hello wor" and text.stopped  # a match inside one chunk
    assert text.add([5]) == "" and text.flush() == ""  # nothing after the stop


def test_held_back_text_is_sent_at_the_end():
    text = IncrementalText(PieceTokenizer(), ["ld?"])
    assert text.add([0, 1, 2, 3]) == "Hello wor"
    assert text.flush() == "ld" and not text.stopped


def test_a_stop_string_that_ends_in_the_partial_character_at_the_end_is_found_by_flush():
    text = IncrementalText(PieceTokenizer(), ["!\ufffd"])
    assert text.add([0, 4, 6]) == "Hel" and not text.stopped  # "\ufffd" may still become a character
    assert text.flush() == "" and text.stopped
    generation = Generation([1], SamplingParams(), ["!\ufffd"], stream=True, include_usage=False)
    choices = Choices([generation], PieceTokenizer(), TokenText(PieceTokenizer()), chat=False)
    last = SimpleNamespace(choice=0, first_token=None, token_ids=[0, 4, 6], finish_reason=FinishReason.LENGTH)
    delta = choices.apply(last)
    assert (delta.text, delta.reason) == ("Hel", "stop")


def cut_at_first_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference: the whole text, cut before the stop string that ends first (the longest of those ending there)."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text.endswith(s, 0, end)]
        if ending:
            return text[: end - max(ending)], True
    return text, False


def stream(tokenizer, ids: list[int], chunks: list[int], stops: list[str]) -> tuple[list[str], bool]:
    """ids added in chunks of the given sizes (round and round), then a flush: the pieces sent and `stopped`."""
    text = IncrementalText(tokenizer, stops)
    pieces, start = [], 0
    for size in itertools.cycle(chunks):
        if start >= len(ids) or text.stopped:
            break
        pieces.append(text.add(ids[start : start + size]))
        start += size
    pieces.append(text.flush())
    return pieces, text.stopped


def check_stream(tokenizer, ids, chunks, stops):
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    expected, stopped = cut_at_first_stop(whole, stops)
    pieces, was_stopped = stream(tokenizer, ids, chunks, stops)
    assert "".join(pieces) == expected and was_stopped == stopped, (ids, chunks, stops, pieces, whole)
    for k in range(len(pieces)):  # never a piece to take back, never a stop string leaked
        assert expected.startswith("".join(pieces[:k]))


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), max_size=40),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    stops=st.lists(st.text("Helo wrd!by\ufffd", min_size=0, max_size=6), max_size=4),
)
def test_any_chunking_sends_the_whole_text_cut_at_the_first_stop(ids, chunks, stops):
    check_stream(PieceTokenizer(), ids, chunks, stops)


# The default model's tokenizer (byte-level BPE): partial characters, special tokens, emoji and CJK.
slow = pytest.mark.slow  # these need the default model (make model)
TEXTS = [
    "Grüße, 世界! 日本語のテキスト 中文",
    "emoji 🙂👍🏽 🇫🇷 👨‍👩‍👧 and a lone 🦀",
    "naïve café — “quotes” ½ ∑ ∞",
    "plain ascii words, numbers 12345 and\nnewlines\t\ttabs",
]


@functools.cache
def default_tokenizer() -> TextTokenizer:
    return TextTokenizer(resolve_model(None))


def byte_token(tokenizer: TextTokenizer, byte: int) -> int:
    """The token of one raw byte, through byte-level BPE's byte-to-character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + others.index(byte))
    return tokenizer.backend.token_to_id(char)


@functools.cache
def token_pools() -> dict[str, list]:
    tokenizer = default_tokenizer()
    return {
        "special": sorted(i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special),
        "partial": [i for i in range(len(tokenizer)) if PARTIAL in tokenizer.decode([i])],
        "texts": [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS],
    }


def token_ids(pools: dict, vocab_size: int):
    """Segments, each a special token, a token of partial bytes, any token, or a run of a text's tokens."""
    segment = st.one_of(
        st.sampled_from(pools["special"]).map(lambda t: [t]),
        st.sampled_from(pools["partial"]).map(lambda t: [t]),
        st.integers(0, vocab_size - 1).map(lambda t: [t]),
        st.tuples(st.sampled_from(pools["texts"]), st.integers(0, 40), st.integers(1, 40)).map(
            lambda x: x[0][x[1] : x[1] + x[2]]
        ),
    )
    return st.lists(segment, max_size=16).map(lambda segments: [t for s in segments for t in s])


@slow
@settings(max_examples=300, deadline=None)
@given(data=st.data(), chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_any_chunking_of_real_tokens_sends_exactly_what_decode_gives(data, chunks):
    tokenizer = default_tokenizer()
    ids = data.draw(token_ids(token_pools(), len(tokenizer)))
    check_stream(tokenizer, ids, chunks, [])


@slow
@settings(max_examples=300, deadline=None)
@given(data=st.data(), chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_any_chunking_of_real_tokens_with_stop_strings_cuts_at_the_first(data, chunks):
    tokenizer = default_tokenizer()
    ids = data.draw(token_ids(token_pools(), len(tokenizer)))
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    inside = st.tuples(st.integers(0, max(0, len(whole) - 1)), st.integers(1, 4)).map(lambda x: whole[x[0] : sum(x)])
    stops = data.draw(st.lists(st.one_of(inside, st.text("a e🙂世\ufffd", max_size=3)), max_size=4))
    check_stream(tokenizer, ids, chunks, stops)


@slow
def test_special_tokens_between_the_bytes_of_a_character():
    tokenizer = default_tokenizer()
    first, *rest = tokenizer.encode(" 日", add_special_tokens=False)
    assert rest  # the character spans tokens
    special = token_pools()["special"][0]
    for ids in ([first, special, *rest], [first, *rest, special], [special, first, special, *rest]):
        pieces, _ = stream(tokenizer, ids, [1], [])
        assert "".join(pieces) == " 日" and PARTIAL not in "".join(pieces)


def periodic_checkpoints(period: int) -> list[int]:
    """Multiples of the period near 100, 1,000 and 20,000 tokens."""
    return [max(1, round(n / period)) * period for n in (100, 1_000, 20_000)]


@slow
def test_the_work_per_token_does_not_grow_with_real_text():
    tokenizer = default_tokenizer()
    text = " ".join(TEXTS)
    pattern = tokenizer.encode(text, add_special_tokens=False)
    assert "#" not in text
    work_per_period(tokenizer, pattern, longest_stops(text), periodic_checkpoints(len(pattern)))


@slow
@pytest.mark.parametrize("byte", [0xF0, 0x80])  # a lead byte broken by the next, a continuation byte alone
def test_bytes_that_never_make_a_character_keep_the_window_short(byte):
    """logit_bias can force them: a window that waited for the character to complete would grow without end."""
    tokenizer = default_tokenizer()
    pattern = [byte_token(tokenizer, byte)]
    assert tokenizer.decode(pattern * 3) == PARTIAL * 3
    work_per_period(tokenizer, pattern, longest_stops("\ufffd"), periodic_checkpoints(1))
    pieces, _ = stream(tokenizer, pattern * 500, [1], [])
    assert "".join(pieces) == PARTIAL * 500


@slow
def test_a_run_of_special_tokens_keeps_the_window_short():
    tokenizer = default_tokenizer()
    pattern = [*token_pools()["special"][:3], byte_token(tokenizer, ord("a"))]
    work_per_period(tokenizer, pattern, longest_stops("a"), periodic_checkpoints(len(pattern)))
