"""Module-name patterns as compressed-tensors reads them: "re:<regex>" or a name suffix."""

import re
from collections.abc import Iterable


def matches(name: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False
