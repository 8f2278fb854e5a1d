"""KV import (prefill/decode disaggregation, helix/kv/transfer.py): a request that arrives with its
prompt's KV decodes the same tokens as one that prefills the prompt, on every layout; the KV comes
from Helix's own export (any layout: the format is layout-free) or from Hugging Face's cache, as a
dict or a safetensors file, for the whole prompt or a prefix of it."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import hf_greedy

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.errors import RequestError
from helix.kv.transfer import kv_from_hf, save_kv

RT = RuntimeConfig(page_size=4, max_context=96, max_batch=8, max_prefill_tokens=16)
N = 10                                         # tokens generated per request
P = [(7 * i + 3) % 120 + 3 for i in range(23)]   # 23 prompt tokens: several pages and chunks
PREFIX = 9                                     # a partial import: KV of the first 9 positions


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def run_all(llm) -> None:
    while llm.has_unfinished():
        llm.step()


def prefix_of(kv: dict, t: int) -> dict:
    return {i: tuple(x[:t] for x in v) if isinstance(v, tuple) else v[:t] for i, v in kv.items()}


OTHER = P[:PREFIX] + [5, 6, 7, 8]             # shares only the first PREFIX tokens with P


@pytest.fixture(scope="module")
def hf_kv(hf_checkpoint):
    """Transformers' KV of P (post-RoPE keys, as Helix caches them) and its greedy tokens for P
    and OTHER: the layout-free reference."""
    path, hf = hf_checkpoint("llama")
    with torch.no_grad():
        cache = hf(torch.tensor([P]), use_cache=True).past_key_values
    return path, kv_from_hf(cache), hf_greedy(hf, P, N)[0], hf_greedy(hf, OTHER, N)[0]


def test_hf_cache_import_decodes_transformers_tokens(hf_kv, tmp_path):
    """KV computed by transformers, as a dict and as a file, whole prompt and a prefix: Helix
    decodes HF's greedy tokens from it and prefills only what is missing."""
    path, kv, want, want_other = hf_kv
    with LLM(path, Layout(), RT) as llm:
        ids = [llm.add_request(P, greedy(), kv=kv),
               llm.add_request(P, greedy(), kv=save_kv(kv, str(tmp_path / "hf.safetensors"))),
               llm.add_request(OTHER, greedy(), kv=prefix_of(kv, PREFIX))]
        run_all(llm)
        assert [llm.outputs[i] for i in ids] == [want, want, want_other]
        assert llm.prefill_tokens_per_rank() == [1 + 1 + len(OTHER) - PREFIX]
        assert llm.stats()["kv_pages_used"] == [0]


LAYOUTS = [("llama", Layout(kvp=2, kv_interleave=4)),            # page-interleaved ownership
           ("llama", Layout(tpa=2)),                              # KV-head slices per rank
           ("tiny-deepseek-v3", Layout(kvp=2, ep=2))]              # MLA latent rows, MoE


@pytest.mark.parametrize("family,layout", LAYOUTS,
                         ids=["gqa-kvp2-I4", "gqa-tpa2", "mla-kvp2-ep2"])
def test_import_equals_local_prefill_on_every_layout(family, layout, hf_kv, tmp_path):
    """Local prefill, then its KV exported (gathered from every rank) and imported back as a
    dict, a file and a prefix: the same tokens. GQA: transformers' KV too, and the export
    equals it (the format does not depend on the layout)."""
    model = hf_kv[0] if family == "llama" else family
    with LLM(model, layout, RT) as llm:
        local = llm.add_request(P, greedy())
        local_other = llm.add_request(OTHER, greedy())
        while not llm.outputs[local]:
            llm.step()
        kv = llm.export_kv(local, len(P))
        imports = [kv, save_kv(kv, str(tmp_path / "kv.safetensors"))]
        if family == "llama":
            imports.append(hf_kv[1])
        ids = [llm.add_request(P, greedy(), kv=k) for k in imports]
        other = llm.add_request(OTHER, greedy(), kv=prefix_of(kv, PREFIX))
        run_all(llm)
        want = llm.outputs[local]
        assert [llm.outputs[i] for i in ids] == [want] * len(imports)
        assert llm.outputs[other] == llm.outputs[local_other]
        assert llm.stats()["kv_pages_used"] == [0] * layout.world_size
    if family == "llama":
        assert want == hf_kv[2] and llm.outputs[other] == hf_kv[3]
        for i, (k, v) in hf_kv[1].items():
            torch.testing.assert_close(kv[i][0], k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(kv[i][1], v, rtol=1e-4, atol=1e-4)


def test_bad_imports_are_one_line_errors(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("llama")
    with LLM(path, Layout(), RT) as llm:
        a = llm.add_request(P[:8], greedy(2))
        llm.step()
        kv = llm.export_kv(a)
        k, v = kv[0]
        bad_file = tmp_path / "x.safetensors"
        bad_file.write_bytes(b"not a safetensors file")
        for given, prompt, match in (
                ({0: (k, v)}, P[:8], "kv lacks layer 1"),
                ({**kv, 5: kv[0]}, P[:8], "kv holds layer 5"),
                ({0: (k, v[:, :1]), 1: kv[1]}, P[:8], r"kv layer 0: expected \(K"),
                ({0: (k, v), 1: tuple(x[:3] for x in kv[1])}, P[:8], "kv layer 1 holds 3"),
                ({0: k, 1: kv[1]}, P[:8], "kv layer 0: expected"),
                ({0: (k.long(), v.long()), 1: kv[1]}, P[:8], "floating point"),
                (kv, P[:5], "kv covers 8 positions, the prompt has 5"),
                ({"a": 1}, P[:8], "kv keys are layer indices"),
                (str(tmp_path / "missing.safetensors"), P[:8], "not found"),
                (str(bad_file), P[:8], "not a readable safetensors file"),
                (42, P[:8], "kv must be a dict")):
            with pytest.raises(RequestError, match=match):
                llm.add_request(prompt, greedy(), kv=given)
        with pytest.raises(RequestError, match="exclude each other"):
            llm.add_request(P, greedy(), synthetic_prefix=4, kv=kv)
        run_all(llm)
        with pytest.raises(RequestError, match="holds no KV now"):
            llm.export_kv(a)
        assert list(llm.outputs) == [a]
