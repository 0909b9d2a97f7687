"""JSON text of tfremat's data (PlanGraph, Plan): to strings, files and back."""

from __future__ import annotations

import json
from typing import Any


def dumps(data: dict[str, Any], path: str | None = None, *, indent: int | None = None) -> str:
    """JSON text of `data`, also written to `path` if given."""
    text = json.dumps(data, indent=indent)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def loads(text_or_path: str) -> dict[str, Any]:
    """Parses a JSON string, or the JSON file at a path."""
    text = text_or_path
    if not text_or_path.lstrip().startswith("{"):
        with open(text_or_path) as f:
            text = f.read()
    return json.loads(text)
