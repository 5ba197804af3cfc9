"""The 1-8 query-token contract of paged_attention / decode_attention (ops and oracles)."""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference


def _paged(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, num_blocks=12, rows=3):
    rng = np.random.default_rng(0)
    kc = mx.array(rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32))
    vc = mx.array(rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32))
    tables = mx.array(rng.permutation(num_blocks)[: num_seqs * 3].reshape(num_seqs, 3).astype(np.int32))
    lens = mx.array(np.array([5, 19][:num_seqs], dtype=np.int32))
    q = mx.array(rng.standard_normal((num_seqs, rows, num_heads, head_dim)).astype(np.float32))
    return q, kc, vc, tables, lens


def sdpa_on_gathered_rows(q, kc, vc, tables, lens, window=None) -> np.ndarray:
    """MLX's own SDPA (an external reference, not the oracle) over each sequence's rows,
    gathered from the block table in NumPy: query [S, L, H, D] -> [S, L, H, D]. Row l sits
    at position p = seq_len - L + l and sees t <= p (and t > p - window)."""
    kc, vc, tables = np.array(kc), np.array(vc), np.array(tables)
    block_size = kc.shape[2]
    outs = []
    for s, n in enumerate(np.array(lens).tolist()):
        rows = [(tables[s, t // block_size], t % block_size) for t in range(n)]
        keys = np.stack([kc[b, :, o] for b, o in rows], axis=1)[None]      # [1, Hkv, n, D]
        values = np.stack([vc[b, :, o] for b, o in rows], axis=1)[None]
        num_rows = q.shape[1]
        pos = n - num_rows + np.arange(num_rows)[:, None]
        t = np.arange(n)[None, :]
        visible = (t <= pos) & (True if window is None else t > pos - window)
        out = mx.fast.scaled_dot_product_attention(q[s:s + 1].transpose(0, 2, 1, 3), mx.array(keys),
                                                   mx.array(values), scale=q.shape[-1] ** -0.5,
                                                   mask=mx.array(visible))
        outs.append(np.array(out.transpose(0, 2, 1, 3))[0])
    return np.stack(outs)


@pytest.mark.parametrize("window", [None, 4])
def test_oracle_rows_match_mlx_causal_sdpa_on_gathered_rows(window):
    """Every row of an L-token query, by the oracle, equals MLX's masked SDPA on the
    sequence's gathered rows (an independent implementation)."""
    q, kc, vc, tables, lens = _paged()
    out = reference.paged_attention(q, kc, vc, tables, lens, sliding_window=window)
    np.testing.assert_allclose(out, sdpa_on_gathered_rows(q, kc, vc, tables, lens, window), rtol=0, atol=1e-5)


def test_oracle_decode_rows_follow_the_bottom_right_causal_mask():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 3, 64))
    k = rng.standard_normal((2, 2, 7, 64))
    v = rng.standard_normal((2, 2, 7, 64))
    out = reference.decode_attention(q, k, v)
    expected = mx.fast.scaled_dot_product_attention(
        mx.array(q.astype(np.float32)), mx.array(k.astype(np.float32)), mx.array(v.astype(np.float32)),
        scale=64 ** -0.5, mask="causal")
    np.testing.assert_allclose(out, np.array(expected), atol=1e-5)


def test_three_d_query_is_the_one_token_case():
    q, kc, vc, tables, lens = _paged(rows=1)
    np.testing.assert_allclose(reference.paged_attention(q[:, 0], kc, vc, tables, lens),
                               sdpa_on_gathered_rows(q, kc, vc, tables, lens)[:, 0], rtol=0, atol=1e-5)
    out = kv.paged_attention(q[:, 0], kc, vc, tables, lens)
    assert out.shape == q[:, 0].shape
    out4 = kv.paged_attention(q, kc, vc, tables, lens)
    assert out4.shape == q.shape
    np.testing.assert_allclose(np.array(out4[:, 0]), np.array(out), atol=1e-6)


def test_more_than_eight_query_tokens_is_rejected():
    q, kc, vc, tables, lens = _paged(rows=9)
    with pytest.raises(ValueError, match=r"\[paged_attention\] query must hold 1 to 8 tokens"):
        kv.paged_attention(q, kc, vc, tables, lens)
    with pytest.raises(ValueError, match=r"\[decode_attention\] query must hold 1 to 8 tokens"):
        kv.decode_attention(mx.zeros((1, 2, 9, 64)), mx.zeros((1, 2, 16, 64)), mx.zeros((1, 2, 16, 64)))
    with pytest.raises(ValueError, match=r"\[paged_attention\] query must hold 1 to 8 tokens"):
        kv.paged_attention(q[:, :0], kc, vc, tables, lens)


def test_more_query_tokens_than_cached_tokens_is_rejected():
    q, kc, vc, tables, lens = _paged(rows=6)   # seq_lens [5, 19]
    with pytest.raises(ValueError, match=r"\[paged_attention\] query holds 6 tokens .* seq_lens\[0\] = 5"):
        kv.paged_attention(q, kc, vc, tables, lens)
    with pytest.raises(ValueError, match=r"\[decode_attention\] query holds 3 tokens but keys only 2"):
        kv.decode_attention(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 2, 64)), mx.zeros((1, 2, 2, 64)))
