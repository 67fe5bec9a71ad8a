"""`onboard.pagecache`: what a stage writes is written back and dropped as it goes, what it reads is
dropped, so a container's memory limit (which counts the page cache) holds no more of it than one
interval's writes; checked inside a real memory cgroup where this machine lets the test make one."""

import ctypes
import importlib.util
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onboard import pagecache

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def resident_bytes(path: Path) -> int:
    """How much of `path` is in the page cache: mincore over a copy-on-write mapping of it (which
    reads nothing)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        start = ctypes.c_char.from_buffer(mapped)
        code = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vector)
        del start
    assert code == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vector) * mmap.PAGESIZE


def test_what_a_stage_wrote_and_read_leaves_the_cache(tmp_path: Path) -> None:
    written, read = tmp_path / "staging", tmp_path / "source.bin"
    written.mkdir()
    with open(read, "wb") as handle:  # a checkpoint on disk: clean pages
        handle.write(os.urandom(8 * MB))
        os.fsync(handle.fileno())
    read.read_bytes()
    assert resident_bytes(read) > 4 * MB  # just read: cached
    with pagecache.bounded(written=[written], read=[read]):
        (written / "shard.bin").write_bytes(os.urandom(16 * MB))
    assert resident_bytes(written / "shard.bin") < MB
    assert resident_bytes(read) < MB


def memcg():
    spec = importlib.util.spec_from_file_location("memcg", ROOT / "scripts" / "memcg.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from onboard import pagecache
    folder = Path(sys.argv[1])
    with pagecache.bounded(written=[folder]):
        with open(folder / "big.bin", "wb") as handle:
            for _ in range(int(sys.argv[2])):
                handle.write(os.urandom(1 << 20))
                time.sleep(0.002)  # a stage writes as it computes, not at the disk's speed
    """
)


def test_dirty_data_stays_bounded_inside_a_memory_cgroup(tmp_path: Path) -> None:
    """512 MB written under a 1 GiB limit: never more than a fraction of it dirty at once."""
    module = memcg()
    group, why = module.Group.make(f"onboard_test_{os.getpid()}", 1 << 30)
    if group is None:
        pytest.skip(why)
    group.remove()
    command = [sys.executable, "-c", WRITER, str(tmp_path), "512"]
    result = module.run_capped(command, 1 << 30, name="onboard_test", interval=0.05)
    assert result["exit"] == 0 and result["oom_kills"] == 0
    assert result["max_dirty"] + result["max_writeback"] < 160 * MB, result
    subprocess.run(["sync"], check=False)
