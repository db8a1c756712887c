from backends.serving.detokenize import TextStream


def stream_text(tokenizer, ids, stop=None):
    text = TextStream(tokenizer, stop)
    pieces = []
    for token in ids:
        text.add(token)
        pieces.append(text.take())
        if text.stopped:
            break
    pieces.append(text.take(final=True))
    return pieces, text


def test_pieces_are_complete_characters_and_add_up(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sentence = "naïve café 東京 ✓ done"
    ids = tokenizer(sentence)["input_ids"]
    # Multi-byte characters are split over byte-level tokens: the stream must hold them back.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    pieces, _ = stream_text(tokenizer, ids)
    assert "".join(pieces) == sentence
    assert all("\ufffd" not in p for p in pieces)
    for p in pieces:
        p.encode("utf-8")  # every piece is valid on its own


def test_stop_string_is_cut_and_held_back(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    pieces, text = stream_text(tokenizer, ids, stop=["fox jumps"])
    assert text.stopped
    assert "".join(pieces) == "The quick brown "
    assert not any("fox" in p for p in pieces)


def test_text_that_only_looks_like_a_stop_prefix_is_released(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer("the dog sleeps")["input_ids"]
    pieces, text = stream_text(tokenizer, ids, stop=["dogma"])
    assert not text.stopped and "".join(pieces) == "the dog sleeps"
