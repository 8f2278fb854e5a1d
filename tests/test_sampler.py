"""The batched, counter-based sampler (helix/runtime/sampler.py): its Gumbel-max kernel against
the torch formula (interpreter on CPU, compiled on a GPU), and that it samples the right
distribution per row."""

import triton_mode  # noqa: F401  (must come before triton is imported)

import pytest
import torch
from triton_mode import DEV

from helix.runtime import sampler


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
