"""The simulator against peaks computed by hand on tiny graphs."""

import dataclasses

import pytest

from tfremat import Node, Plan, PlanGraph, Segment, TensorInfo, simulate
from tfremat.core import PlanMismatchError
from tfremat.simulation import build_schedule

MB = 2**20


def t(mb: float) -> TensorInfo:
    """A float32 tensor of `mb` MiB."""
    return TensorInfo.of((int(mb * MB) // 4,), "float32")


def asked_for(graph: PlanGraph) -> PlanGraph:
    """`graph` on a device whose allocator counts the bytes each buffer asks for
    (no BFC chunks), so that peaks are sums of buffers."""
    return dataclasses.replace(graph, metadata={**graph.metadata, "allocator": None})


def fig2_graph() -> PlanGraph:
    """Chen et al. Fig. 2 / the MXNet note: B = sigmoid(A), C = sigmoid(B),
    F = pool(B), E = pool(C), G = E * F. No weights, so no backward pass: the
    schedule is the forward pass and the loss reading G."""
    return PlanGraph([
        Node("A", "A", "InputLayer", [], [t(4)]),
        Node("B", "B", "Activation", ["A:0"], [t(4)], inplace=True),
        Node("C", "C", "Activation", ["B:0"], [t(4)], inplace=True),
        Node("F", "F", "MaxPooling", ["B:0"], [t(1)]),
        Node("E", "E", "MaxPooling", ["C:0"], [t(1)]),
        Node("G", "G", "Multiply", ["E:0", "F:0"], [t(1)], inplace=True),
    ], outputs=["G:0"])


def test_no_optimisation_allocates_every_output():
    assert simulate(fig2_graph(), sharing="none").peak_bytes == 11 * MB


def test_inplace_avoids_the_trap_of_a_still_needed_input():
    # C = sigmoid(B) may not overwrite B, which F still reads; G overwrites E.
    assert simulate(fig2_graph(), sharing="inplace").peak_bytes == 10 * MB


def test_sharing_frees_after_last_reader():
    est = simulate(fig2_graph(), sharing="sharing")
    # While F runs, B (its input), C (still to be pooled) and F are alive.
    assert est.peak_bytes == 9 * MB
    assert est.peak_step == "fwd F"


def outputs_chain(**sizes_mb: float) -> PlanGraph:
    """An input of 1 MiB, then Dense calls named and sized (MiB) as given, each
    reading the one before; no weights, so no backward pass."""
    nodes = [Node("in", "in", "InputLayer", [], [t(1)])]
    for name, mb in sizes_mb.items():
        nodes.append(Node(name, name, "Dense", [f"{nodes[-1].id}:0"], [t(mb)]))
    return PlanGraph(nodes, outputs=[f"{nodes[-1].id}:0"])


def test_sharing_reuses_memory_of_a_different_size():
    # A 4 MiB buffer dies before a 2 MiB one is made: the peak is not their sum.
    g = outputs_chain(big=4, small=2, tiny=1)
    assert simulate(g, sharing="sharing").peak_bytes == 6 * MB  # big + small
    assert simulate(g, sharing="none").peak_bytes == 7 * MB


def mlp_graph(p1: float = 0.5, p2: float = 0.25) -> PlanGraph:
    return PlanGraph([
        Node("in", "in", "InputLayer", [], [t(1)]),
        Node("d1", "d1", "Dense", ["in:0"], [t(4)], backward_reads=["in:0"],
             param_bytes=int(p1 * MB)),
        Node("relu", "relu", "ReLU", ["d1:0"], [t(4)], backward_reads=["relu:0"],
             inplace=True),
        Node("d2", "d2", "Dense", ["relu:0"], [t(1)], backward_reads=["relu:0"],
             param_bytes=int(p2 * MB)),
    ], outputs=["d2:0"], persistent_bytes={"weights": 3 * MB, "batch": MB})


def test_buffers_are_counted_in_the_allocators_chunks():
    # A 3 MiB output takes a new region of 4 MiB whole (regions double from
    # 2 MiB; a chunk under twice the request is not split). Once it is dead, a
    # 2.5 MiB output takes that chunk whole too. The buffers ask for 3.5 MiB at
    # most (a and b), the chunks hold 4.5.
    g = outputs_chain(a=3, b=0.5, c=2.5)
    est = simulate(g)
    assert est.allocator == "bfc" and est.peak_bytes == int(4.5 * MB)
    assert [b / MB for _, b in est.timeline[1:4]] == [4.0, 4.5, 4.5]
    assert simulate(asked_for(g)).peak_bytes == int(3.5 * MB)



def test_a_gpu_without_memory_growth_carves_every_chunk_from_one_region():
    # Its allocator took all its memory at once (`"bfc-one-region"`): a's
    # 3 MiB are split from that region, not handed a 4 MiB region whole; once
    # a is dead, c's 2.5 MiB take a's 3 MiB hole whole (the best fit, under
    # twice the request), beside b's 0.5.
    g = outputs_chain(a=3, b=0.5, c=2.5)
    gpu = dataclasses.replace(g, metadata={**g.metadata, "allocator": "bfc-one-region"})
    est = simulate(gpu)
    assert est.allocator == "bfc-one-region"
    assert [b / MB for _, b in est.timeline[1:4]] == [3.0, 3.5, 3.5]
    assert est.peak_bytes == int(3.5 * MB) < simulate(g).peak_bytes

def test_a_workspace_takes_a_free_chunk_before_the_steps_outputs():
    # Before c runs, a's 4 MiB chunk and 1.5 MiB of the first region are free.
    # c's 2.5 MiB of temporaries take the 4 MiB chunk whole (under twice the
    # request), then c's 1 MiB output the 1.5 MiB one: 0.5 + 4 + 1.5 MiB of
    # chunks. Counted on top of the outputs alone it would be 0.5 + 1.5 + 2.5.
    g = outputs_chain(a=3, b=0.5, c=1)
    g.nodes[-1].forward_workspace_bytes = int(2.5 * MB)
    est = simulate(g)
    assert est.peak_step == "fwd c" and est.peak_bytes == 6 * MB


def test_a_workspace_that_no_free_chunk_holds_counts_as_measured():
    # 5 MiB of temporaries fit in no free chunk. Extraction measured them as
    # allocator bytes, chunks included, so they count as they are (0.5 + 1.5
    # + 5 MiB), not in a new 8 MiB region taken whole.
    g = outputs_chain(a=3, b=0.5, c=1)
    g.nodes[-1].forward_workspace_bytes = 5 * MB
    est = simulate(g)
    assert est.peak_step == "fwd c" and est.peak_bytes == 7 * MB


def saving_graph(pieces: int) -> PlanGraph:
    """An input of 1 MiB and a call that keeps 2.5 MiB for its backward pass in
    `pieces` buffers (a loop's per-iteration tensors) beside a 0.25 MiB output."""
    return PlanGraph([
        Node("in", "in", "InputLayer", [], [t(1)]),
        Node("rnn", "rnn", "LSTM", ["in:0"], [t(0.25)], backward_reads=["in:0"],
             internal_saved_bytes=int(2.5 * MB), internal_saved_pieces=pieces,
             param_bytes=MB // 4),
    ], outputs=["rnn:0"], persistent_bytes={"weights": MB // 4})


def test_a_buffer_held_in_pieces_fills_regions_chunk_by_chunk():
    # The weights and the output take 0.5 MiB of the first region (2 MiB). As
    # one buffer, 2.5 MiB takes a new region of 4 MiB whole (under twice the
    # request: not split). As 40 pieces of 64 KiB, the first ones fill the
    # first region's free 1.5 MiB and the rest split the next region: the
    # chunks hold what the pieces ask for.
    one, forty = (simulate(saving_graph(n)).timeline[1][1] for n in (1, 40))
    assert one == int(4.5 * MB)
    assert forty == int(3.0 * MB)
    assert simulate(asked_for(saving_graph(1))).peak_bytes == \
        simulate(asked_for(saving_graph(40))).peak_bytes


def test_an_unknown_allocator_is_an_error():
    g = dataclasses.replace(chain(2), metadata={"allocator": "tcmalloc"})
    with pytest.raises(ValueError, match="Unknown allocator 'tcmalloc'"):
        simulate(g)


def test_training_step_peak_by_hand():
    est = simulate(asked_for(mlp_graph()))
    # Backward of relu: relu output (kept for ReluGrad) 4, its gradient 4, the
    # gradient of d1's output 4, and d2's weight gradient 0.25, on top of 4 MiB
    # persistent. ReLU wrote into d1's output in place.
    assert est.peak_bytes == 4 * MB + 12 * MB + int(0.25 * MB)
    assert est.peak_step == "bwd relu"
    assert est.persistent_bytes == 4 * MB


def test_a_weight_gradient_kernel_holds_what_it_reads_through_the_next_step_on_a_cpu():
    alone = asked_for(mlp_graph())
    side_by_side = dataclasses.replace(alone, metadata={**alone.metadata, "concurrent_ops": True})
    # d2's backward ends with its weight gradient, which reads the gradient of
    # d2's output (1 MiB). With ready ops run side by side, relu's backward
    # starts while that kernel runs, so the gradient is still held there.
    est = simulate(side_by_side)
    assert est.peak_bytes == simulate(alone).peak_bytes + MB
    assert est.peak_step == "bwd relu"
    # With an activation fused into d2 (its backward reads its own output), the
    # activation's gradient reads d2's output gradient first, and the weights'
    # gradient reads what that makes: d2's output gradient is freed as before.
    fused = [dataclasses.replace(n, backward_reads=["relu:0", "d2:0"]) if n.id == "d2" else n
             for n in mlp_graph()]
    fused_alone = asked_for(dataclasses.replace(mlp_graph(), nodes=fused))
    fused_side_by_side = dataclasses.replace(
        fused_alone, metadata={**fused_alone.metadata, "concurrent_ops": True})
    assert simulate(fused_side_by_side).peak_bytes == simulate(fused_alone).peak_bytes


def dense(name: str, source: str, mb: float) -> Node:
    """A Dense call of `mb` MiB with weights, reading `source`'s output."""
    return Node(name, name, "Dense", [f"{source}:0"], [t(mb)], backward_reads=[f"{source}:0"],
                param_bytes=1024, flops_forward=10.0, flops_backward=20.0)


def test_a_weight_gradient_kernel_holds_the_summed_gradient_of_an_output_read_twice():
    # d1's output (2 MiB) has two readers, a and b: its backward first sums
    # their two partial gradients (AddN, which frees them), and its weights'
    # gradient reads that sum, so the sum (not the partials) is still held
    # while d0's backward runs beside it, with d1's input (d0's, 1 MiB).
    nodes = [Node("in", "in", "InputLayer", [], [t(1)]), dense("d0", "in", 1),
             dense("d1", "d0", 2), dense("a", "d1", 1), dense("b", "d1", 1),
             Node("add", "add", "Add", ["a:0", "b:0"], [t(1)], inplace=True)]
    alone = asked_for(PlanGraph(nodes, outputs=["add:0"]))
    side_by_side = dataclasses.replace(alone, metadata={**alone.metadata, "concurrent_ops": True})
    at = {label: i for i, (label, _) in enumerate(simulate(alone).timeline)}["bwd d0"]
    assert simulate(side_by_side).timeline[at][1] - simulate(alone).timeline[at][1] == 3 * MB


def chain(n: int, mb: float = 1.0) -> PlanGraph:
    nodes = [Node("in", "in", "InputLayer", [], [t(mb)])]
    for i in range(n):
        nodes.append(dense(f"l{i}", nodes[-1].id, mb))
    return PlanGraph(nodes, outputs=[f"{nodes[-1].id}:0"])


def test_recompute_segments_lower_the_peak_and_cost_one_forward():
    g = chain(16)
    plain = simulate(g)
    plan = Plan.from_segments(g, [[f"l{i}" for i in range(k, k + 4)] for k in range(0, 16, 4)])
    est = simulate(g, plan)
    assert est.peak_bytes < plain.peak_bytes
    # Every node inside a segment but its last runs its forward twice: the
    # last one's output only the next segment's backward (or the loss) reads,
    # and its recompute is pruned.
    assert est.extra_flops == 12 * 10.0
    assert est.overhead == pytest.approx(120.0 / (16 * 30.0))
    # In the last segment's backward: its input l11, which the recompute reads
    # in place, the 4 recomputed outputs, and gradients; l3 and l7 are long
    # gone, 16 activations were alive before.
    assert est.activation_peak_bytes < 10 * MB < plain.activation_peak_bytes


def test_nested_segments_lower_the_peak_further():
    g = chain(32)
    ids = [f"l{i}" for i in range(32)]
    flat = Plan.from_segments(g, [ids[0:16], ids[16:32]])
    nested = Plan.from_segments(g, [
        Segment(ids[0:16], [Segment(ids[0:8]), Segment(ids[8:16])]),
        Segment(ids[16:32], [Segment(ids[16:24]), Segment(ids[24:32])]),
    ])
    nested.validate(g)
    assert simulate(g, nested).peak_bytes < simulate(g, flat).peak_bytes
    assert simulate(g, nested).extra_flops > simulate(g, flat).extra_flops


def test_a_recompute_runs_only_what_its_backward_reads():
    """In the backward pass TensorFlow prunes the recompute's ops whose results
    nothing reads (the profiler showed a U-Net segment's last Conv2DTranspose
    and Concatenate, and a CNN segment's last Dropout multiplication, made in
    the forward pass only): a call runs again when its backward or a call that
    runs reads its output; of one that saves its own tensors apart from its
    output (a Dropout's mask), only those."""
    def graph(saved_apart: bool) -> PlanGraph:
        return asked_for(PlanGraph([
            Node("in", "in", "InputLayer", [], [t(1)]),
            Node("d", "d", "Dense", ["in:0"], [t(4)], backward_reads=["in:0"],
                 param_bytes=1024, flops_forward=10.0, flops_backward=20.0),
            Node("r", "r", "ReLU", ["d:0"], [t(4)], backward_reads=["r:0"],
                 flops_forward=1.0, flops_backward=1.0),
            Node("drop", "drop", "Dropout", ["r:0"], [t(4)], internal_saved_bytes=MB,
                 saved_apart=saved_apart, saved_flops=0.5 if saved_apart else 0.0,
                 flops_forward=1.0, flops_backward=1.0),
            Node("add", "add", "Add", ["drop:0", "in:0"], [t(4)],
                 flops_forward=1.0, flops_backward=0.0),
            Node("out", "out", "Dense", ["add:0"], [t(1)], backward_reads=["add:0"],
                 param_bytes=1024, flops_forward=10.0, flops_backward=20.0),
        ], outputs=["out:0"]))

    segment = [["d", "r", "drop", "add"]]
    apart, with_output = graph(True), graph(False)
    est = simulate(apart, Plan.from_segments(apart, segment))
    labels = [label for label, _ in est.timeline]
    # d (read by r's forward), r (read by its backward) run again; of drop its
    # mask only; add, which nothing in the backward reads, not at all.
    assert "fwd d (recompute 1)" in labels and "fwd r (recompute 1)" in labels
    assert "fwd drop (recompute 1, saved tensors only)" in labels
    assert not any(label.startswith("fwd add (recompute") for label in labels)
    # The mask's ops cost what they cost (`saved_flops`): an LSTM's saved
    # tensors come out of its loop, and recomputing them once cost nothing here.
    assert est.extra_flops == 10.0 + 1.0 + 0.5
    # A call whose saved tensors come with its output (a BatchNorm's statistics)
    # runs whole: its output and its saved tensors.
    whole = simulate(with_output, Plan.from_segments(with_output, segment))
    assert whole.extra_flops == 10.0 + 1.0 + 1.0
    # Its mask alone: 4 MiB (drop's output) less than when it runs whole.
    at, at_whole = dict(est.timeline), dict(whole.timeline)
    assert (at["fwd drop (recompute 1, saved tensors only)"]
            == at_whole["fwd drop (recompute 1)"] - 4 * MB)


def test_plan_for_another_graph_is_refused():
    plan = Plan.from_segments(chain(4), [["l1", "l2"]])
    with pytest.raises(PlanMismatchError, match="made for graph"):
        simulate(chain(5), plan)


def test_timeline_covers_forward_backward_and_update():
    est = simulate(mlp_graph())
    labels = [label for label, _ in est.timeline]
    assert labels[0] == "fwd in" and labels[-1] == "optimizer update"
    assert "loss" in labels and "bwd d1" in labels
    assert max(b for _, b in est.timeline) == est.peak_bytes


def test_unknown_sharing_mode_is_an_error():
    with pytest.raises(ValueError, match="Unknown sharing mode"):
        simulate(chain(2), sharing="magic")


def test_a_multi_replica_step_keeps_every_weight_gradient_until_the_update():
    # With one replica a weight gradient is freed GRADIENT_LIFETIME_STEPS (24)
    # backward steps after it is made; a step traced through a strategy with
    # several replicas all-reduces one pack concatenating all 40 of them.
    one = chain(40)
    several = chain(40)
    several.metadata["replicas"] = 2
    at_update = [dict(simulate(g).timeline)["optimizer update"] for g in (one, several)]
    assert at_update[1] - at_update[0] == (40 - 24) * 1024


def branches_graph(duplicates: bool) -> PlanGraph:
    """d1 feeds two ReLU layers (one computation: the graph optimizer runs them
    once when `duplicates` says so), each read by a Dense; their sum is the
    output."""
    dup = ["r1:0"] if duplicates else []
    return PlanGraph([
        Node("in", "in", "InputLayer", [], [t(1)]),
        Node("d1", "d1", "Dense", ["in:0"], [t(4)], backward_reads=["in:0"],
             param_bytes=1024, flops_forward=10.0, flops_backward=20.0),
        Node("r1", "r1", "ReLU", ["d1:0"], [t(4)], backward_reads=["r1:0"],
             flops_forward=1.0, flops_backward=1.0),
        Node("r2", "r2", "ReLU", ["d1:0"], [t(4)], backward_reads=["r2:0"],
             flops_forward=1.0, flops_backward=1.0, duplicate_of=dup),
        Node("a", "a", "Dense", ["r1:0"], [t(1)], backward_reads=["r1:0"],
             param_bytes=1024, flops_forward=10.0, flops_backward=20.0),
        Node("b", "b", "Dense", ["r2:0"], [t(1)], backward_reads=["r2:0"],
             param_bytes=1024, flops_forward=10.0, flops_backward=20.0),
        Node("sum", "sum", "Add", ["a:0", "b:0"], [t(1)]),
    ], outputs=["sum:0"])


def test_a_duplicate_computation_shares_the_first_ones_buffer():
    shared, apart = simulate(branches_graph(True)), simulate(branches_graph(False))
    at = {label: mb for label, mb in shared.timeline}
    at_apart = {label: mb for label, mb in apart.timeline}
    # r2 runs as r1: it neither reads d1 (which dies at r1) nor makes a buffer.
    assert at["fwd r2"] == at_apart["fwd r2"] - 8 * MB
    # Then one 4 MiB buffer fewer until the ReLUs' backward.
    assert at["loss"] == at_apart["loss"] - 4 * MB
    assert shared.peak_bytes == apart.peak_bytes - 4 * MB


def test_a_duplicate_is_shared_only_when_computed_in_the_same_recompute():
    g = branches_graph(True)
    together = simulate(g, Plan.from_segments(g, [["r1", "r2", "a", "b"]]))
    apart = simulate(g, Plan.from_segments(g, [["r1", "a"], ["r2", "b"]]))
    # Recomputed together, r2 is r1 again: neither its buffer nor its FLOPs.
    # (a and b are not recomputed: their backward reads the ReLUs, not them.)
    assert together.extra_flops == 1.0
    # Recomputed in two segments, each ReLU runs in its own recompute.
    assert apart.extra_flops == 2 * 1.0


def test_duplicate_of_must_name_an_earlier_output_of_the_same_size():
    nodes = branches_graph(True).nodes
    nodes[3] = Node("r2", "r2", "ReLU", ["d1:0"], [t(4)], duplicate_of=["a:0"])
    with pytest.raises(ValueError, match="duplicate 'a:0'"):
        PlanGraph(nodes, outputs=["sum:0"])
    nodes[3] = Node("r2", "r2", "ReLU", ["d1:0"], [t(4)], duplicate_of=["in:0"])
    with pytest.raises(ValueError, match="not an earlier output of its size"):
        PlanGraph(nodes, outputs=["sum:0"])
    g = branches_graph(True)
    assert PlanGraph.from_json(g.to_json()).node("r2").duplicate_of == ["r1:0"]


def fused_conv_chain(released: bool) -> PlanGraph:
    """Two calls with an activation fused in: each backward reads its input
    and its own output (4 MiB each) and holds 8 MiB of workspace."""
    def conv(name: str, source: str) -> Node:
        own = f"{name}:0"
        return Node(name, name, "Conv2D", [f"{source}:0"], [t(4)],
                    backward_reads=[f"{source}:0", own],
                    backward_reads_released=[own] if released else [],
                    backward_workspace_bytes=8 * MB, param_bytes=1024,
                    flops_forward=10.0, flops_backward=20.0)
    return asked_for(PlanGraph([Node("in", "in", "InputLayer", [], [t(4)]),
                                conv("c1", "in"), conv("c2", "c1")], outputs=["c2:0"]))


def test_an_output_only_the_first_backward_ops_read_is_freed_before_the_workspace():
    # c2's backward: its activation's gradient reads c2's output and writes
    # into the incoming gradient; then the convolution's gradients allocate
    # the workspace and c1's output gradient, c2's output gone.
    held, released = simulate(fused_conv_chain(False)), simulate(fused_conv_chain(True))
    assert held.peak_step == released.peak_step == "bwd c2"
    assert held.peak_bytes - released.peak_bytes == 4 * MB
    labels = [label for label, _ in released.timeline]
    assert labels.index("bwd c2 (first ops)") == labels.index("bwd c2") - 1
    # c1's output, which c2's convolution gradient reads, is not released
    # there: it lives until c1's first backward ops.
    schedule = build_schedule(fused_conv_chain(True))
    assert schedule.last_use[schedule.key_of("c1:0")] == schedule.backward_step["c1"] - 1

