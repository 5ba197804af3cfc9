"""use_paged_cache on a model sharded over 2 ring ranks (issue 13 items 1 and 5).

``mlx.launch -n 2 --backend ring`` runs two processes over loopback. Each rank's pools
hold only its kv heads; the block tables are the same on both (the allocator is
deterministic), the greedy tokens equal a single process's, and each rank holds half
the KV bytes. Skips, with the launcher's words, only where mlx.launch cannot start.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import use_paged_cache  # noqa: E402

WORKER = Path(__file__).with_name("sharded_paged_worker.py")
sys.path.insert(0, str(WORKER.parent))
from sharded_paged_worker import engine_run  # noqa: E402
PROMPT = list(range(3, 40))
STEPS = 16


def launcher() -> str:
    path = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    if not Path(path).exists():
        pytest.skip("mlx.launch is not installed")
    return path


def free_ports(count: int) -> int:
    """A base port with ``count`` free consecutive ports (mlx.launch's default 32323 would
    collide with any other ring job on the machine)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    pytest.skip("no free consecutive ports for the ring backend")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ring_ranks_match_one_process_with_half_the_kv_bytes(tmp_path, family):
    cmd = [launcher(), "-n", "2", "--backend", "ring", "--starting-port", str(free_ports(2)),
           "--python", sys.executable, str(WORKER),
           str(tmp_path), family, str(STEPS)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("mlx.launch ran past 120 s: a rank hung")
    if run.returncode != 0 and not list(tmp_path.glob("rank*.json")) and (
            "Address already in use" in run.stderr or "No such file" in run.stderr):
        pytest.skip(f"mlx.launch could not start: {run.stderr.strip()[-300:]}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    model = tiny_models.build(family, seed=0)
    with use_paged_cache(model, block_size=16):
        cache = make_prompt_cache(model)
        expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=STEPS,
                                                     sampler=lambda lp: mx.argmax(lp, axis=-1), prompt_cache=cache)]
        single = cache[0].model_cache.stats()
        table = cache[0].pool.allocator.block_table(cache[0].seq_ids[0])

    for r, rank in enumerate(ranks):
        assert rank["tokens"] == expected, f"rank {r}"
        assert rank["tables"] == [table], f"rank {r}: block tables differ from one process's"
        assert rank["kv_heads"] == cache[0].pool.num_kv_heads // 2
        stats = rank["stats"]
        assert stats["rank"] == r and stats["world_size"] == 2
        assert 2 * stats["used_bytes"] == single["used_bytes"] and 2 * stats["nbytes"] == single["nbytes"]
        assert stats["all_ranks"]["used_bytes"] == single["used_bytes"]
        assert stats["all_ranks"]["used_blocks"] == 2 * single["used_blocks"]

    # The Engine over the sharded model, preempting, stays in lockstep with one process.
    alone = engine_run(model)
    assert alone["preemptions"] > 0
    for r, rank in enumerate(ranks):
        assert rank["engine"] == alone, f"rank {r}"
