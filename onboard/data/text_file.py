"""`.txt` files: one record, or blank-line-separated chunks when the file is long."""

import re
from pathlib import Path

from onboard.data.failure import data_error, unreadable
from onboard.data.record import Record

# Long enough for any context window we calibrate with, short enough that one huge file
# does not become one huge record that tokenization throws most of away.
CHUNK_CHARS = 20_000

_PARAGRAPH = re.compile(r"\S.*?(?=\n[ \t\r\f\v]*\n|\s*\Z)", re.DOTALL)


def read_text(path: Path) -> str:
    try:
        with path.open(encoding="utf-8-sig") as file:
            return file.read()
    except UnicodeDecodeError as exc:
        raise data_error(f"{path}: not UTF-8 text: {exc.reason}") from None
    except OSError as exc:
        raise unreadable(path, exc) from None


def load_txt(path: Path) -> list[Record]:
    text = read_text(path)
    if not text.strip():
        return []
    if len(text) < CHUNK_CHARS:
        return [Record(traffic="text", source=path.name, text=text)]
    return [
        Record(traffic="text", source=f"{path.name}:{line}", text=chunk)
        for line, chunk in chunk_paragraphs(text, CHUNK_CHARS)
    ]


def chunk_paragraphs(text: str, limit: int) -> list[tuple[int, str]]:
    """(first line number, chunk) pairs: whole paragraphs gathered while they fit in `limit`
    characters; a paragraph longer than that on its own is cut at line ends, or hard."""
    chunks: list[tuple[int, str]] = []
    pieces: list[str] = []
    start_line = size = 0
    line, counted_to = 1, 0
    for match in _PARAGRAPH.finditer(text):
        line += text.count("\n", counted_to, match.start())
        counted_to = match.start()
        for offset, piece in _cut(match.group().rstrip(), limit):
            if pieces and size + 2 + len(piece) > limit:
                chunks.append((start_line, "\n\n".join(pieces)))
                pieces = []
            if not pieces:
                start_line, size = line + offset, -2
            pieces.append(piece)
            size += 2 + len(piece)
    if pieces:
        chunks.append((start_line, "\n\n".join(pieces)))
    return chunks


def _cut(paragraph: str, limit: int) -> list[tuple[int, str]]:
    """(line offset, piece) parts of at most `limit` characters, cut after the last line
    end that fits, or at `limit` in a line longer than that."""
    parts: list[tuple[int, str]] = []
    offset = pos = 0
    while len(paragraph) - pos > limit:
        newline = paragraph.rfind("\n", pos + 1, pos + limit + 1)
        end = newline if newline > pos else pos + limit
        parts.append((offset, paragraph[pos:end]))
        offset += paragraph.count("\n", pos, end + 1)
        pos = end + 1 if newline > pos else end
    parts.append((offset, paragraph[pos:]))
    return [(offset, piece) for offset, piece in parts if piece.strip()]
