"""The README stays what a newcomer finishes: at most 300 lines, and every file it links to is in
the repository (a results file renamed or a page moved would leave a dead link)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 300


def test_the_readme_is_at_most_300_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_file_the_readme_links_to_exists() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert len(local) > 20  # the docs pages and the results files behind its figures
    missing = sorted({t for t in local if not (REPO / t).exists()})
    assert not missing, f"README.md links to files that are not there: {missing}"
