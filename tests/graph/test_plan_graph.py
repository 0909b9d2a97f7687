"""PlanGraph: structure checks, JSON round trip, fingerprint."""

import pytest

from tfremat import Node, PlanGraph, TensorInfo


def small_graph() -> PlanGraph:
    return PlanGraph([
        Node("in", "in", "InputLayer", [], [TensorInfo.of((2, 3), "float32")]),
        Node("d", "d", "Dense", ["in:0"], [TensorInfo.of((2, 4), "bfloat16")],
             backward_reads=["in:0"], param_bytes=64, flops_forward=48.0),
    ], persistent_bytes={"weights": 64}, outputs=["d:0"], name="m")


def test_tensor_bytes_follow_dtype():
    assert TensorInfo.of((2, 4), "float32").bytes == 32
    assert TensorInfo.of((2, 4), "float16").bytes == 16
    assert TensorInfo.of((2, 4), "bfloat16").bytes == 16
    assert not TensorInfo.of((2,), "int32").differentiable


def test_json_round_trip_keeps_everything():
    g = small_graph()
    back = PlanGraph.from_json(g.to_json())
    assert back.to_dict() == g.to_dict()
    assert back.fingerprint() == g.fingerprint()


def test_json_round_trip_through_a_file(tmp_path):
    g = small_graph()
    path = tmp_path / "g.json"
    g.to_json(str(path))
    assert PlanGraph.from_json(str(path)).node("d").outputs[0].dtype == "bfloat16"


def test_corrupt_json_is_detected():
    data = small_graph().to_dict()
    data["nodes"][1]["inputs"] = []
    with pytest.raises(ValueError, match="fingerprint does not match"):
        PlanGraph.from_dict(data)


def test_fingerprint_ignores_costs_but_not_structure():
    a, b = small_graph(), small_graph()
    b.nodes[1].flops_forward = 1e9
    assert a.fingerprint() == b.fingerprint()
    c = PlanGraph([a.nodes[0], Node("d2", "d2", "Dense", ["in:0"], a.nodes[1].outputs)])
    assert c.fingerprint() != a.fingerprint()


def test_nodes_must_be_topological_and_edges_known():
    n_in = Node("in", "in", "InputLayer", [], [TensorInfo.of((1,), "float32")])
    n_a = Node("a", "a", "Dense", ["b:0"], [TensorInfo.of((1,), "float32")])
    n_b = Node("b", "b", "Dense", ["in:0"], [TensorInfo.of((1,), "float32")])
    with pytest.raises(ValueError, match="topological"):
        PlanGraph([n_in, n_a, n_b])
    with pytest.raises(ValueError, match="unknown node"):
        PlanGraph([n_in, Node("x", "x", "Dense", ["nope:0"], [])])
    with pytest.raises(ValueError, match="Duplicate node id"):
        PlanGraph([n_in, n_b, n_b])


def test_successors_and_consumers():
    g = small_graph()
    assert g.successors() == {"in": ["d"], "d": []}
    assert g.consumers() == {"in:0": ["d"], "d:0": []}
