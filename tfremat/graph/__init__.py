"""The TensorFlow front end: from a Keras model to its PlanGraph.

`walk` lists a functional model's call sites (`keras_graph.py`); `trace` traces
one training step and locates each call's ops in it (`tracing.py`), with fresh
copies of the training state the step would build (`training_state.py`); `extract`
turns the traced step into a `PlanGraph` (`extraction.py`) with bytes, FLOPs (`costs.py`),
the scratch each heavy kernel asks for (`kernels.py`, from the profiler's memory events:
`profiler.py`) and, on request, measured times (`timing.py`). Importing this package
needs TensorFlow.
"""

from tfremat.backend import require_tensorflow

require_tensorflow()

from tfremat.graph.extraction import extract  # noqa: E402
from tfremat.graph.keras_graph import (CallSite, as_functional, fingerprint,  # noqa: E402
                                       is_subclassed, structure_graph, walk,
                                       walk_with_outputs)
from tfremat.graph.training_state import forgetting_custom_gradients, stand_ins  # noqa: E402
from tfremat.graph.timing import measure_layer_times  # noqa: E402
from tfremat.graph.tracing import (TRACE_ERRORS, TracedStep, batch_specs,  # noqa: E402
                                 built_from_sample, require_built, step_function,
                                 target_candidates, trace, unbuilt_layers, untraceable)

__all__ = ["TRACE_ERRORS", "CallSite", "TracedStep", "as_functional", "batch_specs",
           "built_from_sample", "extract", "fingerprint", "forgetting_custom_gradients",
           "is_subclassed", "measure_layer_times",
           "require_built", "stand_ins", "step_function", "structure_graph",
           "target_candidates", "trace", "unbuilt_layers", "untraceable", "walk",
           "walk_with_outputs"]
