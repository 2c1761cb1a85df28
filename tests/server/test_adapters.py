"""Rules about the transport adapters that a machine can check: REST and gRPC repeat no logic
(the data plane owns every decision), and their methods stay small."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
REST = sorted((SERVER / "rest").glob("*.py"))
GRPC = sorted(p for p in (SERVER / "grpc").glob("*.py"))
WINDOW = 6
ADAPTERS = [
    SERVER / "rest" / "inference.py",
    SERVER / "rest" / "management.py",
    SERVER / "grpc" / "inference.py",
    SERVER / "grpc" / "management.py",
]
LONGEST_METHOD = 20
STREAM_PLUMBING = {"ModelStreamInfer"}
"""Longer by nature: a bidirectional stream's reader, writer and cancellation, no decisions."""


def _logic_lines(path: Path) -> list[str]:
    """Code lines with white space folded: no blanks, comments, imports or docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        line
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }  # fmt: skip
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = " ".join(line.split())
        if not text or text.startswith(("#", "import ", "from ")) or number in docstrings:
            continue
        if re.fullmatch(r"[()\[\]{},:]+", text):
            continue
        lines.append(text)
    return lines


def _windows(paths: list[Path]) -> dict[tuple[str, ...], str]:
    found = {}
    for path in paths:
        lines = _logic_lines(path)
        for i in range(len(lines) - WINDOW + 1):
            found.setdefault(tuple(lines[i : i + WINDOW]), path.name)
    return found


def test_rest_and_grpc_repeat_no_run_of_lines() -> None:
    rest = _windows(REST)
    shared = [(rest[w], name, w) for w, name in _windows(GRPC).items() if w in rest]
    assert not shared, "\n".join(f"rest/{a} ~ grpc/{b}:\n  " + "\n  ".join(w) for a, b, w in shared)


def test_the_checker_finds_a_repeated_run(tmp_path: Path) -> None:
    body = "\n".join(f"x{i} = compute({i}, 'same')" for i in range(WINDOW)) + "\n"
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "b.py").write_text("y = 1\n" + body)
    assert set(_windows([tmp_path / "a.py"])) & set(_windows([tmp_path / "b.py"]))


def test_adapter_methods_are_small() -> None:
    long = []
    for path in ADAPTERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.name.startswith("create_") or node.name in STREAM_PLUMBING:
                continue  # an app factory holds the routes; each route is checked itself
            body = node.body[1:] if ast.get_docstring(node) else node.body
            length = (node.end_lineno or node.lineno) - body[0].lineno + 1
            if length > LONGEST_METHOD:
                long.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long
