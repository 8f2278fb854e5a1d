"""profiling/bench_pdl.py part (f)'s kernels in Triton's interpreter (one program: a grid
barrier of more cannot open there, programs run one after another): the dependent chain
counts its launches, the barrier kernel leaves its counters at zero and stores its rounds."""

import torch

from triton_mode import DEV, ON_GPU  # first: picks the interpreter before triton

import pytest  # noqa: E402

from profiling import bench_pdl  # noqa: E402


@pytest.mark.skipif(ON_GPU, reason="the interpreter's one-program form; the GPU runs the bench")
def test_sync_kernels_in_the_interpreter():
    x = torch.zeros(1, dtype=torch.int32, device=DEV)
    for _ in range(3):
        bench_pdl._dependent_kernel[(1,)](x)
    assert int(x.item()) == 3
    bench_pdl._empty_kernel[(1,)](x)
    assert int(x.item()) == 1
    cnt = torch.zeros(2, dtype=torch.int32, device=DEV)
    bench_pdl._barriers_kernel[(1,)](cnt, x, ROUNDS=4, ATOMIC_POLL=True)
    assert int(x.item()) == 4 and int(torch.count_nonzero(cnt)) == 0
