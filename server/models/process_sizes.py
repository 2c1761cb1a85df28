"""A process's memory as /proc tells it: its resident size (cheap, `statm`) and its proportional
size (`smaps_rollup`: every page it shares divided among the processes that map it), for the
memory budget (`memory.py`), whose process workers share the pages of the fork server they were
forked from."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident size (0 when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(frozen=True)
class Reading:
    """A process's sizes read together: resident, and proportional (each page it shares divided
    by the processes that map it, so a set of processes' proportional sizes add up to what
    they hold together, shared pages once), and its parent's pid."""

    resident: int
    proportional: int
    parent: int


def read_process(pid: int) -> Reading | None:
    """`pid`'s sizes (None when it is gone). `smaps_rollup` walks every mapping of the process:
    milliseconds for one with torch, so it is read at loads and unloads, not per look."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in rollup.splitlines()[1:] if ":" in line)
    try:
        resident, proportional = (int(fields[name].split()[0]) * 1024 for name in ("Rss", "Pss"))
        parent = int(stat.rsplit(")", 1)[1].split()[1])
    except (KeyError, IndexError, ValueError):
        return None
    return Reading(resident, proportional, parent)


def read_processes(pids: Iterable[int], fork_servers: Iterable[int] = ()) -> dict[int, Reading]:
    """Worker processes' sizes and those of the fork servers they were forked from (their
    parents other than this process) or that `fork_servers` names (one outlives its workers),
    by pid; run in a thread."""
    found = {pid: reading for pid in pids if (reading := read_process(pid)) is not None}
    parents = {reading.parent for reading in found.values()} | set(fork_servers)
    for parent in parents - {os.getpid(), *found}:
        reading = read_process(parent)
        if reading is not None:
            found[parent] = reading
    return found
