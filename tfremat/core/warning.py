"""Warnings that name the user's line, not tfremat's."""

from __future__ import annotations

import os
import sys
import warnings

#: Packages whose frames a warning looks past to find the user's line.
_LIBRARIES = ("tfremat", "keras", "tensorflow")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)`, attributed to the first frame
    outside tfremat, Keras and TensorFlow: the user's `fit`, `tfremat.plan`
    or `tfremat.rewrite` call, wherever in those libraries it is raised."""
    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in map(sys.modules.get, _LIBRARIES)
                  if m is not None and getattr(m, "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
