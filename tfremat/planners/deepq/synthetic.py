"""Random PlanGraphs to train the DQN on: chains, residual, U-Net and Transformer-like.

Tensors are float32 of a few MiB and compute is FLOPs, with FLOPs per byte of
output by kind of call (convolutions and matrix products hundreds to thousands,
normalisation and elementwise calls a few), so that at the default device rate
(5e12 FLOP/s) and copy bandwidth (16 GB/s) some copies hide behind compute and
others stall, as on real models. Budgets are drawn between the persistent bytes
and the peak without a plan.
"""

from __future__ import annotations

import numpy as np

from tfremat.core import Node, PlanGraph, TensorInfo
from tfremat.simulation import simulate

MIB = 2**20

#: FLOPs per output byte of each kind of call: (low, high), drawn log-uniformly.
INTENSITY = {"Conv2D": (150.0, 2000.0), "Dense": (100.0, 1500.0),
             "MultiHeadAttention": (200.0, 1500.0), "BatchNormalization": (5.0, 15.0),
             "LayerNormalization": (5.0, 15.0), "ReLU": (1.0, 3.0), "Add": (1.0, 2.0),
             "MaxPooling2D": (2.0, 5.0), "UpSampling2D": (1.0, 3.0),
             "Concatenate": (0.5, 1.0)}

#: What the backward pass of each kind of call reads.
READS = {"Conv2D": "inputs", "Dense": "inputs", "MultiHeadAttention": "inputs",
         "BatchNormalization": "inputs", "LayerNormalization": "inputs", "ReLU": "output",
         "Add": "none", "MaxPooling2D": "inputs", "UpSampling2D": "none",
         "Concatenate": "none"}

FAMILIES = ("chain", "residual", "unet", "transformer")


class _Builder:
    def __init__(self, rng: np.random.Generator, name: str) -> None:
        self.rng = rng
        self.name = name
        self.nodes: list[Node] = []
        self.params = 0

    def input(self, mib: float) -> str:
        self.nodes.append(Node(id="input", layer="input", class_name="InputLayer",
                               inputs=[], outputs=[_tensor(mib)]))
        return "input"

    def call(self, kind: str, inputs: list[str], mib: float) -> str:
        node_id = f"{kind.lower()}_{len(self.nodes)}"
        refs = [f"{i}:0" for i in inputs]
        out = _tensor(mib)
        low, high = INTENSITY[kind]
        flops = out.bytes * float(np.exp(self.rng.uniform(np.log(low), np.log(high))))
        reads = {"inputs": refs, "output": [f"{node_id}:0"], "none": []}[READS[kind]]
        params = int(self.rng.uniform(0.05, 1.0) * MIB) if kind in (
            "Conv2D", "Dense", "MultiHeadAttention") else 0
        self.params += params
        self.nodes.append(Node(
            id=node_id, layer=node_id, class_name=kind, inputs=refs, outputs=[out],
            backward_reads=reads, param_bytes=params, flops_forward=flops,
            flops_backward=2 * flops, inplace=kind in ("ReLU", "Add"),
            backward_workspace_bytes=out.bytes // 4 if kind == "Conv2D" else 0))
        return node_id

    def graph(self, output: str) -> PlanGraph:
        return PlanGraph(self.nodes, outputs=[f"{output}:0"], name=self.name,
                         persistent_bytes={"weights": self.params,
                                           "optimizer": 2 * self.params})


def _tensor(mib: float) -> TensorInfo:
    return TensorInfo.of((max(1, int(mib * MIB / 4)),), "float32")


def chain(rng: np.random.Generator, length: int) -> PlanGraph:
    """Conv-ReLU pairs (some with BatchNormalization) of varying sizes."""
    b = _Builder(rng, f"chain{length}")
    x = b.input(rng.uniform(1, 4))
    while len(b.nodes) < length:
        mib = rng.uniform(1, 8)
        x = b.call(str(rng.choice(["Conv2D", "Dense"])), [x], mib)
        if rng.random() < 0.5:
            x = b.call("BatchNormalization", [x], mib)
        x = b.call("ReLU", [x], mib)
    return b.graph(x)


def residual(rng: np.random.Generator, blocks: int) -> PlanGraph:
    """Residual blocks: conv-BN-ReLU, conv-BN, add, ReLU; sizes shrink by stage."""
    b = _Builder(rng, f"residual{blocks}")
    mib = rng.uniform(4, 12)
    x = b.call("ReLU", [b.input(mib)], mib)
    for k in range(blocks):
        if k and rng.random() < 0.3:
            mib /= 2
            x = b.call("Conv2D", [x], mib)
        h = b.call("ReLU", [b.call("BatchNormalization", [b.call("Conv2D", [x], mib)], mib)],
                   mib)
        h = b.call("BatchNormalization", [b.call("Conv2D", [h], mib)], mib)
        x = b.call("ReLU", [b.call("Add", [h, x], mib)], mib)
    return b.graph(b.call("Dense", [x], 0.1))


def unet(rng: np.random.Generator, depth: int) -> PlanGraph:
    """Encoder halving sizes, decoder concatenating the long skips."""
    b = _Builder(rng, f"unet{depth}")
    mib = rng.uniform(4, 16)
    x, skips = b.input(mib), []

    def block(x: str, mib: float) -> str:
        return b.call("ReLU", [b.call("BatchNormalization", [b.call("Conv2D", [x], mib)],
                                      mib)], mib)

    for _ in range(depth):
        x = block(x, mib)
        skips.append(x)
        mib /= 2
        x = b.call("MaxPooling2D", [x], mib)
    x = block(x, mib)
    for skip in reversed(skips):
        mib *= 2
        x = b.call("Concatenate", [b.call("UpSampling2D", [x], mib), skip], 2 * mib)
        x = block(x, mib)
    return b.graph(b.call("Conv2D", [x], mib / 4))


def transformer(rng: np.random.Generator, blocks: int) -> PlanGraph:
    """Attention, add & norm, feed-forward (4x wide), add & norm, per block."""
    b = _Builder(rng, f"transformer{blocks}")
    mib = rng.uniform(2, 8)
    x = b.call("Dense", [b.input(mib / 4)], mib)
    for _ in range(blocks):
        h = b.call("MultiHeadAttention", [x], mib)
        x = b.call("LayerNormalization", [b.call("Add", [x, h], mib)], mib)
        h = b.call("Dense", [b.call("ReLU", [b.call("Dense", [x], 4 * mib)], 4 * mib)], mib)
        x = b.call("LayerNormalization", [b.call("Add", [x, h], mib)], mib)
    return b.graph(b.call("Dense", [x], 0.1))


def random_graph(rng: np.random.Generator, min_nodes: int = 12,
                 max_nodes: int = 60) -> PlanGraph:
    """A graph of a random family with about `min_nodes` to `max_nodes` calls.

    Args:
        rng: Random generator.
        min_nodes: Fewest calls (about).
        max_nodes: Most calls (about).

    Returns:
        The PlanGraph.
    """
    family = FAMILIES[rng.integers(len(FAMILIES))]
    size = int(rng.integers(min_nodes, max_nodes + 1))
    if family == "chain":
        return chain(rng, size)
    if family == "residual":
        return residual(rng, max(1, size // 7))
    if family == "unet":
        return unet(rng, int(np.clip(size // 9, 1, 5)))
    return transformer(rng, max(1, size // 8))


def random_budget(rng: np.random.Generator, graph: PlanGraph, low: float = 0.35,
                  high: float = 0.9) -> int:
    """A budget removing a random share of the activation memory.

    Args:
        rng: Random generator.
        graph: The PlanGraph.
        low: Smallest share of the activation peak kept.
        high: Largest share kept.

    Returns:
        Persistent bytes plus a share in `[low, high]` of the activation peak.
    """
    est = simulate(graph)
    return int(est.persistent_bytes + rng.uniform(low, high) * est.activation_peak_bytes)
