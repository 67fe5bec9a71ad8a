"""`onboard.hashing.fingerprint`: content hashes of files and directories."""

import hashlib
from pathlib import Path

import pytest

from onboard.errors import OnboardError
from onboard.hashing import fingerprint as fingerprint_path


def test_file_is_sha256_of_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "x"}\n')
    assert fingerprint_path(path) == hashlib.sha256(b'{"text": "x"}\n').hexdigest()
    assert fingerprint_path(str(path)) == fingerprint_path(path)


def test_directory_hash(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("a", encoding="utf-8")
    (root / "sub" / "b.py").write_text("b", encoding="utf-8")
    first = fingerprint_path(root)
    assert fingerprint_path(root) == first

    # tool state does not count
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / ".hidden").write_text("h", encoding="utf-8")
    assert fingerprint_path(root) == first

    (root / "sub" / "b.py").write_text("B", encoding="utf-8")
    changed = fingerprint_path(root)
    assert changed != first
    (root / "sub" / "b.py").rename(root / "sub" / "c.py")
    assert fingerprint_path(root) not in (first, changed)


def test_moved_bytes_between_files_change_the_hash(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for root, (a, b) in ((one, ("ab", "c")), (two, ("a", "bc"))):
        root.mkdir()
        (root / "a.txt").write_text(a, encoding="utf-8")
        (root / "b.txt").write_text(b, encoding="utf-8")
    assert fingerprint_path(one) != fingerprint_path(two)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(OnboardError, match="no such file or directory"):
        fingerprint_path(tmp_path / "missing")


def test_large_files_are_sampled_at_both_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onboard.hashing

    monkeypatch.setattr(onboard.hashing, "FULL_HASH_LIMIT", 4 * 2**20)
    path = tmp_path / "big.safetensors"
    path.write_bytes(bytes(5 * 2**20))
    first = fingerprint_path(path)
    with open(path, "r+b") as handle:  # same size, last byte changed, same mtime
        stat = path.stat()
        handle.seek(-1, 2)
        handle.write(b"\1")
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint_path(path) != first


def test_code_version_starts_with_the_released_version() -> None:
    import tomllib

    from onboard.hashing import code_version

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    version, _, source_hash = code_version().partition("+")
    assert version == pyproject["project"]["version"]
    assert len(source_hash) == 12
