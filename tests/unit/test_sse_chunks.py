"""A stream's chunk of text alone, made from a template: the same bytes as building the chunk and dumping it."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.services.gateway.choices import Delta
from kvferry.services.gateway.responses import TEXT_MARK, ChatShape, CompletionShape, sse


def dumped(shape, index: int, text: str) -> bytes:
    return b"".join(sse(shape.chunk([choice])) for choice in shape.delta_choices(index, Delta(text, None, None)))


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.text(), st.sampled_from(["", '"', "\\", "\n\t", "\x00", "\u2028", "🙂 世界", "\ufffd", TEXT_MARK])
    ),
    index=st.integers(0, 300),
    chat=st.booleans(),
    model=st.sampled_from(["tiny", 'a "quoted" model', "模型", TEXT_MARK]),
)
def test_a_text_chunk_is_the_dumped_chunk_byte_for_byte(text, index, chat, model):
    shape = (ChatShape if chat else CompletionShape)("chatcmpl-0123", model)
    assert shape.text_chunk(index, text) == dumped(shape, index, text)
    assert json.loads(shape.text_chunk(index, text)[len(b"data: ") :])  # still one JSON object
