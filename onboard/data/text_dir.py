"""A directory of text or source files: each file one record."""

from pathlib import Path

from onboard.data.failure import unreadable
from onboard.data.record import Record
from onboard.data.tree import tree_files

TEXT_EXTENSIONS = frozenset({".txt", ".md", ".rst"})
# Config and script formats count as code: in a source tree they are read and written
# like code.
CODE_EXTENSIONS = frozenset(
    {".py", ".js", ".ts", ".go", ".rs", ".c", ".h", ".cpp", ".java"}
    | {".json", ".yaml", ".yml", ".toml", ".sh", ".sql"}
)
EXTENSIONS = TEXT_EXTENSIONS | CODE_EXTENSIONS


def load_text_dir(root: Path) -> list[Record]:
    """Files with one of EXTENSIONS, sorted by relative path; binary, undecodable and
    blank files are skipped."""
    records = []
    for path in tree_files(root):
        suffix = path.suffix.lower()
        if suffix not in EXTENSIONS:
            continue
        text = _decode(path)
        if text is None or not text.strip():
            continue
        traffic = "code" if suffix in CODE_EXTENSIONS else "text"
        source = path.relative_to(root).as_posix()
        records.append(Record(traffic=traffic, source=source, text=text))
    return records


def _decode(path: Path) -> str | None:
    try:
        with path.open("rb") as file:
            data = file.read()
    except OSError as exc:
        raise unreadable(path, exc) from None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
