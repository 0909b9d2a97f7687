"""The Q-network of the DQN paper in NumPy: structure2vec node states and Q values.

Node states (Eq. 1, T = 4 iterations from zero states):

    s_v^{t+1} = ReLU(W1 x_v + W2 sum_{u in N(v)} s_u^t + W3 sum_{u in N(v)} ReLU(W4 w(u, v)))

Graph state (Eq. 2), with the MEAN of the node states where the paper sums
them (a departure: a sum grows with the graph, so weights trained on graphs of
tens of nodes would see states many times larger on graphs of hundreds; the
mean keeps one scale for all sizes, which is what training on small graphs and
planning on large ones needs):

    g = [W5 mean_u s_u^T, W6 s_c^T]

Q value of an action node a (Eq. 3):

    Q(g, s_a) = W7 ReLU([g, W8 s_a])

An action node is the node under execution c with the action's type in its
features (`features.GraphView.features`): its state s_a comes from a pass with
that feature set, while g comes from the pass with "nothing" (which is also the
"nothing" action node). Row vectors: `x @ W1` with `W1` of shape (6, p).

Many states are evaluated at once as one disjoint graph (`Batch`); neighbour
sums are segment sums over edges sorted by destination (every node has a
self-loop, so no segment is empty). `backward` is the hand-written gradient of
the Q values with respect to every weight, for training without a deep learning
framework (planners import no TensorFlow).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from tfremat.planners.deepq.features import FEATURES_VERSION, NUM_FEATURES, GraphView

#: structure2vec iterations (the paper's T).
ITERATIONS = 4

#: Width of the node states (the paper's p).
WIDTH = 32

#: The weights, Eq. 1-3.
NAMES = ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8")

Params = dict[str, np.ndarray]


def init_params(rng: np.random.Generator, width: int = WIDTH) -> Params:
    """Random weights, each scaled by 1/sqrt(fan-in).

    Args:
        rng: Random generator.
        width: The width p of node states.

    Returns:
        The weights by name, float32.
    """
    shapes = {"W1": (NUM_FEATURES, width), "W2": (width, width), "W3": (width, width),
              "W4": (width,), "W5": (width, width), "W6": (width, width),
              "W7": (3 * width,), "W8": (width, width)}
    fan_in = {k: 1 if k == "W4" else s[0] for k, s in shapes.items()}
    return {k: rng.normal(0.0, 1.0 / np.sqrt(fan_in[k]), s).astype(np.float32)
            for k, s in shapes.items()}


@dataclasses.dataclass
class Batch:
    """Several graph copies evaluated as one disjoint graph, and the Q values asked.

    Build with `Batch.of`. Each copy is a GraphView with one feature matrix and a
    node under execution; each query asks Q for (the g of one copy, the action
    node of another copy).
    """

    x: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    weight: np.ndarray
    dst_starts: np.ndarray
    src_order: np.ndarray
    src_starts: np.ndarray
    copy_starts: np.ndarray
    copy_sizes: np.ndarray
    current: np.ndarray
    query_g: np.ndarray
    query_a: np.ndarray

    @classmethod
    def of(cls, copies: list[tuple[GraphView, np.ndarray, int]],
           queries: list[tuple[int, int]]) -> "Batch":
        """Joins graph copies into one graph.

        Args:
            copies: `(view, features, current node)` of each copy.
            queries: `(copy giving g, copy giving the action node)` of each Q.
        """
        xs, srcs, dsts, ws, dstarts, sorders, sstarts, starts, sizes, cur = \
            [], [], [], [], [], [], [], [], [], []
        nodes = edges = 0
        for view, x, c in copies:
            xs.append(x)
            srcs.append(view.src + nodes)
            dsts.append(view.dst + nodes)
            ws.append(view.weight)
            dstarts.append(view.dst_starts + edges)
            sorders.append(view.src_order + edges)
            sstarts.append(view.src_starts + edges)
            starts.append(nodes)
            sizes.append(view.size)
            cur.append(nodes + c)
            nodes += view.size
            edges += len(view.src)
        g, a = zip(*queries)
        return cls(np.concatenate(xs).astype(np.float32), np.concatenate(srcs),
                   np.concatenate(dsts), np.concatenate(ws).astype(np.float32),
                   np.concatenate(dstarts), np.concatenate(sorders),
                   np.concatenate(sstarts), np.array(starts), np.array(sizes),
                   np.array(cur), np.array(g), np.array(a))


@dataclasses.dataclass
class Cache:
    """What `forward` keeps for `backward`."""

    edge_hidden: np.ndarray
    edge_sum: np.ndarray
    messages: list[np.ndarray]
    hidden: list[np.ndarray]
    states: np.ndarray
    pooled: np.ndarray
    joint: np.ndarray


def _sum_into_dst(batch: Batch, values: np.ndarray) -> np.ndarray:
    """Per node, the sum of `values` (one row per edge) over its incoming edges."""
    return np.add.reduceat(values, batch.dst_starts, axis=0)


def _sum_into_src(batch: Batch, values: np.ndarray) -> np.ndarray:
    """Per node, the sum of `values` (one row per edge) over its outgoing edges."""
    return np.add.reduceat(values[batch.src_order], batch.src_starts, axis=0)


def forward(params: Params, batch: Batch) -> tuple[np.ndarray, Cache]:
    """Q values of the batch's queries (Eq. 1-3).

    Args:
        params: The weights.
        batch: The graph copies and queries.

    Returns:
        `(q, cache)`: one Q value per query, and what `backward` needs.
    """
    edge_hidden = np.maximum(batch.weight[:, None] * params["W4"][None, :], 0.0)
    edge_sum = _sum_into_dst(batch, edge_hidden)
    constant = batch.x @ params["W1"] + edge_sum @ params["W3"]
    states = np.zeros_like(constant)
    messages, hidden = [], []
    for _ in range(ITERATIONS):
        m = _sum_into_dst(batch, states[batch.src])
        h = constant + m @ params["W2"]
        messages.append(m)
        hidden.append(h)
        states = np.maximum(h, 0.0)
    pooled = np.add.reduceat(states, batch.copy_starts, axis=0) / batch.copy_sizes[:, None]
    joint = np.concatenate([pooled[batch.query_g] @ params["W5"],
                            states[batch.current[batch.query_g]] @ params["W6"],
                            states[batch.current[batch.query_a]] @ params["W8"]], axis=1)
    q = np.maximum(joint, 0.0) @ params["W7"]
    return q, Cache(edge_hidden, edge_sum, messages, hidden, states, pooled, joint)


def backward(params: Params, batch: Batch, cache: Cache, dq: np.ndarray) -> Params:
    """Gradients of `sum(dq * q)` with respect to every weight.

    Args:
        params: The weights `forward` used.
        batch: The batch `forward` evaluated.
        cache: What `forward` returned with the Q values.
        dq: Gradient of the loss with respect to each Q value.

    Returns:
        The gradients by weight name.
    """
    width = params["W2"].shape[0]
    relu_joint = np.maximum(cache.joint, 0.0)
    grads: Params = {"W7": relu_joint.T @ dq}
    djoint = dq[:, None] * params["W7"][None, :] * (cache.joint > 0)
    dg, dc, da = djoint[:, :width], djoint[:, width:2 * width], djoint[:, 2 * width:]
    states = cache.states
    cur_g, cur_a = batch.current[batch.query_g], batch.current[batch.query_a]
    grads["W5"] = cache.pooled[batch.query_g].T @ dg
    grads["W6"] = states[cur_g].T @ dc
    grads["W8"] = states[cur_a].T @ da
    dpooled = np.zeros_like(cache.pooled)
    np.add.at(dpooled, batch.query_g, dg @ params["W5"].T)
    dstates = np.repeat(dpooled / batch.copy_sizes[:, None], batch.copy_sizes, axis=0)
    np.add.at(dstates, cur_g, dc @ params["W6"].T)
    np.add.at(dstates, cur_a, da @ params["W8"].T)
    dconstant = np.zeros_like(dstates)
    grads["W2"] = np.zeros_like(params["W2"])
    for t in reversed(range(ITERATIONS)):
        dh = dstates * (cache.hidden[t] > 0)
        dconstant += dh
        grads["W2"] += cache.messages[t].T @ dh
        if t:
            dstates = _sum_into_src(batch, (dh @ params["W2"].T)[batch.dst])
    grads["W1"] = batch.x.T @ dconstant
    grads["W3"] = cache.edge_sum.T @ dconstant
    dedge = (dconstant @ params["W3"].T)[batch.dst] * (cache.edge_hidden > 0)
    grads["W4"] = batch.weight @ dedge
    return grads


def save_weights(path: str | os.PathLike, params: Params, **meta: int | float | str) -> None:
    """Writes the weights as float32 with `FEATURES_VERSION` and `meta`.

    Args:
        path: The `.npz` file.
        params: The weights.
        **meta: Facts of the training run (seed, episodes, ...).
    """
    np.savez_compressed(path, features_version=FEATURES_VERSION, iterations=ITERATIONS,
                        **{k: params[k].astype(np.float32) for k in NAMES},
                        **{f"meta_{k}": v for k, v in meta.items()})


def load_weights(path: str | os.PathLike) -> tuple[Params, dict[str, object]]:
    """Reads weights `save_weights` wrote.

    Args:
        path: The `.npz` file.

    Returns:
        `(weights as float32, meta)`.

    Raises:
        ValueError: the file was trained for other features or iterations, or
            misses a weight.
    """
    with np.load(path) as data:
        version = int(data["features_version"]) if "features_version" in data else None
        if version != FEATURES_VERSION:
            raise ValueError(
                f"DQN weights {os.fspath(path)!r} were trained for features version "
                f"{version}, but this tfremat computes version {FEATURES_VERSION}: "
                "retrain them with `python -m tfremat.planners.deepq.train`.")
        if int(data["iterations"]) != ITERATIONS:
            raise ValueError(f"DQN weights {os.fspath(path)!r} use "
                             f"{int(data['iterations'])} structure2vec iterations, "
                             f"not {ITERATIONS}.")
        missing = [k for k in NAMES if k not in data]
        if missing:
            raise ValueError(f"DQN weights {os.fspath(path)!r} miss {missing}.")
        params = {k: data[k].astype(np.float32) for k in NAMES}
        meta = {k[5:]: data[k].item() for k in data.files if k.startswith("meta_")}
    return params, meta
