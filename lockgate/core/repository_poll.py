"""Poll mode: the model repository watched for changes, as Triton's `--model-control-mode
poll`.

Every `interval` seconds each model folder is fingerprinted: every file under it (links
followed no further than the folder itself), by relative path, size and modification time,
without reading any file. What changed is acted on once the folder has held still for one more
poll, so a model being copied in is not loaded half-written:

- a new folder is loaded;
- a changed one is reloaded without a gap (`ModelManager.load_model`: the loaded versions
  serve until the new ones are warm, and serve on if the reload fails, to be tried again
  at the folder's next change);
- a removed one is unloaded, its versions drained.

Language models are left alone when the server does not load them (`--no-llm`). The walk runs
on a worker thread: a repository on a slow mount does not hold the event loop. Pure
bookkeeping but for `poll`, which does the loading.

A bare model (`core/bare_model.py`) is watched the same way, by its file and the config files
beside it (`bare_polling`): reloaded when they change, unloaded when the file is removed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from lockgate.backends.base import LLM_BACKEND
from lockgate.core.bare_model import BareModel, bare_entry
from lockgate.core.manager import ModelManager
from lockgate.core.repository import model_names, scan_model

log = logging.getLogger(__name__)

Fingerprint = frozenset[tuple[str, int, int]]  # (relative path, size, mtime in ns) per file


def fingerprint(folder: Path) -> Fingerprint:
    """What a model folder holds, as far as a change to it shows: each file's relative path,
    size and modification time (an empty set for a folder that cannot be read)."""
    found: set[tuple[str, int, int]] = set()
    for top, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(top, name)
            try:
                stat = os.stat(path)
            except OSError:  # removed while walking, or a dangling link
                continue
            found.add((os.path.relpath(path, folder), stat.st_size, stat.st_mtime_ns))
    return frozenset(found)


def files_fingerprint(paths: list[Path]) -> Fingerprint:
    """`fingerprint` of the files among `paths` that exist, by name."""
    found = set()
    for path in paths:
        try:
            stat = path.stat()
        except OSError:  # absent, or a dangling link
            continue
        found.add((path.name, stat.st_size, stat.st_mtime_ns))
    return frozenset(found)


def snapshot(root: Path) -> dict[str, Fingerprint]:
    """Every model folder of the repository, by name, with its fingerprint."""
    return {name: fingerprint(root / name) for name in model_names(root)}


@dataclass(slots=True)
class Changes:
    """What one poll found to do: models to load (new or changed) and to unload."""

    load: list[str] = field(default_factory=list)
    unload: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.load or self.unload)


@dataclass(slots=True)
class RepositoryWatch:
    """The fingerprints the served models were loaded from, and the changes seen once and
    waiting for a second look. Pure bookkeeping: `observe` takes a snapshot and says what to
    do."""

    loaded: dict[str, Fingerprint]
    seen: dict[str, Fingerprint | None] = field(default_factory=dict)  # None: seen removed

    def observe(self, now: dict[str, Fingerprint]) -> Changes:
        """The changes that held still since the last snapshot; those seen for the first
        time wait for the next one."""
        changes = Changes()
        names = sorted(set(now) | set(self.loaded) | set(self.seen))
        for name in names:
            current = now.get(name)
            if current == self.loaded.get(name):
                self.seen.pop(name, None)  # back as it was loaded, or never changed
                continue
            if name not in self.seen or self.seen[name] != current:
                self.seen[name] = current  # first seen like this: look again next time
                continue
            del self.seen[name]
            if current is None:
                del self.loaded[name]
                changes.unload.append(name)
            else:
                self.loaded[name] = current
                changes.load.append(name)
        return changes


Loader = Callable[[str], Awaitable[None]]


Look = Callable[[], dict[str, Fingerprint]]  # a snapshot of what is watched, by model name


@dataclass(slots=True)
class RepositoryPoller:
    """Takes a snapshot with `look` every `interval` seconds and hands each change to `load`
    or `unload` (by model name), one at a time, in name order."""

    look: Look
    interval: float
    load: Loader
    unload: Loader
    watch: RepositoryWatch = field(init=False)

    def __post_init__(self) -> None:
        self.watch = RepositoryWatch(self.look())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.poll()

    async def poll(self) -> Changes:
        """One look at the repository, and what it changed."""
        now = await asyncio.to_thread(self.look)
        changes = self.watch.observe(now)
        for name in changes.unload:
            log.info("repository poll: model %s was removed: unloading it", name)
            await self._each(self.unload, name)
        for name in changes.load:
            log.info("repository poll: model %s is new or changed: loading it", name)
            await self._each(self.load, name)
        return changes

    async def _each(self, act: Loader, name: str) -> None:
        try:
            await act(name)
        except Exception:  # one model's failure is logged, the poll goes on
            log.exception("repository poll: model %s", name)


def polling(manager: ModelManager, root: Path, interval: float) -> RepositoryPoller:
    """A poller that loads and unloads `manager`'s models from `root`, as its start-up did:
    a language model is skipped when the server does not load them, and a folder removed
    whose model was never loaded has nothing to unload."""
    resolved = root.resolve()

    async def load(name: str) -> None:
        entry = await asyncio.to_thread(scan_model, resolved, root / name)
        config = entry.config
        skipped = config is not None and config.backend == LLM_BACKEND
        if skipped and not manager.settings.language_models:
            return
        await manager.load_model(entry.name, entry.path, config, entry.versions, entry.error)

    return RepositoryPoller(functools.partial(snapshot, root), interval, load, _unloader(manager))


def bare_polling(manager: ModelManager, bare: BareModel, interval: float) -> RepositoryPoller:
    """A poller that reloads a bare model when its file or a config beside it changes, and
    unloads it when its file is removed."""

    def look() -> dict[str, Fingerprint]:
        return {bare.name: files_fingerprint(bare.watched())} if bare.file.is_file() else {}

    async def load(name: str) -> None:
        entry = await asyncio.to_thread(bare_entry, bare)
        await manager.load_model(
            entry.name, entry.path, entry.config, entry.versions, entry.error, bare=True
        )

    return RepositoryPoller(look, interval, load, _unloader(manager))


def _unloader(manager: ModelManager) -> Loader:
    async def unload(name: str) -> None:
        if name in manager.models:
            await manager.unload(name)

    return unload
