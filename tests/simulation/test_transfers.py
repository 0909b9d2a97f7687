"""Host offload in the simulator, against timelines worked out by hand.

The graph is a chain `in -> l0 -> ... -> l5`: l0 makes 2 MiB, the others 1 MiB,
each call's backward reads its input, only l0 has weights. Every forward takes
1 ms and every backward 2 ms (measured times), so the schedule is

    step:   0    1    2    3    4    5    6    7     8    9    10   11   12   13
    label:  fwd  fwd  fwd  fwd  fwd  fwd  fwd  loss  bwd  bwd  bwd  bwd  bwd  bwd
            in   l0   l1   l2   l3   l4   l5         l5   l4   l3   l2   l1   l0
    start:  0    0    1    2    3    4    5    6     6    8    10   12   14   16  (ms)

and the step takes 18 ms. l0's output is read in the forward pass by fwd l1
(step 2) and in the backward pass first by bwd l1 (step 12). Bandwidths are
given in MiB per ms to keep the arithmetic exact. The device's allocator counts
the bytes each buffer asks for (`metadata["allocator"]` None), so that the bytes
of a step are the sum of its live buffers; one test plays them through
TensorFlow's BFC allocator.
"""

import dataclasses

import pytest

from tfremat import Node, Offload, Plan, PlanGraph, TensorInfo, simulate
from tfremat.core import PlanValidationError
from tfremat.simulation import build_schedule

MIB = 2**20
MS = 1e-3


def t(mib: float) -> TensorInfo:
    return TensorInfo.of((int(mib * MIB) // 4,), "float32")


def gbps(mib_per_ms: float) -> float:
    """GB/s (1e9 bytes per second) of a stream moving `mib_per_ms` MiB per ms."""
    return mib_per_ms * MIB / MS / 1e9


def chain(flops: bool = False) -> PlanGraph:
    nodes = [Node("in", "in", "InputLayer", [], [t(1)])]
    for i in range(6):
        prev = nodes[-1].id
        times = ({"flops_forward": 1e9, "flops_backward": 2e9} if flops else
                 {"seconds_forward": 1 * MS, "seconds_backward": 2 * MS})
        nodes.append(Node(f"l{i}", f"l{i}", "Dense", [f"{prev}:0"], [t(2 if i == 0 else 1)],
                          backward_reads=[f"{prev}:0"], param_bytes=1024 if i == 0 else 0,
                          **times))
    return PlanGraph(nodes, outputs=["l5:0"], metadata={"allocator": None})


def offload(graph: PlanGraph, *refs_and_triggers: tuple[str, str | None],
            segments: list[list[str]] = ()) -> Plan:
    plan = Plan.from_segments(graph, list(segments),
                              offloaded=[Offload(r, p) for r, p in refs_and_triggers])
    plan.validate(graph)
    return plan


def live(est, label: str) -> int:
    return dict(est.timeline)[label]


def test_schedule_times_by_hand():
    est = simulate(chain())
    assert [lab for lab, _ in est.timeline][:9] == [
        "fwd in", "fwd l0", "fwd l1", "fwd l2", "fwd l3", "fwd l4", "fwd l5", "loss", "bwd l5"]
    assert est.step_times[12] == pytest.approx((14 * MS, 16 * MS))  # bwd l1
    assert est.step_seconds == est.baseline_seconds == pytest.approx(18 * MS)
    assert est.stall_seconds == 0 and est.host_peak_bytes == 0


def test_flops_are_timed_at_the_device_rate():
    # 6 forwards of 1 GFLOP and 6 backwards of 2 GFLOP at 2 TFLOP/s.
    est = simulate(chain(flops=True), device_flops=2e12)
    assert est.step_seconds == pytest.approx(18e9 / 2e12)


def test_recomputation_adds_its_forward_time():
    g = chain()
    est = simulate(g, Plan.from_segments(g, [["l1", "l2", "l3"]]))
    assert est.baseline_seconds == pytest.approx(18 * MS)
    # l1 and l2 run again; l3's output only l4's backward reads, outside the
    # segment, so its recompute is pruned.
    assert est.step_seconds == pytest.approx(20 * MS)
    assert est.overhead == pytest.approx(2 / 18)


def test_offload_lowers_the_peak_by_the_tensor_at_the_turn():
    g = chain()
    plain = simulate(g)
    # At the loss, l0..l5 (7 MiB) and the gradient of l5 (1 MiB) are alive.
    assert plain.peak_bytes == 8 * MIB and plain.peak_step == "loss"
    # 2 MiB at 2 MiB/ms: out at 1-2 ms, back at 12-13 ms (trigger bwd l2).
    est = simulate(g, offload(g, ("l0:0", "l2")), bandwidth_gbps=gbps(2))
    assert est.peak_bytes == 6 * MIB
    assert plain.peak_bytes - est.peak_bytes == 2 * MIB
    assert est.stall_seconds == 0


def test_offload_lowers_the_peak_in_the_allocators_chunks_too():
    g = dataclasses.replace(chain(), metadata={})  # TensorFlow's BFC allocator
    plain = simulate(g)
    est = simulate(g, offload(g, ("l0:0", "l2")), bandwidth_gbps=gbps(2))
    assert est.allocator == plain.allocator == "bfc"
    assert est.peak_bytes < plain.peak_bytes


def test_copy_hidden_behind_compute_costs_nothing():
    g = chain()
    # 3 ms each way; the copy back starts at bwd l3's dispatch (10 ms) and lands
    # at 13 ms, before bwd l1 starts at 14 ms.
    est = simulate(g, offload(g, ("l0:0", "l3")), bandwidth_gbps=gbps(2 / 3))
    assert est.stall_seconds == 0
    assert est.step_seconds == pytest.approx(est.baseline_seconds)
    assert est.overhead == 0


def test_late_prefetch_stalls_by_the_missing_time():
    g = chain()
    # Triggered at bwd l2 (12 ms), the 3 ms copy lands at 15 ms: bwd l1 waits 1 ms.
    est = simulate(g, offload(g, ("l0:0", "l2")), bandwidth_gbps=gbps(2 / 3))
    assert est.stall_seconds == pytest.approx(1 * MS)
    assert est.step_times[12] == pytest.approx((15 * MS, 17 * MS))
    assert est.step_seconds == pytest.approx(19 * MS)
    assert est.overhead == pytest.approx(1 / 18)


def test_just_in_time_copy_back_stalls_for_the_whole_transfer():
    g = chain()
    est = simulate(g, offload(g, ("l0:0", None)), bandwidth_gbps=gbps(2 / 3))
    assert est.stall_seconds == pytest.approx(3 * MS)
    assert est.step_seconds == pytest.approx(21 * MS)


def test_copy_in_flight_keeps_the_device_buffer():
    g = chain()
    plain = simulate(g)
    # 2 MiB at 0.4 MiB/ms: out from 1 ms to 6 ms, so l0 stays on the device
    # through fwd l5 (starts at 5 ms) and is gone from the loss (6 ms) on.
    est = simulate(g, offload(g, ("l0:0", "l2")), bandwidth_gbps=gbps(0.4))
    for label in ["fwd l2", "fwd l3", "fwd l4", "fwd l5"]:
        assert live(est, label) == live(plain, label)
    for label in ["loss", "bwd l5", "bwd l4", "bwd l3"]:
        assert live(est, label) == live(plain, label) - 2 * MIB
    assert est.peak_bytes == 7 * MIB and est.peak_step == "fwd l5"


def test_one_stream_copies_one_tensor_at_a_time():
    g = chain()
    plain = simulate(g)
    # 1 MiB/ms: l0 goes out 1-3 ms; l1, made at 2 ms, waits and goes out 3-4 ms,
    # so l1 is on the device through fwd l3 (starts at 3 ms), not fwd l4.
    est = simulate(g, offload(g, ("l0:0", "l3"), ("l1:0", "l4")), bandwidth_gbps=gbps(1))
    assert live(est, "fwd l2") == live(plain, "fwd l2")  # both in flight
    assert live(est, "fwd l3") == live(plain, "fwd l3") - 2 * MIB
    assert live(est, "fwd l4") == live(plain, "fwd l4") - 3 * MIB


def test_buffer_waits_for_its_forward_readers():
    nodes = chain().nodes
    # l3 also reads l0 in the forward pass (a skip connection).
    nodes[4] = Node("l3", "l3", "Add", ["l2:0", "l0:0"], [t(1)], backward_reads=[],
                    seconds_forward=1 * MS, seconds_backward=2 * MS)
    g = PlanGraph(nodes, outputs=["l5:0"])
    plain = simulate(g)
    est = simulate(g, offload(g, ("l0:0", "l4")), bandwidth_gbps=gbps(100))
    assert live(est, "fwd l3") == live(plain, "fwd l3")
    assert live(est, "fwd l4") == live(plain, "fwd l4") - 2 * MIB


def test_prefetched_copy_lives_from_trigger_to_last_reader():
    g = chain()
    plain = simulate(g)
    est = simulate(g, offload(g, ("l0:0", "l4")), bandwidth_gbps=gbps(2))
    # Back on the device from bwd l4's step on, as in the plan without offload.
    assert live(est, "bwd l5") == live(plain, "bwd l5") - 2 * MIB
    for label in ["bwd l4", "bwd l3", "bwd l2", "bwd l1"]:
        assert live(est, label) == live(plain, label)


def test_host_peak_holds_every_tensor_between_its_copies():
    g = chain()
    est = simulate(g, offload(g, ("l0:0", "l3"), ("l1:0", "l4"), ("l2:0", "l5")),
                   bandwidth_gbps=gbps(2))
    assert est.host_peak_bytes == 4 * MIB
    assert simulate(g).host_peak_bytes == 0


def test_segment_input_comes_back_before_the_recomputation():
    g = chain()
    plan = offload(g, ("l1:0", None), segments=[["l2", "l3", "l4"]])
    schedule = build_schedule(g, plan)
    life = schedule.lifetime(schedule.key_of("l1:0"))
    # The recomputation reads the input first, so that is where it must be back.
    assert schedule.labels[life.backward_first] == "fwd l2 (recompute 1)"
    # 1 MiB at 0.5 MiB/ms, copied back just in time: the recomputation waits 2 ms.
    est = simulate(g, plan, bandwidth_gbps=gbps(0.5))
    recompute_only = simulate(g, Plan.from_segments(g, [["l2", "l3", "l4"]]))
    assert est.stall_seconds == pytest.approx(2 * MS)
    assert est.step_seconds == pytest.approx(recompute_only.step_seconds + 2 * MS)
    # Out from 2 ms to 4 ms, back from the recomputation on: off the device at the turn.
    assert live(est, "loss") == live(recompute_only, "loss") - MIB


def test_trigger_after_the_first_backward_reader_is_refused():
    g = chain()
    with pytest.raises(PlanValidationError, match="must come after its last reader 'l1'"):
        simulate(g, Plan.from_segments(g, [], offloaded=[Offload("l0:0", "l0")]))
    # Planners simulate unvalidated plans; the simulator still refuses this one.
    with pytest.raises(PlanValidationError, match="too late"):
        simulate(g, Plan.from_segments(g, [], offloaded=[Offload("l0:0", "l0")]),
                 validate=False)


def test_trigger_without_a_backward_step_is_refused():
    g = chain()
    with pytest.raises(PlanValidationError, match="'in' of 'l1:0' has no floating input"):
        simulate(g, Plan.from_segments(g, [], offloaded=[Offload("l1:0", "in")]))
    with pytest.raises(PlanValidationError, match="no backward step"):
        simulate(g, Plan.from_segments(g, [], offloaded=[Offload("l1:0", "in")]),
                 validate=False)


def test_unknown_offloaded_tensor_is_refused():
    g = chain()
    plan = Plan.from_segments(g, [], offloaded=[Offload("l9:0")])
    with pytest.raises(PlanValidationError, match="not in the graph"):
        simulate(g, plan)


def test_a_500_call_step_with_offload_simulates_in_well_under_50_ms():
    import time

    nodes = [Node("in", "in", "InputLayer", [], [t(1)])]
    for i in range(500):
        prev = nodes[-1].id
        nodes.append(Node(f"l{i}", f"l{i}", "Dense", [f"{prev}:0"], [t(1)],
                          backward_reads=[f"{prev}:0"], param_bytes=1024,
                          flops_forward=1e9, flops_backward=2e9))
    g = PlanGraph(nodes, outputs=["l499:0"])
    plan = offload(g, *[(f"l{i}:0", f"l{i + 2}") for i in range(0, 490, 2)])
    simulate(g, plan)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        simulate(g, plan)
        runs.append(time.perf_counter() - started)
    assert sorted(runs)[2] < 0.05
