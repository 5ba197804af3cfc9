"""The chip table maps MLX device names to full configurations."""
from kvmetal import chips


def test_device_names_map_to_full_configurations():
    assert chips.from_device_name("Apple M3 Max").name == "m3-max"  # not the binned 30-core part
    assert chips.from_device_name(" Apple M4 Max ").bandwidth_gbs == 546
    assert chips.from_device_name("Apple M1").gpu_cores == 8
    assert chips.from_device_name("Apple M9 Hyper") is None


def test_every_chip_is_sane():
    for chip in chips.CHIPS.values():
        assert chip.bandwidth_gbs > 0 and chip.gpu_cores > 0 and chip.memory_gib
        assert chip.device_name.startswith("Apple M")


def test_metal_device_info_asks_mlx_for_the_gpu(monkeypatch):
    import mlx.core as mx

    from kvmetal import chips

    asked = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.metal, "device_info", lambda: {"device_name": "old call"})
    monkeypatch.setattr(mx, "device_info", lambda d=None: asked.append(d) or {"device_name": "Apple M2"},
                        raising=False)
    assert chips.metal_device_info() == {"device_name": "Apple M2"} and asked == [mx.gpu]
    monkeypatch.delattr(mx, "device_info")   # an MLX without mx.device_info: the old call
    assert chips.metal_device_info() == {"device_name": "old call"}
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert chips.metal_device_info() == {}
