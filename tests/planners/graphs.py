"""Synthetic PlanGraphs for planner tests: chains, residual blocks, U-Net skips,
DenseNet concatenations, shared layers, subclassed blocks and random DAGs.

Sizes are in MiB-scale float32 tensors so budgets read naturally in MiB.
"""

from __future__ import annotations

import random

from tfremat.core import Node, PlanGraph, TensorInfo

MIB = 2**20
_ELEMS = MIB // 4  # float32 elements in one MiB


class Builder:
    """Appends nodes in topological order; each node makes one float32 tensor."""

    def __init__(self, name: str = "synthetic") -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.calls: dict[str, int] = {}

    def input(self, mib: float = 1.0) -> str:
        return self._add("input", "InputLayer", [], mib, cost=0.0)

    def layer(self, class_name: str, inputs: list[str], *, mib: float = 1.0,
              cost: float = 1.0, reads: str = "inputs", params: int = 0,
              layer: str | None = None, saved_mib: float = 0.0) -> str:
        """Adds a call; `reads` is what its backward keeps: inputs/output/none."""
        return self._add(layer or class_name.lower(), class_name, inputs, mib, cost,
                         reads, params, saved_mib, named=layer is not None)

    def _add(self, base: str, class_name: str, inputs: list[str], mib: float,
             cost: float, reads: str = "none", params: int = 0,
             saved_mib: float = 0.0, named: bool = False) -> str:
        k = self.calls.get(base, 0)
        self.calls[base] = k + 1
        if named:
            node_id = f"{base}@{k}"
        else:
            node_id = f"{base}_{k}" if k else base
        refs = [f"{i}:0" for i in inputs]
        own = f"{node_id}:0"
        backward_reads = {"inputs": refs, "output": [own], "none": []}[reads]
        self.nodes.append(Node(
            id=node_id, layer=base if named else node_id, class_name=class_name,
            inputs=refs, outputs=[TensorInfo.of((int(mib * _ELEMS),), "float32")],
            backward_reads=list(backward_reads),
            internal_saved_bytes=int(saved_mib * MIB), param_bytes=params,
            flops_forward=cost, flops_backward=2 * cost))
        return node_id

    def graph(self, outputs: list[str], persistent_mib: float = 0.0) -> PlanGraph:
        return PlanGraph(nodes=self.nodes, outputs=[f"{o}:0" for o in outputs],
                         persistent_bytes={"weights": int(persistent_mib * MIB)},
                         name=self.name)


def chain(n: int, mib: float = 1.0, persistent_mib: float = 0.0) -> PlanGraph:
    """Input followed by `n` dense-like calls, each reading its input."""
    b = Builder("chain")
    x = b.input(mib)
    for _ in range(n):
        x = b.layer("Dense", [x], mib=mib, cost=10.0, params=1024)
    return b.graph([x], persistent_mib)


def conv_bn_relu(b: Builder, x: str, mib: float = 1.0, bn_saved_mib: float = 0.0) -> str:
    x = b.layer("Conv2D", [x], mib=mib, cost=100.0 * mib, params=4096)
    x = b.layer("BatchNormalization", [x], mib=mib, cost=2.0 * mib, saved_mib=bn_saved_mib)
    return b.layer("ReLU", [x], mib=mib, cost=0.5 * mib, reads="output")


def resnet_like(blocks: int, mib: float = 1.0, bn_saved_mib: float = 0.0) -> PlanGraph:
    """Residual blocks of conv-bn-relu, conv-bn-relu, conv-bn, add, relu (10 nodes).

    `bn_saved_mib`: internal bytes each BatchNormalization keeps for backward.
    """
    b = Builder("resnet")
    x = b.input(mib)
    for _ in range(blocks):
        h = conv_bn_relu(b, x, mib, bn_saved_mib)
        h = conv_bn_relu(b, h, mib, bn_saved_mib)
        h = b.layer("Conv2D", [h], mib=mib, cost=100.0 * mib, params=4096)
        h = b.layer("BatchNormalization", [h], mib=mib, cost=2.0 * mib,
                    saved_mib=bn_saved_mib)
        x = b.layer("Add", [h, x], mib=mib, cost=0.2 * mib, reads="none")
        x = b.layer("ReLU", [x], mib=mib, cost=0.5 * mib, reads="output")
    return b.graph([x], persistent_mib=4.0)


def frozen_backbone(frozen: int, trainable: int, mib: float = 1.0) -> PlanGraph:
    """`resnet_like` blocks whose first `frozen` have no trainable weights (a
    backbone frozen for fine-tuning: no gradient reaches them), then
    `trainable` blocks and a Dense head. Each convolution keeps half its
    output's bytes inside for its backward pass."""
    b = Builder("frozen")
    x = b.input(mib)
    for k in range(frozen + trainable):
        params = 4096 if k >= frozen else 0
        h = x
        for _ in range(2):
            h = b.layer("Conv2D", [h], mib=mib, cost=100.0 * mib, params=params,
                        saved_mib=mib / 2)
            h = b.layer("ReLU", [h], mib=mib, cost=0.5 * mib, reads="output")
        x = b.layer("ReLU", [b.layer("Add", [h, x], mib=mib, cost=0.2 * mib, reads="none")],
                    mib=mib, cost=0.5 * mib, reads="output")
    x = b.layer("Dense", [x], mib=0.01, cost=1.0, params=1024)
    return b.graph([x], persistent_mib=4.0)


def subclassed_blocks(blocks: int = 6) -> PlanGraph:
    """A subclassed model of blocks (one node per block call, `metadata
    ["subclassed"]`), each keeping 3 MiB of its own for its backward pass."""
    b = Builder("blocks")
    x = b.input(1.0)
    for _ in range(blocks):
        x = b.layer("Block", [x], mib=1.0, cost=100.0, params=4096, saved_mib=3.0)
    graph = b.graph([x], persistent_mib=1.0)
    graph.metadata["subclassed"] = True
    return graph


def unet_like(depth: int, mib: float = 4.0) -> PlanGraph:
    """Encoder halving sizes, decoder concatenating the long skip connections."""
    b = Builder("unet")
    x = b.input(mib)
    skips, size = [], mib
    for _ in range(depth):
        x = conv_bn_relu(b, x, size)
        skips.append(x)
        size /= 2
        x = b.layer("MaxPooling2D", [x], mib=size, cost=size, reads="inputs")
    x = conv_bn_relu(b, x, size)
    for skip in reversed(skips):
        size *= 2
        x = b.layer("UpSampling2D", [x], mib=size, cost=size, reads="none")
        x = b.layer("Concatenate", [x, skip], mib=2 * size, cost=0.1, reads="none")
        x = conv_bn_relu(b, x, size)
    return b.graph([x], persistent_mib=2.0)


def densenet_like(layers: int, mib: float = 1.0) -> PlanGraph:
    """A dense block: every layer reads the concatenation of all earlier ones."""
    b = Builder("densenet")
    feats = [b.input(mib)]
    x = feats[0]
    for _ in range(layers):
        h = conv_bn_relu(b, x, mib)
        feats.append(h)
        x = b.layer("Concatenate", list(feats), mib=mib * len(feats), cost=0.1,
                    reads="none")
    x = b.layer("Dense", [x], mib=0.5, cost=50.0, params=1024)
    return b.graph([x], persistent_mib=1.0)


def shared_layers(n_blocks: int = 6) -> PlanGraph:
    """A chain that calls one Dense layer (`shared`) at three places."""
    b = Builder("shared")
    x = b.input()
    for i in range(n_blocks):
        x = b.layer("Dense", [x], cost=10.0, params=1024)
        x = b.layer("ReLU", [x], cost=0.5, reads="output")
        if i % 2 == 1:
            x = b.layer("Dense", [x], cost=10.0, params=1024 if i == 1 else 0,
                        layer="shared")
    return b.graph([x], persistent_mib=1.0)


def random_dag(seed: int, n: int, extra_edges: int = 3) -> PlanGraph:
    """A chain of `n` calls plus random skip edges, random sizes and costs."""
    rng = random.Random(seed)
    b = Builder(f"random{seed}")
    ids = [b.input(rng.choice([0.5, 1.0]))]
    skips: dict[int, list[int]] = {}
    for _ in range(extra_edges):
        if n >= 3:
            src = rng.randrange(1, n - 1)
            dst = rng.randrange(src + 2, n + 1) if src + 2 <= n else n
            skips.setdefault(dst, []).append(src)
    for i in range(1, n + 1):
        inputs = [ids[i - 1]] + [ids[s] for s in skips.get(i, []) if s < i - 1]
        ids.append(b.layer(rng.choice(["Dense", "ReLU", "Add"]), inputs,
                           mib=rng.choice([0.5, 1.0, 2.0]),
                           cost=float(rng.choice([1, 2, 5, 10])),
                           reads=rng.choice(["inputs", "output"]), params=256))
    return b.graph([ids[-1]], persistent_mib=0.5)
