"""The python code in README.md and docs/*.md runs, and prints what it shows.

Every block fenced ```` ```python ```` runs, each in a fresh namespace, all of
one file in one subprocess run in a temporary folder (files they write stay
there).  Where a block is followed directly by a plain ```` ``` ```` block,
that block is its printed output, compared exactly.  A fragment that cannot
run alone (it names a user's ``model`` or ``fn``) is fenced
```` ```python fragment ````.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\n```\n(.*?)^```\n)?", re.S | re.M)
_END = "\x00end of block\x00"

# Runs each block given as JSON on stdin in a fresh namespace, and marks where each one's output ends.
_RUNNER = f"""
import json, sys
for source in json.load(sys.stdin):
    exec(compile(source, "<doc block>", "exec"), {{"__name__": "__doc_block__"}})
    print({_END!r}, flush=True)
"""


def _blocks(page: Path) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(page.read_text())]


PAGES_WITH_CODE = [p for p in PAGES if _blocks(p)]


def test_docs_have_code_to_run():
    assert ROOT / "README.md" in PAGES_WITH_CODE and len(PAGES_WITH_CODE) >= 3


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_docs_code_blocks_run_and_print_what_they_show(page, tmp_path):
    blocks = _blocks(page)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps([b for b, _ in blocks]),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = result.stdout.split(_END + "\n")
    assert len(outputs) == len(blocks) + 1
    for (source, shown), printed in zip(blocks, outputs):
        if shown is not None:
            assert printed == shown, f"{page.name}: the block\n{source}\nprints\n{printed}"
