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
