"""Issue 17: six defects a Mac (Apple's compiler, MLX's runtime) would hit, one
regression test each, on the simulator (strict, two schedule seeds) and, where the
configuration applies, on the cpu backend against the same float64 oracle.

1. An empty split's first tile located a token past the block table (out-of-bounds
   read of block_tables).
2. The shared-mode tile copy issued 16-byte loads where the vector check only
   guaranteed 8-byte alignment (a view with rows 68 halves apart).
3. Inputs under 8 elements are `constant` in MLX; the load helpers only took
   `device` pointers (a compile error in Metal).
4. Softcap's tanh under Metal's fast math overflows to NaN past |x| ~ 44.
5. math_mode="relaxed" needs macOS 15; below it the kernels build "safe".
6. Shared mode launched ceil(G * L / 8) simdgroups, past 1024 threads for G * L > 256
   (since issue 30 the cap is 384 threads, chips.PIPELINE_THREAD_LIMIT).

Issue 30 runs rules 1, 3, 4 and 6 over every kernel of the registry
(tests/test_metal_rules.py); the cases here stay as the original reproducers.
"""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
import kvmetal.sim as sim
from kvmetal import chips
from kvmetal import reference as ref
from kvmetal.backends import metal, metal_layout, metal_specs
from kvmetal.sim.backend import sim_backend

from kvcases import assert_close, maybe_quantize, paged_attention_inputs, random, run_checked

f16, bf16, f32 = mx.float16, mx.bfloat16, mx.float32
BACKENDS = ["sim", "cpu"]


# 1. ------------------------------------------------------------------- bounded locate

@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_split_does_not_read_past_the_block_table(backend):
    # 16 query heads over 1 kv head (shared mode), a full 10-block table, 4 splits of
    # 64 tokens: split 3 starts at token 192 = block 12, past the table.
    rng = np.random.default_rng(0)
    q = random(rng, (1, 16, 64), f16)
    kc, vc = random(rng, (12, 1, 16, 64), f16), random(rng, (12, 1, 16, 64), f16)
    tables = mx.array(rng.permutation(12)[:10].astype(np.int32)[None])
    lens = mx.array([160], dtype=mx.int32)
    expected = ref.paged_attention(q, kc, vc, tables, lens)
    run_checked(backend, kv.paged_attention, expected, q, kc, vc, tables, lens, num_splits=4,
                kernel="paged_attention_partials")


# 2. ------------------------------------------------------------ 16-byte tile copy check

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [68, 66, 72])
def test_shared_mode_tile_copy_of_a_view_with_8_byte_aligned_rows(backend, width):
    # K and V are views of a [1, 1, 40, width] array: rows width halves apart
    # (68: 8-byte aligned rows, vector atoms but no 16-byte units; 66: scalar path;
    # 72: 16-byte rows). G = 16: shared mode, the tile copy.
    rng = np.random.default_rng(width)
    base = random(rng, (1, 1, 40, width), f16)
    k, v = base[..., :64], base[..., width - 64:]
    q = random(rng, (1, 16, 1, 64), f16)
    expected = ref.decode_attention(q, k, v)
    run_checked(backend, kv.decode_attention, expected, q, k, v, kernel="decode_attention_partials")


# 3. ------------------------------------------------------------ inputs bound as constant

CONSTANT_CASES = [
    # (gqa, query_len, T, head_dim, K quant, V quant): B = Hkv = 1 and T <= 7 with
    # D = group size put the scales (T elements) in `constant`; 2-bit D 64 at T = 1
    # puts the data (4 words) there too. G * L <= 8: register mode; more: shared.
    (4, 1, 5, 64, (4, 64), (8, 64)),
    (1, 1, 1, 64, (2, 64), (2, 64)),
    (16, 1, 3, 128, (8, 128), (4, 128)),
    (4, 4, 7, 64, (2, 64), None),
    (3, 2, 2, 128, None, (5, 128)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CONSTANT_CASES, ids=[f"g{c[0]}-l{c[1]}-t{c[2]}-d{c[3]}" for c in CONSTANT_CASES])
def test_decode_with_inputs_under_8_elements(case, backend):
    gqa, query_len, tokens, head_dim, kq, vq = case
    rng = np.random.default_rng(tokens + gqa)
    q = random(rng, (1, gqa, query_len, head_dim), f16)
    k = maybe_quantize(random(rng, (1, 1, tokens, head_dim), f16), kq)
    v = maybe_quantize(random(rng, (1, 1, tokens, head_dim), f16), vq)
    sinks = mx.array(rng.standard_normal(gqa).astype(np.float32))  # H < 8: constant too
    if kq:  # the case really has a constant-bound quantized input
        assert min(k.scales.size, k.data.size) < 8
    expected = ref.decode_attention(q, k, v, sinks=sinks)
    run_checked(backend, kv.decode_attention, expected, q, k, v, sinks=sinks, kernel="decode_attention_partials")


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_with_constant_tables_lengths_and_sinks(backend):
    # One sequence, a 3-block table, 2 query heads: block_tables, seq_lens and sinks
    # all have fewer than 8 elements; G * L = 12: shared mode.
    rng = np.random.default_rng(3)
    query, kc, vc, tables, lens, sinks = paged_attention_inputs(
        rng, lens=(37,), num_kv_heads=1, gqa=2, head_dim=64, block_size=16, dtype=f16, k_quant=(4, 32),
        use_sinks=True, query_len=6)
    assert tables.size < 8 and lens.size < 8 and sinks.size < 8
    expected = ref.paged_attention(query, kc, vc, tables, lens, sinks=sinks)
    run_checked(backend, kv.paged_attention, expected, query, kc, vc, tables, lens, sinks=sinks,
                kernel="paged_attention_partials")


# 4. ------------------------------------------------------------ softcap under fast math

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("query_len,gqa", [(1, 4), (4, 4)])  # register and shared mode
def test_softcap_with_scores_far_past_fast_tanh_overflow(backend, query_len, gqa):
    # Scores around 1e3 with softcap 5: tanh's argument ~ 200 (fast tanh: NaN past 44).
    rng = np.random.default_rng(9)
    query, kc, vc, tables, lens, _ = paged_attention_inputs(
        rng, lens=(40, 9), num_kv_heads=1, gqa=gqa, head_dim=64, block_size=32, dtype=f32, query_len=query_len)
    query = query * 300.0
    expected = ref.paged_attention(query, kc, vc, tables, lens, softcap=5.0)
    assert np.abs(np.array(query)).max() > 44 * 5
    run_checked(backend, kv.paged_attention, expected, query, kc, vc, tables, lens, softcap=5.0,
                kernel="paged_attention_partials")


def test_attention_kernels_are_built_with_fast_math_on_macos_15():
    # What makes the test above meaningful: the sim runs these kernels with fast tanh/exp2.
    backend = sim_backend(macos=15)
    spec = metal_specs.SPECS["paged_attention_partials"]
    assert metal_specs.math_mode_for(spec.math_mode, backend.macos) == "relaxed"


# 5. ------------------------------------------------------------ macOS 14 vs 15

def test_default_macos_version_off_a_mac_is_15(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "mac_ver", lambda: ("", ("", "", ""), ""))
    assert metal_specs.default_macos_version() == 15
    monkeypatch.setattr(platform, "mac_ver", lambda: ("14.6.1", ("", "", ""), "arm64"))
    assert metal_specs.default_macos_version() == 14
    assert metal_specs.math_mode_for("relaxed", 14) == "safe" and metal_specs.math_mode_for("relaxed", 15) == "relaxed"
    assert metal_specs.math_mode_for("safe", 15) == "safe"


@pytest.mark.parametrize("macos", [14, 15])
def test_attention_builds_and_matches_on_macos_14_and_15(macos):
    rng = np.random.default_rng(macos)
    query, kc, vc, tables, lens, sinks = paged_attention_inputs(
        rng, lens=(33, 70), num_kv_heads=2, gqa=4, head_dim=64, block_size=16, dtype=f16, k_quant=(8, 64),
        use_sinks=True, query_len=2)
    backend = sim_backend(macos=macos)
    assert backend.macos == macos
    expected = ref.paged_attention(query, kc, vc, tables, lens, softcap=30.0, sinks=sinks)
    with sim.trace(strict=True, seed=1) as t:
        out = backend.paged_attention(query, kc, vc, tables, lens, scale=64 ** -0.5, softcap=30.0,
                                      sliding_window=None, sinks=sinks, num_splits=3)
        mx.eval(out)
    assert_close(out, expected, f16)
    assert any("paged_attention_partials" in c.name for c in t.calls)


def test_macos_14_rejects_relaxed_math_like_mlx():
    # The simulator standing in for macOS 14 refuses "relaxed" as MLX does, so a
    # backend that forgot the fallback fails here.
    backend = metal.KernelBackend("sim-14-no-fallback", lambda **kw: sim.metal_kernel(**kw, macos=14), macos=15)
    rng = np.random.default_rng(0)
    query, kc, vc, tables, lens, _ = paged_attention_inputs(
        rng, lens=(9,), num_kv_heads=1, gqa=1, head_dim=64, block_size=8, dtype=f16, query_len=1)
    with pytest.raises(ValueError, match="requires macOS 15"):
        backend.paged_attention(query, kc, vc, tables, lens, scale=0.125, softcap=None, sliding_window=None,
                                sinks=None, num_splits=1)


# 6. ------------------------------------------------------------ simdgroup cap

def test_layout_caps_the_threadgroup_and_walks_row_blocks():
    for gqa, query_len in [(16, 8), (32, 8), (48, 8), (33, 5)]:
        layout = metal_layout.attention_layout(head_dim=128, gqa=gqa, query_len=query_len, k_bits=0, k_group=32,
                                        k_itemsize=2, v_bits=0, v_group=32, v_itemsize=2, block_size=16)
        rows = gqa * query_len
        assert layout.threads <= metal_layout.MAX_SHARED_SIMDGROUPS * 32 == chips.PIPELINE_THREAD_LIMIT == 384
        assert layout.rows_per_simdgroup <= metal_layout.SHARED_ROW_LIMIT
        assert layout.row_passes * layout.simdgroups * layout.rows_per_simdgroup >= rows
        assert (layout.row_passes - 1) * layout.simdgroups * layout.rows_per_simdgroup < rows
    # 128 rows of float16 at D 128: 2 passes of 8 simdgroups x 8 rows, the most a lane's
    # 128 registers hold (issue 41, P1; one pass of 12 x 11 before).
    layout = metal_layout.attention_layout(head_dim=128, gqa=16, query_len=8, k_bits=0, k_group=32, k_itemsize=2,
                                           v_bits=0, v_group=32, v_itemsize=2, block_size=16)
    assert (layout.row_passes, layout.simdgroups, layout.rows_per_simdgroup) == (2, 8, 8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["paged", "decode"])
def test_48_query_heads_per_kv_head_with_8_query_tokens(backend, op):
    # 384 rows: passes of up to 12 simdgroups (paged float16: 4 passes of 12 x 8 rows;
    # decode with 4-bit K: 6 of 11 x 6). The sim backend's pipelines allow only
    # chips.PIPELINE_THREAD_LIMIT = 384 threads (what M1/M2 allow register-heavy ones).
    rng = np.random.default_rng(48)
    if op == "paged":
        query, kc, vc, tables, lens, _ = paged_attention_inputs(
            rng, lens=(20, 9), num_kv_heads=1, gqa=48, head_dim=64, block_size=8, dtype=f16, query_len=8)
        expected = ref.paged_attention(query, kc, vc, tables, lens)
        args, fn, kernel = (query, kc, vc, tables, lens), kv.paged_attention, "paged_attention_partials"
    else:
        query = random(rng, (1, 48, 8, 64), f16)
        k = maybe_quantize(random(rng, (1, 1, 19, 64), f16), (4, 32))
        v = random(rng, (1, 1, 19, 64), f16)
        expected = ref.decode_attention(query, k, v)
        args, fn, kernel = (query, k, v), kv.decode_attention, "decode_attention_partials"
    if backend == "sim":
        calls = run_checked(backend, fn, expected, *args, num_splits=2, kernel=kernel)
        assert all(c.threadgroup[0] == (chips.PIPELINE_THREAD_LIMIT if op == "paged" else 352) for c in calls)
    else:
        run_checked(backend, fn, expected, *args, num_splits=2, kernel=kernel)
