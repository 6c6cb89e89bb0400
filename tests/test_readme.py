"""Every ```python block of README.md runs as written.

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
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+)\b")


def python_blocks() -> List[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_readme_has_python_blocks() -> None:
    assert len(python_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    code = python_blocks()[index]
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
        f"README block {index} failed:\n{code}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-3000:]}"
    )
