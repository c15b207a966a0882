"""Each token's bytes, for decoding a byte-level BPE tokenizer's output without it: the bytes joined and read as
UTF-8 are its decode, and a tokenizer whose decode is not that gets no table."""

import pytest

from kvferry.common.model_files import resolve_model
from kvferry.common.text_tokenizer import TextTokenizer
from kvferry.services.gateway.token_bytes import token_bytes

pytestmark = pytest.mark.slow  # the default model's tokenizer (make model)


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


def test_a_tokenizer_whose_decode_cleans_up_spaces_gets_no_table():
    tokenizer = TextTokenizer(resolve_model(None))
    tokenizer.clean_up_tokenization_spaces = True  # " ," becomes "," across tokens: not a join of bytes
    assert token_bytes(tokenizer) is None


def test_a_tokenizer_without_a_byte_level_backend_gets_no_table():
    class Pieces:
        def decode(self, ids, skip_special_tokens=True):
            return "".join("ab"[i] for i in ids)

    assert token_bytes(Pieces()) is None
