"""Streaming detokenization with characters split over byte-level tokens."""

from __future__ import annotations

import pytest

from kvmesh.make_model import train_tokenizer
from kvmesh.router.text.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def decoder(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def test_emoji_split_over_four_tokens_is_emitted_whole(tok):
    ids = tok.encode("😀", add_special_tokens=True).ids
    assert len(ids) == 5 and ids[0] == 0  # BOS, then the four UTF-8 bytes as tokens
    d = IncrementalDetokenizer(decoder(tok))
    assert [d.push([i]) for i in ids] == ["", "", "", "", "😀"]
    assert d.flush() == ""


def test_deltas_join_to_the_full_text_and_never_hold_a_replacement_char(tok):
    text = "héllo wörld 😀 日本 and ascii"
    ids = tok.encode(text, add_special_tokens=True).ids
    d = IncrementalDetokenizer(decoder(tok))
    deltas = [d.push([i]) for i in ids]
    assert "".join(deltas) + d.flush() == text
    assert not any("\ufffd" in x for x in deltas)
    # In bigger chunks the same text comes out.
    d2 = IncrementalDetokenizer(decoder(tok))
    assert "".join(d2.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + d2.flush() == text


def test_flush_emits_an_incomplete_character_at_end_of_stream(tok):
    ids = tok.encode("a 日", add_special_tokens=True).ids  # BOS, a, space, then 3 byte tokens of 日
    d = IncrementalDetokenizer(decoder(tok))
    assert len(ids) == 6 and [d.push([i]) for i in ids[:-1]] == ["", "a", " ", "", ""]
    assert d.flush() == "\ufffd"
    assert (d.push([]), d.flush()) == ("", "")
