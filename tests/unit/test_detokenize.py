from backends.serving.detokenize import TextStream


def stream_text(tokenizer, ids, stop=None, prompt_ids=None):
    text = TextStream(tokenizer, stop, prompt_ids)
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


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace: '▁' marks a word's leading space, and the
    decoder drops it on the first token of a decode call), as Llama-2 and Mistral have."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = ["The capital of France is Paris.", "Rome is the capital of Italy.", "Paris is in France."] * 20
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_metaspace_output_keeps_its_leading_space():
    tokenizer = metaspace_tokenizer()
    prompt = tokenizer("The capital of France is")["input_ids"]
    output = tokenizer("The capital of France is Paris. Rome is")["input_ids"][len(prompt) :]
    assert tokenizer.convert_ids_to_tokens(output)[0].startswith("▁Paris")
    pieces, text = stream_text(tokenizer, output, prompt_ids=prompt)
    assert "".join(pieces) == " Paris. Rome is"
    assert text.text == " Paris. Rome is"
    # Without the prompt as context the first space is lost: what the fix is about.
    assert tokenizer.decode(output, skip_special_tokens=True) == "Paris. Rome is"


def test_byte_level_output_is_the_same_with_prompt_context(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer("café naïve")["input_ids"]
    output = tokenizer(" 東京 ✓ done")["input_ids"]
    pieces, _ = stream_text(tokenizer, output, prompt_ids=prompt)
    assert "".join(pieces) == " 東京 ✓ done"


class CharTokenizer:
    """One token per character: stop-string tests without a vocabulary in the way."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_stop_strings_match_the_naive_search():
    import random

    rng = random.Random(0)
    for _ in range(300):
        output = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        pieces, text = stream_text(CharTokenizer(), [ord(c) for c in output], stop=stops)
        # The reference: after each token, cut at the earliest stop string the text contains.
        expected, found = output, False
        for n in range(1, len(output) + 1):
            hits = [output[:n].find(s) for s in stops if s in output[:n]]
            if hits:
                expected, found = output[: min(hits)], True
                break
        assert text.text == expected and "".join(pieces) == expected, (output, stops)
        assert text.stopped == found
        for i in range(len(pieces)):  # nothing handed out could still begin a stop string
            sent = "".join(pieces[: i + 1])
            assert not any(s in sent for s in stops)


def test_many_long_stop_strings_cost_linear_time():
    import time

    # 32 stops of 1024 characters (the caps) that nearly match every tail of the output.
    stops = ["a" * 500 + "x" + "a" * 522 + chr(0x4E00 + i) for i in range(32)]
    output = "a" * 4000
    start = time.perf_counter()
    pieces, text = stream_text(CharTokenizer(), [ord(c) for c in output], stop=stops)
    elapsed = time.perf_counter() - start
    assert not text.stopped and "".join(pieces) == output
    # Each step holds back the longest tail that begins a stop string: checking every
    # prefix length (O(stops x L^2)) took 3.5 s for the first 1000 characters here, the
    # matcher 0.15 s for all 4000 (the bound is loose for slow machines).
    assert elapsed < 2.0, elapsed
