"""Tiny tokenizers saved next to a tiny HF checkpoint (tests/hf_fixtures.py), so text tests run
without downloads, 128 tokens each (the fixtures' vocabulary): a word-level one (whitespace
pre-tokenizer, a chat template of plain words), and a character-level one whose tokens decode by
concatenation, as real tokenizers' do (structured outputs: JSON and regexes over characters)."""

from __future__ import annotations

import os
import shutil

SPECIAL = ["<unk>", "<|end|>"]
WORDS = ("user assistant system : . , ? ! the a an and or but if then so of to in on at by for "
         "with from up down out over under again once here there when where why how all any both "
         "each few more most other some such no nor not only own same than too very can will just "
         "should now cat dog bird fish tree river stone cloud rain snow wind fire light dark red "
         "blue green gold silver small large old new good bad fast slow high low hot cold happy "
         "sad run walk jump swim fly sing read write speak think know see hear feel make take "
         "give find tell ask work play rest sleep eat drink house road city sea sky sun moon "
         "star day night").split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def vocab(size: int = 128) -> dict[str, int]:
    words = SPECIAL + WORDS
    assert len(set(words)) == len(words) and len(words) >= size, len(words)
    return {w: i for i, w in enumerate(words[:size])}


def save_tokenizer(path: str, size: int = 128) -> str:
    """tokenizer.json + tokenizer_config.json (with the chat template) in `path`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(WordLevel(vocab(size), unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|end|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return path


def checkpoint_with_tokenizer(src: str, dst: str, chars: bool = False) -> str:
    """A copy of the checkpoint at `src` with the word-level tokenizer (chars: the
    character-level one) added (the fixtures' checkpoints are shared by other tests, so they
    stay untouched)."""
    if not os.path.isdir(dst):
        shutil.copytree(src, dst)
        (save_char_tokenizer if chars else save_tokenizer)(dst)
    return dst


CHAR_PIECES = ['{"', '"}', '":', '","', '":"', '"]', '["', 'true', 'false', 'null', 'red',
               'blue', 'green', 'name', 'color', 'yes', 'no', 'the', 'and', 'cat', 'dog', 'age',
               'ok', '10', '42', '00', 'ing', 'er', 'on', 'in', 'at']


def char_vocab() -> dict[str, int]:
    """<unk>, <|end|>, the 95 printable ASCII characters, 31 multi-character pieces."""
    words = SPECIAL + [chr(c) for c in range(32, 127)] + CHAR_PIECES
    assert len(set(words)) == len(words) == 128, len(words)
    return {w: i for i, w in enumerate(words)}


def save_char_tokenizer(path: str) -> str:
    """A character-level tokenizer (prompts encode one character a token; the pieces are only
    generated), decoding by concatenation, eos <|end|>."""
    from tokenizers import Regex, Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(WordLevel(char_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|end|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return path
