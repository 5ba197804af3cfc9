"""Every code block in README.md and docs/*.md runs as written (the rules are in
docs/design.md, "Code blocks in the docs"):

- ``python`` blocks run, in order, one namespace per file, in a temporary directory;
  ``path/to/model`` is replaced by a small random mlx-lm model written here.
- ``bash``/``sh`` blocks run when every line is a ``kvmetal`` command (or a comment),
  each in-process through ``kvmetal.cli.main``, and must exit 0.
- ``python no-run`` / ``bash no-run`` (the info string after the fence) marks a block
  that must not run; a block without a language, or ``text``, is a listing.

New docs/*.md files are picked up automatically.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ([ROOT / "README.md"] if (ROOT / "README.md").exists() else []) + sorted((ROOT / "docs").glob("*.md"))
PLACEHOLDER = "path/to/model"
SHELLS = ("bash", "sh", "shell", "console")


@dataclass
class Block:
    path: Path
    line: int        # 1-based line of the opening fence
    lang: str
    options: list
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list:
    blocks, current = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if current is None:
            m = re.match(r"^```(\S*)\s*(.*)$", line)
            if m:
                current = Block(path, number, m.group(1).lower(), m.group(2).split(), "")
        elif re.match(r"^```\s*$", line):
            blocks.append(current)
            current = None
        else:
            current.code += line + "\n"
    assert current is None, f"{path}:{current.line}: unclosed code block"
    return blocks


def shell_commands(code: str) -> list:
    """Logical lines (backslash continuations joined), comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", code)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from kvmetal.integrations import tiny_models

    path = tmp_path_factory.mktemp("docs-model")
    tiny_models.save("llama", path, dtype=mx.float32)
    return path


def _needs_model(blocks) -> bool:
    return any(PLACEHOLDER in b.code for b in blocks)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run_as_written(path, request, tmp_path, monkeypatch):
    blocks = [b for b in code_blocks(path) if "no-run" not in b.options and b.lang in ("python", *SHELLS)]
    model = str(request.getfixturevalue("tiny_model_dir")) if _needs_model(blocks) else None
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks:
        code = block.code.replace(PLACEHOLDER, model) if model else block.code
        if block.lang == "python":
            try:
                exec(compile(code, block.where, "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"{block.where}: python block raised {type(exc).__name__}: {exc}")
            continue
        from kvmetal import cli

        for command in shell_commands(code):
            words = shlex.split(command)
            if words[0] != "kvmetal":
                pytest.fail(f"{block.where}: `{command}` is not a kvmetal command; mark the block "
                            f"'{block.lang} no-run' if it is not meant to run (docs/design.md)")
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code_ = cli.main(words[1:])
            assert code_ == 0, f"{block.where}: `{command}` exited {code_}:\n{out.getvalue()[-2000:]}"


def test_readme_starts_with_the_two_commands():
    blocks = code_blocks(ROOT / "README.md")
    assert blocks[0].line <= 4, "the README's first block comes right after the title"
    assert blocks[0].code.strip().splitlines() == ['pip install . && kvmetal bench', 'pip install ".[test]" && pytest']


def test_readme_api_example_runs_to_the_documented_shapes():
    example = next(b for b in code_blocks(ROOT / "README.md") if b.lang == "python")
    scope: dict = {}
    exec(compile(example.code, example.where, "exec"), scope)
    assert scope["out"].shape == (1, 32, 128)
    assert scope["keys"].shape == (1, 8, 32, 128)


def test_no_reference_to_a_missing_design_md():
    for path in DOCS + sorted((ROOT / "kvmetal").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for target in re.findall(r"(?<![\w/])(?:[\w./]*/)?DESIGN\.md", path.read_text()):
            pytest.fail(f"{path.relative_to(ROOT)} refers to {target}; the design lives in docs/design.md")


def test_the_parser_sees_markers_and_listings(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# t\n\n```python no-run  (needs a Mac)\nimport metal\n```\n\n```\nlisting\n```\n"
                   "```bash\nkvmetal budget -m llama-3-8b \\\n  --context 8K\n# c\n```\n")
    blocks = code_blocks(doc)
    assert [(b.lang, b.options[:1], b.line) for b in blocks] == [("python", ["no-run"], 3), ("", [], 7),
                                                                  ("bash", [], 10)]
    assert shell_commands(blocks[2].code) == ["kvmetal budget -m llama-3-8b    --context 8K"]


def _block_after(path: Path, heading: str) -> str:
    """The first code block after ``heading`` in ``path``."""
    text = path.read_text()
    section = text[text.index(heading):]
    return re.search(r"```[^\n]*\n(.*?)```", section, re.S).group(1)


def layout_entries(block: str) -> list:
    """``(path, description)`` for each line of a repository-layout block that names a path:
    a line's first word, at the start of the line or, for what a folder holds, two spaces
    further in than the folder's line (``kvmetal/`` then ``  ops.py`` is kvmetal/ops.py).
    A line indented further than that continues the description above it."""
    entries, folders = [], []          # folders: (indent, path) of the folders the next line may be in
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if indent != (folders[-1][0] + 2 if folders else 0):
            if entries:
                entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
            continue
        name, _, description = line.strip().partition(" ")
        path = (folders[-1][1] if folders else "") + name
        entries.append((path, description.strip()))
        if name.endswith("/"):
            folders.append((indent, path))
    return entries


def layout_problems(block: str, where: str) -> list:
    """What a repository-layout block gets wrong against the tree: a path that does not exist,
    a file a folder's description names that the folder lacks, and a tracked top-level folder
    or a package under kvmetal/ without a line of its own."""
    entries = layout_entries(block)
    problems = [f"{where} names {path}, which does not exist" for path, _ in entries if not (ROOT / path).exists()]
    for path, description in entries:
        if path.endswith("/"):
            files = re.findall(r"(?<![\w/.-])\w+\.(?:py|metal|h|cpp|md)\b", description)
            problems += [f"{where}: the line for {path} names {f}, which is not in it"
                         for f in files if not (ROOT / path / f).exists()]
    folders = {f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and _tracked(p)}
    packages = {f"kvmetal/{p.parent.name}/" for p in (ROOT / "kvmetal").glob("*/__init__.py")}
    missing = sorted(((folders - {"kvmetal/"}) | packages) - {path for path, _ in entries})
    if missing:
        problems.append(f"{where} has no line for {missing}")
    return problems


def test_the_readme_repository_block_names_what_exists_and_nothing_else():
    """Issue 43: the block was two turns stale. Each line starts with a path that exists, and
    every tracked top-level folder and every package under kvmetal/ has a line."""
    block = _block_after(ROOT / "README.md", "## Repository")
    assert layout_problems(block, "README's Repository block") == []


def test_the_design_layout_block_names_what_exists_and_nothing_else():
    """docs/design.md's "Layout of the repository" went stale too (no serve/, models/,
    selfcheck/, commands/, bench/, docs/, tools/): the README's check, on its nested lines."""
    block = _block_after(ROOT / "docs" / "design.md", "## Layout of the repository")
    assert len(layout_entries(block)) > 10
    assert layout_problems(block, "docs/design.md's layout block") == []


def test_the_layout_parser_nests_folders_and_joins_continuations():
    block = ("pyproject.toml     builds bindings/ into kvmetal/_ext,\n"
             "                   ships kernels/*.metal\n"
             "kvmetal/\n"
             "  ops.py           public ops\n"
             "  sim/             the simulator;\n"
             "                   traffic.py: what the kernels load\n"
             "    runtime/       nested deeper\n"
             "  cli.py           the command; commands/: generate\n"
             "tests/             pytest\n")
    assert layout_entries(block) == [
        ("pyproject.toml", "builds bindings/ into kvmetal/_ext, ships kernels/*.metal"), ("kvmetal/", ""),
        ("kvmetal/ops.py", "public ops"), ("kvmetal/sim/", "the simulator; traffic.py: what the kernels load"),
        ("kvmetal/sim/runtime/", "nested deeper"), ("kvmetal/cli.py", "the command; commands/: generate"),
        ("tests/", "pytest")]
    stale = "kvmetal/\n  sim/             gone.py and traffic.py\n  nowhere.py       x\n"
    problems = layout_problems(stale, "X")
    assert "X names kvmetal/nowhere.py, which does not exist" in problems
    assert "X: the line for kvmetal/sim/ names gone.py, which is not in it" in problems
    assert not any("traffic.py" in p for p in problems)
    assert any(p.startswith("X has no line for [") and "'kvmetal/serve/'" in p and "'tests/'" in p for p in problems)


def _tracked(path: Path) -> bool:
    """A folder git tracks (build outputs and caches are not the repository's)."""
    import subprocess

    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", path.name], capture_output=True, text=True)
    return out.returncode != 0 or bool(out.stdout.strip())  # no git (an sdist): every folder counts
