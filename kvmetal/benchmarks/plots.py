"""Charts for ``kvmetal bench --plot`` (matplotlib, imported only when asked for)."""
from __future__ import annotations


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"[bench] --plot needs matplotlib: pip install matplotlib ({exc})") from exc
    return plt


def plot_kernel_results(results: list, read_gbps: float, path: str, *, peak: tuple | None = None) -> None:
    """Horizontal bars: GB/s per timed case (median, min..max as an error bar), with this
    machine's read bandwidth (and the chip's peak on a Mac) as vertical lines."""
    plt = _pyplot()
    timed = [r for r in results if r.get("gbps")]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(timed) + 1.8))
    names = [f"{r['name']} [{r['backend']}]" for r in timed]
    gbps = [r["gbps"] for r in timed]
    # GB/s is kv_bytes / seconds: the fastest run gives the highest figure.
    lo = [g - r["kv_bytes"] / r["max_seconds"] / 1e9 for g, r in zip(gbps, timed)]
    hi = [r["kv_bytes"] / r["min_seconds"] / 1e9 - g for g, r in zip(gbps, timed)]
    ax.barh(names, gbps, xerr=[lo, hi], color="tab:blue", capsize=3)
    ax.axvline(read_gbps, color="black", linestyle="--", label=f"read bandwidth {read_gbps:.1f} GB/s")
    if peak is not None:
        ax.axvline(peak[0], color="tab:red", linestyle=":", label=f"{peak[1]} {peak[0]:g} GB/s")
    ax.invert_yaxis()
    ax.set_xlabel("effective GB/s (KV bytes / median time; bars: min..max)")
    ax.set_title("kvmetal bench")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_model_results(rows: list, path: str, *, title: str) -> None:
    """Prompt and generation tokens/s against context, one line per configuration."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for ax, key, label in ((axes[0], "prompt_tps", "prompt tokens/s"), (axes[1], "generation_tps",
                                                                        "generation tokens/s")):
        for config in configs:
            mine = [r for r in rows if r["config"] == config and r.get(key)]
            ax.plot([r["context"] for r in mine], [r[key] for r in mine], marker="o", label=config)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
