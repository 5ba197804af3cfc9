"""The README's API example runs as written, and its first lines are the two commands."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.skipif(not README.exists(), reason="README.md is not next to the tests")
def test_readme_api_example_runs():
    text = README.read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    scope = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert scope["out"].shape == (1, 32, 128)
    assert scope["keys"].shape == (1, 8, 32, 128)


@pytest.mark.skipif(not README.exists(), reason="README.md is not next to the tests")
def test_readme_starts_with_the_two_commands():
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).strip().splitlines()
    assert block == ['pip install . && kvmetal bench', 'pip install ".[test]" && pytest']
