"""Plan -> Keras model: recompute segments and host offload applied to a model.

`rewrite_model(model, plan)` returns a new model sharing the original's layers
and weights, in which each recompute segment runs as one `RecomputeSegment`
layer (`exact_recompute.py` over `recompute_grad.py`) and offloaded tensors
live on the host (`offload.py`); with updates in the backward pass, each unit
applies the optimizer's update to its own weights (`backward_updates.py`).
`PlanInstallation` applies a plan to a model's
own training step, undoably (what the `Planner` callback uses); under XLA it
traces the step within `units_compiled()`, where each recompute segment compiles
with XLA on its own and the step between them runs in TensorFlow's executor, as
a model `tfremat.rewrite` made does (`train_units_compiled_under_xla`). `unwrapped`
gives back the model a rewritten model was made from, to plan it again. Importing this
package registers `RecomputeSegment`, so rewritten models saved to `.keras` load
with `keras.models.load_model`.
"""

from tfremat.backend import require_tensorflow

require_tensorflow()

from tfremat.rewriter.backward_updates import choose_updates, fallback_reason  # noqa: E402
from tfremat.rewriter.compilers import (compiles_segments,  # noqa: E402
                                        train_units_compiled_under_xla, units_compiled)
from tfremat.rewriter.exact_recompute import makes_masks, random_on_cpu  # noqa: E402
from tfremat.rewriter.install import PlanInstallation  # noqa: E402
from tfremat.rewriter.rewriting import rewrite_model  # noqa: E402
from tfremat.rewriter.segment_layer import RecomputeSegment  # noqa: E402
from tfremat.rewriter.unwrap import UNIT_CLASSES, unit_layers, unwrapped  # noqa: E402
from tfremat.rewriter.update_layer import UpdateUnit  # noqa: E402

__all__ = ["PlanInstallation", "RecomputeSegment", "UNIT_CLASSES", "UpdateUnit",
           "choose_updates", "compiles_segments", "fallback_reason", "makes_masks",
           "random_on_cpu", "rewrite_model", "train_units_compiled_under_xla", "unit_layers",
           "units_compiled", "unwrapped"]
