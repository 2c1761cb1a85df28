"""Many models on one node: a memory budget, models loaded on their first request, and the least
recently used idle ones unloaded to make room.

Every model version has a `Residency`: whether its workers are up (LOADED), being started
(LOADING) or not (UNLOADED: registered and available, its archive open, no worker), how many
bytes it held when it last loaded, and when a request last asked for it. A version registered
with `load: lazy` (or under `--lazy-load`) starts UNLOADED; its first request queues in its
batcher, as requests do while workers are busy, and `ModelMemory.wanted` starts the load. The
request waits there, bounded by its deadline, and is served by the first worker up.

The budget is for the server's resident memory: the process's resident size when the memory
accounting began (`baseline_bytes`, the Python runtime and the libraries, before any model),
plus each loaded version's resident bytes, measured when it loaded: the growth of the server
process's resident size across the load for thread workers (loads run one at a time, so each
growth is its own), the proportional size of each child for process workers (its pages shared
with the fork server it was forked from divided among the processes that share them, and the
fork server counted too). Before a version's first load its size is estimated from its model
files. A load that would pass the budget first
unloads the least recently used versions that are idle (nothing queued, no worker busy) and
evictable; when that is not enough, the load fails and its waiting requests are answered 503
saying the budget is full. An unloaded version loads again on its next request.

    memory = ModelMemory(parse_budget("2GiB"), metrics)
    memory.wanted(mv)  # on the event loop: load it (once), the request waits in its queue
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from scriptserve.server.errors import ModelNotReady, ServingError
from scriptserve.server.models.heap import give_back_heap, map_large_allocations, release_heap
from scriptserve.server.models.process_sizes import Reading, read_processes, resident_bytes
from scriptserve.server.observability.metrics import MemoryStats

if TYPE_CHECKING:
    from scriptserve.server.models.model_version import ModelVersion
    from scriptserve.server.observability.metrics import ServerMetrics

log = logging.getLogger("scriptserve.memory")

_PAGE = os.sysconf("SC_PAGE_SIZE")
_BUSY_POLL_S = 0.005
"""How often a load waiting for room looks again for a version gone idle."""
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_PERCENT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*%\s*")


class Residence(str, Enum):
    LOADED = "LOADED"
    LOADING = "LOADING"
    UNLOADED = "UNLOADED"


# -- sizes -------------------------------------------------------------------------------------
def memory_limit() -> int:
    """The memory this server may use: its cgroup's limit (v2 `memory.max`, v1
    `memory.limit_in_bytes`) where one is set below the machine's, else the machine's."""
    total = _machine_memory()
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            return int(text)
    return total


def _machine_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * _PAGE


def parse_budget(text: str, limit: Callable[[], int] = memory_limit) -> int:
    """A budget in bytes from `2GiB`, `512MB`, `1.5G`, `1073741824` or `60%` (of `limit()`,
    the cgroup's limit or the machine's memory); raises ValueError saying what is accepted."""
    percent = _PERCENT.fullmatch(text)
    if percent is not None:
        share = float(percent.group(1))
        if not 0 < share <= 100:
            raise ValueError(f"memory budget {text!r}: a share must be above 0% and at most 100%")
        return int(limit() * share / 100)
    size = _SIZE.fullmatch(text)
    unit = size.group(2).lower() if size is not None else ""
    if size is None or unit not in _UNITS:
        raise ValueError(
            f"memory budget {text!r} is not a size: give bytes or a number with a unit "
            "(512MB, 2GiB, 1.5G) or a share of the memory limit (60%)"
        )
    budget = int(float(size.group(1)) * _UNITS[unit])
    if budget <= 0:
        raise ValueError(f"memory budget {text!r} must be more than 0 bytes")
    return budget


def files_size(paths: Iterable[Path]) -> int:
    """Bytes of the files under `paths` (a directory counts its files)."""
    total = 0
    for path in paths:
        if path.is_dir():
            total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            total += path.stat().st_size
    return total


def human(size: int) -> str:
    """`size` bytes as people read them: 1.5 GiB, 300 MiB, 12 KiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


# -- one version's residency -------------------------------------------------------------------
@dataclass(eq=False)
class Residency:
    """Whether a model version's workers are up, and what they hold."""

    lazy: bool = False
    """Registered with `load: lazy`: loaded on its first request, not at registration."""
    evictable: bool = True
    """May be unloaded to make room for another version (`evictable: false` pins it)."""
    estimate_bytes: int = 0
    """What a load is expected to take: the model files' size before the first load, then what
    the last load measured."""
    resident_bytes: int = 0
    """What its workers hold now, measured when they loaded (0 while unloaded)."""
    files_bytes: int = 0
    """Its model files' size on disk."""
    parked: bool = False
    """Registered but not loaded (lazy and never asked for, or unloaded to make room): its
    first request loads it. A version its operator scaled to 0 is not parked."""
    loading: asyncio.Task[None] | None = None
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    evictions: int = 0

    @property
    def state(self) -> Residence:
        if self.loading is not None:
            return Residence.LOADING
        return Residence.UNLOADED if self.parked else Residence.LOADED

    def describe(self) -> dict[str, object]:
        """What describe and the OIP model metadata's parameters show."""
        return {
            "residence": self.state.value,
            "load": "lazy" if self.lazy else "eager",
            "evictable": self.evictable,
            "residentBytes": self.resident_bytes,
            "estimatedBytes": self.estimate_bytes,
            "filesBytes": self.files_bytes,
            "loads": self.loads,
            "evictions": self.evictions,
        }


class BudgetFull(ModelNotReady):
    """A load that the budget cannot hold, even with every idle evictable version unloaded."""


class ModelMemory:
    """The server's memory budget and the loads and unloads that keep it (module docstring).
    Runs on the event loop; the blocking parts (starting and stopping workers) in threads."""

    def __init__(self, budget_bytes: int | None, metrics: ServerMetrics) -> None:
        self.budget_bytes = budget_bytes
        self.metrics = metrics
        if budget_bytes is not None:
            map_large_allocations()
        self.baseline_bytes = resident_bytes()
        """The process's resident size before any model. What a backend loads once (torch and
        its kernels, onnxruntime) is loaded by the first model that needs it, and counted in
        that model's first load: a server of `.pt2` models never imports torch."""
        self._versions: Callable[[], Iterable[ModelVersion]] = tuple
        self._readings: dict[int, Reading] = {}
        """The process workers and their fork servers, as last read (`_read_workers`)."""
        self._workers_read: frozenset[int] = frozenset()
        """The process workers that lived at the last reading: when the live ones differ (one
        crashed, or its replacement started), `server_bytes` reads them all again."""
        self._fork_servers: set[int] = set()
        """The fork servers read so far. One outlives its last worker, and then holds alone the
        pages its workers shared with it: it is read again while it lives."""
        self._process_bytes = 0
        """What the last worker process loaded held beyond its model files."""
        self._lock = asyncio.Lock()
        """One load or unload at a time: each load's growth is measured alone, and each load's
        room is made knowing every other one."""

    def watch(self, versions: Callable[[], Iterable[ModelVersion]]) -> None:
        """Where the versions the budget holds are listed (the registry's)."""
        self._versions = versions

    # -- what the budget holds -----------------------------------------------------------------
    def accounted_bytes(self) -> int:
        """The baseline, every version's resident bytes and the process workers' fork servers,
        as measured at the last load or unload."""
        versions = sum(mv.residency.resident_bytes for mv in self._versions())
        return self.baseline_bytes + versions + self._fork_servers_bytes()

    def _fork_servers_bytes(self) -> int:
        """The live fork servers' proportional sizes, as last read."""
        readings = self._readings
        forks = self._fork_servers & readings.keys()
        return sum(readings[pid].proportional for pid in forks if resident_bytes(pid))

    def used_bytes(self) -> int:
        """What the budget counts now: the accounted bytes, or the server's resident size when
        that is more. Loads and unloads leave the C heap fragmented (freed bytes the allocator
        keeps between live ones), so the resident size drifts above the accounting; counting it
        unloads as many more models as that drift takes."""
        return max(self.accounted_bytes(), self.server_bytes())

    def stats(self) -> MemoryStats:
        return MemoryStats(
            self.budget_bytes, self.baseline_bytes, self.accounted_bytes(), self.server_bytes()
        )

    def server_bytes(self) -> int:
        """The server's size now: this process's resident size, and its process workers' and
        their fork servers' proportional sizes as last read, each moved by as much as its
        resident size has moved since (a worker's shared pages are counted once, not once a
        worker: they are forked from one process)."""
        total = resident_bytes()
        listed = self._listed()
        live = {pid for _, found in listed for pid in found if resident_bytes(pid)}
        if live != self._workers_read:  # a worker crashed, or its replacement started
            known = self._live_fork_servers()
            workers = [pid for _, found in listed for pid in found]
            self._take(listed, read_processes(workers, known), known)
        for pid, reading in self._readings.items():
            now = resident_bytes(pid)
            if now:
                total += max(0, reading.proportional + now - reading.resident)
        return total

    async def _read_workers(self) -> None:
        """Read every process worker's and fork server's sizes (in a thread), and set each
        process-worker version's resident bytes to its workers' proportional sizes: a fork or
        an exit changes how many processes share the fork server's pages, and so every
        worker's share of them."""
        listed = self._listed()
        workers = [pid for _, found in listed for pid in found]
        if not workers and not self._readings:
            return
        known = self._live_fork_servers()
        self._take(listed, await asyncio.to_thread(read_processes, workers, known), known)

    def _listed(self) -> list[tuple[ModelVersion, list[int]]]:
        return [(mv, _worker_pids(mv)) for mv in self._versions()]

    def _live_fork_servers(self) -> list[int]:
        return [pid for pid in self._fork_servers if resident_bytes(pid)]

    def _take(
        self,
        listed: list[tuple[ModelVersion, list[int]]],
        readings: dict[int, Reading],
        known: list[int],
    ) -> None:
        """Keep `readings` of the workers `listed` (each version's) and of the fork servers
        `known`, and set each process-worker version's resident bytes to its live workers'
        proportional sizes."""
        parents = {reading.parent for reading in readings.values()}
        self._fork_servers = (parents | set(known)) & readings.keys()
        self._readings = readings
        self._workers_read = frozenset(
            pid for _, found in listed for pid in found if pid in readings
        )
        for mv, found in listed:
            if mv.settings.worker_mode == "process" and (found or mv.pool.size == 0):
                sizes = [readings[pid].proportional for pid in found if pid in readings]
                mv.residency.resident_bytes = sum(sizes)

    async def workers_changed(self, mv: ModelVersion) -> None:
        """`mv`'s workers were started or stopped outside a load or an unload (scaled, or
        unregistered): for process workers, every process is read again, since a fork or an
        exit changes each one's share of the fork server's pages."""
        if mv.settings.worker_mode == "process":
            async with self._lock:
                await self._read_workers()

    # -- loads ---------------------------------------------------------------------------------
    def wanted(self, mv: ModelVersion) -> None:
        """On the event loop, for a request to a parked version: load it, once however many
        requests ask. The requests wait in its queue; when the load fails they are answered
        with its error (503), and the version stays parked for the next request to retry."""
        residency = mv.residency
        self.metrics.model_load_waits.labels(mv.name, mv.version).inc()
        if residency.loading is None:
            residency.loading = asyncio.ensure_future(self._load_for_requests(mv))

    async def _load_for_requests(self, mv: ModelVersion) -> None:
        try:
            await self._load(mv, mv.settings.workers)  # the requests counted as its use
        except ServingError as exc:
            mv.pool.fail_queued(exc)
        except Exception as exc:  # a handler that cannot load: the waiting requests' answer
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            log.error("model=%s version=%s could not load: %s", mv.name, mv.version, message)
            mv.pool.fail_queued(
                ModelNotReady(f"model {mv.name!r} version {mv.version} could not load: {message}")
            )
        finally:
            mv.residency.loading = None

    async def load(self, mv: ModelVersion, workers: int) -> None:
        """Start `workers` workers for a version that has none, within the budget (unloading
        idle versions to make room), and measure what they hold. Raises BudgetFull, or what
        starting a worker raises (HandlerError, ServingError). Being asked to load is a use
        of the version, as a request is: when it was asked, not when the load ended, which
        can be after requests to other versions."""
        mv.residency.last_used = time.monotonic()
        await self._load(mv, workers)

    async def _load(self, mv: ModelVersion, workers: int) -> None:
        residency = mv.residency
        async with self._lock:
            if mv.unloading or mv.pool.size > 0:
                residency.parked = False
                return
            await self._make_room(mv)
            started = time.perf_counter()
            before = resident_bytes()
            await asyncio.to_thread(mv.pool.scale, workers)
            if mv.settings.worker_mode == "process":
                await self._read_workers()
                measured = mv.residency.resident_bytes
            else:
                # At least its files: other threads free memory while it loads, and the
                # growth alone could then say less than its weights take.
                measured = max(residency.files_bytes, resident_bytes() - before)
            seconds = time.perf_counter() - started
            if mv.settings.worker_mode == "process":
                self._process_bytes = max(0, measured // workers - residency.files_bytes)
            residency.resident_bytes = residency.estimate_bytes = measured
            residency.parked = False
            residency.loads += 1
            await self._shed(mv)
        self.metrics.model_loads.labels(mv.name, mv.version).inc()
        self.metrics.model_load_seconds.observe(seconds)
        log.info(
            "model=%s version=%s loaded in %.2f s: %s resident (%s of %s used)",
            mv.name,
            mv.version,
            seconds,
            human(measured),
            human(self.used_bytes()),
            human(self.budget_bytes) if self.budget_bytes else "no budget",
        )

    def _estimate(self, mv: ModelVersion) -> int:
        """What a load of `mv` will take: what its last load measured; before its first, its
        model files, and as much again as a worker process took beyond its files the last time
        one loaded (Python and torch), for each of its process workers."""
        residency = mv.residency
        if residency.loads or mv.settings.worker_mode != "process":
            return residency.estimate_bytes
        return residency.estimate_bytes + mv.settings.workers * self._process_bytes

    async def _shed(self, loaded: ModelVersion) -> None:
        """After a load that measured more than its estimate: unload idle versions, least
        recently used first, until the budget holds again (never the one just loaded)."""
        if self.budget_bytes is None:
            return
        while self.used_bytes() > self.budget_bytes:
            victim = self._least_recently_used(loaded, idle=True)
            if victim is None:
                log.warning(
                    "model=%s version=%s took more than estimated: %s of %s used, and no idle "
                    "model can be unloaded",
                    loaded.name,
                    loaded.version,
                    human(self.used_bytes()),
                    human(self.budget_bytes),
                )
                return
            await self._unload(victim, f"to hold the budget after loading {loaded.name!r}")

    async def _make_room(self, mv: ModelVersion) -> None:
        """Unload idle versions, least recently used first, until `mv` fits. While the only
        versions that could make room are busy, wait for one to be idle (at most the model's
        response timeout: its waiting requests' deadlines end no later)."""
        if self.budget_bytes is None:
            return
        need = self._estimate(mv)
        until = time.monotonic() + mv.settings.response_timeout_s
        while self.used_bytes() + need > self.budget_bytes:
            victim = self._least_recently_used(mv, idle=True)
            if victim is not None:
                await self._unload(victim, "to make room for " + repr(mv.name))
            elif self._least_recently_used(mv, idle=False) is None or time.monotonic() > until:
                raise BudgetFull(
                    f"the memory budget is full ({human(self.used_bytes())} of "
                    f"{human(self.budget_bytes)} used): model {mv.name!r} needs about "
                    f"{human(need)} and every loaded model is busy or pinned; retry later, "
                    "or raise --memory-budget"
                )
            else:
                await asyncio.sleep(_BUSY_POLL_S)

    def _least_recently_used(self, wanted: ModelVersion, idle: bool) -> ModelVersion | None:
        """The evictable loaded version asked for least recently, other than `wanted`; with
        `idle`, only one with nothing queued and no worker busy."""
        found = [
            mv
            for mv in self._versions()
            if mv is not wanted
            and mv.residency.evictable
            and mv.residency.loading is None
            and not mv.unloading
            and mv.pool.size > 0
            and not (idle and (mv.batcher.depth or mv.pool.busy))
        ]
        return min(found, key=lambda mv: mv.residency.last_used, default=None)

    async def _unload(self, mv: ModelVersion, why: str) -> None:
        """Stop a version's workers and park it: its next request loads it again. Parked
        first, on the loop, so that a request arriving meanwhile queues for the next load
        (or is taken by a worker that has not stopped yet, and served by this one)."""
        residency = mv.residency
        residency.parked = True
        residency.resident_bytes = 0
        residency.evictions += 1
        before = resident_bytes()
        await asyncio.to_thread(_stop_workers, mv)
        freed = before - resident_bytes()
        if mv.settings.worker_mode == "process":
            await self._read_workers()
        if mv.settings.worker_mode != "process":
            # What it gave back is what its next load will take: its first load also held what
            # the process sets up once (torch, its kernels), which stays after it.
            residency.estimate_bytes = max(residency.files_bytes, freed)
        self.metrics.model_evictions.labels(mv.name, mv.version).inc()
        log.info(
            "model=%s version=%s unloaded %s: %s freed",
            mv.name,
            mv.version,
            why,
            human(max(0, freed)),
        )


def _stop_workers(mv: ModelVersion) -> None:
    mv.pool.scale(0)
    mv.pool.wait_retired()
    release_heap(mv.pool)
    give_back_heap()


def _worker_pids(mv: ModelVersion) -> list[int]:
    return [pid for slot in mv.pool.slots() if isinstance(pid := getattr(slot, "pid", None), int)]
