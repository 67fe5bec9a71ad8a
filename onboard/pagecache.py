"""Keeping the page cache a stage fills inside a container's memory limit.

A container's limit (a memory cgroup) counts the page cache of the files its processes write and
read, not only their own memory.  A streamed quantize of a 7.9 GB checkpoint under a 4 GiB limit
kept its own memory near 0.5 GB, while its cgroup filled with 2 to 3.4 GB of page cache: the
offload folder compressed-tensors writes (thousands of files, 0.6 GB of them dirty at once), the
artifact's shards and the checkpoint's, 1.3 GB of them mapped.  Clean pages are reclaimed under
the limit; dirty ones must be written back first, and a group that fills with them faster than
the disk drains them is killed however little memory its process holds.

`bounded(written, read)` runs a thread beside the stage that every `interval` seconds writes back
what changed under the `written` folders (`fdatasync`) and tells the kernel it is not needed again
(`posix_fadvise(DONTNEED)`), and drops the `read` files' pages the same way: dirty data is bounded
by what the stage writes in one interval, and pages nobody maps any longer leave the group at
once.  Pages a library still maps (safetensors' mmap of the shard being read) stay until it lets
go of them.  Where the calls do not exist (not Linux), it does nothing.
"""

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

INTERVAL = 0.25  # seconds between two write-backs
_SUPPORTED = hasattr(os, "posix_fadvise") and hasattr(os, "fdatasync")


def release(path: Path, write_back: bool = True) -> None:
    """Write `path`'s dirty pages back (`write_back`) and drop its pages from the cache."""
    if not _SUPPORTED:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # gone (a temporary file renamed or removed meanwhile)
    try:
        if write_back:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _files(folder: Path) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    yield from _files(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    yield entry
    except OSError:
        return


class _Releaser(threading.Thread):
    def __init__(self, written: Sequence[Path], read: Sequence[Path], interval: float):
        super().__init__(name="onboard-pagecache", daemon=True)
        self.written, self.read, self.interval = list(written), list(read), interval
        self.stop = threading.Event()
        self._seen: dict[str, tuple[int, int]] = {}

    def sweep(self) -> None:
        for folder in self.written:
            for entry in _files(folder):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                state = (stat.st_size, stat.st_mtime_ns)
                if self._seen.get(entry.path) != state:
                    release(Path(entry.path))
                    self._seen[entry.path] = state
        for path in self.read:
            for entry in [path] if path.is_file() else _files(path):
                release(Path(entry if isinstance(entry, Path) else entry.path), write_back=False)

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sweep()


@contextmanager
def bounded(written: Sequence[Path] = (), read: Sequence[Path] = (), interval: float = INTERVAL) -> Iterator[None]:
    """Within the block, the page cache of the `written` folders and the `read` files or folders
    is written back and dropped every `interval` seconds, and once more at the end."""
    if not _SUPPORTED or not (written or read):
        yield
        return
    releaser = _Releaser(written, read, interval)
    releaser.start()
    try:
        yield
    finally:
        releaser.stop.set()
        releaser.join()
        releaser.sweep()
