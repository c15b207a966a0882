"""Each token's bytes, for decoding a byte-level BPE tokenizer's output without it: the bytes joined and read as
UTF-8 are its decode, and a tokenizer whose decode is not that gets no table."""

import pytest
from tokenizers import Tokenizer, decoders, models

from kvferry.common.model_files import resolve_model
from kvferry.common.text_tokenizer import TextTokenizer
from kvferry.services.gateway.detokenizer import IncrementalText
from kvferry.services.gateway.token_bytes import CHAR_BYTES, token_bytes

slow = pytest.mark.slow  # the default model's tokenizer (make model)


@slow
def test_the_default_tokenizers_tokens_join_into_its_decode():
    tokenizer = TextTokenizer(resolve_model(None))
    table = token_bytes(tokenizer)
    assert table is not None and len(table) == len(tokenizer)
    text = "Grüße, 世界! emoji 🙂👍🏽 and <|im_start|> naïve café\n\ttabs"
    ids = tokenizer.encode(text, add_special_tokens=False)
    special = [i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special][:3]
    for sequence in (ids, [*special, *ids], ids[::-1], ids[1:-1:2]):  # cut characters and special tokens too
        joined = b"".join(table[i] for i in sequence).decode("utf-8", "replace")
        assert joined == tokenizer.decode(sequence, skip_special_tokens=True)


@slow
def test_a_tokenizer_whose_decode_cleans_up_spaces_gets_no_table():
    tokenizer = TextTokenizer(resolve_model(None))
    tokenizer.clean_up_tokenization_spaces = True  # " ," becomes "," across tokens: not a join of bytes
    assert token_bytes(tokenizer) is None


def test_a_tokenizer_without_a_byte_level_backend_gets_no_table():
    class Pieces:
        def decode(self, ids, skip_special_tokens=True):
            return "".join("ab"[i] for i in ids)

    assert token_bytes(Pieces()) is None


class ByteLevelTokenizer:
    """A byte-level BPE tokenizer as TextTokenizer wraps one: its backend, decode, no clean-up of spaces."""

    clean_up_tokenization_spaces = False

    def __init__(self, vocab: dict[str, int]):
        self.backend = Tokenizer(models.BPE(vocab, []))
        self.backend.decoder = decoders.ByteLevel()

    def decode(self, ids, skip_special_tokens=False):
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_a_token_past_a_hole_in_the_vocabulary_is_in_the_table():
    # Ids need not be contiguous: the vocabulary's size (a count) is not where its last id ends.
    bytes_in_order = sorted(CHAR_BYTES, key=CHAR_BYTES.get)
    tokenizer = ByteLevelTokenizer({char: i for i, char in enumerate(bytes_in_order)} | {"\u0120hello": 300})
    ids = [ord("a"), 300, ord("!")]
    text = IncrementalText(tokenizer, [])
    assert text.add(ids) + text.flush() == tokenizer.decode(ids, skip_special_tokens=True) == "a hello!"
