"""The DQN agent: Algorithm 1 of the paper, fitted Q-iteration with experience replay.

Each episode walks one graph under one budget (`environment.Episode`). At each
node the agent takes a random valid action with probability epsilon, else the
action of highest Q (Eq. 3); epsilon falls linearly from 1 to `EPSILON_MIN`
over the episodes (the paper's `e > episode / l` test). Every transition
`(state, action, reward, next state)` goes into the replay memory, and every
`train_every` steps a mini-batch sampled from it takes one Adam step on Eq. 4:

    loss = (y - Q(g, s_a))^2,   y = r + gamma * max_a' Q(g', s_a')   (Eq. 5)

with y held constant (no gradient flows through it) and y = r at terminal
states. Gradients come from `network.backward`, clipped by global norm.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np

from tfremat.planners.deepq import network
from tfremat.planners.deepq.environment import Episode
from tfremat.planners.deepq.features import ACTION_CODES, NOTHING, GraphView

#: Lowest exploration rate, reached at the last episode.
EPSILON_MIN = 0.05

Task = tuple[GraphView, int]


@dataclasses.dataclass
class Transition:
    """One step of an episode, as the replay memory keeps it.

    Attributes:
        view: The graph.
        x: Node features of the state ("nothing" at the current node).
        current: The node under execution.
        action: The action taken.
        reward: The reward received.
        next_x: Features of the next state, None when it is terminal.
        next_current: Node under execution in the next state.
        next_actions: Actions valid in the next state.
    """

    view: GraphView
    x: np.ndarray
    current: int
    action: int
    reward: float
    next_x: np.ndarray | None
    next_current: int | None
    next_actions: tuple[int, ...]


def with_action(x: np.ndarray, current: int, action: int) -> np.ndarray:
    """`x` with `action`'s type at the current node (the action node's features)."""
    if action == NOTHING:
        return x
    out = x.copy()
    out[current, 4] = ACTION_CODES[action]
    return out


def _state_batch(items: list[tuple[GraphView, np.ndarray, int, tuple[int, ...]]]
                 ) -> tuple[network.Batch, list[int]]:
    """One batch asking Q of every listed action of every state.

    Returns:
        The batch and, per state, how many queries it has (in order).
    """
    copies, queries, counts = [], [], []
    for view, x, c, actions in items:
        g = len(copies)
        copies.append((view, x, c))
        for a in actions:
            if a == NOTHING:
                queries.append((g, g))
            else:
                queries.append((g, len(copies)))
                copies.append((view, with_action(x, c, a), c))
        counts.append(len(actions))
    return network.Batch.of(copies, queries), counts


class Agent:
    """Learns Q values by Algorithm 1 and plans with them.

    Args:
        params: Initial weights (`network.init_params` or loaded ones); the
            agent trains a copy.
        seed: Seed of exploration and replay sampling.
        learning_rate: Adam's step size.
        gamma: Decay factor of Eq. 5.
        batch_size: Transitions per update.
        replay_size: Transitions the replay memory keeps (oldest dropped).
        train_every: Environment steps per update.
        max_grad_norm: Gradients are scaled down to this global norm.

    Example:

    ```python
    agent = Agent(network.init_params(np.random.default_rng(0)), seed=0)
    losses = agent.train([(describe(graph), budget)], episodes=20)
    ```
    """

    def __init__(self, params: network.Params, *, seed: int = 0,
                 learning_rate: float = 1e-3, gamma: float = 0.9, batch_size: int = 32,
                 replay_size: int = 20000, train_every: int = 4,
                 max_grad_norm: float = 5.0) -> None:
        self.params = {k: v.copy() for k, v in params.items()}
        self.rng = np.random.default_rng(seed)
        self.learning_rate = learning_rate
        self.gamma = gamma
        self.batch_size = batch_size
        self.replay_size = replay_size
        self.train_every = train_every
        self.max_grad_norm = max_grad_norm
        self.replay: list[Transition] = []
        self._moments = {k: (np.zeros_like(v), np.zeros_like(v))
                         for k, v in self.params.items()}
        self._updates = 0
        self._steps = 0

    def q_values(self, episode: Episode) -> tuple[list[int], np.ndarray]:
        """Q of every valid action at the episode's current node.

        Returns:
            `(actions, q)`.
        """
        actions = episode.valid_actions()
        batch, _ = _state_batch([(episode.view, episode.features(), episode.current,
                                  tuple(actions))])
        q, _ = network.forward(self.params, batch)
        return actions, q

    def act(self, episode: Episode, epsilon: float = 0.0) -> int:
        """The epsilon-greedy action at the episode's current node."""
        actions, q = self.q_values(episode)
        if self.rng.random() < epsilon:
            return int(self.rng.choice(actions))
        return actions[int(np.argmax(q))]

    def run_episode(self, view: GraphView, budget_bytes: int, epsilon: float,
                    learn: bool = True) -> tuple[Episode, list[float]]:
        """Walks one episode, storing transitions and updating when `learn`.

        Returns:
            The finished episode and the losses of the updates made.
        """
        episode = Episode(view, budget_bytes)
        losses = []
        while not episode.done:
            c, x = episode.current, episode.features()
            action = self.act(episode, epsilon)
            reward = episode.step(action)
            if episode.done:
                nxt, nc, acts = None, None, ()
            else:
                nxt, nc, acts = episode.features(), episode.current, tuple(
                    episode.valid_actions())
            self.replay.append(Transition(view, x, c, action, reward, nxt, nc, acts))
            if len(self.replay) > self.replay_size:
                self.replay.pop(0)
            self._steps += 1
            if learn and self._steps % self.train_every == 0 and \
                    len(self.replay) >= self.batch_size:
                losses.append(self.update())
        return episode, losses

    def update(self) -> float:
        """One Adam step of fitted Q-iteration on a replayed mini-batch.

        Returns:
            The mini-batch's mean squared error before the step.
        """
        picks = self.rng.choice(len(self.replay), self.batch_size, replace=False)
        batch_items = [self.replay[i] for i in picks]
        targets = np.array([t.reward for t in batch_items])
        ahead = [(k, t) for k, t in enumerate(batch_items) if t.next_x is not None]
        if ahead:
            nb, counts = _state_batch([(t.view, t.next_x, t.next_current, t.next_actions)
                                       for _, t in ahead])
            q_next, _ = network.forward(self.params, nb)
            splits = np.split(q_next, np.cumsum(counts)[:-1])
            for (k, _), qs in zip(ahead, splits):
                targets[k] += self.gamma * qs.max()
        batch, _ = _state_batch([(t.view, t.x, t.current, (t.action,))
                                 for t in batch_items])
        q, cache = network.forward(self.params, batch)
        error = q - targets
        grads = network.backward(self.params, batch, cache,
                                 (2.0 * error / len(error)).astype(np.float32))
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        scale = min(1.0, self.max_grad_norm / max(norm, 1e-12))
        self._updates += 1
        b1, b2 = 0.9, 0.999
        for k, g in grads.items():
            m, v = self._moments[k]
            m *= b1
            m += (1 - b1) * scale * g
            v *= b2
            v += (1 - b2) * (scale * g) ** 2
            m_hat = m / (1 - b1 ** self._updates)
            v_hat = v / (1 - b2 ** self._updates)
            self.params[k] -= self.learning_rate * m_hat / (np.sqrt(v_hat) + 1e-8)
        return float(np.mean(error ** 2))

    def train(self, tasks: list[Task] | Callable[[np.random.Generator], Task],
              episodes: int, on_episode: Callable[[int, Episode, list[float]], None]
              | None = None, time_limit: float | None = None) -> list[float]:
        """Algorithm 1 over `episodes` episodes.

        Args:
            tasks: `(view, budget)` pairs to draw from uniformly, or a function
                drawing one from the agent's random generator.
            episodes: Number of episodes.
            on_episode: Called after each episode with its index, the episode
                and its losses.
            time_limit: Seconds after which no further episode starts (None:
                no limit); checked before each episode, so the last one may
                run past it. The agent keeps the weights trained until then.

        Returns:
            The loss of every update, in order.
        """
        end = math.inf if time_limit is None else time.monotonic() + time_limit
        losses: list[float] = []
        for k in range(episodes):
            if time.monotonic() >= end:
                break
            if callable(tasks):
                view, budget = tasks(self.rng)
            else:
                view, budget = tasks[int(self.rng.integers(len(tasks)))]
            epsilon = max(EPSILON_MIN, 1.0 - k / max(episodes, 1))
            episode, found = self.run_episode(view, budget, epsilon)
            losses += found
            if on_episode is not None:
                on_episode(k, episode, found)
        return losses

    def greedy(self, view: GraphView, budget_bytes: int) -> Episode:
        """Walks one episode taking the action of highest Q everywhere (no learning)."""
        episode = Episode(view, budget_bytes)
        while not episode.done:
            episode.step(self.act(episode))
        return episode
