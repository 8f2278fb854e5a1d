"""The batched, counter-based sampler (helix/runtime/sampler.py and sampling_ops.py): its
Gumbel-max kernel against the torch formula (interpreter on CPU, compiled on a GPU), its filters
against a per-row reference, and that it samples the right distribution per row."""

import triton_mode  # noqa: F401  (must come before triton is imported)

import math

import pytest
import torch
from triton_mode import DEV

from helix.runtime import sampling_ops as sampler
from helix.runtime.sampler import Sampler
from helix.runtime.sampling import SamplingParams


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-row reference: logits [V] fp32 -> temperature-scaled logits with filtered entries
    at -inf."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample(logits, params, seeds, counters) -> list[int]:
    """Tokens the runtime's Sampler draws for these rows (its eager path)."""
    s = Sampler(logits.shape[0], logits.device)
    s.sample(logits, params, seeds, counters)
    return s.tokens.tolist()


@pytest.mark.parametrize("V", [7, 3000])
def test_gumbel_kernel_matches_the_torch_noise(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g)
    x[2, 5:] = float("-inf")                       # filtered entries are never drawn
    seeds = torch.tensor([1, 2, 3, 2**40 + 5, 0])
    counters = torch.tensor([0, 9, 4, 4, 123456])
    want = sampler.gumbel_argmax_torch(x, seeds, counters)
    got = sampler.gumbel_argmax_triton(x.to(DEV), seeds.to(DEV), counters.to(DEV)).cpu()
    assert torch.equal(got, want) and got[2] < 5


@pytest.mark.parametrize("V,block", [(7, 4), (3000, 512), (5000, 4096)])
def test_greedy_argmax_kernel_matches_torch(V, block):
    """The chunked greedy argmax (one launch, the last program of a row picks among chunks):
    torch.argmax's index, ties to the lowest index (within a chunk and across chunks), a NaN
    the largest value, -inf rows, rows past the logits untouched."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g)
    x[1, :] = 2.0                                           # all tied: index 0
    x[2, [V - 1, V // 2, 3]] = 9.0                          # ties in different chunks
    x[3, :] = float("-inf")
    x[4, V // 3] = float("nan")
    out = torch.full((8,), -7, dtype=torch.long)
    for rep in range(2):                                    # the arrival counters reset
        got = out.clone().to(DEV)
        sampler.greedy_argmax_triton(x.to(DEV), got, block)
        got = got.cpu()
        assert torch.equal(got[:6], torch.argmax(x, -1)), (rep, got, torch.argmax(x, -1))
        assert got[6:].tolist() == [-7, -7]


def test_sample_rows_draws_each_row_from_its_own_distribution():
    n, V = 3000, 6
    probs = torch.tensor([[0.5, 0.3, 0.2, 0, 0, 0], [0, 0, 0, 0.1, 0.1, 0.8]])
    logits = probs.clamp(min=1e-12).log().repeat(n, 1).to(DEV)
    B = 2 * n
    out = torch.full((B,), -1, dtype=torch.int64, device=DEV)
    temp = torch.ones(B, device=DEV)
    temp[-1] = 0.0                                  # greedy row: keeps what out holds
    sampler.sample_rows(logits, temp, torch.zeros(B, dtype=torch.int64, device=DEV),
                        torch.ones(B, device=DEV), torch.full((B,), 11, device=DEV),
                        torch.arange(B, device=DEV), out)
    out = out.cpu()
    assert out[-1] == -1
    for r in range(2):
        counts = torch.bincount(out[r:-1:2], minlength=V).float() / out[r:-1:2].numel()
        torch.testing.assert_close(counts, probs[r], atol=0.03, rtol=0)


def test_filter_logits():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0, 2.5])
    x = filter_logits(logits, SamplingParams(temperature=0.5, top_k=2))
    assert torch.isinf(x).tolist() == [True, False, True, True, False]
    assert x[1] == 6.0                                 # divided by the temperature
    # top_p: the smallest set of most likely tokens whose mass reaches p
    probs = logits.softmax(-1)                         # sorted: 3.0 .43, 2.5 .26, 2.0 .16, ...
    keep2 = float(probs[1] + probs[4])
    x = filter_logits(logits, SamplingParams(temperature=1.0, top_p=keep2 - 0.01))
    assert torch.isfinite(x).tolist() == [False, True, False, False, True]
    x = filter_logits(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert torch.isfinite(x).tolist() == [False, True, False, False, False]


def test_sample_follows_the_distribution():
    n = 4000
    logits = torch.log(torch.tensor([0.1, 0.6, 0.3, 1e-9])).repeat(n, 1)
    p = SamplingParams(temperature=1.0)
    counters = list(range(n))                        # positions: fresh noise per row
    counts = torch.bincount(torch.tensor(sample(logits, [p] * n, [7] * n, counters)),
                            minlength=4).float() / n
    torch.testing.assert_close(counts, torch.tensor([0.1, 0.6, 0.3, 0.0]), atol=0.03, rtol=0)
    # greedy rows take the argmax whatever their seed
    assert sample(logits[:2], [SamplingParams(), p], [1, 2], [0, 0])[0] == 1
    # (seed, counter) reproduces; another seed draws differently
    a = sample(logits[:50], [p] * 50, [5] * 50, counters[:50])
    b = sample(logits[:50], [p] * 50, [5] * 50, counters[:50])
    c = sample(logits[:50], [p] * 50, [6] * 50, counters[:50])
    assert a == b and a != c and SamplingParams().greedy and not p.greedy
    assert math.isclose(sum(counts.tolist()), 1.0, abs_tol=1e-6)


def test_batched_filter_matches_the_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.5, top_k=9,
                                                                        top_p=0.6),
              SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-9)]
    got = sampler.filter_rows(logits, torch.tensor([p.temperature for p in params]),
                      torch.tensor([p.top_k for p in params]),
                      torch.tensor([p.top_p for p in params]))
    for i, p in enumerate(params):
        want = filter_logits(logits[i], p)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), i
        torch.testing.assert_close(got[i][torch.isfinite(want)], want[torch.isfinite(want)])


def test_top_k_and_top_p_draws_stay_in_the_kept_set():
    logits = torch.tensor([[3.0, 2.9, 2.8, -1.0, -2.0]]).repeat(500, 1)
    params = [SamplingParams(temperature=5.0, top_k=2)] * 250 + \
             [SamplingParams(temperature=5.0, top_p=0.5)] * 250
    toks = sample(logits, params, [3] * 500, list(range(500)))
    assert set(toks[:250]) == {0, 1}               # both kept tokens drawn, nothing else
    assert set(toks[250:]) <= {0, 1, 2} and len(set(toks[250:])) > 1
