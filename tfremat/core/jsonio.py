"""JSON text of tfremat's data (PlanGraph, Plan): to strings, files and back."""

from __future__ import annotations

import json
import os
from typing import Any


def dumps(data: dict[str, Any], path: str | os.PathLike | None = None, *,
          indent: int | None = None) -> str:
    """JSON text of `data`, also written to `path` if given."""
    text = json.dumps(data, indent=indent)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def loads(text_or_path: str | os.PathLike, what: str) -> dict[str, Any]:
    """Parses a JSON object given as text or as the path of a file holding it.

    Args:
        text_or_path: JSON text, or the path of a JSON file.
        what: What is read (e.g. `"plan"`), for error messages.

    Returns:
        The parsed JSON object.

    Raises:
        ValueError: the argument is neither an existing file nor JSON text, the
            JSON is malformed, or it holds something other than an object.
    """
    source = "the given text"
    if isinstance(text_or_path, os.PathLike) or os.path.isfile(str(text_or_path)):
        source = f"file {os.fspath(text_or_path)!r}"
        with open(text_or_path) as f:
            text = f.read()
    else:
        text = str(text_or_path)
        if not text.lstrip().startswith(("{", "[", '"')):
            raise ValueError(f"Cannot read a {what}: {text[:80]!r} is neither an existing "
                             "file nor JSON text.")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"Cannot read a {what} from {source}: it is not valid JSON "
                         f"({e}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"Cannot read a {what} from {source}: it holds a JSON "
                         f"{type(data).__name__}, not an object.")
    return data
