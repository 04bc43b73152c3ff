"""Incremental detokenization: the DecodeStream path and the window path give a full decode's text."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specserve.assets import SHIPPED_TARGET
from specserve.engine.detokenizer import IncrementalDetokenizer, stream_backend


class WindowOnly:
    """A tokenizer seen through `decode` alone: the detokenizer's window path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def emitted(tokenizer, prompt: list[int], out: list[int]) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in out]
    assert "".join(pieces) == detok.text
    return detok.text, pieces


def continuation(tokenizer, prompt: list[int], out: list[int], window: int = 6) -> str:
    """What a full decode of the prompt's tail and the output adds to the tail's text."""
    tail = prompt[-window:]
    before = tokenizer.decode(tail, skip_special_tokens=True)
    return tokenizer.decode(tail + out, skip_special_tokens=True)[len(before):]


@pytest.fixture(scope="module")
def shipped():
    return AutoTokenizer.from_pretrained(SHIPPED_TARGET)


def test_byte_level_bpe_streams_a_full_decode(shipped):
    assert stream_backend(shipped) is not None and stream_backend(WindowOnly(shipped)) is None
    rng = random.Random(0)
    text = "déjà vu: naïve café 日本語 😀 x = {'k': [1, 2]}\n"
    for case in range(40):
        # prompts are text, whole characters; outputs any ids (cut characters, specials, random tokens)
        prompt = shipped.encode(text[rng.randrange(0, 20):rng.randrange(21, 40)], add_special_tokens=False)
        out = shipped.encode(text, add_special_tokens=False)[rng.randrange(0, 5):]
        out = [t if rng.random() < 0.8 else rng.choice([0, 1, 2, rng.randrange(shipped.vocab_size)]) for t in out]
        streamed, pieces = emitted(shipped, prompt, out)
        windowed, _ = emitted(WindowOnly(shipped), prompt, out)
        assert streamed == windowed == continuation(shipped, prompt, out), case
    whole = shipped.encode(text, add_special_tokens=False)
    assert emitted(shipped, [5, 6], whole)[0] == text  # every character whole, none held back at the end
    # a character split across tokens is held back until it is whole, then emitted once
    split = shipped.encode("日", add_special_tokens=False)
    assert len(split) > 1
    text, pieces = emitted(shipped, [5], split)
    assert text == "日" and pieces[:-1] == [""] * (len(split) - 1)


def test_ids_past_the_vocabulary_add_no_text(shipped):
    text, pieces = emitted(shipped, [5, 6], [7, 10 ** 6, 8])
    assert pieces[1] == "" and text == shipped.decode([7, 8], skip_special_tokens=True)


def metaspace_tokenizer(clean_up: bool = False) -> PreTrainedTokenizerFast:
    """A SentencePiece-style word tokenizer: '▁' marks a space, stripped at the start of a decode."""
    words = ["<unk>", "</s>", "▁hello", "▁world", "▁a", "b", "▁,", ",", "▁"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   clean_up_tokenization_spaces=clean_up)


def test_metaspace_continues_the_prompt():
    tok = metaspace_tokenizer()
    assert stream_backend(tok) is not None
    rng = random.Random(1)
    for case in range(30):
        prompt = [rng.randrange(2, 9) for _ in range(rng.randrange(1, 8))]
        out = [rng.randrange(0, 9) for _ in range(rng.randrange(1, 20))]
        streamed, _ = emitted(tok, prompt, out)
        windowed, _ = emitted(WindowOnly(tok), prompt, out)
        assert streamed == windowed == continuation(tok, prompt, out), (case, prompt, out)
    assert emitted(tok, [2], [3, 4])[0] == " world a"  # the space before the first output word is kept


def test_space_clean_up_keeps_the_tokenizers_own_decode():
    tok = metaspace_tokenizer(clean_up=True)
    assert stream_backend(tok) is None
    prompt, out = [2], [3, 6, 4]
    assert emitted(tok, prompt, out)[0] == continuation(tok, prompt, out)


def test_a_broken_stream_starts_afresh(shipped):
    """DecodeStream's state can break ("Invalid prefix encountered"); the detokenizer then decodes on with a new one."""
    detok = IncrementalDetokenizer(shipped, [5])

    class Broken:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered while decoding")

    detok._stream = Broken()
    ids = shipped.encode(" hello", add_special_tokens=False)
    assert "".join(detok.add(t) for t in ids) == shipped.decode(ids, skip_special_tokens=True)
    detok._stream = type("Other", (), {"step": lambda self, tok, i: 1 / 0})()
    with pytest.raises(ZeroDivisionError):  # any other error is not swallowed
        detok.add(ids[0])
