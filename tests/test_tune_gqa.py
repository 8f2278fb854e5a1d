"""profiling/tune_gqa.py's variant plumbing (the timing itself needs a GPU): every combination of
the listed knobs, 0 meaning the library's choice, and each variant's module settings in force
only during its call."""

import argparse

import pytest

from helix.attention import triton_decode
from profiling import tune_gqa


def _args(**kw):
    base = dict(splits="0", block_n="0", warps="0", stages="0", fused="1",
                merge_elements="0", merge_chunk="0")
    return argparse.Namespace(**{**base, **kw})


def test_variants_are_the_product_of_the_knobs():
    vs = tune_gqa.variants(_args(splits="4,8", stages="2,3", fused="1,0"))
    assert len(vs) == 8
    assert {(v["num_splits"], v["num_stages"], v["fused"]) for v in vs} == {
        (s, st, f) for s in (4, 8) for st in (2, 3) for f in (True, False)}
    (default,) = tune_gqa.variants(_args())
    assert default == dict(num_splits=None, block_n=None, num_warps=None, num_stages=None,
                           fused=True, merge_elements=None, merge_chunk=None)


def test_a_variant_sets_the_launch_config_and_merge_bounds_only_inside_its_call():
    before = (triton_decode.gqa_launch_config, triton_decode.FUSED_MERGE,
              triton_decode.FUSED_MERGE_ELEMENTS, triton_decode.FUSED_MERGE_CHUNK)
    (v,) = tune_gqa.variants(_args(warps="8", stages="2", fused="0", merge_elements="16384",
                                   merge_chunk="4096"))

    def inside():
        cfg = triton_decode.gqa_launch_config(128, 4, None)
        return (cfg["num_warps"], cfg["num_stages"], triton_decode.FUSED_MERGE,
                triton_decode.FUSED_MERGE_ELEMENTS, triton_decode.FUSED_MERGE_CHUNK)
    assert tune_gqa.run_variant(v, inside) == (8, 2, False, 16384, 4096)
    after = (triton_decode.gqa_launch_config, triton_decode.FUSED_MERGE,
             triton_decode.FUSED_MERGE_ELEMENTS, triton_decode.FUSED_MERGE_CHUNK)
    assert after == before

    def failing():
        raise RuntimeError("out of shared memory")
    with pytest.raises(RuntimeError):
        tune_gqa.run_variant(v, failing)
    assert (triton_decode.gqa_launch_config, triton_decode.FUSED_MERGE,
            triton_decode.FUSED_MERGE_ELEMENTS, triton_decode.FUSED_MERGE_CHUNK) == before
