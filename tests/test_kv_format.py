"""One KVFormat from the flags and the API to the cache (issue 33): validated once, the same
flag meaning in generate, serve and bench, per-side group sizes that reach the pools."""
from __future__ import annotations

import argparse

import pytest

from kvmetal import KVFormat
from kvmetal.kv_format import KVFormatError, add_format_flags, default_group_size, format_from_args, format_notes


def flags(*argv):
    parser = argparse.ArgumentParser()
    add_format_flags(parser)
    return format_from_args(parser.parse_args(list(argv)))


def test_per_side_flags_win_over_the_both_sides_flags():
    assert flags() == KVFormat()
    assert flags("--kv-bits", "8") == KVFormat(k_bits=8, v_bits=8)
    assert flags("--kv-bits", "4", "--k-bits", "8") == KVFormat(k_bits=8, v_bits=4)
    assert flags("--k-bits", "8", "--v-bits", "4") == KVFormat(k_bits=8, v_bits=4)
    got = flags("--kv-bits", "8", "--kv-group-size", "64", "--v-group-size", "32")
    assert (got.k_group_size, got.v_group_size) == (64, 32)


def test_group_sizes_follow_the_head_dim_and_errors_name_the_flag():
    fmt = flags("--k-bits", "8", "--v-bits", "4")
    assert fmt.for_head_dim(64).cache_options() == dict(k_bits=8, v_bits=4, k_group_size=32, v_group_size=32)
    assert fmt.for_head_dim(256).k_group_size == default_group_size(256) == 32
    assert format_notes(fmt, 128) == []
    with pytest.raises(KVFormatError, match=r"--k-group-size 128 does not divide the model's head_dim 64; "
                                            r"try --k-group-size 64"):
        flags("--kv-bits", "8", "--k-group-size", "128").for_head_dim(64)
    with pytest.raises(KVFormatError, match=r"--kv-group-size 128 does not divide"):
        flags("--kv-bits", "8", "--kv-group-size", "128").for_head_dim(96)
    with pytest.raises(KVFormatError, match=r"head_dim 48 has no supported quantization group size"):
        fmt.for_head_dim(48)
    float_side = flags("--k-bits", "8").for_head_dim(64)
    assert float_side.v_bits is None and float_side.label == "K8/Vf16 g32"


@pytest.mark.parametrize("kwargs,match", [
    (dict(k_bits=7), r"k_bits must be None or one of \(2, 3, 4, 5, 6, 8\), got 7"),
    (dict(v_bits=True), r"v_bits must be None or one of"),
    (dict(k_group_size=48), r"k_group_size must be None or one of \(32, 64, 128\), got 48"),
    (dict(dtype="f8"), r"dtype must be one of"),
])
def test_bad_values_are_refused_when_made(kwargs, match):
    with pytest.raises(KVFormatError, match=match):
        KVFormat(**kwargs)


def test_the_api_takes_a_kv_format_or_loose_arguments_not_both():
    assert KVFormat.coerce(k_bits=8, v_bits=4, group_size=32) == KVFormat(8, 4, 32, 32)
    assert KVFormat.coerce(KVFormat(8, 4)) == KVFormat(8, 4)
    with pytest.raises(ValueError, match=r"\[Engine\] give kv_format or k_bits, not both"):
        KVFormat.coerce(KVFormat(8, 4), k_bits=8, owner="Engine")
    with pytest.raises(TypeError, match="kv_format must be a kvmetal.KVFormat, got dict"):
        KVFormat.coerce({"k_bits": 8})
    with pytest.raises(KVFormatError, match=r"\[use_paged_cache\] v_bits must be None or one of"):
        KVFormat.coerce(v_bits=9, owner="use_paged_cache")


def test_the_engine_cache_and_pools_get_one_format():
    pytest.importorskip("mlx_lm")
    from kvmetal.integrations import tiny_models
    from kvmetal.engine.engine import Engine

    model = tiny_models.build("llama")  # head_dim 64
    fmt = KVFormat(k_bits=8, v_bits=4, v_group_size=64)
    with Engine(model, kv_format=fmt) as engine:
        assert engine.cache.kv_format == fmt
        pool = engine.cache.pools[0]
        assert (pool.k_bits, pool.v_bits, pool.k_group_size, pool.v_group_size) == (8, 4, 32, 64)
        rid = engine.add_request([1, 2, 3, 4, 5], max_tokens=3)
        while engine.has_work():
            engine.step()
        assert len(engine.requests[rid].output) == 3
    with pytest.raises(ValueError, match=r"give kv_format or k_bits, not both"):
        Engine(model, kv_format=fmt, k_bits=8)
    assert "make_cache" not in vars(model)
