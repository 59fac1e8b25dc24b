"""Every command the README and docs/guide.md show parses with today's options, and every
Python snippet compiles (running them takes GPUs, torchrun or a checkpoint folder: the tests
of each feature do that)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from autotp.cli.main import _parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "planner.md"]


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in _blocks(path, "bash"):
            for line in block.splitlines():
                for part in line.split("&&"):
                    synopsis = re.sub(r"\s\[[^]]*\]", "", part.split("  #")[0].split(" > ")[0])  # optional [--x N] parts
                    words = shlex.split(synopsis, comments=True)
                    if words[:1] == ["autotp"]:
                        found.append((path.name, " ".join(words)))
    return found


@pytest.mark.parametrize(("doc", "command"), _commands(), ids=[c for _, c in _commands()])
def test_documented_command_parses(doc: str, command: str) -> None:
    _parser().parse_args(shlex.split(command)[1:])


def test_documented_python_compiles() -> None:
    blocks = [(path.name, block) for path in DOCS for block in _blocks(path, "python")]
    assert len(blocks) >= 3
    for name, block in blocks:
        compile(block, name, "exec")
