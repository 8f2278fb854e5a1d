"""Text in and out: the checkpoint's own tokenizer (Hugging Face `transformers.AutoTokenizer`, read
from the checkpoint directory only, never downloaded), its chat template, and incremental
detokenization for streams.

Presets (random weights) ship no tokenizer: they take and return token ids; asking one for text
is a one-line error naming the fix.
"""

from __future__ import annotations

import os

from helix.errors import HelixError, RequestError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer:
    """A loaded tokenizer: encode text, render chat messages, decode ids (special tokens
    skipped), and a per-request incremental decoder."""

    def __init__(self, hf, path: str):
        self.hf, self.path = hf, path
        self.backend = getattr(hf, "backend_tokenizer", None)  # tokenizers.Tokenizer (fast)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Prompt text -> ids, with the tokenizer's special tokens (e.g. BOS)."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages [{"role", "content"}] (and the request's tools) -> prompt ids through
        the checkpoint's chat template, ending with the assistant's turn."""
        if not self.has_chat_template:
            raise RequestError(f"the tokenizer in {self.path} has no chat template: send a plain "
                               f"prompt (/v1/completions, --prompt) instead")
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=False, **({"tools": tools} if tools
                                                                  else {}))
        except Exception as e:   # a template's own raise_exception (e.g. roles out of order)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RequestError(f"messages: the chat template refused them: {why}") from None
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One id's text alone, special tokens included (log-probabilities name tokens by it;
        a piece of a character split across tokens decodes to U+FFFD)."""
        return self.hf.decode([token], skip_special_tokens=False)

    def detokenizer(self) -> "Detokenizer":
        return Detokenizer(self)


class Detokenizer:
    """Incremental decoding of one request's generated ids: `add(ids)` returns the new text.
    The deltas concatenate to decode(all ids); bytes of a character split across tokens are
    held back until it is whole (tokenizers' DecodeStream on fast tokenizers; re-decoding the
    whole output on others)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.text = ""
        self.stream = None
        if tok.backend is not None:
            from tokenizers.decoders import DecodeStream
            self.stream = DecodeStream(skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        if self.stream is not None:
            out = []
            for t in ids:
                piece = self.stream.step(self.tok.backend, t)
                if piece:
                    out.append(piece)
            delta = "".join(out)
        else:
            self.ids += ids
            full = self.tok.decode(self.ids)
            if full.endswith("\ufffd"):          # a character split across tokens: wait
                return ""
            delta = full[len(self.text):]
        self.text += delta
        return delta


def has_tokenizer_files(model: str) -> bool:
    return os.path.isdir(model) and any(os.path.isfile(os.path.join(model, f))
                                        for f in TOKENIZER_FILES)


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer a checkpoint directory ships, or None (a preset, or no tokenizer files)."""
    if not has_tokenizer_files(model):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise HelixError("text needs the transformers package: pip install "
                         "'helix-decode[serve]', or give token ids") from None
    try:
        hf = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as e:
        raise HelixError(f"the tokenizer in {model} does not load: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return Tokenizer(hf, model)


def require_tokenizer(model: str, tok: Tokenizer | None, what: str = "--prompt") -> Tokenizer:
    """tok, or the one-line error for text asked of a model without a tokenizer."""
    if tok is None:
        kind = "a preset (random weights, no tokenizer)" if not os.path.isdir(model) else \
            "a checkpoint without tokenizer files"
        raise HelixError(f"{what} needs a tokenizer and {model} is {kind}: give token ids "
                         f"(--prompt-ids), or a checkpoint directory with tokenizer.json")
    return tok
