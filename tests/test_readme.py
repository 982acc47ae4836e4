"""The READMEs' code fences: every opening fence is closed by a line that is exactly ``` (a closing line that
carries text is no close on GitHub, which then renders the prose after it as code and the code as prose)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READMES = [p for p in ("README.md", os.path.join("cuda", "README.md")) if os.path.exists(os.path.join(ROOT, p))]


def bad_fences(lines):
    """(opening line, offending line) numbers: a fence line with text inside a code block (GitHub does not close
    the block there), or None for a block never closed."""
    bad, opening = [], None
    for n, line in enumerate(lines, 1):
        if not line.lstrip().startswith("```"):
            continue
        if opening is None:
            opening = n
        elif line.strip() == "```":
            opening = None
        else:
            bad.append((opening, n))
    return bad + ([(opening, None)] if opening else [])


def test_the_check_finds_a_fence_closed_on_a_line_with_text():
    assert bad_fences(["```python", "x = 1", "``` Dtypes: ...", "```"]) == [(1, 3)]
    assert bad_fences(["```", "x"]) == [(1, None)]
    assert bad_fences(["```bash", "ls", "```", "text", "```", "```"]) == []


@pytest.mark.parametrize("path", READMES)
def test_every_code_fence_is_closed(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert bad_fences(lines) == [], f"{path}: (opening, offending) lines of fences not closed by exactly ```"
