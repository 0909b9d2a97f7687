"""A small GPT-style language model trained under a memory budget.

Token and position embeddings, pre-norm transformer blocks with causal
self-attention and dropout, a softmax over the vocabulary. The `Planner`
plans at the first batch; dropout stays exact under recomputation (the
recompute replays the forward pass's mask).

    python examples/transformer_lm.py            # 4 blocks, 256 tokens, batch 16
    python examples/transformer_lm.py --smoke    # tiny, a few seconds

The full size takes 2-3 minutes on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to the token embeddings."""

    def __init__(self, length: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.length, self.dim = length, dim

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.length, self.dim), name="table")

    def call(self, x):
        return x + self.table

    def get_config(self):
        return {**super().get_config(), "length": self.length, "dim": self.dim}


def gpt(vocab: int, length: int, dim: int, heads: int, blocks: int,
        dropout: float = 0.1) -> keras.Model:
    tokens = keras.Input((length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, dim, name="embed")(tokens)
    x = PositionEmbedding(length, dim, name="positions")(x)
    for b in range(blocks):
        # Causal self-attention: position t attends to positions <= t only.
        h = keras.layers.LayerNormalization(name=f"b{b}_ln1")(x)
        h = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=dropout,
                                            name=f"b{b}_attn")(h, h, use_causal_mask=True)
        x = keras.layers.Add(name=f"b{b}_res1")([x, h])
        h = keras.layers.LayerNormalization(name=f"b{b}_ln2")(x)
        h = keras.layers.Dense(4 * dim, activation="gelu", name=f"b{b}_mlp1")(h)
        h = keras.layers.Dense(dim, name=f"b{b}_mlp2")(h)
        h = keras.layers.Dropout(dropout, name=f"b{b}_drop")(h)
        x = keras.layers.Add(name=f"b{b}_res2")([x, h])
    x = keras.layers.LayerNormalization(name="ln_out")(x)
    logits = keras.layers.Dense(vocab, name="logits")(x)
    return keras.Model(tokens, logits, name="gpt")



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        vocab, length, dim, heads, blocks, batch, steps = 64, 64, 32, 2, 2, 8, 2
    else:
        vocab, length, dim, heads, blocks, batch, steps = 2000, 256, 256, 4, 4, 16, 16

    keras.utils.set_random_seed(0)
    model = gpt(vocab, length, dim, heads, blocks)
    # No metrics: the loss is all the Planner needs.
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    # Synthetic text: predict the next token of random sequences.
    rng = np.random.default_rng(0)
    text = rng.integers(0, vocab, (batch * steps, length + 1)).astype("int32")
    x, y = text[:, :-1], text[:, 1:]

    # A budget below what the plain step needs: halfway between its predicted
    # peak and the lowest peak chen-sqrt reaches.
    graph = tfremat.extract(model, batch_size=batch)
    plain = tfremat.simulate(graph)
    budget = (plain.peak_bytes + min_feasible_budget(graph, "chen-sqrt")) / 2 / 2**20
    print(f"{model.name}: {blocks} blocks, {length} tokens, batch {batch}; plain step "
          f"predicted {plain.peak_mb:.1f} MiB, budget {budget:.1f} MiB")

    planner = tfremat.Planner(budget, verbose=0)
    history = model.fit(x, y, batch_size=batch, epochs=2, verbose=0, callbacks=[planner])
    print(f"plan: {planner.plan.planner}, {len(planner.plan.segments)} segments, "
          f"predicted {planner.predicted_peak_mb:.1f} MiB "
          f"(+{planner.plan.estimates.overhead:.0%} compute)")
    for epoch, (loss, peak) in enumerate(zip(history.history["loss"],
                                             history.history["peak_memory_mb"])):
        print(f"epoch {epoch}: loss {loss:.3f}, measured peak {peak:.1f} MiB")
    # An epoch's peak includes its first step (tracing, first-use allocations).
    if planner.plan_peak_mb is not None:
        verdict = "within" if planner.plan_peak_mb <= budget else "OVER"
        print(f"final plan, its first step left out: measured peak "
              f"{planner.plan_peak_mb:.1f} MiB, {verdict} the budget; "
              f"re-planned {planner.replans}x")


if __name__ == "__main__":
    main()
