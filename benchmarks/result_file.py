"""Where a benchmark's JSON result goes: $OUT (the device tool's folder that comes back) or ./out."""

from __future__ import annotations

import json
import os


def write_result(name: str, result) -> str:
    """result as indented JSON in $OUT/name (./out/name without OUT); returns the path."""
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path
