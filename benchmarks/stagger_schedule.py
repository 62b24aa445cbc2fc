"""The env steps of ppo_staggered.py's staggered advance, for the benchmarks' reports (no training, no imports).

Before training, ppo_staggered.stagger_advance steps every env from a common reset and starts group j of the N_B
groups at step (N_B - 1 - j) * S: (N_B - 1) * S steps of all N envs (per rank) that are not trained on and not in
the script's global_step. Every table that compares env steps to a threshold, or returns at a step budget, between
the staggered scheme and another counts them: the user's simulator ran them.
"""

from __future__ import annotations

import math


def advance_env_steps(num_envs: int, horizon: int, num_steps: int, world_size: int = 1) -> int:
    """The env steps (all ranks) of the staggered advance of a run with N = num_envs envs per rank, horizon H and
    rollout length K, as ppo_staggered.resolve_args sets its schedule: N_B = min(ceil(H / K), N) groups, S =
    max(K, floor(H / N_B)) steps apart (S = K with one group); the advance is (N_B - 1) * S * N steps per rank.
    Naive and random-start runs have no advance: their callers count 0. (Before commit e36795f, S was
    max(K, ceil(H / N_B)): the same S wherever H / N_B is a whole number or below K, as in every saved result.)"""
    groups = min(math.ceil(horizon / num_steps), num_envs)
    stagger_step = max(num_steps, horizon // groups) if groups > 1 else num_steps
    return (groups - 1) * stagger_step * num_envs * world_size
