"""The sparse-V benchmark over captured attention (``kvmetal bench --cases sparse_v_captured``)
and the capture file it reads (``kvmetal.benchmarks.attention_capture``)."""
import json

import numpy as np

from kvmetal import cli
from kvmetal.benchmarks import attention_capture, cases


def _fake_capture(path, *, tokens=160, layers=2, sink=3.0):
    """Layers whose key 0 is aligned with the queries (an attention sink), so most keys
    fall under tau against it."""
    rng = np.random.default_rng(0)
    out = {}
    for i in range(layers):
        q = (rng.standard_normal((4, 64)) * 2).astype(np.float16)
        k = rng.standard_normal((2, tokens, 64)).astype(np.float16)
        k[:, 0] = sink * q.reshape(2, 2, 64).mean(axis=1)
        v = rng.standard_normal((2, tokens, 64)).astype(np.float16)
        out[i] = {"q": q, "k": k, "v": v, "scale": 0.125, "softcap": 0.0, "window": None}
    return attention_capture.save({"model": "fake", "tokens": tokens, "layers": out}, path)


def test_capture_file_round_trips(tmp_path):
    path = _fake_capture(tmp_path / "c.npz")
    meta, rows = attention_capture.load_capture(path)
    assert meta["layers"] == [0, 1] and meta["tokens"] == 160
    layer, q, k, v, scale, softcap = rows[1]
    assert layer == 1 and q.shape == (4, 64) and k.shape == v.shape == (2, 160, 64) and k.dtype == np.float16
    assert scale == 0.125 and softcap == 0.0


def test_case_times_exact_and_sparse_and_reports_sim_v_bytes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVMETAL_SPARSE_V_CAPTURE", str(_fake_capture(tmp_path / "c.npz")))
    assert cli.main(["bench", "--cases", "sparse_v_captured", "--repeat", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["name"].split()[0] for r in rows] == ["sparse_v_captured_f16", "sparse_v_captured_k8v4"]
    for r in rows:
        assert r["baseline"]["name"].startswith("kvmetal paged_attention exact")
        assert r["speedup_vs_baseline"] > 0
        # The sink puts most rows under tau; the kernel skips no more than the final max allows.
        assert 0.5 < r["sim_v_rows_skipped"] <= r["v_rows_skippable_final_max_sim_layers"] + 1e-9
        assert r["sim_v_bytes_per_token"] < 0.5 * r["sim_v_bytes_per_token_exact"]


def test_case_without_a_capture_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMETAL_SPARSE_V_CAPTURE", str(tmp_path / "missing.npz"))
    rows = cases.run_case("sparse_v_captured", backend="cpu", tokens=0, repeat=1, baseline=True,
                          progress=lambda m: None)
    assert rows[0]["skipped"] and "attention_capture" in rows[0]["note"]


def test_layer_tensors_keep_only_a_sliding_window(tmp_path):
    import mlx.core as mx

    rng = np.random.default_rng(1)
    kc = mx.array(rng.standard_normal((4, 1, 16, 64)).astype(np.float16))
    q = mx.array(rng.standard_normal((1, 2, 64)).astype(np.float16))
    tables, lens = mx.array([[2, 0, 3, 1]], mx.int32), mx.array([50], mx.int32)
    full = attention_capture._layer_tensors((q, kc, kc, tables, lens), {"scale": 0.5})
    win = attention_capture._layer_tensors((q, kc, kc, tables, lens), {"scale": 0.5, "sliding_window": 20})
    assert full["k"].shape == (1, 50, 64) and win["k"].shape == (1, 20, 64)
    np.testing.assert_array_equal(win["k"], full["k"][:, -20:])
    assert full["scale"] == 0.5 and win["window"] == 20
    # Token 17 is row 1 of table entry 1 (block 0).
    np.testing.assert_array_equal(full["k"][0, 17], np.array(kc[0, 0, 1]))
