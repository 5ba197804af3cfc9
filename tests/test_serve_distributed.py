"""``kvmetal serve`` across 2 ranks (mlx.launch, ring backend over loopback).

Rank 0 serves HTTP; both ranks run every step on a tensor-parallel llama (one kv head
each). Skipped, with the reason, only where mlx.launch cannot start 2 ranks here.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvmetal.serve import metrics  # noqa: E402
from kvmetal.serve.tiny import build_model_dir  # noqa: E402

HALF_BLOCK_BYTES = 2 * 2 * 1 * 16 * 64 * 4  # per rank: layers * (K, V) * 1 kv head * 16 tokens * 64 * float32
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
import kvmetal  # noqa: E402

KVMETAL = Path(kvmetal.__file__).resolve().parents[1]  # run where this process found kvmetal


def free_port(count: int = 1) -> int:
    """A port p with p .. p + count - 1 free (the ring backend listens on one port per rank)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for q in range(port + 1, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return port
        except OSError:
            continue
    raise RuntimeError("no free ports")


def launch(script, *args) -> list:
    """mlx.launch on 2 ring ranks over loopback, on ports of its own (other launches may be running)."""
    return [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_port(2)), "--python",
            sys.executable, str(script), *map(str, args)]


@pytest.fixture(scope="module")
def launch_ok():
    if not os.path.exists(LAUNCH):
        pytest.skip("mlx.launch is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "probe.py"
        script.write_text("import mlx.core as mx\ng = mx.distributed.init()\n"
                          "print('sum', mx.distributed.all_sum(mx.array([1.0])).item())\n")
        try:
            out = subprocess.run(launch(script), capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.skip("mlx.launch -n 2 --backend ring did not finish in 60 s here")
    if out.returncode != 0 or out.stdout.count("sum 2.0") != 2:
        pytest.skip(f"mlx.launch -n 2 --backend ring cannot start here: {out.stderr[-300:]}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny-llama-tp"))


class TwoRanks:
    """``mlx.launch -n 2 ... kvmetal serve``; rank 0 listens on ``port``."""

    def __init__(self, model_dir, *options):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.log = tempfile.TemporaryFile("w+")
        entry = Path(tempfile.mkdtemp()) / "kvmetal_entry.py"
        entry.write_text("import sys\nfrom kvmetal.cli import main\nsys.exit(main())\n")
        self.proc = subprocess.Popen(
            launch(entry, "serve", "--model", self.model, "--port", self.port, "--log-level", "INFO", *options),
            stdout=self.log, stderr=subprocess.STDOUT, text=True, cwd=KVMETAL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"2 ranks did not start:\n{self.output()[-3000:]}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher and its ranks
        self.proc.wait()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def pids(self) -> dict:
        return {int(r): int(p) for r, p in re.findall(r"rank (\d) of 2 \(pid (\d+)\)", self.output())}

    def stop(self) -> int:
        """SIGTERM to rank 0, which tells rank 1 to stop: both exit 0, and so does mlx.launch."""
        if self.proc.poll() is None and 0 in self.pids():
            os.kill(self.pids()[0], signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode


def running(pid: int, *, use_proc: bool | None = None) -> bool:
    """Alive and not a zombie (a rank is mlx.launch's child, not ours to wait for): /proc where
    there is one (Linux), else ps (macOS has no /proc; POSIX ps prints Z for a zombie)."""
    if use_proc is None:
        use_proc = Path("/proc/self/status").exists()
    if use_proc:
        try:
            return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return out.returncode == 0 and bool(out.stdout.strip()) and not out.stdout.strip().startswith("Z")


@pytest.mark.parametrize("use_proc", [True, False], ids=["proc", "ps"])
def test_running_tells_a_live_process_from_a_zombie_and_a_reaped_one(use_proc):
    if use_proc and not Path("/proc/self/status").exists():
        pytest.skip("no /proc here (macOS): running() uses ps, tested by the other case")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert running(child.pid, use_proc=use_proc)
        child.stdin.close()
        deadline = time.monotonic() + 30
        while running(child.pid, use_proc=use_proc):      # exited, not yet reaped: a zombie
            assert time.monotonic() < deadline, "running() still says alive after the child exited"
            time.sleep(0.05)
        assert child.poll() == 0  # ... and only now reaped
        assert not running(child.pid, use_proc=use_proc)
    finally:
        child.kill()
        child.wait()


def greedy_alone(model_dir, prompt, max_tokens):
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    # A completion keeps its first token's leading space (the streamed text trims it).
    return tokenizer.decode([r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)])


@pytest.mark.slow  # over 10 s here (tests/README.md)
def test_two_ranks_answer_like_one_process_with_half_the_kv_per_rank(launch_ok, model_dir):
    prompts = ["The paged cache keeps keys and values in fixed blocks", "Write a short poem about the sea",
               "Servers batch many requests in one forward pass", "What is the capital of France?",
               "Quantized keys keep eight bits"]
    expected = greedy_alone(model_dir, prompts[0], 12)
    # A per-rank cap of 4 blocks: five requests at once must wait and preempt, in lockstep.
    ranks = TwoRanks(model_dir, "--kv-memory", f"{4 * HALF_BLOCK_BYTES}B")
    try:
        client = openai.OpenAI(base_url=ranks.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        run = lambda p, n=20: client.completions.create(model=ranks.model, prompt=p, max_tokens=n)  # noqa: E731
        first = run(prompts[0], 12).choices[0].text
        alone = [run(p).choices[0].text for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = [r.choices[0].text for r in pool.map(run, prompts)]
        m = metrics.parse(httpx.get(ranks.url + "/metrics").text)
    finally:
        status = ranks.stop()
    assert status == 0, ranks.output()
    assert set(ranks.pids()) == {0, 1}
    assert first == expected  # tensor parallel over 2 ranks = mlx-lm in one process, greedy
    assert together == alone
    assert m["kvmetal_ranks"] == 2
    assert m["kvmetal_kv_pool_bytes"] == 4 * HALF_BLOCK_BYTES  # rank 0 holds its one kv head of two
    assert m["kvmetal_preemptions"] > 0 and m["kvmetal_kv_peak_used_bytes"] <= 4 * HALF_BLOCK_BYTES


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_dead_rank_stops_the_server_instead_of_hanging(launch_ok, model_dir, how):
    # killed: the ring backend reports the lost peer; frozen (SIGSTOP): the collective
    # hangs, and the watchdog ends rank 0 after --rank-timeout.
    ranks = TwoRanks(model_dir, "--rank-timeout", "5")
    try:
        client = openai.OpenAI(base_url=ranks.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.completions.create(model=ranks.model, prompt="hello", max_tokens=4).choices[0].text
        pids = ranks.pids()
        os.kill(pids[1], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        while running(pids[0]):
            assert time.monotonic() - started < 30, "rank 0 kept running after rank 1 died"
            time.sleep(0.1)
        # rank 0 said why (unless mlx.launch stopped it first when rank 1 was killed);
        # give the launcher a moment to forward its last lines
        said = ("the engine loop died", "rank 1 exited") if how == "killed" else ("another rank has probably died",)
        while not any(s in ranks.output() for s in said) and time.monotonic() - started < 40:
            time.sleep(0.1)
    finally:
        ranks.kill()
    out = ranks.output()
    assert any(s in out for s in said), out[-2000:]


def test_sigterm_mid_stream_ends_every_rank_with_status_0(launch_ok, model_dir):
    # rank 0 drains for --shutdown-timeout, then its stop command reaches rank 1: both exit 0
    import json
    import threading

    ranks = TwoRanks(model_dir, "--shutdown-timeout", "1")
    lines, started = [], threading.Event()

    def read():
        body = {"prompt": "Write a short poem about the sea", "max_tokens": 1900, "stream": True,
                "logit_bias": {"0": -100}}
        with httpx.stream("POST", ranks.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
        started.set()

    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        assert started.wait(60)
        pids = ranks.pids()
        status = ranks.stop()  # SIGTERM to rank 0 mid-answer
        reader.join(30)
    finally:
        ranks.kill()
    assert status == 0, ranks.output()[-3000:]
    assert not running(pids[0]) and not running(pids[1])
    assert lines[-1] == "[DONE]" and "shutting down" in json.loads(lines[-2])["error"]["message"], lines[-3:]
