"""Every ```python block of README.md runs as written, and so does every
docs/*.md block that starts with a torchrun line.

Each block is saved as a file and run in a fresh interpreter, so a block
that leans on a name from another block (or on anything not in it) fails.
A block whose first line reads ``# torchrun --nproc-per-node P ...`` runs
under torchrun with P gloo ranks on this machine. The README keeps its
examples small enough for this (a few seconds each on a 2-core CPU); there
is no size override.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+)\b")


def python_blocks() -> List[Tuple[str, str]]:
    """(where, code) of each block to run: README's all, docs' torchrun ones."""
    blocks = [(f"README.md block {i}", code)
              for i, code in enumerate(BLOCK.findall((ROOT / "README.md").read_text()))]
    for page in sorted((ROOT / "docs").glob("*.md")):
        runnable = [code for code in BLOCK.findall(page.read_text()) if TORCHRUN.match(code)]
        blocks += [(f"docs/{page.name} torchrun block {i}", code) for i, code in enumerate(runnable)]
    return blocks


def test_readme_has_python_blocks() -> None:
    assert sum(where.startswith("README") for where, _ in python_blocks()) >= 3


@pytest.mark.parametrize("where,code", python_blocks(), ids=[w for w, _ in python_blocks()])
def test_readme_block_runs(where: str, code: str, tmp_path: Path) -> None:
    if "transformers" in code and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (the [hf] extra)")
    script = tmp_path / "block.py"
    script.write_text(code)
    ranks = TORCHRUN.match(code)
    command = [sys.executable, str(script)]
    if ranks:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", ranks.group(1)]
    # the checkout's package first, whatever is installed; one thread per process
    path = os.pathsep.join([str(ROOT / "src")] + os.environ.get("PYTHONPATH", "").split(os.pathsep))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (
        f"{where} failed:\n{code}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-3000:]}"
    )
