"""Plan -> Keras model: recompute segments applied to a model's layers.

`rewrite_model(model, plan)` returns a new model sharing the original's layers
and weights, in which each recompute segment runs as one `RecomputeSegment`
layer. Importing this package registers `RecomputeSegment`, so rewritten models
saved to `.keras` load with `keras.models.load_model`.
"""

from tfremat.backend import require_tensorflow

require_tensorflow()

from tfremat.rewriter.api import rewrite_model  # noqa: E402
from tfremat.rewriter.segment_layer import RecomputeSegment  # noqa: E402

__all__ = ["RecomputeSegment", "rewrite_model"]
