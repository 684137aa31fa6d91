"""Watching the config file: every change to it, or to a link on the way to it, calls back.

The watcher looks at folders, not at the file: editors that save by renaming a temporary file
over it replace its inode. Where the path runs through links (a link to a file kept elsewhere, or
Kubernetes' ConfigMap volumes, whose `..data` link is swapped to a new folder on every update), a
change to any of those links counts too, and the folders watched follow the links afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from watchfiles import awatch

DEBOUNCE_MS = 100
# Links followed before a path counts as a loop, as the kernel's own limit (MAXSYMLINKS).
MAX_LINKS = 40


def links_to(path: Path) -> tuple[Path, frozenset[Path]]:
    """The file `path` leads to and every link met on the way (links in its folders' names too),
    all absolute, none resolved further than the walk itself needs."""
    pending, links = Path(os.path.abspath(path)), set()
    for _ in range(MAX_LINKS):
        # The first name along the path, from the root down, that is a link.
        link = next((p for p in [*reversed(pending.parents[:-1]), pending] if p.is_symlink()), None)
        if link is None:
            return pending, frozenset(links)
        links.add(link)
        pending = Path(os.path.normpath(link.parent / os.readlink(link))) / pending.relative_to(link)
    return pending, frozenset(links)


async def watch_config(path: Path, changed: Callable[[], Awaitable[object]]) -> None:
    """Call `changed` after each change to the file at `path` or to a link on the way to it;
    returns only when cancelled."""
    # watchfiles' loggers are held at warning (info at level debug) by control/logs.py's set_level.
    while True:
        target, links = links_to(path)
        names = {str(p) for p in (target, *links)}
        folders = sorted({str(p.parent) for p in (target, *links) if p.parent.is_dir()})
        if not folders:  # every folder on the way is gone: look again in a moment
            await anyio.sleep(1)
            continue
        stop = anyio.Event()
        try:
            async for _ in awatch(
                *folders,
                recursive=False,
                debounce=DEBOUNCE_MS,
                step=20,
                stop_event=stop,
                watch_filter=lambda _change, name, names=names: name in names,
            ):
                await changed()
                if links_to(path) != (target, links):
                    break  # a link now leads elsewhere: watch the folders it leads to
        finally:
            stop.set()
