"""The python code in README.md and docs/*.md runs, and prints what it shows.

Every block fenced ```` ```python ```` runs, each in a fresh namespace, the
blocks of one file one after another in a temporary folder of their own
(files they write stay there); the files' blocks all run in one subprocess,
which pays ``import torch`` once rather than once a file.  Where a block is followed directly by a plain ```` ``` ```` block,
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

# Runs, for each (folder, blocks) given as JSON on stdin, the blocks in that
# folder, each in a fresh namespace, with what each prints; a block that raises
# ends its file's run with the traceback.  One JSON line per file.
_RUNNER = """
import contextlib, io, json, os, sys, traceback
for folder, blocks in json.load(sys.stdin):
    os.chdir(folder)
    printed, error = [], None
    for source in blocks:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(source, "<doc block>", "exec"), {"__name__": "__doc_block__"})
        except BaseException:
            error = traceback.format_exc()
            break
        finally:
            printed.append(out.getvalue())
    print(json.dumps([printed, error]), flush=True)
"""


def _blocks(page: Path) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(page.read_text())]


PAGES_WITH_CODE = [p for p in PAGES if _blocks(p)]


def test_docs_have_code_to_run():
    assert ROOT / "README.md" in PAGES_WITH_CODE and len(PAGES_WITH_CODE) >= 3


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory) -> dict:
    """page -> (what each block printed, the traceback if one raised), for the pages this session selected."""
    pages = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_docs_code_blocks_run_and_print_what_they_show"
    ]
    jobs = [(str(tmp_path_factory.mktemp(page.stem)), [b for b, _ in _blocks(page)]) for page in pages]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(jobs),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.returncode == 0 and len(lines) == len(pages), result.stderr[-3000:]
    return dict(zip(pages, lines))


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_docs_code_blocks_run_and_print_what_they_show(page, ran):
    blocks = _blocks(page)
    outputs, error = ran[page]
    assert error is None, f"{page.name}: {error[-3000:]}"
    assert len(outputs) == len(blocks)
    for (source, shown), printed in zip(blocks, outputs):
        if shown is not None:
            assert printed == shown, f"{page.name}: the block\n{source}\nprints\n{printed}"


def test_docs_readme_is_at_most_150_lines():
    # issue 29: the README is the front door; findings go to CHANGELOG, reference to docs/
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
