"""Text in and out (helix/serving/tokenizer.py, stream.py, `helix generate --prompt/--chat`): a
tiny checkpoint with a tokenizer the tests build (tests/serving_fixtures.py) generates
transformers' greedy text; streamed deltas add up to generate's tokens and text; presets refuse
text with one line; split characters wait until whole."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace

import pytest
from hf_fixtures import hf_greedy
from serving_fixtures import checkpoint_with_tokenizer

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.serving.stream import stream
from helix.serving.tokenizer import load_tokenizer

TEXTS = ["the cat and the dog run fast .", "red fish swim under the old bridge"]
N = 12
FLAGS = ["--max-new-tokens", str(N), "--ignore-eos", "--device", "cpu", "--dtype", "float32",
         "--max-context", "128", "--page-size", "4"]


@pytest.fixture(scope="module")
def tok_ckpt(hf_checkpoint, tmp_path_factory):
    """(checkpoint dir with tokenizer files, HF model, loaded Tokenizer)."""
    src, hf = hf_checkpoint("llama")
    path = checkpoint_with_tokenizer(src, str(tmp_path_factory.mktemp("tok") / "llama-tok"))
    return path, hf, load_tokenizer(path)


def hf_text(hf, tok, prompt_ids: list[int]) -> tuple[list[int], str]:
    ids = hf_greedy(hf, prompt_ids, N)[0]
    return ids, tok.hf.decode(ids, skip_special_tokens=True)


def helix_here(capsys, *args) -> subprocess.CompletedProcess:
    from helix.cli import main
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_generate_text_prompts_equal_transformers(tok_ckpt, capsys):
    path, hf, tok = tok_ckpt
    want = [hf_text(hf, tok, tok.encode(t)) for t in TEXTS]
    args = ["generate", "--model", path, *[a for t in TEXTS for a in ("--prompt", t)],
            "--prompt-ids", "5,6,7", *FLAGS]
    r = helix_here(capsys, *args, "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["tokens"][:2] == [ids for ids, _ in want]
    assert result["text"][:2] == [text for _, text in want]
    assert result["text"][2] == tok.decode(result["tokens"][2])   # ids in, text out too
    r = helix_here(capsys, *args)                                   # streamed to the terminal
    lines = r.stdout.splitlines()
    assert lines[0] == f"request 0: {want[0][1]}" and lines[2] == f"request 1: {want[1][1]}"
    assert lines[1] == f"  ({len(tok.encode(TEXTS[0]))} prompt tokens -> {N} new, length)"
    assert re.match(r"request 2 \(3 prompt tokens -> 12 new, length\): [\d ]+$", lines[4])


def test_generate_chat_uses_the_chat_template(tok_ckpt, capsys):
    path, hf, tok = tok_ckpt
    ids = tok.hf.encode(tok.hf.apply_chat_template([{"role": "user", "content": TEXTS[0]}],
                                                   add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    r = helix_here(capsys, "generate", "--model", path, "--prompt", TEXTS[0], "--chat", *FLAGS,
                   "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["text"] == [hf_text(hf, tok, ids)[1]]


@pytest.mark.parametrize("args,match", [
    (["--model", "tiny-llama", "--prompt", "hello"], "--prompt needs a tokenizer and tiny-llama is "
                                                     "a preset"),
    (["--model", "tiny-llama", "--prompt-ids", "1,2", "--chat"], "--chat applies to text"),
])
def test_text_without_a_tokenizer_is_one_line(args, match, capsys):
    r = helix_here(capsys, "generate", *args, *FLAGS)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"helix: error: {r.stderr.split(': ', 2)[2].strip()}"]
    assert match in r.stderr


def test_stream_deltas_equal_generate(tok_ckpt):
    """Requests joining at different steps, each yielding its tokens one step at a time: the
    deltas add up to generate's ids and to the decoded text."""
    path, _, tok = tok_ckpt
    prompts = [tok.encode(t) for t in TEXTS]
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    with LLM(path, Layout(), RuntimeConfig(page_size=4, max_context=128)) as llm:
        want = llm.generate(prompts, params)
        ids = [llm.add_request(p, params if i else replace(params, logprobs=1))
               for i, p in enumerate(prompts)]
        got = {i: ([], "") for i in ids}
        finished, logprobs = [], []
        for d in stream(llm, ids, tok):
            toks, text = got[d.request_id]
            got[d.request_id] = (toks + d.token_ids, text + d.text)
            assert len(d.token_ids) <= 1
            assert (d.logprobs is None) == (d.request_id != ids[0])
            if d.request_id == ids[0]:
                assert len(d.logprobs) == len(d.token_ids)
                logprobs += d.logprobs
            if d.finish_reason:
                finished.append((d.request_id, d.finish_reason))
        assert [got[i][0] for i in ids] == want
        assert [got[i][1] for i in ids] == [tok.decode(w) for w in want]
        assert sorted(finished) == [(i, "length") for i in ids]
        assert logprobs == llm.logprobs[ids[0]] and len(logprobs) == N


def test_detokenizer_holds_back_split_characters(tmp_path):
    """A byte-level BPE splits 'é' and emoji over several tokens: no delta carries a broken
    character, and the deltas add up to decode()."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["café crème brûlée", "hello world"],
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=
                                                pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    text = "naïve café 🙂 déjà vu"
    ids = tok.encode(text)
    d = tok.detokenizer()
    deltas = [d.add([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas) and "" in deltas   # some tokens wait


def test_stop_strings_split_across_outputs():
    from helix.serving.stop import StopStrings
    s = StopStrings(("STOP", "xy"))
    out = [s.feed(t) for t in ["hello S", "TO", "P and more"]]
    assert "".join(t for t, _ in out) == "hello " and out[-1][1] and not out[0][1]
    s = StopStrings(("STOP",))
    assert s.feed("abcST") == ("ab", False) and s.feed("x", final=True) == ("cSTx", False)
