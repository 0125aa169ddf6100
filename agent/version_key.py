"""The one parser of version numbers (TensorRT, CUDA, L4T, compute capabilities): the leading
dotted digits as a tuple of ints, for comparing. A base module: the platform's detection and
the engines (which may import only base modules) both use it.

Worker side: Python >= 3.6.
"""

import re
from typing import Optional, Tuple

_LEADING = re.compile(r"\s*(\d+(?:\.\d+)*)")


def version_key(text: object, width: Optional[int] = None) -> Tuple[int, ...]:
    """``"8.6.1.6"`` -> (8, 6, 1, 6); ``"10.3.0.post1"``, ``"8.2.1-1+cuda10.2"`` -> the leading
    numbers only; ``width`` cuts or pads with zeros (``"8.6"``, 3 -> (8, 6, 0)); no leading
    number -> ()."""
    match = _LEADING.match(str(text))
    if not match:
        return ()
    key = tuple(int(p) for p in match.group(1).split("."))
    if width is not None:
        key = (key + (0,) * width)[:width]
    return key
