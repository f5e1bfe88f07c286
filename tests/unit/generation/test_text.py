"""Incremental detokenisation: the streamed pieces add up to the whole text; stop strings are cut and held back."""

from __future__ import annotations

from coalesce.generation.text import IncrementalText


class Bytes:
    """A tokenizer whose tokens are single UTF-8 bytes (so characters can span tokens)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text: IncrementalText, data: bytes, *, final_take: bool = True) -> list[str]:
    pieces = []
    for byte in data:
        text.add(byte)
        pieces.append(text.take(final=False))
        if text.stopped:
            break
    text.finish()
    if final_take:
        pieces.append(text.take(final=True))
    return pieces


def test_pieces_add_up_and_never_split_a_character():
    text = IncrementalText(Bytes())
    pieces = feed(text, "naïve 🙂 text".encode())
    assert "".join(pieces) == "naïve 🙂 text"
    assert all("\ufffd" not in p for p in pieces)


def test_a_stop_string_ends_the_text_before_it_and_is_held_back_in_streams():
    text = IncrementalText(Bytes(), stop=("STOP",))
    pieces = feed(text, b"abc STOP and more")
    assert text.stopped and text.text == "abc "
    assert "".join(pieces) == "abc "
    assert not any("S" in p for p in pieces), "no part of the stop string is ever sent"


def test_text_that_could_start_a_stop_string_is_sent_once_it_cannot():
    text = IncrementalText(Bytes(), stop=("xyz",))
    pieces = feed(text, b"axyb c")
    assert not text.stopped and "".join(pieces) == "axyb c"


def test_an_incomplete_character_at_the_end_is_kept():
    text = IncrementalText(Bytes())
    feed(text, "é".encode()[:1])
    assert text.text == "\ufffd"
