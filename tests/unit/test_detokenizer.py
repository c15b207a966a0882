from kvferry.services.gateway.detokenizer import IncrementalText


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
