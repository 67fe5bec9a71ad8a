"""Run a command inside a memory cgroup, as a container's limit runs it, and sample what fills it.

    python scripts/memcg.py CAP -- COMMAND ...        # e.g. 4GiB -- .venv/bin/onboard quantize ...

A cgroup-v1 memory group (`memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` where swap
is accounted) or a v2 one (`memory.max`) is made for the command; `memory.stat` is sampled every
half second. A container's limit counts the page cache its processes fill, not only their own
memory: the command's resident memory, its page cache, the dirty and mapped part of it, the
group's peak and whether the kernel killed it are printed as JSON (and the exit code passed on).
Where no group can be made (no permission, no memory controller), it says why and exits 3.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
# memory.stat keys: v1 (this group's own, `total_` for the subtree) and v2's names
STAT_KEYS = {
    "rss": ("total_rss", "anon"),
    "page_cache": ("total_cache", "file"),
    "dirty": ("total_dirty", "file_dirty"),
    "writeback": ("total_writeback", "file_writeback"),
    "mapped": ("total_mapped_file", "file_mapped"),
}


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.rstrip("bBiIkKmMgG")
    return int(float(number) * units[text[len(number) :].upper()])


class Group:
    """A fresh memory cgroup capped at `cap` bytes; `None` from `make` with the reason where it cannot be."""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version

    @classmethod
    def make(cls, name: str, cap: int) -> "tuple[Group | None, str]":
        try:
            if (V1 / "memory.limit_in_bytes").is_file():
                path = V1 / name
                path.mkdir(exist_ok=True)
                (path / "memory.limit_in_bytes").write_text(str(cap))
                if (path / "memory.memsw.limit_in_bytes").is_file():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(cap))
                return cls(path, 1), ""
            if (V2 / "cgroup.controllers").is_file() and "memory" in (V2 / "cgroup.controllers").read_text():
                path = V2 / name
                path.mkdir(exist_ok=True)
                (path / "memory.max").write_text(str(cap))
                (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").is_file() else None
                return cls(path, 2), ""
        except OSError as err:
            return None, f"cannot make a memory cgroup here ({err.strerror}: {err.filename})"
        return None, "no cgroup memory controller on this machine"

    def stat(self) -> dict[str, int]:
        raw = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        index = 0 if self.version == 1 else 1
        return {key: int(raw.get(names[index], 0)) for key, names in STAT_KEYS.items()}

    def peak(self) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        fields = dict(line.split() for line in (self.path / name).read_text().splitlines())
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        try:
            if self.version == 1:
                (self.path / "memory.force_empty").write_text("0")
            self.path.rmdir()
        except OSError:
            pass


def run_capped(command: list[str], cap: int, name: str = "onboard_memcg", interval: float = 0.5) -> dict:
    """Run `command` in a fresh group capped at `cap`; what it used, sampled (raises `RuntimeError`
    with the reason where no group can be made)."""
    group, why = Group.make(f"{name}_{os.getpid()}", cap)
    if group is None:
        raise RuntimeError(why)
    procs = group.path / "cgroup.procs"
    start = time.perf_counter()
    process = subprocess.Popen(command, preexec_fn=lambda: procs.write_text(str(os.getpid())))
    maxima: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                for key, value in group.stat().items():
                    maxima[key] = max(maxima[key], value)
            except OSError:
                pass
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = process.wait()
    done.set()
    sampler.join()
    result = {
        "exit": code,
        "seconds": round(time.perf_counter() - start, 1),
        "cap": cap,
        "peak": group.peak(),
        "oom_kills": group.oom_kills(),
        **{f"max_{key}": value for key, value in maxima.items()},
    }
    group.remove()
    return result


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        result = run_capped(sys.argv[3:], parse_size(sys.argv[1]))
    except RuntimeError as err:
        print(f"memcg: {err}", file=sys.stderr)
        return 3
    print(json.dumps(result, indent=2))
    return result["exit"]


if __name__ == "__main__":
    sys.exit(main())
