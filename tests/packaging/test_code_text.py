"""The code's own text says what and why; what was measured lives in benchmarks/README.md, beside
the results file and the machine that produced it. A docstring or comment that quotes a timing
("12.4 us", "about 1.1 s"), a speed ratio ("1.14x") or a share of time ("46 % of the event
loop") goes stale as soon as the code or the machine changes, and no test can say when."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("archiver", "handlers", "server", "training")
LEFT_OUT = ("handlers/torchserve/ts/", "server/grpc/_generated/")
"""TorchServe's own module paths (its handlers import from them as they are) and generated code."""
MEASURED = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:us|µs)\b"  # a timing in microseconds
    r"|\b\d+\.\d+x\b"  # a speed ratio
    r"|\b\d+(?:\.\d+)?\s?% of (?:the|its|an?)\b"  # a share of something's time
    r"|(?:\babout|~)\s?\d+(?:\.\d+)?\s?(?:ms|s)\b"  # an approximate timing: "about 1.1 s"
    r"|\bmeasured\b[^.()]*?\b\d+(?:\.\d+)?\s?(?:ms|s)\b"  # a timing made once: "(measured: 52 ms"
    r"|\b\d+(?:\.\d+)?\s?(?:ms|s) for \d"  # a timing of so many things: "360 ms for 200"
)
"""What was measured. A setting's value or a limit ("every 100 ms", "waiting at most 60 s") is
the code's own and stays."""


def _texts(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings (every string that is a statement of its own) of a module,
    with their first lines."""
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.append((node.lineno, node.value.value))
    return found


def test_no_docstring_or_comment_quotes_a_measurement() -> None:
    quoted = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative.startswith(LEFT_OUT):
                continue
            for line, text in _texts(path):
                for match in MEASURED.finditer(text):
                    quoted.append(f"{relative}:{line}: {match.group(0)!r}")
    assert len(list((REPO / "server").rglob("*.py"))) > 50  # the packages were found
    assert not quoted, (
        "figures belong in benchmarks/README.md beside their results file; say why in words "
        "here:\n" + "\n".join(quoted)
    )
