"""kvmetal.sim: simdgroup_matrix (8x8 MMA fragments) with Apple's lane ownership, strict and counted."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal.sim as sim
from kvcases import run1

DTYPES = {"float": mx.float32, "half": mx.float16, "bfloat": mx.bfloat16}


def frag_coord(lane):
    """(row, first column) lane `lane` holds: the layout of MLX's steel BaseMMAFrag::get_coord."""
    qid = lane // 4
    return (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2


def test_lane_ownership_covers_the_fragment_once():
    seen = {(r, c + j) for lane in range(32) for r, c in [frag_coord(lane)] for j in (0, 1)}
    assert seen == {(r, c) for r in range(8) for c in range(8)}


def test_thread_elements_follow_apples_lane_layout():
    # Each lane reports the two elements it holds of a loaded row-major matrix:
    # element (r, c) holds 8r + c, so the lane's values spell its coordinates.
    src = """
    uint lane = thread_index_in_simdgroup;
    simdgroup_float8x8 m;
    simdgroup_load(m, inp, 8);
    out[lane * 2] = m.thread_elements()[0];
    out[lane * 2 + 1] = m.thread_elements()[1];
    """
    got = run1(src, [mx.arange(64, dtype=mx.float32)], (64,), grid=(32, 1, 1), threadgroup=(32, 1, 1),
               names=["inp"])
    want = [8 * r + c + j for lane in range(32) for r, c in [frag_coord(lane)] for j in (0, 1)]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tname", ["float", "half", "bfloat"])
def test_multiply_accumulate_matches_numpy(tname):
    # Two simdgroups each compute D = A B + C through threadgroup memory, with
    # load origin/stride (a 16-wide source) and a transposed load of B.
    src = f"""
    uint lane = thread_index_in_simdgroup;
    uint sg = simdgroup_index_in_threadgroup;
    threadgroup {tname} tile[2 * 8 * 16];
    for (uint i = thread_index_in_threadgroup; i < 2 * 8 * 16; i += 64) tile[i] = ab[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<{tname}, 8, 8> a, bt, c, d;
    simdgroup_load(a, tile + sg * 128, 16);                   // columns 0..7 of rows 0..7
    simdgroup_load(bt, tile + sg * 128, 16, ulong2(8, 0), true);  // columns 8..15, transposed
    c = make_filled_simdgroup_matrix<{tname}, 8, 8>({tname}(0.5f));
    simdgroup_multiply_accumulate(d, a, bt, c);
    simdgroup_store(d, out + sg * 64, 8);
    """
    rng = np.random.default_rng(0)
    ab = rng.integers(-3, 4, size=(2, 8, 16)).astype(np.float32)
    got = run1(src, [mx.array(ab).astype(DTYPES[tname])], (128,), DTYPES[tname], grid=(64, 1, 1),
               threadgroup=(64, 1, 1), names=["ab"], strict=True).reshape(2, 8, 8)
    want = np.stack([ab[s, :, :8] @ ab[s, :, 8:].T + 0.5 for s in range(2)])
    np.testing.assert_array_equal(got, want)  # small integers: exact in every type


def test_mixed_types_accumulate_in_float_and_diagonal_constructor():
    # half A, B times the identity; float accumulator starts from a diagonal matrix.
    src = """
    uint lane = thread_index_in_simdgroup;
    simdgroup_half8x8 a;
    simdgroup_load(a, inp, 8);
    simdgroup_half8x8 eye(half(1.0f));
    simdgroup_float8x8 acc(2.0f);
    simdgroup_multiply_accumulate(acc, a, eye, acc);
    simdgroup_float8x8 twice;
    simdgroup_multiply(twice, acc, simdgroup_float8x8(1.0f));
    simdgroup_store(twice, out, 8, ulong2(0, 0), true);
    """
    x = (np.arange(64, dtype=np.float32).reshape(8, 8) / 8.0)
    got = run1(src, [mx.array(x).astype(mx.float16)], (64,), grid=(32, 1, 1), threadgroup=(32, 1, 1),
               names=["inp"]).reshape(8, 8)
    np.testing.assert_array_equal(got, (x + 2.0 * np.eye(8)).T)  # the store was transposed


def test_mma_counted_per_simdgroup_execution():
    src = """
    simdgroup_float8x8 a = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
    simdgroup_float8x8 d = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int i = 0; i < 3; i++) simdgroup_multiply_accumulate(d, a, a, d);
    simdgroup_store(d, out + simdgroup_index_in_threadgroup * 64, 8);
    """
    with sim.trace() as t:
        got = run1(src, [mx.zeros(1)], (4 * 64,), grid=(64, 2, 1), threadgroup=(64, 1, 1))
    np.testing.assert_array_equal(got[:128], np.full(128, 24.0))  # 3 x (8 x 1 x 1)
    call = t.calls[-1]
    assert call.mma == 3 * 4  # 3 per simdgroup, 2 simdgroups x 2 threadgroups
    assert call.collectives["simdgroup_store"] == 4


def test_divergent_mma_is_an_error_under_strict():
    # Lanes 0..15 skip the multiply: a deliberately broken kernel.
    src = """
    uint lane = thread_index_in_simdgroup;
    simdgroup_float8x8 a = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
    simdgroup_float8x8 d = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    if (lane >= 16) simdgroup_multiply_accumulate(d, a, a, d);
    out[lane * 2] = d.thread_elements()[0];
    out[lane * 2 + 1] = d.thread_elements()[1];
    """
    with pytest.raises(sim.DivergentCollectiveError, match="simdgroup_multiply_accumulate"):
        run1(src, [mx.zeros(1)], (64,), grid=(32, 1, 1), threadgroup=(32, 1, 1), strict=True)
    # Not strict: the missing lanes' elements are poison, so the products are NaN.
    got = run1(src, [mx.zeros(1)], (64,), grid=(32, 1, 1), threadgroup=(32, 1, 1))
    assert np.isnan(got[32:]).all() and (got[:32] == 0).all()


def test_divergent_load_is_an_error_under_strict():
    src = """
    uint lane = thread_index_in_simdgroup;
    simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    if (lane != 5) simdgroup_load(m, inp, 8);
    out[lane] = m.thread_elements()[0];
    """
    with pytest.raises(sim.DivergentCollectiveError, match="simdgroup_load"):
        run1(src, [mx.zeros(64)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"], strict=True)


def test_load_out_of_bounds_is_caught():
    src = """
    simdgroup_float8x8 m;
    simdgroup_load(m, inp, 8, ulong2(0, 1));  // rows 1..8 of an 8-row buffer
    out[thread_index_in_simdgroup] = m.thread_elements()[0];
    """
    with pytest.raises(sim.OutOfBoundsError, match="buffer 'inp'"):
        run1(src, [mx.zeros(64)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"])
