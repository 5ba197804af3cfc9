"""``/metrics``: the worker's numbers in Prometheus' text format (what vLLM serves too)."""
from __future__ import annotations

# name in the snapshot -> (metric type, help)
METRICS = {
    "ranks": ("gauge", "Ranks serving together under mlx.launch (KV byte figures are rank 0's)."),
    "requests_running": ("gauge", "Requests decoding now."),
    "requests_waiting": ("gauge", "Requests waiting for KV blocks (new or preempted)."),
    "generated_tokens": ("counter", "Output tokens generated."),
    "generation_tokens_per_second": ("gauge", "Output tokens per second over the last 10 s."),
    "prompt_tokens": ("counter", "Prompt tokens admitted (recomputed ones after preemption included)."),
    "prompt_tokens_cached": ("counter", "Prompt tokens found in the prefix cache instead of computed."),
    "prefix_hit_rate": ("gauge", "prompt_tokens_cached / prompt_tokens."),
    "preemptions": ("counter", "Running requests preempted (freed, recomputed later) to make room."),
    "decode_steps": ("counter", "Batched decode steps."),
    "spec_draft_tokens": ("counter", "Drafted tokens verified (--speculative)."),
    "spec_accepted_tokens": ("counter", "Drafted tokens accepted."),
    "spec_acceptance_rate": ("gauge", "spec_accepted_tokens / spec_draft_tokens (0 before any draft)."),
    "spec_verify_passes": ("counter", "Decode rows that carried drafts (one per request and pass)."),
    "decode_tokens_per_pass": ("gauge", "Tokens a decoding request got per forward pass (1 without speculation)."),
    "cascade_steps": ("counter", "Decode passes (per full-attention layer group) that read shared prefixes once "
                                 "(paged_attention_cascade)."),
    "kv_pool_bytes": ("gauge", "Bytes of the KV pools (allocated, used or not)."),
    "kv_used_bytes": ("gauge", "Bytes of KV blocks owned by live requests."),
    "kv_free_bytes": ("gauge", "Cap (or pool, without a cap) minus used bytes."),
    "kv_cap_bytes": ("gauge", "The --kv-memory cap in bytes (-1: none, the pool grows)."),
    "kv_peak_used_bytes": ("gauge", "Peak bytes of KV blocks owned by live requests."),
    "kv_peak_pool_bytes": ("gauge", "Peak bytes of the KV pools."),
    "kv_blocks_total": ("gauge", "KV blocks of every layer-group pool together."),
    "kv_blocks_owned": ("gauge", "KV blocks owned by live requests."),
    "kv_blocks_cached": ("gauge", "KV blocks nobody owns that hold a published prefix (the prefix cache)."),
    "kv_blocks_pinned": ("gauge", "Cached blocks recycled last because several requests shared them "
                                  "(system prompts)."),
    "kv_blocks_free": ("gauge", "KV blocks on the free list (owned + cached + free = total)."),
    "prompt_cache_loaded_blocks": ("gauge", "Prefix blocks loaded from --prompt-cache-dir at start."),
    "prompt_cache_saved_blocks": ("counter", "Prefix blocks written to --prompt-cache-dir."),
    "prompt_cache_warnings": ("counter", "Prompt-cache files skipped (corrupt, mismatched) or not written."),
    "prompt_cache_bytes": ("gauge", "Bytes the prompt cache keeps on disk (segments and index)."),
    "prompt_cache_segments": ("gauge", "Segments the prompt cache's index names."),
    "prompt_cache_discarded_files": ("gauge", "Files a crash left (temporary, or no index names them), deleted at start."),
    "prompt_cache_evicted_segments": ("counter", "Prompt-cache segments evicted under --prompt-cache-max-bytes."),
    "prompt_cache_saving": ("gauge", "1 while the prompt cache saves (0: no cache, or saving turned off)."),
    "prompt_cache_restores": ("counter", "Requests whose prefix blocks were read back from --prompt-cache-dir "
                                         "instead of recomputed (the disk tier)."),
    "prompt_cache_restored_tokens": ("counter", "Prompt tokens restored from disk."),
    "prompt_cache_restore_seconds": ("counter", "Seconds restores took, read start to rows in the pool, summed."),
    "prompt_cache_restore_bytes": ("counter", "Bytes of segment files restores read."),
    "prompt_cache_restore_misses": ("counter", "Restores that failed (unreadable or damaged segment, no room in "
                                               "the pool): their tokens were recomputed."),
    "prompt_cache_restore_missed_tokens": ("counter", "Prompt tokens on disk that misses recomputed."),
    "prompt_cache_restores_in_flight": ("gauge", "Requests waiting for their blocks to come back from disk."),
}


def render(snapshot: dict) -> str:
    lines = []
    for name, (kind, help_) in METRICS.items():
        value = snapshot[name]
        full = f"kvmetal_{name}"
        lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}", f"{full} {_number(value)}"]
    full = "kvmetal_requests_finished"
    lines += [f"# HELP {full} Finished requests by reason.", f"# TYPE {full} counter"]
    for reason, count in sorted(snapshot["requests_finished"].items()):
        lines.append(f'{full}{{reason="{reason}"}} {count}')
    full = "kvmetal_http_rejected"
    lines += [f"# HELP {full} Requests answered with a 4xx error, by HTTP status (invalid request 400, API key "
              f"401, unknown model or route 404, body size 413, queue full 429, ...).", f"# TYPE {full} counter"]
    for status, count in sorted(snapshot.get("http_rejected", {}).items()):
        lines.append(f'{full}{{status="{status}"}} {count}')
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    if value is None:
        return "-1"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(int(value))


def parse(text: str) -> dict:
    """The samples of a ``render`` output as {name: value} (labels kept in the name)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
