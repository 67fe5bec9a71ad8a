"""Tensors the artifact holds as the source stores them, checked byte for byte.

Two kinds: a release's MTP layers, which transformers never loads and `mtp_carry.py` copies in,
and a VLM's vision tower and projector, which transformers' VLM class loads and saves untouched
because no recipe quantizes them (`models/vlm.py`). Either one lost or changed by the save, by
another tool or by hand is refused in one line, at quantize and again by the gate.
"""

import shutil
from pathlib import Path

from onboard.errors import OnboardError
from onboard.models.headers import TensorEntry, safetensors_entries
from onboard.models.vlm import PROCESSOR_FILES, read_config, vision_entries


class KeptLost(OnboardError):
    """An artifact lacks, or changed, a tensor it must keep as the source stores it."""


def check_kept(
    what: str, wanted: dict[str, TensorEntry], source: Path, artifact: Path, byte_equal: bool = True, consequence=""
) -> dict:
    """Every tensor of `wanted` (the source's) is in `artifact` with its dtype and shape, and its
    bytes unless `byte_equal` is off; raises `KeptLost` (`what` names the kind) otherwise."""
    found = safetensors_entries(artifact)
    missing = [name for name in sorted(wanted) if name not in found]
    if missing:
        raise KeptLost(
            f"{artifact} lacks {len(missing)} of the {len(wanted)} {what} tensors of {source} (e.g. {missing[0]})"
            f"{consequence}; quantize it again with this onboard"
        )
    for name in sorted(wanted):
        have, want = found[name], wanted[name]
        if (have.dtype, have.shape) != (want.dtype, want.shape):
            raise KeptLost(
                f"{artifact}: {what} tensor {name} is {have.dtype}{list(have.shape)}, the source's "
                f"{want.dtype}{list(want.shape)}"
            )
        if byte_equal and have.read() != want.read():
            raise KeptLost(f"{artifact}: {what} tensor {name} differs from the source's")
    return {
        "tensors": len(wanted),
        "bytes": sum(entry.nbytes for entry in wanted.values()),
        "dtypes": sorted({entry.dtype for entry in wanted.values()}),
        "kept": True,
    }


def keep_vision(source: Path, artifact: Path) -> dict:
    """A VLM's vision tower, byte for byte in the artifact, and the processor files beside it (what
    vLLM reads to take images); {} for a text model."""
    config = read_config(source)
    wanted = vision_entries(source, config)
    if not wanted:
        return {}
    copied = []
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (artifact / name).is_file():
            shutil.copyfile(source / name, artifact / name)
            copied.append(name)
    record = check_kept("vision", wanted, source, artifact, consequence=": it would not take images")
    return {**record, "processor_files": sorted(name for name in PROCESSOR_FILES if (artifact / name).is_file())}
