"""``kvmetal budget``: the KV arithmetic, config parsing, chips, errors, JSON and plot."""
import builtins
import dataclasses
import json

import pytest

from kvmetal import budget as B
from kvmetal.budget import KVFormat, ModelShape

KIB, GIB = 1024, 1 << 30


def run_json(capsys, *argv) -> dict:
    assert B.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ----------------------------------------------------------------------------- classic figures

def test_32_layer_8_kv_head_f16_is_128_kib_per_token_and_4_gib_at_32k(capsys):
    model = ModelShape("m", num_layers=32, num_kv_heads=8, head_dim=128)
    assert B.bytes_per_token(model, KVFormat()) == 128 * KIB
    assert B.cache_bytes(model, KVFormat(), context=32 * 1024) == 4 * GIB
    r = run_json(capsys, "--model", "llama-3-8b", "--context", "32K", "--kv", "f16")
    assert r["bytes_per_token"] == 128 * KIB and r["cache_bytes"] == 4 * GIB
    assert r["bytes_per_token_per_layer"] == 4096


def test_80_layer_model_at_64k_f16_is_about_21_gb(capsys):
    r = run_json(capsys, "--model", "llama-3-70b", "--context", "64K")
    assert r["bytes_per_token"] == 320 * KIB
    assert r["cache_bytes"] == 80 * 8 * 128 * 2 * 2 * 65536
    assert round(r["cache_bytes"] / 1e9) == 21
    assert B.main(["--model", "llama-3-70b", "--context", "64K"]) == 0
    assert "21.47 GB (20.00 GiB)" in capsys.readouterr().out


def test_quantized_bytes_include_scales_and_biases():
    model = ModelShape("m", num_layers=32, num_kv_heads=8, head_dim=128)
    # K8: 128 B codes + 2 groups * (scale + bias) * 2 B = 136; V4: 64 + 8 = 72
    k8v4 = B.parse_kv("k8v4")
    assert B.bytes_per_token_per_layer(model, k8v4) == {"k": 8 * 136, "v": 8 * 72, "total": 8 * 208}
    assert B.bytes_per_token(model, k8v4) == 32 * 8 * 208
    # group 32 doubles the scale overhead; f32 scales double it again
    k4g32 = KVFormat(k_bits=4, v_bits=4, k_group_size=32, v_group_size=32, dtype="f32")
    assert k4g32.row_bytes(128, "k") == 64 + 4 * 2 * 4
    # 3-bit rows are 3/8 of a byte per value
    assert KVFormat(k_bits=3, v_bits=3).row_bytes(128, "v") == 48 + 8


def test_mixed_float_and_quantized_sides():
    fmt = B.parse_kv("k8vf16")
    assert (fmt.k_bits, fmt.v_bits) == (8, None)
    assert fmt.row_bytes(128, "k") == 136 and fmt.row_bytes(128, "v") == 256
    assert fmt.label == "K8/Vf16 g64"


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("spec,expected", [
    ("f16", KVFormat()), ("float16", KVFormat()), ("bf16", KVFormat(dtype="bf16")),
    ("f32", KVFormat(dtype="f32")), ("k8v4", KVFormat(8, 4)), ("K4/V8", KVFormat(4, 8)),
    ("q8", KVFormat(8, 8)), ("int4", KVFormat(4, 4)),
])
def test_parse_kv(spec, expected):
    assert B.parse_kv(spec) == expected


@pytest.mark.parametrize("text,tokens", [("8192", 8192), ("32K", 32768), ("32k", 32768), ("1M", 1 << 20),
                                         ("1.5K", 1536), (4096, 4096)])
def test_parse_tokens(text, tokens):
    assert B.parse_tokens(text) == tokens


def test_parse_config_json(tmp_path, capsys):
    cfg = {
        "model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "hidden_size": 3584, "intermediate_size": 18944,
        "vocab_size": 152064, "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = B.load_model(str(path))
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (28, 4, 128)
    assert model.param_count() == pytest.approx(7.6e9, rel=0.01)
    assert B.bytes_per_token(model, KVFormat()) == 28 * 4 * 128 * 2 * 2
    # a directory works too, and its safetensors give the exact weight bytes
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1234)
    r = run_json(capsys, "--model", str(tmp_path), "--context", "1K")
    assert r["weights_bytes"] == 1234 and r["weights_source"] == "safetensors"
    assert r["cache_bytes"] == 1024 * 28 * 4 * 128 * 4


def test_config_variants():
    # explicit head_dim, missing kv heads (MHA), mlx-lm quantized weights, nested text_config
    cfg = {"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
                           "head_dim": 128, "vocab_size": 1000, "intermediate_size": 512},
           "quantization": {"bits": 4, "group_size": 64}}
    model = B.shape_from_config(cfg)
    assert (model.num_kv_heads, model.head_dim) == (4, 128)
    assert model.weight_bits == 4.5
    assert model.estimated_weights_bytes() == int(model.param_count() * 4.5 / 8)
    with pytest.raises(ValueError, match=r"\[budget\] .*kv_lora_rank"):
        B.shape_from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 512})
    with pytest.raises(ValueError, match=r"\[budget\] .*needs num_hidden_layers"):
        B.shape_from_config({"hidden_size": 64})


def test_preset_weight_estimates_match_published_sizes():
    expected = {"llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "mistral-7b": 7.24e9, "qwen2.5-7b": 7.62e9,
                "gemma-2-9b": 9.24e9, "mixtral-8x7b": 46.7e9, "phi-3-mini": 3.82e9, "llama-3.2-1b": 1.24e9,
                "gemma-3-270m": 268e6}
    for name, params in expected.items():
        assert B.PRESETS[name].param_count() == pytest.approx(params, rel=0.01), name
    llama31 = B.load_model("Llama-3.1-8B")  # llama-3-8b's shapes with the 128K context
    assert llama31 == dataclasses.replace(B.PRESETS["llama-3-8b"], name="llama-3.1-8b", max_position_embeddings=131072)


# ----------------------------------------------------------------------------- memory and bandwidth

def test_fit_and_decode_floor_with_memory_and_bandwidth(capsys):
    r = run_json(capsys, "--model", "llama-3.1-8b", "--context", "32K", "--batch", "2", "--memory", "64",
                 "--bandwidth", "400", "--usable-fraction", "0.5", "--weights-gb", "16")
    mem, floor = r["memory"], r["decode_floor"]
    free = 32 * GIB - 16 * 10**9
    assert mem["usable_bytes"] == 32 * GIB and mem["free_for_cache_bytes"] == free
    assert mem["max_context_at_batch"] == free // (128 * KIB * 2) // 16 * 16
    assert mem["max_batch_at_context"] == free // (4 * GIB) == 4
    assert mem["fits"] is True
    # decode floor: 8 GiB of cache at 400 GB/s
    assert floor["cache_ms_per_step"] == pytest.approx(8 * GIB / 400e9 * 1e3)
    assert floor["with_weights_ms_per_step"] == pytest.approx((8 * GIB + 16e9) / 400e9 * 1e3)
    assert floor["cache_tokens_per_s_total"] == pytest.approx(2 * floor["cache_tokens_per_s_per_seq"])


def test_chip_table_fills_memory_and_bandwidth(capsys):
    r = run_json(capsys, "--model", "qwen2.5-7b", "--context", "128K", "--kv", "k8v4", "--chip", "M4-Max")
    assert r["chip"] == "m4-max"
    assert r["memory"]["memory_bytes"] == 128 * GIB and r["memory"]["usable_fraction"] == 0.75
    assert r["decode_floor"]["bandwidth_bytes_per_s"] == 546e9
    small = run_json(capsys, "--model", "llama-3-70b", "--chip", "m2", "--memory", "16")
    assert small["memory"]["fits"] is False and small["memory"]["max_context_at_batch"] == 0
    assert small["memory"]["usable_fraction"] == pytest.approx(2 / 3)


def test_quantized_cache_fits_more_context(capsys):
    common = ["--model", "llama-3.1-8b", "--chip", "m3-max", "--context", "128K"]
    f16 = run_json(capsys, *common)
    k8v4 = run_json(capsys, *common, "--kv", "k8v4")
    ratio = k8v4["bytes_per_token"] / f16["bytes_per_token"]
    assert ratio == pytest.approx(224 / 512)  # group 32 (the default, as serve): K 128 + 16, V 64 + 16
    assert k8v4["memory"]["max_context_by_memory"] > 2.2 * f16["memory"]["max_context_by_memory"]
    assert k8v4["decode_floor"]["cache_ms_per_step"] == pytest.approx(ratio * f16["decode_floor"]["cache_ms_per_step"])


def test_overhead_is_reserved(capsys):
    base = ["--model", "llama-3-8b", "--memory", "64", "--usable-fraction", "1", "--weights-gb", "16"]
    plain, reserved = run_json(capsys, *base), run_json(capsys, *base, "--overhead-gb", "2.5")
    assert plain["memory"]["free_for_cache_bytes"] - reserved["memory"]["free_for_cache_bytes"] == 2.5e9


def test_block_size_rounds_contexts_up(capsys):
    model = ModelShape("m", num_layers=1, num_kv_heads=1, head_dim=64)
    assert B.cache_bytes(model, KVFormat(), context=17, block_size=16) == 32 * 64 * 2 * 2
    r = run_json(capsys, "--model", "llama-3-8b", "--context", "100", "--block-size", "32")
    assert r["cache_bytes"] == 128 * 128 * KIB


def test_text_output_and_compare(capsys):
    assert B.main(["--model", "llama-3-8b", "--kv", "k8v4", "--chip", "m4-pro", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "K8/V4 g32" in out and "0.438 x f16" in out and "decode floor at 273 GB/s" in out
    assert "K4/V2 g32" in out and "largest context at batch 1" in out


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("argv,match", [
    (["--model", "no-such-model"], r"model 'no-such-model' is neither a preset"),
    (["--model", "llama-3-8b", "--kv", "k7v4"], r"--kv bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"),
    (["--model", "llama-3-8b", "--kv", "fp9"], r"--kv must look like f16, bf16, f32, k8v4 or q8"),
    (["--model", "llama-3-8b", "--context", "12x"], r"--context must be a token count"),
    (["--model", "llama-3-8b", "--context", "0"], r"--context must be positive"),
    (["--model", "llama-3-8b", "--batch", "0"], r"--batch must be positive"),
    (["--model", "llama-3-8b", "--chip", "m9"], r"--chip must be one of"),
    (["--model", "phi-3-mini", "--kv", "k8v4", "--kv-group-size", "64"],
     r"--kv-group-size 64 does not divide the model's head_dim 96; try --kv-group-size 32"),
    (["--model", "llama-3-8b", "--kv", "k8v4", "--kv-bits", "4"], r"either --kv k8v4 or --kv-bits"),
    (["--model", "llama-3-8b", "--kv", "k8v4", "--k-bits", "4"], r"either --kv k8v4 or --k-bits"),
    (["--model", "llama-3-8b", "--kv", "q8", "--kv-bits", "4", "--v-bits", "2"],
     r"either --kv q8 or --kv-bits/--v-bits, not both"),
    (["--model", "llama-3-8b", "--memory", "-1"], r"memory must be positive"),
    (["--model", "llama-3-8b", "--memory", "8", "--usable-fraction", "1.5"], r"usable fraction must be in"),
])
def test_bad_arguments_are_clear_errors(capsys, argv, match):
    assert B.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmetal budget: error: ") and "[budget]" not in err
    assert __import__("re").search(match, err), err


def test_bad_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert B.main(["--model", str(path)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        B.main(["--context", "8K"])   # --model is required
    assert exc.value.code == 2


def test_cli_dispatches_budget(capsys):
    from kvmetal import cli

    assert cli.main(["budget", "--model", "llama-3-8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 128 * KIB


# ----------------------------------------------------------------------------- plot

def test_plot_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cache.png"
    r = run_json(capsys, "--model", "llama-3-8b", "--kv", "k8v4", "--chip", "m4-max", "--plot", str(out))
    assert r["plot"] == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_skips_formats_the_head_dim_cannot_hold(tmp_path, capsys, monkeypatch):
    drawn = []
    monkeypatch.setattr(B, "plot_cache_sizes", lambda model, formats, path, **_: drawn.append([f.label for f in formats]))
    # no quantized format holds head_dim 96 at group 64: f16 alone is drawn
    run_json(capsys, "--model", "phi-3-mini", "--kv", "f16", "--kv-group-size", "64", "--plot", str(tmp_path / "a.png"))
    run_json(capsys, "--model", "phi-3-mini", "--kv", "k8vf16", "--plot", str(tmp_path / "b.png"))
    assert drawn == [["f16"], ["f16", "K8/V8 g32", "K8/V4 g32", "K4/V4 g32", "K4/V2 g32", "K8/Vf16 g32"]]


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert B.main(["--model", "llama-3-8b", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------- sliding windows, tp, honesty

GEMMA3_12B = {"model_type": "gemma3", "text_config": {
    "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024,
    "sliding_window_pattern": 6, "max_position_embeddings": 131072, "vocab_size": 262208}}
GPT_OSS_20B = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12, "vocab_size": 201088}


def _write_config(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_gemma3_sliding_layers_are_counted_at_their_window(tmp_path, capsys):
    r = run_json(capsys, "-m", _write_config(tmp_path, GEMMA3_12B), "--context", "32K")
    assert (r["model"]["num_sliding_layers"], r["model"]["sliding_window"]) == (40, 1024)
    layer = 8 * 256 * 2 * 2  # kv heads x head_dim x (K + V) x f16
    # 8 global layers hold 32K tokens; 40 local layers their 1024-token window plus one partial block
    assert r["tokens_held_per_layer"] == {"full": 32768, "sliding_window": 1040}
    assert r["cache_bytes"] == layer * (8 * 32768 + 40 * 1040)
    assert r["cache_bytes_if_no_window"] == layer * 48 * 32768
    assert r["cache_bytes"] < r["cache_bytes_if_no_window"] / 5
    assert B.main(["-m", _write_config(tmp_path, GEMMA3_12B), "--context", "32K"]) == 0
    assert "40 of 48 layers see the last 1,024 tokens" in capsys.readouterr().out


def test_gpt_oss_layer_types_and_qwen2_without_windows(tmp_path):
    gpt = B.shape_from_config(GPT_OSS_20B)
    assert (gpt.num_sliding_layers, gpt.sliding_window, gpt.num_full_layers) == (12, 128, 12)
    qwen = B.shape_from_config({"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
                                "num_key_value_heads": 4, "hidden_size": 3584, "sliding_window": 131072,
                                "use_sliding_window": False})
    assert qwen.num_sliding_layers == 0
    # a window longer than the context changes nothing
    assert B.cache_bytes(gpt, KVFormat(), context=100) == B.bytes_per_token(gpt, KVFormat()) * 100


def test_largest_context_with_windows_is_the_true_boundary():
    model = B.PRESETS["gemma-3-12b"]
    free = 10 * GIB
    longest = B.max_context(model, KVFormat(), free_bytes=free, batch=2, block_size=16)
    assert B.cache_bytes(model, KVFormat(), context=longest, batch=2, block_size=16) <= free
    assert B.cache_bytes(model, KVFormat(), context=longest + 16, batch=2, block_size=16) > free


def test_json_includes_the_compare_table(capsys):
    r = run_json(capsys, "-m", "llama-3-8b", "--context", "8K", "--compare")
    labels = [row["label"] for row in r["compare"]]
    assert labels[:3] == ["f16", "K8/V8 g32", "K8/V4 g32"]
    f16 = r["compare"][0]
    assert f16["bytes_per_token"] == 128 * KIB and f16["cache_bytes"] == 128 * KIB * 8192


def test_head_dim_96_suggests_group_size_32(capsys):
    assert B.main(["-m", "phi-3-mini", "--kv", "k8v4", "--kv-group-size", "64"]) == 2
    assert "try --kv-group-size 32" in capsys.readouterr().err
    assert run_json(capsys, "-m", "phi-3-mini", "--kv", "k8v4")["format"]["k_group_size"] == 32  # the default
    r = run_json(capsys, "-m", "phi-3-mini", "--kv", "f16", "--kv-group-size", "64", "--compare")
    assert [row["label"] for row in r["compare"]] == ["f16", "K8/V8 g64", "K8/V4 g64", "K4/V4 g64", "K4/V2 g64"]
    assert all("try --kv-group-size 32" in row["error"] for row in r["compare"][1:])


def test_weights_beyond_memory_say_so_and_give_no_decode_floor(tmp_path, capsys):
    r = run_json(capsys, "-m", "llama-3-70b", "--chip", "m4-pro", "--memory", "24")
    assert r["memory"]["weights_fit"] is False and r["decode_floor"] is None
    assert B.main(["-m", "llama-3-70b", "--chip", "m4-pro", "--memory", "24"]) == 0
    out = capsys.readouterr().out
    assert "weights alone" in out and "exceed usable memory" in out and "decode floor at" not in out


def test_context_past_the_trained_context_gets_a_note(tmp_path, capsys):
    config = _write_config(tmp_path, GEMMA3_12B)
    assert B.main(["-m", config, "--context", "256K"]) == 0
    assert "exceeds the model's trained context (max_position_embeddings 131,072)" in capsys.readouterr().out
    assert run_json(capsys, "-m", config, "--context", "128K")["notes"] == []


def test_missing_config_file_says_file_not_found(tmp_path, capsys):
    assert B.main(["-m", str(tmp_path / "config.json")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_tensor_parallel_splits_kv_heads_and_weights(capsys):
    one = run_json(capsys, "-m", "llama-3-8b", "--context", "32K")
    two = run_json(capsys, "-m", "llama-3-8b", "--context", "32K", "--tp", "2")
    assert two["tp"] == {"devices": 2, "kv_heads_total": 8, "kv_heads_per_device": 4, "kv_replicated": False}
    assert two["cache_bytes"] * 2 == one["cache_bytes"]
    assert abs(two["weights_bytes"] * 2 - one["weights_bytes"]) <= 2
    sixteen = run_json(capsys, "-m", "llama-3-70b", "--tp", "16")
    assert sixteen["tp"]["kv_replicated"] and sixteen["tp"]["kv_heads_per_device"] == 1
    assert B.main(["-m", "llama-3-70b", "--tp", "16"]) == 0
    assert "KV is replicated" in capsys.readouterr().out
    assert B.main(["-m", "llama-3-8b", "--tp", "3"]) == 2
    assert "--tp 3 must divide" in capsys.readouterr().err


def test_plot_of_a_windowed_model_marks_the_request(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "gemma.png"
    assert B.main(["-m", "gemma-3-12b", "--context", "32K", "--kv", "k8v4", "--chip", "m4-max",
                   "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert B._token_label(1 << 20) == "1M" and B._token_label(32768) == "32K"


def test_largest_context_stops_at_the_models_maximum(tmp_path, capsys):
    """Issue 35: the memory could hold 1M tokens of gemma-3-12b, but the model takes 128K."""
    assert B.main(["-m", "gemma-3-12b", "--context", "32K", "--kv", "k8v4", "--chip", "m4-pro"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fits"))
    assert "largest context at batch 1: 131,072 tokens, the model's maximum (max_position_embeddings; " \
           "memory would hold 971,648)" in line
    config = tmp_path / "config.json"  # SmolLM2's shapes: 8K context
    config.write_text('{"model_type": "llama", "num_hidden_layers": 30, "num_key_value_heads": 3, '
                      '"num_attention_heads": 9, "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152, '
                      '"max_position_embeddings": 8192, "tie_word_embeddings": true}')
    report, _ = B.run(["-m", str(config), "--context", "4K", "--chip", "m4-max"])
    assert report["memory"]["max_context_at_batch"] == 8192 and report["memory"]["max_context_is_model_limit"]
    assert report["memory"]["max_context_by_memory"] > 1_000_000


# ----------------------------------------------------------------------------- issue 44

def test_the_default_group_size_is_the_one_generate_and_serve_use(capsys):
    from kvmetal.kv_format import DEFAULT_KV_GROUP_SIZE

    r = run_json(capsys, "-m", "llama-3-8b", "--kv", "k8v4")
    assert (r["format"]["k_group_size"], r["format"]["v_group_size"]) == (DEFAULT_KV_GROUP_SIZE,) * 2 == (32, 32)
    # the shared flags of generate/serve mean the same here
    same = run_json(capsys, "-m", "llama-3-8b", "--kv-bits", "4", "--k-bits", "8", "--kv-group-size", "32")
    assert same["bytes_per_token"] == r["bytes_per_token"]
    g64 = run_json(capsys, "-m", "llama-3-8b", "--kv", "k8v4", "--kv-group-size", "64")
    assert g64["bytes_per_token"] < r["bytes_per_token"]
    # --group-size, budget's name for --kv-group-size before it took the shared flags, still means it
    assert run_json(capsys, "-m", "llama-3-8b", "--kv", "k8v4", "--group-size", "64") == g64


@pytest.mark.parametrize("name", ["default", "smollm2", "gemma3", "smollm2:keep"])
def test_named_models_are_read_from_their_gguf_header(capsys, name):
    from kvmetal.models.named import ModelMissing, gguf_parts

    try:
        gguf_parts("gemma3" if name == "gemma3" else "smollm2")
    except ModelMissing as exc:
        pytest.skip(str(exc))
    r = run_json(capsys, "-m", name, "--kv-bits", "4", "--k-bits", "8", "--context", "8K")
    m = r["model"]
    if name == "gemma3":
        assert (m["num_layers"], m["num_kv_heads"], m["head_dim"]) == (18, 1, 256)
    else:  # SmolLM2-135M: K8/V4 at group 32, what kvmetal serve allocates: 30 x (72 + 8 + 32 + 8) x 3 heads
        assert (m["num_layers"], m["num_kv_heads"], m["head_dim"]) == (30, 3, 64)
        assert r["bytes_per_token"] == 30 * 3 * ((64 + 2 * 2 * 2) + (32 + 2 * 2 * 2))
    assert B.main(["-m", f"{name.partition(':')[0]}:int8"]) == 2
    assert "dtype must be one of" in capsys.readouterr().err


# ----------------------------------------------------------------------------- one meaning of the K/V format flags

FORMAT_ATTRS = ("dest", "default", "choices", "type", "nargs", "const", "required")


def _format_actions(parser) -> dict:
    """option string -> the argparse attributes that make a flag's meaning, for every flag
    ``kv_format.add_format_flags`` declares (read from a fresh parser: no list kept by hand)."""
    import argparse

    from kvmetal.kv_format import add_format_flags

    reference = argparse.ArgumentParser(add_help=False)
    add_format_flags(reference)
    options = [o for a in reference._actions for o in a.option_strings]
    assert len(options) >= 6 and "--kv-group-size" in options
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    return {o: {k: getattr(by_option[o], k) for k in FORMAT_ATTRS} if o in by_option else None for o in options}


def _command_parsers() -> dict:
    from kvmetal.benchmarks import _parser as bench_parser
    from kvmetal.commands.generate import _parser as generate_parser
    from kvmetal.serve.cli import _parser as serve_parser

    return {"serve": serve_parser(), "generate": generate_parser(), "bench": bench_parser()}


def test_budget_takes_the_format_flags_of_generate_serve_and_bench():
    """Issue 46: budget declared its own --k-bits/--kv-group-size... (no choices, --group-size's
    dest); now add_format_flags gives it the same flags, defaults, choices and types."""
    budget = _format_actions(B._parser())
    assert None not in budget.values(), budget
    for name, parser in _command_parsers().items():
        assert _format_actions(parser) == budget, name


@pytest.mark.parametrize("argv", [["--k-bits", "7"], ["--kv-bits", "1"], ["--v-bits", "x"],
                                  ["--kv-group-size", "48"], ["--k-group-size", "16"], ["--v-group-size", "256"]])
def test_a_bad_format_flag_is_the_error_serve_gives(argv, capsys):
    messages = []
    for parser in (B._parser(), _command_parsers()["serve"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["-m", "llama-3-8b", *argv])
        assert exc.value.code == 2
        messages.append(capsys.readouterr().err.replace(parser.prog, "PROG"))
    assert messages[0] == messages[1] and argv[0] in messages[0], messages


FLAG_CASES = [
    [], ["--kv-bits", "4"], ["--k-bits", "8"], ["--v-bits", "4"], ["--kv-bits", "4", "--k-bits", "8"],
    ["--kv-bits", "8", "--v-group-size", "64"], ["--kv-group-size", "64"], ["--kv-bits", "8", "--kv-group-size", "128"],
    ["--k-bits", "8", "--v-bits", "4", "--kv-group-size", "64", "--k-group-size", "128"],
]


@pytest.mark.parametrize("model", ["llama-3-8b", "qwen2.5-0.5b", "phi-3-mini", "gemma-3-270m"])
def test_budget_resolves_the_format_as_serve_does(model, capsys):
    """The format budget reports is the one serve allocates for the same flags (group sizes
    chosen for the head_dim by KVFormat.for_head_dim, default_group_size when none is given),
    and a combination serve refuses, budget refuses with the same words."""
    from kvmetal.kv_format import KVFormatError, default_group_size, format_from_args

    head_dim = B.load_model(model).head_dim
    serve = _command_parsers()["serve"]
    for argv in FLAG_CASES:
        try:
            expected = format_from_args(serve.parse_args(argv)).for_head_dim(head_dim)
        except KVFormatError as exc:
            assert B.main(["-m", model, *argv]) == 2, argv
            assert capsys.readouterr().err == f"kvmetal budget: error: {exc}\n", argv
            continue
        got = run_json(capsys, "-m", model, *argv)["format"]
        assert got == {**dataclasses.asdict(expected), "label": expected.label}, argv
        for side in ("k", "v"):
            if got[f"{side}_bits"] is not None and not any("group" in a for a in argv):
                assert got[f"{side}_group_size"] == default_group_size(head_dim) == 32, (argv, side)
