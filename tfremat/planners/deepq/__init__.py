"""The DQN planner: swap and recompute planned by a deep Q-network (the fourth seed).

Chen, *GPU Memory Management for Neural Networks Using Deep Q-Network*: each
layer call gets six features (`features.py`), structure2vec embeds them and Q
values rank the actions swap-out, remove (recompute) and nothing
(`network.py`, NumPy, with a hand-written backward pass), episodes run on
tfremat's simulator (`environment.py`), and fitted Q-iteration with experience
replay trains the weights (`agent.py`, Algorithm 1) on synthetic graphs
(`synthetic.py`, `train.py`). `planner.py` is the planner, `dqn`.

Departures from the paper, each explained where it is made: the graph state
averages the node states instead of summing them (`network.py`); the reward
adds a shaping term for memory over the budget and is clipped (`environment.py`);
the nodes are Keras layer calls rather than GPU memory operations (`features.py`).
"""

from tfremat.planners.deepq.planner import SHIPPED_WEIGHTS, dqn

__all__ = ["SHIPPED_WEIGHTS", "dqn"]
