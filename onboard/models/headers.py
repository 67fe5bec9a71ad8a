"""What a directory's safetensors files hold, from their headers alone (no tensor is read)."""

import json
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors' name: "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file
    nbytes: int

    def read(self) -> bytes:
        with open(self.file, "rb") as handle:
            handle.seek(self.offset)
            return handle.read(self.nbytes)


def safetensors_entries(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of the directory's *.safetensors files."""
    entries: dict[str, TensorEntry] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            entries[name] = TensorEntry(file, info["dtype"], tuple(info["shape"]), 8 + length + start, end - start)
    return entries
