"""From a traced training step to a PlanGraph.

Every graph operation of the step gets an owner: the layer call that made it
(forward), the layer call whose gradient it computes (backward, by the
`gradient_tape/<forward scope>` naming of TensorFlow's gradient ops), the loss, or
the optimizer update. From owners and data flow follow, per call: the forward
tensors its backward keeps, transient workspaces, FLOPs, and edges.
"""

from __future__ import annotations

import collections
import gc
import heapq
from typing import Any

import keras
import tensorflow as tf

from tfremat.backend import device_allocator, device_name, kernels_at_once, require_tensorflow
from tfremat.graph import costs
from tfremat.core import Node, PlanGraph, TensorInfo, UnsupportedModelError
from tfremat.graph.kernels import KernelWorkspaces, measure_kernel_workspaces
from tfremat.graph.timing import measure_layer_times
from tfremat.graph.tracing import CALL_SCOPE, TracedStep, trace

LOSS = "<loss>"
UPDATE = "<update>"
#: Ops after the backward pass that wait for no gradient: Keras's metrics, which
#: read the outputs and the targets. Keras computes them after the optimizer's
#: update in Python, but nothing orders them after it, and TensorFlow runs an op
#: once its inputs exist: beside the loss.
METRICS = "<metrics>"
#: Owners of ops that belong to no layer call.
_NOT_CALLS = (None, LOSS, UPDATE, METRICS)

_Root = tuple[int, int]  # (op index, output index) of the buffer's first tensor


def extract(model: keras.Model, *, batch_size: int | None = None,
            sample: Any = None, measure_times: bool = False,
            measure_kernels: bool = True) -> PlanGraph:
    """Traces a training step of `model` and builds its PlanGraph.

    Nested functional models are flattened (their layers become nodes with ids
    `"inner_model/layer"`); a subclassed model's nodes are its direct sublayers.

    Args:
        model: A built Keras model, or one a `sample` with targets builds (as
            `fit` builds it). When compiled, its loss and optimizer are used;
            otherwise a mean-square loss with SGD.
        batch_size: Batch size, when the input shapes come from `model.inputs`.
        sample: One training batch `(x, y)` (or `x`), or a `tf.data.Dataset`
            of batches; its shapes and dtypes define the step.
        measure_times: Also run each layer call alone to measure its forward
            and backward seconds (functional and Sequential models; takes about
            a second per layer). Planners then use seconds instead of FLOPs.
        measure_kernels: Run each distinct heavy op of the step once alone to
            measure the scratch memory its kernel allocates (`graph/kernels.py`;
            seconds; resets the device's peak memory statistic), and count it
            in the workspaces of the calls. False counts only tensors.

    Returns:
        The `PlanGraph` of one training step.

    Raises:
        BackendError: TensorFlow is missing or Keras uses another backend.
        UnsupportedModelError: the model is unbuilt or cannot be traced.

    Example:

    >>> graph = tfremat.extract(keras.applications.ResNet50(weights=None),
    ...                         batch_size=16)
    >>> tfremat.simulate(graph).peak_mb
    """
    require_tensorflow()
    try:
        traced = trace(model, batch_size=batch_size, sample=sample)
        kernels = measure_kernel_workspaces(traced.ops) if measure_kernels else None
        graph = build_plan_graph(model, traced, kernels)
        del traced
    finally:
        # The traced graph holds the stand-in optimizer's slots (`stand_ins`)
        # in reference cycles (`forgetting_custom_gradients`): left to Python's
        # collector, a user's next `fit` peaked with them (an MLP with Adam:
        # 97.3 MiB, 65.2 after collecting them).
        gc.collect()
    if measure_times and not graph.metadata["subclassed"]:
        measure_layer_times(model, graph)
    return graph


class _Dataflow:
    """Buffers (alias roots), sizes and readers of a traced step's tensors, and
    the scratch bytes of their kernels (op index -> bytes); `threads`: how many
    kernels may run (and hold scratch) at the same time."""

    def __init__(self, ops: list[tf.Operation], scratch: dict[int, int],
                 threads: int = 1) -> None:
        self.ops = ops
        self.scratch = scratch
        self.threads = threads
        self.concurrent = threads > 1
        self.index = {op.name: i for i, op in enumerate(ops)}
        order = _inputs_first(ops, self.index)
        self.dead = _dead_ops(ops, self.index, order)
        self.root: dict[_Root, _Root] = {}
        self.size: dict[_Root, int] = {}
        self.readers: dict[_Root, list[int]] = collections.defaultdict(list)
        # `_written_in_place` by the positions it was asked for: a call's backward
        # ops are asked for up to six times (two orders, each peak computed with
        # and without a carried kernel, the released reads, the in-place gradient).
        self.homes: dict[tuple[int, ...], dict[_Root, _Root]] = {}
        for i in order:
            op = ops[i]
            for j in range(len(op.outputs)):
                if self._is_view(op, j):
                    src = op.inputs[min(j, len(op.inputs) - 1)]
                    self.root[(i, j)] = self.root_of(src)
                else:
                    self.root[(i, j)] = (i, j)
                    free = (op.type in costs.FREE_OPS or op.type == "Placeholder"
                            or i in self.dead)
                    self.size[(i, j)] = 0 if free else costs.output_bytes(op, j)
        # Readers in a second pass: computing a loop's gradient adds inputs made
        # later (its accumulators' empty lists) to the forward `While` op.
        for i, op in enumerate(ops):
            if i in self.dead:
                continue
            for t in op.inputs:
                self.readers[self.root_of(t)].append(i)

    def _is_view(self, op: tf.Operation, j: int) -> bool:
        """Whether output j of `op` lives in an input's buffer.

        Besides reshapes and identities, a BiasAdd whose input has no other
        reader: Grappler fuses Conv2D/MatMul + BiasAdd into one kernel writing
        one buffer.
        """
        if op.type in costs.ALIAS_OPS and op.inputs:
            return True
        if op.type == "BiasAdd":
            src = self.root_of(op.inputs[0])
            return self.ops[src[0]].type in costs.FUSED_WITH_BIAS and \
                len(op.inputs[0].consumers()) == 1
        return False

    def root_of(self, t: tf.Tensor) -> _Root:
        return self.root[(self.index[t.op.name], t.value_index)]


def _inputs_first(ops: list[tf.Operation], index: dict[str, int]) -> list[int]:
    """The indices of `ops` (a graph's, in the order they were made) in an
    order where every op comes after the ops whose outputs it reads or whose
    control outputs it waits for, otherwise as made.

    The order they were made is such an order, but for the readers of a
    unit's gradient sum of a rewritten model: the sums two at a time
    (`tfremat.rewriter.recompute_grad.summed_in_pairs`) are made after the
    ops that read them (planning a rewritten model with BatchNormalization
    failed on a KeyError).
    """
    waits_for = [sorted({index[t.op.name] for t in op.inputs if t.op.name in index}
                        | {index[c.name] for c in op.control_inputs if c.name in index})
                 for op in ops]
    if all(j < i for i, before in enumerate(waits_for) for j in before):
        return list(range(len(ops)))
    pending = [len(before) for before in waits_for]
    readers: list[list[int]] = [[] for _ in ops]
    for i, before in enumerate(waits_for):
        for j in before:
            readers[j].append(i)
    ready = [i for i, n in enumerate(pending) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers[i]:
            pending[r] -= 1
            if pending[r] == 0:
                heapq.heappush(ready, r)
    placed = set(order)  # all, but in a cycle (none in a tf.function's graph)
    return order + [i for i in range(len(ops)) if i not in placed]


def _dead_ops(ops: list[tf.Operation], index: dict[str, int], order: list[int]) -> set[int]:
    """Indices of the ops Grappler prunes before the step runs: stateless ops
    whose results reach neither the function's outputs nor a stateful op (the
    gradient of a `SelectV2` with respect to its constant branch, which
    Keras's dropout makes: a tensor of the activation's size, never read;
    the gradient of the model's input). `order`: `_inputs_first`'s."""
    graph = ops[0].graph if ops else None
    fetched = {t.op.name for t in getattr(graph, "outputs", None) or []}
    live = [False] * len(ops)
    for i in reversed(order):
        op = ops[i]
        live[i] = (op.op_def.is_stateful or not op.outputs or op.name in fetched
                   or bool(op._control_outputs)  # an op waits for it
                   or any(c.name not in index or live[index[c.name]]
                          for t in op.outputs for c in t.consumers()))
    return {i for i, alive in enumerate(live) if not alive}


def _owners(traced: TracedStep, flow: _Dataflow, waits: list[bool],
            feeds: list[bool]) -> list[str | None]:
    n = len(traced.ops)
    owner: list[str | None] = [None] * n
    for site_id, (start, end) in traced.ranges.items():
        for i in range(start, min(end, traced.forward_end)):
            owner[i] = site_id
    for i in range(traced.forward_end, traced.backward_start):
        owner[i] = LOSS
    # After the backward pass: the update, whose ops depend (by data or
    # control) on a gradient op or feed ops that do (`_waiting_for_gradients`),
    # and the metrics.
    for i in range(traced.backward_end, n):
        owner[i] = UPDATE if waits[i] or feeds[i] else METRICS
    # Backward ops: "gradient_tape/<forward op or scope>/..." names the forward
    # op whose gradient they compute. A recompute inside a call (`keras.remat`,
    # `tf.recompute_grad`) runs the call's sublayers again in the backward
    # pass, in scopes named after theirs but outside the call's ("<sublayer
    # scope>/...", gradients "gradient_tape/<sublayer scope>/..."): the scope
    # of a sublayer, right below the call's own, names its call too.
    sublayers = {s.id: {layer.name for layer in s.operation._flatten_layers(include_self=False)}
                 for s in traced.sites
                 if not s.is_input and isinstance(s.operation, keras.layers.Layer)}
    scope_owner: dict[str, str | None] = {}

    def own(scope: str, site: str) -> None:
        prev = scope_owner.get(scope, site)
        scope_owner[scope] = site if prev == site else None

    for i in range(traced.backward_start):
        site = owner[i]
        if site is None:
            continue
        parts = traced.ops[i].name.split("/")
        for k in range(1, len(parts) + 1):
            own("/".join(parts[:k]), site)
        if CALL_SCOPE in parts[:-2]:
            scope = parts[parts.index(CALL_SCOPE) + 1]  # made unique: "<name>_<n>"
            if {scope, scope.rpartition("_")[0]} & sublayers.get(site, set()):
                own(scope, site)
    for i in range(traced.backward_start, traced.backward_end):
        name = traced.ops[i].name
        parts = name.removeprefix("gradient_tape/").split("/")
        for k in range(len(parts), 0, -1):
            found = scope_owner.get("/".join(parts[:k]))
            if found is not None:
                owner[i] = found
                break
    # An unattributed backward op that makes a weight's gradient (only ops after
    # the backward pass read it) from parts one node made belongs to that node:
    # the AddN summing the gradients of a layer called once per step inside the
    # node (Keras's `TimeDistributed`) runs as soon as the node's last part
    # exists, though traced at the end of the backward pass.
    for i in range(traced.backward_start, traced.backward_end):
        if owner[i] is None and all(
                c >= traced.backward_end for j in range(len(flow.ops[i].outputs))
                for c in flow.readers[flow.root[(i, j)]]):
            made_by = {owner[k] for k in (flow.index[t.op.name] for t in flow.ops[i].inputs)
                       if traced.backward_start <= k < i}
            if len(made_by) == 1 and None not in made_by:
                owner[i] = made_by.pop()
    # The others (AddN of fan-out gradients, ...) belong to the next attributed
    # one: the gradient they prepare is consumed there.
    following: str = LOSS
    for i in range(traced.backward_end - 1, traced.backward_start - 1, -1):
        if owner[i] is None:
            owner[i] = following
        else:
            following = owner[i]
    return owner


def _waiting_for_gradients(traced: TracedStep, flow: _Dataflow
                           ) -> tuple[list[bool], list[bool]]:
    """For each op of the step: whether it depends (by data or control) on a
    gradient op; and, of the ops after the backward pass that do not, whether
    one that does reads their results (the optimizer's `m * momentum`)."""
    n = len(traced.ops)
    waits = [traced.backward_start <= i < traced.backward_end for i in range(n)]
    for i in range(traced.backward_end, n):
        op = flow.ops[i]
        waits[i] = any(waits[flow.index[t.op.name]] for t in op.inputs) or any(
            waits[flow.index[c.name]] for c in op.control_inputs)
    feeds = [False] * n
    for i in range(n - 1, traced.backward_end - 1, -1):
        if waits[i]:
            continue
        readers = (c for j in range(len(flow.ops[i].outputs))
                   for c in flow.readers[flow.root[(i, j)]])
        feeds[i] = any(waits[c] or feeds[c] for c in readers if c > i)
    return waits, feeds


def _early_update_buffers(traced: TracedStep, flow: _Dataflow, waits: list[bool],
                          feeds: list[bool]) -> frozenset[_Root]:
    """The buffers the update makes before any gradient exists and hands to
    its ops that wait for one (`PlanGraph.update_early_bytes`; `waits` and
    `feeds` from `_waiting_for_gradients`).

    Keras's SGD with momentum computes `m * momentum` from the slot alone, and
    RMSprop `rho * velocity`: the executor runs them as the step starts, and
    each is held until its gradient arrives. Measured (the profiler's memory
    events, `benchmarks/peak_contents.py`'s replay): VGG19 at 96 px, batch 16,
    SGD with momentum 0.9, every such product live at the step's peak beside
    the whole forward pass.
    """
    found = set()
    for i in range(traced.backward_end, len(traced.ops)):
        if not feeds[i] or i in flow.dead:
            continue
        for j in range(len(flow.ops[i].outputs)):
            root = flow.root[(i, j)]
            if root == (i, j) and any(waits[c] for c in flow.readers[root]):
                found.add(root)
    return frozenset(found)


def _scratch_spans(positions: list[int], local: dict[int, int],
                   flow: _Dataflow, off_chain: frozenset[int] = frozenset()
                   ) -> dict[int, tuple[int, int]]:
    """For each op at `positions` whose kernel has scratch, the local positions
    over which that scratch counts: its own, or, when kernels run side by side
    (`flow.concurrent`), from the first to the last of its siblings with
    scratch (ops reading a buffer it reads, ready at the same time), so that
    siblings' scratch adds up as measured on CPU, and for a kernel off the
    chain of input gradients (`off_chain`, see `_overlapping_scratch`) up to
    and with the next such kernel at `positions`, or to their end: the ops
    after it run beside it. (A `keras.remat` block of two 3x3 convolutions: the second's
    filter gradient, 32 MiB of scratch, ran beside the first's; the step
    measured 73.5-78.7 MiB beyond what the process held, predicted 54.2
    without, 80.6 with.)
    Ops whose outputs are never read hold none."""
    # An op whose outputs nothing reads (the gradient of the model's input) is
    # pruned by Grappler before the step runs: its kernel never runs.
    with_scratch = [p for p in positions if flow.scratch.get(p) and any(
        flow.readers[flow.root[(p, j)]] for j in range(len(flow.ops[p].outputs)))]
    spans = {p: (local[p], local[p]) for p in with_scratch}
    if not flow.concurrent:
        return spans
    beside = [p for p in with_scratch if p in off_chain]
    for p, following in zip(beside, beside[1:] + [None]):
        spans[p] = (local[p], len(positions) - 1 if following is None else local[following])
    by_input: dict[_Root, list[int]] = collections.defaultdict(list)
    for p in with_scratch:
        for r in {flow.root_of(t) for t in flow.ops[p].inputs}:
            if flow.size.get(r):
                by_input[r].append(p)
    for group in by_input.values():
        first, last = min(local[p] for p in group), max(local[p] for p in group)
        for p in group:
            start, end = spans[p]
            spans[p] = (min(start, first), max(end, last))
    return spans


def _off_chain_kernels(traced: TracedStep, flow: _Dataflow,
                       owner: list[str | None]) -> frozenset[int]:
    """The backward ops whose kernels have scratch and whose outputs no input
    gradient waits for (`_off_the_chain`); none where kernels run one at a
    time (`flow.concurrent` false)."""
    if not flow.concurrent:
        return frozenset()
    bwd = range(traced.backward_start, traced.backward_end)
    return frozenset(i for i in bwd if flow.scratch.get(i)
                     and _off_the_chain(i, flow, owner, bwd))


def _overlapping_scratch(traced: TracedStep, flow: _Dataflow, owner: list[str | None],
                         off_chain: frozenset[int]) -> dict[str, tuple[int, str]]:
    """For each node, the scratch of an earlier node's kernel that may still be
    running while its backward runs, and that node's id (only when kernels run
    side by side, `flow.concurrent`).

    A backward kernel whose outputs no other node's backward reads (a weight
    gradient, which only the update reads) is off the chain of output
    gradients: the executor starts the next node's backward on another
    inter-op thread while it runs. With TensorFlow's CPU kernels a 3x3
    `Conv2DBackpropFilter` holds up to 30 MiB of scratch, and two of them at
    once show up in about one step in ten, so an epoch's peak has them. The
    latest such kernel counts in the backward of every node with an op
    between it and the next one. A node's ops need not be contiguous: the
    gradient of an activity regularizer runs at the start of the backward
    pass, long before the rest of its layer's.
    """
    carry: dict[str, tuple[int, str]] = {}
    if not flow.concurrent:
        return carry
    bwd = range(traced.backward_start, traced.backward_end)
    pending_owner, pending = None, 0
    for i in bwd:
        v = owner[i]
        if v not in _NOT_CALLS and pending_owner != v and (
                pending > carry.get(v, (0, ""))[0]):
            carry[v] = (pending, "" if pending_owner in _NOT_CALLS else pending_owner)
        if i in off_chain:
            pending_owner, pending = v, flow.scratch[i]
    return carry


def _off_the_chain(i: int, flow: _Dataflow, owner: list[str | None], bwd: range) -> bool:
    """Whether op `i`'s outputs are read and reach no other node's backward,
    directly or through ops of its own node (a filter gradient, read by its
    node's cast and then the update; not a kernel that returns the input
    gradient too, such as an XLA-compiled convolution's gradient, which its
    node's `AddN` hands on). An op that only views what it reads (an
    `IdentityN` handing on a custom gradient's weight and input gradients
    together, as `keras.remat`'s does) leads nowhere: the readers of its views
    are the readers of the buffers they view."""
    v = owner[i]
    todo, seen, read = [i], {i}, False
    while todo:
        op = todo.pop()
        for j in range(len(flow.ops[op].outputs)):
            for c in flow.readers[flow.root[(op, j)]]:
                read = True
                if c not in bwd or c in seen or all(
                        flow.root[(c, k)] != (c, k) for k in range(len(flow.ops[c].outputs))):
                    continue
                if owner[c] != v:
                    return False
                seen.add(c)
                todo.append(c)
    return read


def _run_at_the_start(batch: list[int], end: int, flow: _Dataflow) -> set[int]:
    """Forward ops (indices below `end`) that the executor runs as the step
    starts and that are done before the batch reaches their layer: they do not
    depend on the batch (`batch`: the step's input placeholders), nor does any
    reader of what they make. Dropout's random numbers and their comparison
    with the rate are made so, for every Dropout at once; only the mask, read
    by the layer and its backward pass, lives on. Their buffers are no
    workspace of the layer's forward pass. (A Dropout of 18 MiB outputs was
    predicted with 36 MiB of workspace; the profiler showed the random floats
    of all four Dropouts of a small CNN made and freed in the step's first
    0.5 ms, and the measured peak 30% below the prediction.)"""
    on_batch = set(batch)
    for i, op in enumerate(flow.ops[:end]):
        if (any(flow.index[t.op.name] in on_batch for t in op.inputs)
                or any(flow.index[c.name] in on_batch for c in op.control_inputs)):
            on_batch.add(i)
    return {i for i in range(end) if i not in on_batch and all(
        c < end and c not in on_batch
        for j in range(len(flow.ops[i].outputs)) for c in flow.readers[flow.root[(i, j)]])}


def _saved_apart(positions: set[int], outputs: list[_Root], saved: set[_Root],
                 flow: _Dataflow) -> bool:
    """Whether a call's intermediates that its backward reads (`saved`, made at
    op indices `positions`) are all made by ops that neither make its outputs
    nor read them: a Dropout's mask, not what a fused kernel makes with its
    output. A recompute that needs only them runs those ops alone (see
    `Node.saved_apart`)."""
    if not saved:
        return False
    after = {r[0] for r in outputs if r[0] in positions}
    todo = list(after)
    while todo:
        i = todo.pop()
        for j in range(len(flow.ops[i].outputs)):
            for c in flow.readers[flow.root[(i, j)]]:
                if c in positions and c not in after:
                    after.add(c)
                    todo.append(c)
    return all(r[0] not in after for r in saved)


def _saved_flops(positions: set[int], saved: set[_Root], flow: _Dataflow) -> float:
    """FLOPs of the ops at `positions` (a call's forward ops) that make its
    saved intermediates `saved`, or that those ops read from, directly or not:
    what a recompute running only them runs. An LSTM's saved tensors come out
    of its loop, which makes its outputs too: all of its cost."""
    todo = [r[0] for r in saved if r[0] in positions]
    needed = set(todo)
    while todo:
        op = flow.ops[todo.pop()]
        for source in [*(t.op for t in op.inputs), *op.control_inputs]:
            i = flow.index.get(source.name)
            if i is not None and i in positions and i not in needed:
                needed.add(i)
                todo.append(i)
    return float(sum(costs.op_flops(flow.ops[i]) for i in needed))


def _peak_of_temporaries(positions: list[int], flow: _Dataflow,
                         is_temporary: Any, carried: int = 0,
                         counted: frozenset[_Root] = frozenset(),
                         off_chain: frozenset[int] = frozenset()) -> int:
    """`_temporaries`' peak."""
    return _temporaries(positions, flow, is_temporary, carried, counted, off_chain)[0]


def _temporaries(positions: list[int], flow: _Dataflow,
                 is_temporary: Any, carried: int = 0,
                 counted: frozenset[_Root] = frozenset(),
                 off_chain: frozenset[int] = frozenset()) -> tuple[int, list[int]]:
    """Peak bytes of temporary buffers made at `positions` (op indices, sorted),
    each alive from its op to its last reader among `positions`, and of the
    scratch of their kernels, alive while each runs (`_scratch_spans`, where
    `off_chain` are the kernels the ops after them run beside); `carried`:
    scratch of an earlier kernel that may still run throughout. At most
    `flow.threads` kernels hold scratch at once. Buffers in `counted` are
    counted elsewhere (none of them is a temporary).

    An elementwise op whose temporary input dies at it writes into that input's
    buffer, as TensorFlow's kernels do when they own the only reference. So
    does one whose input made before `positions` (a tensor the forward pass
    saved for this backward pass) dies at it: that buffer is counted where it
    was made, and the op's output costs nothing here, nor do the outputs
    written into it in turn. (GELU's backward multiplies the incoming gradient
    by the saved `erfc` term: counted as a new buffer, a GPT-style block's MLP
    was predicted with 6 MiB of backward workspace where it holds 2.)

    Returns:
        The peak, and the scratch of each of the kernels at `positions` that
        hold scratch at the peak (`carried` not among them), largest first:
        each is an allocation of its own.
    """
    if not positions:
        return 0, []
    local = {p: k for k, p in enumerate(positions)}
    # Temporaries an output of the call is written into (a Tile the mean's
    # gradient divides in place, the scaled input a Dropout's select keeps):
    # they are that output's buffer, counted as the output.
    homes = _written_in_place(positions, flow)
    taken = {homes[r] for r in homes if flow.size.get(r) and not is_temporary(r)}
    delta = [0] * (len(positions) + 1)
    last: dict[_Root, int] = {}
    first = min(positions)
    outside: set[_Root] = set(counted)
    # Each kernel's span, scratch and op (-1 for `carried`'s).
    kernels = [(start, end, flow.scratch[p], p)
               for p, (start, end) in _scratch_spans(positions, local, flow, off_chain).items()]
    if carried:
        kernels.append((0, len(positions) - 1, carried, -1))
    # The kernels holding scratch at each position, largest first.
    holding = [sorted(((b, p) for start, end, b, p in kernels if start <= k <= end),
                      reverse=True)[:flow.threads]
               for k in range(len(positions))]
    scratch = [sum(b for b, _ in held) for held in holding]
    for p in positions:
        op = flow.ops[p]
        for j in range(len(op.outputs)):
            r = flow.root[(p, j)]
            if (r != (p, j) or not flow.size.get(r) or r in counted or not is_temporary(r)
                    or homes.get(r) in taken):
                continue
            last[r] = max((local[c] for c in flow.readers[r] if c in local), default=local[p])
            nbytes = flow.size[r]
            sources = ([flow.root_of(t) for t in op.inputs]
                       if op.type in costs.ELEMENTWISE_OPS else [])
            if any(flow.size.get(src) == nbytes and (src in outside or src[0] < first)
                   and all(local[c] <= local[p] if c in local else c < first
                           for c in flow.readers[src])
                   for src in sources):
                outside.add(r)  # written into a buffer counted elsewhere
                continue
            reused = any(last.get(src) == local[p] and flow.size[src] == nbytes
                         for src in sources)
            delta[local[p] + (1 if reused else 0)] += nbytes
            delta[last[r] + 1] -= nbytes
    peak = live = 0
    pieces: list[int] = []
    for d, held, kernels_there in zip(delta, scratch, holding):
        live += d
        if live + held > peak:
            peak = live + held
            pieces = [b for b, p in kernels_there if p != -1]
    return peak, pieces


def _ready_first(positions: list[int], flow: _Dataflow) -> list[int]:
    """`positions` (op indices, sorted) in the order an executor that runs each
    op as soon as its inputs exist may run them: first-in, first-out by the
    time they become ready, ties in the traced order.

    Ops that do not depend on one another run before the ops that gather them:
    Keras's `TimeDistributed` slices its input per step, and the backward pass
    makes one whole-input-sized `StridedSliceGrad` per step, which the
    executor runs before the `AddN`s that sum them (measured: 3 x
    TimeDistributed(Dense(512)) over 100 steps, batch 32, 770 MiB against 207
    predicted in the traced order).
    """
    inside = set(positions)
    waiting = {p: {flow.index[t.op.name] for t in flow.ops[p].inputs} & inside - {p}
               for p in positions}
    users: dict[int, list[int]] = collections.defaultdict(list)
    for p, needs in waiting.items():
        for q in needs:
            users[q].append(p)
    queue = collections.deque(p for p in positions if not waiting[p])
    order = []
    while queue:
        p = queue.popleft()
        order.append(p)
        for u in sorted(users[p]):
            waiting[u].discard(p)
            if not waiting[u]:
                queue.append(u)
    return order if len(order) == len(positions) else positions


def _released_reads(positions: list[int], reads: dict[str, _Root], flow: _Dataflow) -> list[str]:
    """Of a call's backward reads (`reads`: reference -> buffer), those whose
    readers among its backward ops (`positions`, sorted) all run before
    anything else there is allocated: each reader is an ancestor of every op
    there that makes a buffer of its own or holds scratch.

    An activation fused into a convolution is the case: its gradient reads
    the call's output and writes into the incoming gradient, and the
    convolution's gradients, which allocate, read what it wrote. Where the
    call is the output's last reader, it is freed before the call's
    workspace and input gradients exist. Profiled on a CNN of four
    `Conv2D(activation="relu")`: the last one's output (28 MiB of chunk) was
    freed before its `Conv2DBackpropInput` made the input gradient, the
    step's peak.
    """
    if not reads:
        return []
    inside = set(positions)
    homes = _written_in_place(positions, flow)
    allocating = [p for p in positions if flow.scratch.get(p) or any(
        homes.get((p, j)) == (p, j) and flow.size.get((p, j))
        for j in range(len(flow.ops[p].outputs)))]
    if not allocating:
        return []
    first: set[int] | None = None  # the ops every allocating one waits for
    for p in allocating:
        ancestors: set[int] = set()
        todo = [p]
        while todo:
            for t in flow.ops[todo.pop()].inputs:
                a = flow.index[t.op.name]
                if a in inside and a not in ancestors:
                    ancestors.add(a)
                    todo.append(a)
        first = ancestors if first is None else first & ancestors
        if not first:
            return []
    return sorted(ref for ref, root in reads.items()
                  if all(c in first for c in flow.readers[root] if c in inside))


def _gradient_in_place(positions: list[int], flow: _Dataflow, input_bytes: list[int]) -> bool:
    """Whether a call's backward ops (`positions`) allocate none of its input
    gradients: each buffer they make that other ops read and that is the size
    of one of the call's inputs (`input_bytes`) is written into a buffer made
    before them (the incoming gradient), as elementwise gradient kernels do."""
    if not positions or len(input_bytes) != 1:
        return False
    inside = set(positions)
    homes = _written_in_place(positions, flow)
    gradients = [r for r in homes if flow.size.get(r) == input_bytes[0]
                 and any(c not in inside for c in flow.readers[r])]
    return bool(gradients) and all(homes[r][0] < positions[0] for r in gradients)


def _written_in_place(positions: list[int], flow: _Dataflow) -> dict[_Root, _Root]:
    """For each buffer made at `positions` (op indices, sorted), the buffer it
    is written into: its own, or the buffer of an input of the same size that
    dies at its op, which an elementwise kernel (or one of
    `costs.FORWARDING_OPS`) takes over instead of allocating, followed down
    the chain. Not to be changed: it is kept for the same `positions`."""
    key = tuple(positions)
    if key in flow.homes:
        return flow.homes[key]
    homes = flow.homes[key] = {}
    for p in positions:
        op = flow.ops[p]
        forwarding = costs.FORWARDING_OPS.get(op.type, {})
        taken: set[_Root] = set()
        for j in range(len(op.outputs)):
            r = flow.root[(p, j)]
            if r != (p, j):
                continue
            homes[r] = r
            if op.type in costs.ELEMENTWISE_OPS:
                candidates = list(op.inputs)
            else:
                candidates = [op.inputs[forwarding[j]]] if j in forwarding else []
            for t in candidates:
                src = flow.root_of(t)
                if (src not in taken and flow.size.get(src) == flow.size.get(r)
                        and flow.size.get(r) and max(flow.readers[src]) == p):
                    taken.add(src)
                    homes[r] = homes.get(src, src)
                    break
    return homes


def build_plan_graph(model: keras.Model, traced: TracedStep,
                     kernels: KernelWorkspaces | None = None) -> PlanGraph:
    """Builds the PlanGraph of a traced step (see `extract`); `kernels`, the
    measured scratch of its kernels, counts in the workspaces, and so do the
    iterations a loop runs at once (`costs.loop_run_ahead_bytes`)."""
    ops = traced.ops
    scratch = dict(kernels.bytes_by_op) if kernels else {}
    for i, op in enumerate(ops):  # a loop's iterations in flight hold scratch too
        if op.type in costs.WHILE_OPS:
            scratch[i] = scratch.get(i, 0) + costs.loop_run_ahead_bytes(op)
    flow = _Dataflow(ops, scratch, kernels.threads if kernels and kernels.concurrent else 1)
    waits, feeds = _waiting_for_gradients(traced, flow)
    owner = _owners(traced, flow, waits, feeds)
    bwd = range(traced.backward_start, traced.backward_end)

    out_ref: dict[_Root, str] = {}  # buffer -> "site:k" of the call output it is
    for site_id, tensors in traced.call_outputs.items():
        for k, t in enumerate(tensors):
            out_ref.setdefault(flow.root_of(t), f"{site_id}:{k}")
    first_of = _deduplicated(ops, traced.backward_start)
    computed: dict[_Root, str] = {}  # deduplicated buffer -> first call output it is

    x_spec, y_spec = traced.input_specs
    placeholders = [i for i, op in enumerate(ops[:traced.backward_start])
                    if op.type == "Placeholder" and op.outputs[0].dtype != tf.resource]
    x_flat = tf.nest.flatten(x_spec)
    batch = x_flat[0].shape[0] if x_flat and x_flat[0].shape.rank else None
    input_sites = [s for s in traced.sites if s.is_input]
    if input_sites:
        for site, i in zip(input_sites, placeholders):
            out_ref[(i, 0)] = f"{site.id}:0"
    else:
        input_sites = []
        for k, i in enumerate(placeholders[:len(x_flat)]):
            out_ref[(i, 0)] = f"input_{k}:0"
    root_of_ref = {ref: r for r, ref in out_ref.items()}

    backward_reads: dict[str, list[str]] = collections.defaultdict(list)
    internal_saved: dict[str, int] = collections.Counter()
    saved_buffers: dict[str, int] = collections.Counter()
    saved_inside: dict[str, set[_Root]] = collections.defaultdict(set)  # their buffers
    for r, nbytes in flow.size.items():
        v = owner[r[0]]
        if v in _NOT_CALLS or r[0] >= traced.backward_start:
            continue
        bwd_readers = {owner[c] for c in flow.readers[r] if c in bwd}
        bwd_readers -= set(_NOT_CALLS)
        if not bwd_readers:
            continue
        ref = out_ref.get(r)
        if ref is None:
            internal_saved[v] += nbytes
            saved_buffers[v] += costs.output_buffers(ops[r[0]], r[1]) if nbytes else 0
            if nbytes:
                saved_inside[v].add(r)
        else:
            for w in bwd_readers:
                backward_reads[w].append(ref)

    # Op indices of each call's forward and backward, of the loss and the update.
    positions: dict[Any, list[int]] = collections.defaultdict(list)
    for i, o in enumerate(owner):
        key = o if o in (LOSS, UPDATE, METRICS) else (o, i < traced.forward_end)
        positions[key].append(i)

    nodes: list[Node] = []
    params_seen: set[str] = set()
    off_chain = _off_chain_kernels(traced, flow, owner)
    overlapping = _overlapping_scratch(traced, flow, owner, off_chain)
    early = _run_at_the_start(placeholders, traced.backward_start, flow)

    # Input nodes.
    if input_sites:
        for site, spec in zip(input_sites, x_flat):
            nodes.append(Node(site.id, site.layer_key, "InputLayer", [],
                              [TensorInfo.of(spec.shape, spec.dtype.name)]))
    else:
        for k, spec in enumerate(x_flat):
            nodes.append(Node(f"input_{k}", f"input_{k}", "InputLayer", [],
                              [TensorInfo.of(spec.shape, spec.dtype.name)]))

    by_id = {n.id: n for n in nodes}
    for site in traced.sites:
        if site.is_input:
            continue
        fwd_pos = positions[(site.id, True)]
        bwd_pos = positions[(site.id, False)]
        outs = traced.call_outputs[site.id]
        out_roots = [flow.root_of(t) for t in outs]
        fwd_set = set(fwd_pos)
        if site.node is not None:
            inputs = list(site.inputs)
        else:
            inputs = _dynamic_inputs(site.id, fwd_pos, flow, out_ref)
        aliases_input = [r[0] not in fwd_set and r in out_ref and out_ref[r] != f"{site.id}:{k}"
                         for k, r in enumerate(out_roots)]
        outputs = [_tensor_info(t, batch, site.id) for t in outs]
        duplicate_of: list[str | None] = []
        for k, r in enumerate(out_roots):
            first = computed.setdefault((first_of[r[0]], r[1]), f"{site.id}:{k}")
            duplicate_of.append(None if aliases_input[k] or first == out_ref.get(r)
                                or first.startswith(f"{site.id}:") else first)
        saved_roots = {r for r in flow.size if r[0] in fwd_set and any(
            c in bwd for c in flow.readers[r])}
        forward_ws = _peak_of_temporaries(
            [i for i in fwd_pos if i not in early], flow,
            lambda r: r not in out_roots and r not in saved_roots)
        carried, carried_from = overlapping.get(site.id, (0, ""))
        orders = (bwd_pos, _ready_first(bwd_pos, flow))

        def backward_peak(scratch: int) -> tuple[int, list[int]]:
            return max(_temporaries(
                order, flow, lambda r: all(owner[c] == site.id for c in flow.readers[r]),
                carried=scratch, off_chain=off_chain) for order in orders)

        reads = sorted(set(backward_reads.get(site.id, [])))
        released = _released_reads(bwd_pos, {ref: root_of_ref[ref] for ref in reads}, flow)
        backward_ws, scratch_pieces = backward_peak(carried)
        backward_alone, scratch_pieces = backward_peak(0) if carried else (backward_ws,
                                                                           scratch_pieces)
        saved_apart = _saved_apart(fwd_set, out_roots, saved_inside[site.id], flow)
        saved_flops = (_saved_flops(fwd_set, saved_inside[site.id], flow)
                       if saved_apart else 0.0)
        backward_inplace = _gradient_in_place(
            bwd_pos, flow, [by_id[r.rsplit(":", 1)[0]].outputs[int(r.rsplit(":", 1)[1])].bytes
                            for r in inputs if r.rsplit(":", 1)[0] in by_id])
        weights = getattr(site.operation, "trainable_weights", [])
        param_bytes = 0
        if site.layer_key not in params_seen:
            params_seen.add(site.layer_key)
            param_bytes = costs.variable_bytes(weights)
        root_op = ops[out_roots[0][0]] if len(outs) == 1 else None
        inplace = bool(
            root_op is not None and root_op.type in costs.ELEMENTWISE_OPS
            and out_roots[0][0] in fwd_set and inputs
            and outputs[0].bytes == by_id[inputs[0].rsplit(":", 1)[0]].outputs[
                int(inputs[0].rsplit(":", 1)[1])].bytes)
        node = Node(
            id=site.id, layer=site.layer_key, class_name=site.class_name,
            inputs=inputs, outputs=outputs,
            backward_reads=reads, backward_reads_released=released,
            internal_saved_bytes=int(internal_saved.get(site.id, 0)),
            internal_saved_pieces=max(1, saved_buffers.get(site.id, 0)),
            forward_workspace_bytes=forward_ws, backward_workspace_bytes=backward_ws,
            backward_scratch_pieces=scratch_pieces,
            backward_carried_bytes=backward_ws - backward_alone,
            backward_carried_from=carried_from if backward_ws > backward_alone else "",
            param_bytes=param_bytes,
            flops_forward=sum(costs.op_flops(ops[i]) for i in fwd_pos),
            flops_backward=sum(costs.op_flops(ops[i]) for i in bwd_pos),
            inplace=inplace, backward_inplace=backward_inplace, saved_apart=saved_apart,
            saved_flops=saved_flops,
            alias_inputs=[_alias_position(r, inputs, out_ref) if a else None
                          for r, a in zip(out_roots, aliases_input)],
            duplicate_of=duplicate_of if any(duplicate_of) else [],
        )
        nodes.append(node)
        by_id[node.id] = node

    loss_pos = positions[LOSS]
    update_pos = positions[UPDATE]
    homes = _written_in_place(loss_pos, flow)
    made_at_loss = set(loss_pos)
    # A buffer the loss writes into one made before it (a dying output's) is
    # no new memory: the output's gradient then takes the output's place. One
    # whose contents, written in place down a chain, outlive the loss is the
    # gradient the backward pass reads, no workspace.
    outliving = {home for r, home in homes.items()
                 if any(owner[c] != LOSS for c in flow.readers[r])}
    loss_ws = _peak_of_temporaries(
        loss_pos, flow, lambda r: homes[r][0] in made_at_loss and homes[r] not in outliving
        and all(owner[c] == LOSS for c in flow.readers[r]))
    metrics_ws = _peak_of_temporaries(
        positions[METRICS], flow, lambda r: all(owner[c] == METRICS for c in flow.readers[r]))
    outputs_in_place = sorted({out_ref[home] for home in outliving
                               if home[0] not in made_at_loss and home in out_ref})
    early = _early_update_buffers(traced, flow, waits, feeds)
    update_ws = _peak_of_temporaries(update_pos, flow, lambda r: True, counted=early)
    output_refs = traced.output_refs or _dynamic_outputs(owner, flow, out_ref)

    persistent = {
        "weights": costs.variable_bytes(model.trainable_weights),
        "other": costs.variable_bytes(model.non_trainable_weights),
        "optimizer": traced.optimizer_bytes,
        "batch": int(sum(costs.tensor_bytes(ops[i].outputs[0]) for i in placeholders)),
    }
    return PlanGraph(
        nodes=nodes, persistent_bytes=persistent,
        update_workspace_bytes=update_ws,
        update_early_bytes=sum(flow.size.get(r, 0) for r in early),
        loss_workspace_bytes=loss_ws + metrics_ws,
        outputs=output_refs, outputs_in_place=outputs_in_place, name=model.name,
        metadata={
            "batch_shape": [list(s.shape) for s in x_flat],
            "trace_seconds": round(traced.seconds, 3),
            "step_ops": len(ops),
            "subclassed": not input_sites,
            "replicas": traced.replicas,
            "allocator": device_allocator(device_name()),
            "concurrent_ops": kernels_at_once(device_name()) > 1,
            **({"kernel_workspaces": kernels.metadata()} if kernels else {}),
        })


def _tensor_info(t: tf.Tensor, batch: int | None, site_id: str) -> TensorInfo:
    """The shape, dtype and bytes of a call's output. Ops that go through ragged
    tensors (`TextVectorization`) lose the batch dimension's static size; it
    is the batch's.

    Raises:
        UnsupportedModelError: a dimension other than the batch's is unknown.
    """
    shape = t.shape.as_list() if t.shape.rank is not None else None
    if shape and shape[0] is None:
        shape[0] = batch
    if shape is None or None in shape:
        raise UnsupportedModelError(
            f"The output of {site_id!r} has a shape known only when the step runs "
            f"({t.shape}), so its memory cannot be planned. Give the layer a fixed "
            "output size (e.g. TextVectorization(output_sequence_length=...)), or pad "
            "the batch to a fixed shape.")
    return TensorInfo.of(shape, t.dtype.name)


def _deduplicated(ops: list[tf.Operation], end: int) -> list[int]:
    """For each op, the index of the first op before `end` that computes the
    same: same type and attributes, same inputs and control inputs once
    duplicates are merged. Grappler's common-subgraph elimination runs such
    ops once, so their outputs are one buffer. Stateful ops are never merged."""
    index = {op.name: i for i, op in enumerate(ops)}
    first = list(range(len(ops)))
    seen: dict[tuple, int] = {}
    for i, op in enumerate(ops[:end]):
        if op.op_def is None or op.op_def.is_stateful or not op.outputs:
            continue
        try:
            inputs = tuple((first[index[t.op.name]], t.value_index) for t in op.inputs)
            controls = tuple(sorted(first[index[c.name]] for c in op.control_inputs))
        except KeyError:  # reads an op outside the step (a captured function's)
            continue
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                             for k, v in op.node_def.attr.items()))
        first[i] = seen.setdefault((op.type, inputs, controls, attrs), i)
    return first


def _alias_position(root: _Root, inputs: list[str], out_ref: dict[_Root, str]) -> int | None:
    ref = out_ref.get(root)
    return inputs.index(ref) if ref in inputs else None


def _dynamic_inputs(site_id: str, fwd_pos: list[int], flow: _Dataflow,
                    out_ref: dict[_Root, str]) -> list[str]:
    """Edges of a subclassed model's call: other calls' outputs its ops read."""
    own = f"{site_id}:"
    refs: list[str] = []
    for i in fwd_pos:
        for t in flow.ops[i].inputs:
            ref = out_ref.get(flow.root_of(t))
            if ref is not None and not ref.startswith(own) and ref not in refs:
                refs.append(ref)
    return refs


def _dynamic_outputs(owner: list[str | None], flow: _Dataflow,
                     out_ref: dict[_Root, str]) -> list[str]:
    """Model outputs of a subclassed model: call outputs the loss reads."""
    outs = []
    for r, ref in out_ref.items():
        if any(owner[c] == LOSS for c in flow.readers[r]) and ref not in outs:
            outs.append(ref)
    return outs
