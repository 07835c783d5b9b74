"""Every ```python block of README.md runs as written.

A block either runs on a CPU-only machine (it picks its device by availability) or says so in its
first line, a comment such as ``# needs a CUDA GPU``. The CPU blocks run here, each in a fresh
interpreter in an empty directory; the GPU blocks are compiled here and run by ``pytest -m gpu``
(``make gpu-check``) on a machine with a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
# The declaration: "# needs a CUDA GPU", "# needs a GPU", "# needs a CUDA GPU and CuPy", ...
GPU_NEED = re.compile(r"#\s*needs (a )?(CUDA )?GPU", re.IGNORECASE)
TIMEOUT_S = 180  # a block is a few seconds; this only bounds a hang on a loaded machine


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    code: str

    @property
    def needs_gpu(self) -> bool:
        first = self.code.lstrip("\n").splitlines()[0] if self.code.strip() else ""
        return bool(GPU_NEED.match(first.strip()))

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks, dedented (a block inside a list item is indented like the item)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        indent, lang, start = m["indent"], m["lang"], i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"README.md:{start + 1}: the ```{lang} block is never closed")
        if lang == "python":
            blocks.append(Block(start + 1, textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))
CPU_BLOCKS = [b for b in BLOCKS if not b.needs_gpu]
GPU_BLOCKS = [b for b in BLOCKS if b.needs_gpu]


def run_block(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    # One CPU thread unless asked otherwise: on a busy 2-core CI machine torch's OpenMP threads
    # spin against the other processes and a block takes several times longer.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block} did not finish within {TIMEOUT_S} s:\n{e.stdout or ''}{e.stderr or ''}")
    assert proc.returncode == 0, (
        f"{block} failed (exit {proc.returncode}):\n--- code\n{block.code}--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"
    )


def test_blocks_found() -> None:
    assert len(BLOCKS) >= 5, [str(b) for b in BLOCKS]
    assert CPU_BLOCKS and GPU_BLOCKS, "expected blocks of both kinds: ones that run on the CPU and GPU ones"


def test_python_parser_sees_indented_blocks() -> None:
    text = "1. a step:\n   ```python\n   x = 1\n   if x:\n       y = 2\n   ```\n```sh\nls\n```\n"
    (block,) = python_blocks(text)
    assert block.line == 2 and block.code == "x = 1\nif x:\n    y = 2\n"


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_block_compiles(block: Block) -> None:
    compile(block.code, str(block), "exec")


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_gpu_need_is_declared_in_the_first_line(block: Block) -> None:
    """A block that mentions needing a GPU says so in its first line (and only there), so that a
    reader sees it before reading the code and this test knows which blocks to run on the CPU."""
    lines = block.code.strip("\n").splitlines()
    later = [n for n, line in enumerate(lines[1:], start=2) if GPU_NEED.search(line)]
    assert not later, f"{block}: the GPU need is declared on line {later[0]} of the block, not its first"


@pytest.mark.parametrize("block", CPU_BLOCKS, ids=str)
def test_cpu_block_runs(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("block", GPU_BLOCKS, ids=str)
def test_gpu_block_runs(block: Block, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    run_block(block, tmp_path)
