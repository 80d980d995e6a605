"""The docs match the code: every `--flag` on a fenced command line that runs a stage or a benchmark is in
that script's `--help`, and every repository path the README and docs/ name exists."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"((?:benchmarks/)?[\w]+\.py)\b")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_]*)")
# Paths inside the repository: under one of its folders, or a top-level file of ours.
TOP = ("attention", "benchmarks", "docs", "models", "planning", "runtime", "tests", "workarounds", ".ci")
NOT_OURS = {"stage3_vae_decoder_flax.py"}  # the reference scripts' files, which docs/reference-scripts.md maps to ours
FOLDERS = "|".join(map(re.escape, TOP))
REPO_PATH = re.compile(r"(?<![\w./-])((?:" + FOLDERS + r")/[\w./-]*[\w/]|[\w]+\.(?:py|md|toml))(?![\w/-])")


def fenced_commands(text: str) -> list[str]:
    """Lines of the fenced blocks, backslash continuations joined, comments dropped."""
    lines = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(line.split(" #")[0])
    return lines


def script_flags(page: Path) -> list[tuple[str, str]]:
    """(script, flag) for each flag following a stage or benchmark script on a fenced command line."""
    found = []
    for line in fenced_commands(page.read_text()):
        for command in re.split(r"&&|;|\|", line):
            scripts = [s for s in SCRIPT.findall(command) if s.startswith(("stage", "benchmarks/"))]
            if scripts:
                found += [(scripts[0], flag) for flag in FLAG.findall(command.split(scripts[0], 1)[1])]
    return found


@functools.cache
def help_text(script: str) -> str:
    result = subprocess.run([sys.executable, ROOT / script, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


CASES = sorted({(page.name, script, flag) for page in PAGES for script, flag in script_flags(page)})


def test_the_docs_name_script_flags():
    """The extraction below sees the README's commands (a test that checks nothing would pass too)."""
    assert ("README.md", "stage2_transformer.py", "--plan") in CASES


@pytest.mark.parametrize("page, script, flag", CASES)
def test_documented_flag_is_in_the_scripts_help(page, script, flag):
    assert (ROOT / script).is_file(), f"{page} runs {script}, which does not exist"
    assert re.search(rf"{re.escape(flag)}\b", help_text(script)), f"{page}: {script} has no {flag}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_named_repository_paths_exist(page):
    text = page.read_text()
    named = set(REPO_PATH.findall(text)) - NOT_OURS
    named |= {link for link in re.findall(r"\]\(([^)#:]+)\)", text)}
    missing = []
    for name in sorted(named):
        candidates = [ROOT / name, page.parent / name]
        if not any(path.exists() for path in candidates):
            missing.append(name)
    assert not missing, f"{page.name} names {missing}"
