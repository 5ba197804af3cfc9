"""The Metal kernels' part of ``kvmetal bench`` where no Apple GPU is present: rows
of simulator traffic and cost figures (measured by ``kvmetal.sim.traffic``).

On a Mac, ``kvmetal bench`` runs every case on the metal backend itself (timed,
next to ``mx.fast.scaled_dot_product_attention`` on the GPU, with the fraction of
the chip's peak bandwidth). Elsewhere the Metal kernels cannot run, so the
simulator's traffic figures for small cases are reported instead: bytes loaded
from the K/V caches against the live KV bytes, labelled "sim traffic (no timing)",
and the decode kernels' cost figures at 8K tokens, labelled "sim costs (no timing)".
"""
from __future__ import annotations

from ..sim import traffic

SIM_LABEL = "sim traffic (no timing)"


def traffic_rows(progress) -> list:
    """Simulator traffic rows for the paged decode kernel (no timing)."""
    results = []
    cases = [
        ("paged_attention f16 GQA 1", dict(num_kv_heads=2, gqa=1)),
        ("paged_attention f16 GQA 4", dict(num_kv_heads=2, gqa=4)),
        ("paged_attention f16 GQA 8", dict(num_kv_heads=1, gqa=8)),
        ("paged_attention f16 sliding_window=256", dict(num_kv_heads=2, gqa=4, sliding_window=256)),
        ("paged_attention K8/V4", dict(num_kv_heads=2, gqa=4, k_bits=8, v_bits=4)),
    ]
    for name, kwargs in cases:
        progress(f"  measuring sim traffic of {name} ...")
        figures = traffic.paged_costs(1024, head_dim=64, **kwargs)
        note = (f"{SIM_LABEL}: loaded {figures['loaded_bytes']:,} B from K/V = "
                f"{figures['loaded_over_live']:.3f}x the live rows' bytes")
        results.append({"name": f"{name} T=1024 D=64", "backend": "sim", "seconds": None,
                        "kv_bytes": figures["live_bytes"], "gbps": None, "note": note,
                        "loaded_bytes": figures["loaded_bytes"], "loaded_over_live": figures["loaded_over_live"]})
    return results


# The cases `kvmetal bench` prints on Linux: D 128, 8K tokens, f16 and K8/V4, L = 1 and 8.
BENCH_CASES = [
    ("paged f16 G4 L1", traffic.paged_costs, dict(gqa=4)),
    ("paged f16 G4 L8", traffic.paged_costs, dict(gqa=4, query_len=8)),
    ("paged K8/V4 G4 L1", traffic.paged_costs, dict(gqa=4, k_bits=8, v_bits=4)),
    ("decode f16 G4 L1", traffic.decode_costs, dict(gqa=4)),
    ("decode K8/V4 G8 L1", traffic.decode_costs, dict(gqa=8, k_bits=8, v_bits=4)),
    ("MLX sdpa_vector f16 G4 L1", traffic.mlx_sdpa_vector_costs, dict(gqa=4)),
]

COLUMNS = (("loaded/live", "loaded_over_live", "{:.3f}"), ("tg mem B", "threadgroup_memory", "{:d}"),
           ("barriers/1K rows", "barriers_per_1k_rows", "{:.2f}"),
           ("reductions/(tok x row)", "reductions_per_token_row", "{:.3f}"),
           ("shuffles/(tok x row)", "shuffles_per_token_row", "{:.3f}"),
           ("transc./(tok x row)", "transcendentals_per_token_row", "{:.3f}"),
           ("B/load", "bytes_per_load", "{:.1f}"))


LEGEND = ("sim costs, per kernel launch as the simulator counts them: loaded/live = bytes loaded from the K/V "
          "caches / bytes of the live rows (1.000: each row read once); tg mem B = threadgroup memory per "
          "threadgroup, bytes; barriers/1K rows = threadgroup barriers per 1,000 K/V rows; reductions, shuffles "
          "and transc. (transcendentals: exp, log, tanh) per (token x query row); B/load = bytes per device load "
          "instruction (wider is better)")


def cost_rows(progress, tokens: int = 8192) -> list:
    """``kvmetal bench`` result rows (untimed, labelled) with each decode kernel's cost figures."""
    rows = []
    for name, fn, kwargs in BENCH_CASES:
        if fn is traffic.mlx_sdpa_vector_costs and not traffic.mlx_sdpa_path().exists():
            continue  # this MLX wheel ships no Metal headers
        progress(f"  measuring sim costs of {name} ...")
        fig = fn(tokens, **kwargs)
        note = "sim costs (no timing): " + ", ".join(f"{label} {fmt.format(fig[key])}" for label, key, fmt in COLUMNS)
        rows.append({"name": f"{name} T={tokens} D=128", "backend": "sim", "seconds": None,
                     "kv_bytes": fig["live_bytes"], "gbps": None, "note": note, "costs": fig})
    return rows


# ----------------------------------------------------------------------------- modelled times

MODEL_LABEL = "MODELLED, not measured (kvmetal/sim/cost_model.py; docs/cost_model.md)"


def modelled_rows(progress, tokens: int = 8192, chips=("m2-max", "m4-max")) -> list:
    """Rows of modelled decode times (cost model over the simulator's counters): kvmetal's
    paged decode (partials + reduce) and MLX's decode kernels as MLX dispatches them, D 128,
    8 kv heads, GQA 4, f16 and K8/V4. Untimed rows: ``seconds`` stays None, the modelled
    time is in the note and in ``modelled_seconds``. Full table: tools/cost_model.py."""
    from ..sim import cost_cases as cc
    from ..sim import cost_model as cm

    progress(f"  modelling decode T={tokens} G4 (cost model over simulator counters) ...")
    mlx = {}
    for chip in chips:
        suffix = cm.MLX_ARCH_SUFFIX[chip]
        if suffix not in mlx:
            mlx[suffix] = cc.mlx_decode(tokens, 4, arch_suffix=suffix)
    rows = []
    for fmt in ("f16", "K8/V4"):
        works = [w.scaled(cc.KV_HEADS) for w in cc.kvmetal_decode(tokens, 4, fmt)]
        for chip in chips:
            plan, mworks = mlx[cm.MLX_ARCH_SUFFIX[chip]]
            k = cm.estimate_launches(works, chip)["seconds"]
            m = cm.estimate_launches([w.scaled(cc.KV_HEADS) for w in mworks], chip)["seconds"]
            note = (f"{MODEL_LABEL}: kvmetal {k * 1e6:.0f} us vs MLX {plan['kernel']} (f16) {m * 1e6:.0f} us "
                    f"on {chip}")
            rows.append({"name": f"modelled {chip} paged {fmt} G4 T={tokens} D=128 Hkv=8", "backend": "model",
                         "seconds": None, "kv_bytes": None, "gbps": None, "note": note, "modelled_seconds": k,
                         "modelled_mlx_seconds": m, "modelled": True})
    return rows
