"""Which built-in rows are held out for evaluation."""

import hashlib
from typing import Literal

Split = Literal["calib", "eval"]
SPLITS: tuple[Split, ...] = ("calib", "eval")


def split_of(key: object) -> Split:
    """About one key in four goes to "eval", the rest to "calib". The choice hashes the
    key alone, so it never changes when rows are added, removed or reordered."""
    digest = hashlib.sha256(str(key).encode("utf-8")).hexdigest()
    return "eval" if int(digest, 16) % 4 == 0 else "calib"
