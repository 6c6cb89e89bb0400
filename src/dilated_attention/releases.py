"""The installed release of a package the library adapts to (triton, numpy, transformers),
read from its metadata without importing it. Its own module: the kernel choice (backends.py)
and the transformers integration, which must not reach down to the kernels, both need it."""

from __future__ import annotations

import importlib.metadata
import re
from typing import Tuple


def installed_release(package: str) -> Tuple[int, ...]:
    """The installed `package`'s (major, minor), or () when it is not installed.

    A pre-release or local build counts as its release ("5.0rc1" -> (5, 0), "3.9.0+git" ->
    (3, 9)); a part without leading digits ends the release there.
    """
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ()
    release = []
    for part in version.split(".")[:2]:
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        release.append(int(digits.group()))
    return tuple(release)
