"""Structured outputs: a request's tokens constrained to a language (any JSON value, JSON that
follows a schema, a regular expression, one of a list of strings, an EBNF grammar). xgrammar
(https://github.com/mlc-ai/xgrammar, the `structured` extra) compiles the grammar against the
checkpoint's own tokenizer and tells, before each token, which token ids keep the output a
prefix of the language.

A spec is a pair (kind, text), hashable and picklable so it travels in a step's commands:

    ("json", "")              any JSON value (OpenAI's response_format json_object)
    ("json_schema", schema)   JSON text following the schema (a JSON string)
    ("regex", pattern)        the pattern (xgrammar's regex syntax)
    ("choice", options)       exactly one of the strings (options: a JSON list of strings)
    ("ebnf", grammar)         an EBNF grammar whose start rule is `root`

A JSON schema is compiled without free whitespace (`any_whitespace=False`: the separators are
", " and ": "): a random or weak model left free to emit whitespace can fill its whole budget
with it.

Where it runs: every rank keeps a matcher per constrained request (sampling is replicated, so
every rank applies the same mask and gets the same token). Before a step, each constrained
row's allowed ids are written as a bitmask [rows, ceil(V / 32)] int32 (bit j of word w: id
32 w + j), uploaded, unpacked on the device and applied to the row's processed logits (-inf
elsewhere, helix/runtime/sampler.py process_rows); after the step the row's token is accepted
by its matcher, and a matcher that has accepted a stop token (the language is complete) ends
the request with finish reason "stop". A constrained row needs its previous token on the host
to know its mask, so a step holding one does not overlap the step before it.

Compiling a new schema takes from milliseconds to seconds (the tokenizer's vocabulary against
the grammar). `Grammars.prepare` starts it on a background thread (xgrammar releases the GIL
while it compiles); the serving loop holds such a request back until `ready`, so the other
requests' steps go on meanwhile (and every rank is told to start its own compile at once).
`compile` waits for a compile in flight, or compiles in place when none was started.
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from helix.errors import RequestError

KINDS = ("json", "json_schema", "regex", "choice", "ebnf")
CACHE = 64                       # compiled grammars kept per engine (least recently used out)


def check_spec(spec) -> tuple[str, str] | None:
    """A grammar spec as SamplingParams keeps it: None, or (kind, text) with a known kind."""
    if spec is None:
        return None
    if (not isinstance(spec, (tuple, list)) or len(spec) != 2 or spec[0] not in KINDS
            or not isinstance(spec[1], str)):
        raise RequestError(f"grammar must be (kind, text) with kind one of {', '.join(KINDS)}, "
                           f"got {spec!r}: e.g. grammar=('regex', '(yes|no)')")
    return (spec[0], spec[1])


def choice_spec(options) -> tuple[str, str]:
    """("choice", ...) of a list of strings."""
    if (isinstance(options, (str, bytes)) or not hasattr(options, "__iter__")
            or not (options := list(options))
            or not all(isinstance(o, str) and o for o in options)):
        raise RequestError(f"a choice is a non-empty list of non-empty strings, got {options!r}")
    return ("choice", json.dumps(options))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise RequestError("structured outputs need xgrammar: pip install -e \".[structured]\""
                           ) from None
    return xgrammar


class Grammars:
    """Grammars compiled for one checkpoint's tokenizer (loaded on first use), cached."""

    def __init__(self, model: str, vocab: int):
        self.model, self.vocab = model, vocab
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._building: dict[tuple[str, str], Future] = {}   # compiles in flight
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()       # one compile at a time (and the compiler's set-up)

    def prepare(self, spec: tuple[str, str]) -> None:
        """Start compiling `spec` in the background (nothing when it is compiled or under
        way); an error is raised by `compile`."""
        if spec in self._cache or spec in self._building:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="helix-grammar")
        self._building[spec] = self._pool.submit(self._build, spec)

    def ready(self, spec: tuple[str, str]) -> bool:
        """`compile(spec)` returns (or raises) without waiting."""
        fut = self._building.get(spec)
        return spec in self._cache or (fut is not None and fut.done())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def compiler(self):
        if self._compiler is None:
            from helix.serving.tokenizer import load_tokenizer
            tok = load_tokenizer(self.model)
            if tok is None:
                raise RequestError(f"structured outputs need the checkpoint's tokenizer and "
                                   f"{self.model} has none (a preset takes token ids only): "
                                   f"use a checkpoint directory with its tokenizer files")
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=self.vocab)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: tuple[str, str]):
        """The compiled grammar of a spec; a spec that does not compile is a RequestError
        naming the kind and xgrammar's first line."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        fut = self._building.pop(spec, None)
        grammar = fut.result() if fut is not None else self._build(spec)
        self._cache[spec] = grammar
        if len(self._cache) > CACHE:
            self._cache.popitem(last=False)
        return grammar

    def _build(self, spec: tuple[str, str]):
        """Compile (on whichever thread calls it; one at a time)."""
        with self._lock:
            return self._compile(self.compiler(), spec)

    @staticmethod
    def _compile(comp, spec: tuple[str, str]):
        kind, text = spec
        try:
            if kind == "json":
                grammar = comp.compile_builtin_json_grammar()
            elif kind == "json_schema":
                grammar = comp.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                grammar = comp.compile_regex(text)
            elif kind == "choice":
                options = json.loads(text)
                grammar = comp.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(o) for o in options))
            else:
                grammar = comp.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", why)      # xgrammar's time, file:line
            why = re.sub(r"^Check failed: .*? is false: ", "", why)
            raise RequestError(f"the {kind} grammar does not compile: {why}") from None
        return grammar

    def matcher(self, spec: tuple[str, str], rollback: int = 0) -> "Matcher":
        """A matcher at the start of the language; `rollback`: tokens it may look ahead by
        (speculative decoding's guesses, Matcher.fill_ahead)."""
        with warnings.catch_warnings():      # (newer xgrammar: always unlimited, deprecated)
            warnings.simplefilter("ignore", DeprecationWarning)
            return Matcher(_xgrammar().GrammarMatcher(self.compile(spec),
                                                      max_rollback_tokens=rollback))


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher):
        self.m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of a host bitmask [m, ceil(V / 32)] int32: the ids allowed next."""
        self.m.fill_next_token_bitmask(bitmask, row)

    def fill_ahead(self, bitmask: torch.Tensor, row: int, guesses) -> None:
        """Rows row .. row + len(guesses) of a host bitmask: the ids allowed after guesses[:j]
        for each j (speculative decoding's rows); rows past a guess the language refuses keep
        every id (such a row's token is never kept). The matcher ends where it was."""
        self.m.fill_next_token_bitmask(bitmask, row)
        taken = 0
        for g in guesses:
            if not self.m.accept_token(g):
                break
            taken += 1
            if self.m.is_terminated():           # a stop token: nothing follows it
                break
            self.m.fill_next_token_bitmask(bitmask, row + taken)
        if taken:
            self.m.rollback(taken)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    @property
    def done(self) -> bool:
        """It has accepted a stop token: the output is a whole sentence of the language."""
        return bool(self.m.is_terminated())


def bitmask(rows: int, vocab: int) -> torch.Tensor:
    """A host bitmask [rows, ceil(vocab / 32)] int32 allowing every id."""
    return torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32)


def allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Unpack a bitmask [m, W] int32 (any device) -> [m, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()
