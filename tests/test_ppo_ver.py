"""ppo_ver.py: sequences and packing, the packed LSTM, GAE over variable-length sequences, VER minibatches,
importance weights, the PPO loss and learned entropy coefficient, the preemption rules, the recurrent collector
(VER, NoVER, sync; inflight actions; --bootstrap-at-done) against a step-by-step recomputation, the observation
normalizer (obs_rms: statistics, DD-PPO merge, what the collector and evaluate feed the policy), argument validation
(flags that would do nothing, checkpoints of other files), the progress line, checkpoints (generators, the toy chains'
states from the workers), and runs as a user runs the script (ToyChain with heterogeneous step times, ManiSkill,
--recurrent, resume and --evaluate, torchrun with a straggling rank, worker crashes, Ctrl-C at start, in training and
in an evaluation)."""

import copy
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import DEVICES, ROOT

import ppo_ver as ver
from toy_chain_env import ToyChainWorkerConfig, draw_target_actions

GAMMA, LAM = 0.9, 0.8


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny networks: one thread is fastest, and robust on a machine shared with the env workers of the smoke runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------------------
# Sequences, packing, the packed LSTM
# ----------------------------------------------------------------------------------------------------------------------
def test_build_sequences_groups_env_episodes_in_time_order():
    env_ids = np.array([0, 1, 0, 1, 0, 2, 0, 1])
    episode_ids = np.array([3, 5, 3, 6, 4, 0, 4, 6])
    order, lengths = ver.build_sequences(env_ids, episode_ids)
    # env 0 episode 3: steps 0, 2 | env 0 episode 4: 4, 6 | env 1 episode 5: 1 | env 1 episode 6: 3, 7 | env 2: 5
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 7, 5]
    assert lengths.tolist() == [2, 2, 1, 2, 1]


def test_pack_layout_hand_worked_and_matches_torch_pack_sequence():
    lengths = np.array([2, 4, 1, 3])
    select, batch_sizes, sorted_sequences = ver.pack_layout(lengths)
    # flat: seq0 = 0,1 | seq1 = 2,3,4,5 | seq2 = 6 | seq3 = 7,8,9; by length: seq1, seq3, seq0, seq2
    assert sorted_sequences.tolist() == [1, 3, 0, 2]
    assert batch_sizes.tolist() == [4, 3, 2, 1]
    assert select.tolist() == [2, 7, 0, 6, 3, 8, 1, 4, 9, 5]
    assert ver.sequence_starts(lengths).tolist() == [0, 2, 6, 7] and ver.sequence_starts([]).tolist() == []
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 12, size=rng.integers(1, 9))
        flat = torch.arange(int(lengths.sum()))
        pieces = list(torch.split(flat, lengths.tolist()))
        reference = torch.nn.utils.rnn.pack_sequence(pieces, enforce_sorted=False)
        select, batch_sizes, _ = ver.pack_layout(lengths)
        assert torch.equal(flat[select], reference.data)
        assert batch_sizes.tolist() == reference.batch_sizes.tolist()


def make_agent(obs_dim=3, act_dim=4, recurrent=True, continuous=False):
    import gymnasium as gym

    torch.manual_seed(0)
    obs_space = gym.spaces.Box(-1, 1, (obs_dim,))
    act_space = gym.spaces.Box(-1, 1, (act_dim,)) if continuous else gym.spaces.Discrete(act_dim)
    return ver.Agent(
        obs_space,
        act_space,
        recurrent,
        ent_coef=0.01,
        learned_ent_coef=False,
        hidden_sizes=(16,),
        lstm_hidden_size=8,
        lstm_layers=2,
    )


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_packed_forward_equals_step_by_step_with_resets_at_episode_starts(device, continuous):
    """Fig. 3C: running pieces of sequences as one PackedSequence, each from its stored state, gives exactly the
    step-by-step outputs of an LSTM whose state is zeroed at episode starts (habitat-lab's test of the same)."""
    agent = make_agent(continuous=continuous).to(device).double()
    rng = np.random.default_rng(1)
    n_envs, steps = 5, 23
    obs = torch.as_tensor(rng.normal(size=(steps, n_envs, 3)), device=device)
    if continuous:
        actions = torch.as_tensor(rng.normal(size=(steps, n_envs, 4)), device=device)
    else:
        actions = torch.as_tensor(rng.integers(0, 4, size=(steps, n_envs)), device=device)
    starts = rng.random((steps, n_envs)) < 0.15
    starts[0] = True
    # Step by step: reset the state at episode starts; remember the state each step acted from.
    state = agent.initial_state(n_envs, device)
    state = (state[0].double(), state[1].double())
    stored_h, stored_c, ref_logprob, ref_entropy, ref_value = [], [], [], [], []
    with torch.no_grad():
        for t in range(steps):
            keep = torch.as_tensor(~starts[t], device=device, dtype=torch.float64).view(1, -1, 1)
            state = (state[0] * keep, state[1] * keep)
            stored_h.append(state[0].transpose(0, 1))
            stored_c.append(state[1].transpose(0, 1))
            dist, value, state = agent.step(obs[t], state)
            ref_logprob.append(dist.log_prob(actions[t])), ref_entropy.append(dist.entropy()), ref_value.append(value)
    ref = [torch.stack(x) for x in (ref_logprob, ref_entropy, ref_value)]  # (steps, n_envs)
    stored_h, stored_c = torch.stack(stored_h), torch.stack(stored_c)  # (steps, n_envs, layers, hidden)

    # Pieces: split every env's stream at episode starts and at random cuts (as minibatch cuts split sequences).
    cuts = starts | (rng.random((steps, n_envs)) < 0.1)
    pieces = []
    for e in range(n_envs):
        begin = 0
        for t in range(1, steps + 1):
            if t == steps or cuts[t, e]:
                pieces.append([(u, e) for u in range(begin, t)])
                begin = t
    rng.shuffle(pieces)
    flat = [step for piece in pieces for step in piece]
    t_idx = torch.tensor([t for t, _ in flat], device=device)
    e_idx = torch.tensor([e for _, e in flat], device=device)
    first = [piece[0] for piece in pieces]
    state0 = tuple(s[[t for t, _ in first], [e for _, e in first]].transpose(0, 1) for s in (stored_h, stored_c))
    with torch.no_grad():
        logprob, entropy, value = agent.evaluate(
            obs[t_idx, e_idx], actions[t_idx, e_idx], state0, np.array([len(p) for p in pieces])
        )
    for got, expected in zip((logprob, entropy, value), ref):
        torch.testing.assert_close(got, expected[t_idx, e_idx], rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------------------------------------------------
# GAE over variable-length sequences
# ----------------------------------------------------------------------------------------------------------------------
def reference_gae_per_env(rewards, values, next_values, done, gamma, lam):
    """Independent reference on one env's steps in time order (one rollout): sum (gamma lam)^l delta_{t+l} until
    the episode or the rollout ends (next_values: 0 after a termination that bootstraps nothing)."""
    n = len(rewards)
    adv = np.zeros(n)
    for t in range(n):
        total, coef = 0.0, 1.0
        for u in range(t, n):
            total += coef * (rewards[u] + gamma * next_values[u] - values[u])
            if done[u]:
                break
            coef *= gamma * lam
        adv[t] = total
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gae_on_variable_length_sequences_equals_a_per_env_reference(seed):
    """A VER rollout: envs with different numbers of steps, interleaved in collection order, episodes ending by
    termination or truncation anywhere; sequences -> packed GAE -> back, against a per-env loop."""
    rng = np.random.default_rng(seed)
    n_envs = 6
    steps_per_env = rng.integers(1, 25, size=n_envs)  # no per-env constraint (Sec. 2.2)
    env_ids = rng.permutation(np.repeat(np.arange(n_envs), steps_per_env))  # collection order
    n = len(env_ids)
    rewards, values, next_values = rng.normal(size=n), rng.normal(size=n), rng.normal(size=n)
    terminated = rng.random(n) < 0.08
    truncated = (rng.random(n) < 0.08) & ~terminated
    done = terminated | truncated
    episode_ids = np.zeros(n, dtype=np.int64)
    for e in range(n_envs):  # the episode counter of each env goes up after each of its episode ends
        rows = np.flatnonzero(env_ids == e)
        episode_ids[rows] = np.concatenate([[0], np.cumsum(done[rows])[:-1]])
    expected = np.zeros(n)
    for e in range(n_envs):
        rows = np.flatnonzero(env_ids == e)
        expected[rows] = reference_gae_per_env(
            rewards[rows], values[rows], next_values[rows] * ~terminated[rows], done[rows], GAMMA, LAM
        )

    order, lengths = ver.build_sequences(env_ids, episode_ids)
    select, batch_sizes, _ = ver.pack_layout(lengths)
    t = lambda x: torch.as_tensor(x[order][select], dtype=torch.float64)  # noqa: E731
    packed = ver.compute_gae_packed(t(rewards), t(values), t(next_values * ~terminated), batch_sizes, GAMMA, LAM)
    advantages = torch.empty_like(packed)
    advantages[torch.as_tensor(select)] = packed  # back to sequence order
    got = np.empty(n)
    got[order] = advantages.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)


def test_gae_packed_hand_worked():
    # Two sequences: A = [r 1, 2] ends by termination; B = [r 3] cut by the rollout end, bootstrap V' = 2.5.
    # Packed: t0: A0, B0 | t1: A1. V = [0.5, 1.0 | 1.5].
    select, batch_sizes, _ = ver.pack_layout(np.array([2, 1]))
    assert select.tolist() == [0, 2, 1]
    f = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    adv = ver.compute_gae_packed(f(1, 3, 2), f(0.5, 1.5, 1.0), f(1.0, 2.5, 0.0), batch_sizes, GAMMA, LAM)
    # A1 = 2 - 1 = 1 (terminal: next value 0); A0 = (1 + .9*1 - .5) + .72*1 = 2.12; B0 = 3 + .9*2.5 - 1.5 = 3.75
    np.testing.assert_allclose(adv.numpy(), [2.12, 3.75, 1.0])


# ----------------------------------------------------------------------------------------------------------------------
# Minibatches, importance weights, preemption, filling
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_minibatches_cover_every_step_once_in_equal_sizes_and_split_sequences_only_at_cuts(seed):
    rng = np.random.default_rng(seed)
    num_minibatches = int(rng.integers(1, 6))
    lengths = rng.integers(1, 30, size=int(rng.integers(3, 40)))
    lengths[-1] += (-lengths.sum()) % num_minibatches  # total divisible by the number of minibatches
    total = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    sequence_of = np.repeat(np.arange(len(lengths)), lengths)
    minibatches = ver.make_minibatches(lengths, num_minibatches, rng)
    assert len(minibatches) == num_minibatches
    seen = np.concatenate([idx for idx, _ in minibatches])
    assert sorted(seen.tolist()) == list(range(total))  # every step exactly once per epoch
    assert {len(idx) for idx, _ in minibatches} == {total // num_minibatches}  # equal sizes
    n_pieces = 0
    for idx, piece_lengths in minibatches:
        assert piece_lengths.sum() == len(idx) and (piece_lengths > 0).all()
        for piece in np.split(idx, np.cumsum(piece_lengths)[:-1]):
            # a piece is a contiguous run of one sequence, in time order
            assert len(set(sequence_of[piece])) == 1 and (np.diff(piece) == 1).all()
            n_pieces += 1
    # Sequences are split only where a cut falls inside them: at most num_minibatches - 1 extra pieces.
    cuts_inside = 0
    for idx, _ in minibatches[1:]:
        first = idx[0]
        cuts_inside += first != starts[sequence_of[first]]
    assert n_pieces == len(lengths) + cuts_inside <= len(lengths) + num_minibatches - 1
    # Shuffled: another seed orders the sequences differently.
    other = ver.make_minibatches(lengths, num_minibatches, np.random.default_rng(seed + 100))
    assert not np.array_equal(np.concatenate([i for i, _ in other]), seen)


def test_importance_weights_hand_worked():
    # T = 4 steps per env expected; env 0 gave 8 (w = 0.5), env 1 gave 4 (w = 1), env 2 gave 2 (T/n = 2, clipped to 1).
    env_ids = torch.tensor([0] * 8 + [1] * 4 + [2] * 2)
    w = ver.importance_weights(env_ids, num_envs=3, num_steps=4, clip_max=1.0)
    assert w.tolist() == [0.5] * 8 + [1.0] * 4 + [1.0] * 2
    w = ver.importance_weights(env_ids, num_envs=3, num_steps=4, clip_max=1.5)
    assert w.tolist() == [0.5] * 8 + [1.0] * 4 + [1.5] * 2
    # NoVER / sync: T steps from every env, all weights 1.
    assert ver.importance_weights(torch.arange(3).repeat(4), 3, 4).tolist() == [1.0] * 12


def ppo_update_inputs(learned_ent_coef):
    """A one-minibatch PPO update on a hand-made batch: an MLP agent, behaviour log-probabilities that differ from the
    current policy (ratios != 1, some clipped) and importance weights that differ per step."""
    import gymnasium as gym

    torch.manual_seed(0)
    agent = ver.Agent(
        gym.spaces.Box(-1, 1, (3,)),
        gym.spaces.Discrete(4),
        False,
        ent_coef=0.5,
        learned_ent_coef=learned_ent_coef,
        hidden_sizes=(16,),
    )
    n = 10
    obs, actions = torch.randn(n, 3), torch.randint(0, 4, (n,))
    with torch.no_grad():
        logprob, _, value = agent.evaluate(obs, actions)
    x = torch.linspace(-1, 1, n)
    batch = dict(
        obs=obs,
        actions=actions,
        logprobs=logprob + 0.3 * x - 0.1,  # ratios exp(0.1 - 0.3 x): some clipped, old_approx_kl != 0
        values=value + 0.1 * x,
        advantages=torch.randn(n),
        returns=value + torch.randn(n),
        weights=torch.linspace(0.2, 1.0, n),
        hidden=None,
        lengths=np.array([4, 6]),
        env_ids=torch.zeros(n, dtype=torch.int64),
    )
    args = replace(
        ver.Args(),
        update_epochs=1,
        num_minibatches=1,
        max_grad_norm=1e9,
        ent_coef=0.5,
        learned_ent_coef=learned_ent_coef,
        target_entropy=0.7,
        clip_coef=0.2,
        vf_coef=0.5,
    )
    return agent, batch, args


@pytest.mark.parametrize("learned_ent_coef", [False, True])
def test_ppo_update_gradient_equals_the_weighted_losses_of_sec_4(learned_ent_coef):
    """The gradients of one PPO minibatch update equal those of the Sec. 4 loss written out independently: every term
    weighted by the truncated importance weights w, the entropy bonus scaled by the stop-gradient alpha, and (learned
    coefficient) alpha * ([unweighted mean entropy]_sg - lambda) as the only loss on log alpha."""
    agent, batch, args = ppo_update_inputs(learned_ent_coef)
    reference = copy.deepcopy(agent)
    logprob, entropy, value = reference.evaluate(batch["obs"], batch["actions"])
    ratio, w, adv = (logprob - batch["logprobs"]).exp(), batch["weights"], batch["advantages"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # advantages are normalized per minibatch
    surrogate = torch.minimum(adv * ratio, adv * ratio.clamp(0.8, 1.2))
    v_loss = 0.5 * (value - batch["returns"]) ** 2
    alpha = reference.log_ent_coef.exp() if learned_ent_coef else torch.tensor(args.ent_coef)  # fixed: --ent-coef
    loss = (
        -(w * surrogate).sum() / len(w)
        + 0.5 * (w * v_loss).sum() / len(w)
        - alpha.detach() * (w * entropy).sum() / len(w)
    )
    h = entropy.sum() / len(w)  # unweighted: the importance weights (< 1 here) would bias it low
    if learned_ent_coef:
        loss = loss + alpha * (h.detach() - 0.7)
    loss.backward()

    optimizer = torch.optim.SGD(agent.parameters(), lr=0.0)  # lr 0: the weights stay, their gradients are compared
    out = ver.ppo_update(args, agent, optimizer, batch, np.random.default_rng(0))
    for (name, p), p_ref in zip(agent.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
    assert 0 < out["losses/clipfrac"] < 1  # some ratios were clipped, so the clipped branch was exercised
    logratio = (logprob - batch["logprobs"]).detach()
    expected = {  # the update's statistics, each under its own name
        "losses/policy_loss": -(w * surrogate).mean(),
        "losses/value_loss": (w * v_loss).mean(),
        "losses/entropy": entropy.mean(),
        "losses/old_approx_kl": (-logratio).mean(),
        "losses/approx_kl": ((ratio - 1) - logratio).mean(),
        "losses/clipfrac": ((ratio - 1).abs() > 0.2).float().mean(),
    }
    for name, value in expected.items():
        assert out[name] == pytest.approx(float(value.detach()), rel=1e-5, abs=1e-7), name
    if learned_ent_coef:  # d/d log(alpha) of alpha * (H - lambda) = alpha * (H - lambda)
        torch.testing.assert_close(agent.log_ent_coef.grad, (0.5 * (h - 0.7)).detach())


def test_learned_entropy_coefficient_moves_towards_the_target_and_stays_in_its_bounds():
    """alpha grows while the policy's entropy is below the target and shrinks while it is above (Sec. 4), and stays
    within [1e-4, 1] (habitat-lab's bounds) however long it is pushed."""
    for target, direction, bound in ((10.0, 1, 1.0), (0.0, -1, 1e-4)):  # 4 actions: entropy <= log 4 = 1.39
        agent, batch, args = ppo_update_inputs(True)
        args = replace(args, target_entropy=target)
        before = float(agent.log_ent_coef.detach())
        optimizer = torch.optim.Adam(agent.parameters(), lr=0.01)
        ver.ppo_update(args, agent, optimizer, batch, np.random.default_rng(0))
        assert direction * (float(agent.log_ent_coef.detach()) - before) == pytest.approx(
            0.01, rel=1e-3
        )  # Adam's first step
        optimizer = torch.optim.SGD(agent.parameters(), lr=100.0)
        for _ in range(3):
            ver.ppo_update(args, agent, optimizer, batch, np.random.default_rng(0))
        assert float(agent.log_ent_coef.detach().exp()) == pytest.approx(bound, rel=1e-5)


def test_preemption_rule_hand_worked():
    # Two ranks with one env each, steps of 1 s and 2 s, T x N = 4 per rank, LT = 2 s:
    # S(t) = min(4, t) + min(4, t // 2): S/(t+2) = 1/3, 3/4, 4/5, 6/6, 7/8, 8/10 at t = 1, 2, 3, 4, 6, 8.
    t_star, steps, t_full = ver.optimal_preemption_time(np.array([[1.0], [2.0]]), 4, None, 2.0)
    assert (t_star, steps, t_full) == (4.0, 6, 8.0)
    # A long learning phase makes waiting for the straggler worth it.
    t_star, steps, t_full = ver.optimal_preemption_time(np.array([[1.0], [2.0]]), 4, None, 100.0)
    assert (t_star, steps) == (8.0, 8)
    # One rank: S(t) / (t + LT) grows until the batch is full, so VER on one GPU is never preempted.
    rng = np.random.default_rng(0)
    t_star, steps, t_full = ver.optimal_preemption_time(rng.uniform(0.01, 0.05, size=(1, 8)), 64, None, 0.5)
    assert t_star == t_full and steps == 64
    # NoVER (T per env): env 0 steps every 1 s, env 1 every 3 s, T = 2, LT = 1: S(t) = min(2, t) + min(2, t // 3),
    # S/(t+1) = 1/2, 2/3, 3/4, 3/5, 3/6, 4/7 at t = 1..6: stop at t = 3 with 3 of the 4 steps.
    t_star, steps, t_full = ver.optimal_preemption_time(np.array([[1.0, 3.0]]), 4, 2, 1.0)
    assert (t_star, steps, t_full) == (3.0, 3, 6.0)


@pytest.mark.slow
def test_ddppo_preemption_rule():
    """DD-PPO's rule (--sync under torchrun): stop once sync_frac of the ranks are done and a quarter of the batch
    (T x N = 64 here) is collected."""

    class Store:  # stands in for the TCPStore that counts the ranks done with this rollout
        def __init__(self, done):
            self.counts = {"done_3": done}

        def add(self, key, amount):
            self.counts[key] = self.counts.get(key, 0) + amount
            return self.counts[key]

    args = ver.resolve_args(ver.Args(num_envs=4, num_steps=16, sync=True, sync_frac=0.6, cuda=False), world_size=4)
    # 0.6 x 4 ranks = 2.4: three ranks must be done
    assert ver.ddppo_stop_rule(Store(3), args, 3)(16, 0.0) and not ver.ddppo_stop_rule(Store(3), args, 3)(15, 9.0)
    assert not ver.ddppo_stop_rule(Store(2), args, 3)(64, 9.0) and not ver.ddppo_stop_rule(Store(3), args, 4)(64, 0.0)


@pytest.mark.parametrize(
    "rule, slow_step_time, other, expected_steps",
    [
        ("ver", 3.0, 2.0, 1),  # S(t) = min(8, 2 floor(t/3)) + min(8, 2 floor(t)): S/(t+2) peaks at t* = 4 (10/6)
        ("ver", 10.0, 0.5, 0),  # t* = 4 (8/4.5), before this rank's first step: its batch is all old experience
        ("ver", 3.0, 100.0, 4),  # a long learning phase: waiting pays, t* = t_full = 12, no preemption
        ("ddppo", 3.0, 1, 1),  # the other rank is done: stop once a quarter (2 steps) is in
        ("ddppo", 3.0, 0, 4),  # no rank is done: collect the whole batch
    ],
)
def test_the_collector_stops_where_the_preemption_rule_says_and_the_batch_is_filled(
    rule, slow_step_time, other, expected_steps
):
    """Sec. 2.3 on the collector users run, on a simulated clock (no race against the wall clock): this rank's two
    envs take `slow_step_time` s a step, the other rank's (injected) 1 s, T x N = 8. After one full rollout, the
    collector's Time(S) estimate is this rank's step time; the VER rule from those step times (`other` = LT) or
    DD-PPO's (`other` = ranks done) then stops the rollout, with the steps the rule predicts, at t*; the preempted
    batch is filled to T x N with the previous rollout's steps (Sec. 2.3)."""
    T, N = 4, 2
    args = ver.resolve_args(
        ver.Args(
            env_id="ToyChain-v0",
            num_envs=N,
            num_steps=T,
            toy=ToyChainWorkerConfig(horizon=8, block_length=2, num_actions=3),
            num_minibatches=1,
            cuda=False,
            inference_min_batch=None if rule == "ddppo" else 1,  # (--sync acts on all N at once)
            sync=rule == "ddppo",
            sync_frac=0.5 if rule == "ddppo" else 0.6,  # (DD-PPO's rule alone reads it)
        ),
        world_size=2,
    )
    env = ver.make_env(args)
    torch.manual_seed(0)
    agent = ver.Agent(env.observation_space, env.action_space, False, args.ent_coef, False, hidden_sizes=(16,))
    slots, clock = ver.SharedSlots(N, env), SimulatedClock()
    obs_rms = ver.RunningMeanStd((), "cpu", enabled=False)  # ToyChain's block index: not normalized
    collector = ver.Collector(
        args, TimedFakeWorkers(args, slots, [slow_step_time] * N, clock), slots, agent, obs_rms, "cpu"
    )
    collector.clock = clock
    rollout = collector.collect()
    assert rollout.env_steps == T * N and rollout.step_times.tolist() == [slow_step_time] * N
    previous = ver.build_batch(collector.storage, N, T, GAMMA, LAM)
    collector.start_next_rollout()

    if rule == "ver":  # row r: the step time of each env of rank r, then its learning time
        gathered = np.array([[*rollout.step_times, other], [1.0, 1.0, other]])
        stop_early, t_star = ver.ver_stop_rule(gathered, args.batch_size, collector.quota)
        assert t_star == (4.0 if expected_steps < T else 12.0)
    else:
        store = type("Store", (), {"add": lambda self, key, amount: other})()
        stop_early = ver.ddppo_stop_rule(store, args, iteration=2)
    start = clock.now
    rollout = collector.collect(stop_early)
    assert rollout.steps_per_env.tolist() == [expected_steps] * N
    if rule == "ver" and expected_steps < T:  # stopped at t*, within one 5 ms poll
        assert 4.0 <= clock.now - start < 4.01
    fresh = ver.build_batch(collector.storage, N, T, GAMMA, LAM)
    filled = ver.fill_from_previous(fresh, previous, args.batch_size, np.random.default_rng(0))
    assert fresh["lengths"].sum() == expected_steps * N and filled["lengths"].sum() == len(filled["obs"]) == T * N
    assert torch.equal(filled["logprobs"][: expected_steps * N], fresh["logprobs"])
    old = set(zip(previous["logprobs"].tolist(), previous["values"].tolist()))
    old_rows = zip(filled["logprobs"][expected_steps * N :].tolist(), filled["values"][expected_steps * N :].tolist())
    assert all(row in old for row in old_rows)


def test_fill_from_previous_tops_up_with_whole_old_sequences_cut_to_size():
    def batch(lengths, tag):
        n = int(np.sum(lengths))
        x = torch.arange(n, dtype=torch.float32) + tag
        return dict(
            obs=x,
            actions=x,
            logprobs=x,
            values=x,
            advantages=x,
            returns=x,
            weights=x,
            hidden=None,
            lengths=np.array(lengths),
            env_ids=torch.full((n,), tag),
        )

    fresh, old = batch([3, 2], 100), batch([4, 4, 4], 0)
    filled = ver.fill_from_previous(fresh, old, 12, np.random.default_rng(0))
    assert filled["lengths"][:2].tolist() == [3, 2] and filled["lengths"].sum() == len(filled["obs"]) == 12
    assert filled["obs"][:5].tolist() == [100, 101, 102, 103, 104] and filled["hidden"] is None
    old_part = filled["obs"][5:].long().tolist()  # 7 old steps: one whole sequence of 4, then 3 of another
    assert filled["lengths"][2:].tolist() == [4, 3] and old_part[0] % 4 == 0 and old_part[4] % 4 == 0
    assert old_part[:4] == list(range(old_part[0], old_part[0] + 4))
    assert (filled["env_ids"][5:] == 0).all()
    assert ver.fill_from_previous(fresh, old, 5, np.random.default_rng(0)) is fresh


# ----------------------------------------------------------------------------------------------------------------------
# The collector, with the env workers simulated in this process (arrivals in a seeded random order)
# ----------------------------------------------------------------------------------------------------------------------
class FakeWorkers:
    """Stands in for EnvWorkers: the envs step in this process when poll() lets them arrive, each stepping env
    arriving with its own probability per poll (heterogeneous speeds). Logs every transition of every env:
    (obs, action, policy version that acted, reward, terminated, truncated, true next obs)."""

    def __init__(self, args, slots, arrive_prob, test_state, seed=0):
        self.envs = [ver.make_env(args) for _ in range(args.num_envs)]
        self.slots, self.p, self.rng, self.test_state = (
            slots,
            np.asarray(arrive_prob),
            np.random.default_rng(seed),
            test_state,
        )
        self.log = {e: [] for e in range(args.num_envs)}
        self.current, self.acted = {}, {}
        self.initial = list(range(args.num_envs))
        self.stepping = []
        for e, env in enumerate(self.envs):
            self.current[e] = env.reset(seed=seed + e)
            slots.obs[e] = torch.as_tensor(self.current[e])

    def send_step(self, envs):
        assert not set(envs) & set(self.stepping)  # never an action for an env that is still stepping
        for e in envs:
            self.acted[int(e)] = (self.slots.action[e].numpy().copy(), self.test_state["version"])
        self.stepping += [int(e) for e in envs]

    def poll(self, timeout):
        if self.initial:
            arrived, self.initial = self.initial, []
            return arrived
        chosen = [e for e in self.stepping if self.rng.random() < self.p[e]] or self.stepping[:1]
        for e in chosen:
            self.deliver(e)
        return chosen

    def deliver(self, e):
        """Env e steps with the action it was sent and its result is written into its slot."""
        self.stepping.remove(e)
        action, version = self.acted[e]
        obs, reward, terminated, truncated, final, success = self.envs[e].step(action)
        self.log[e].append(
            (self.current[e], action, version, reward, terminated, truncated, obs if final is None else final)
        )
        s = self.slots
        s.obs[e], s.reward[e], s.terminated[e], s.truncated[e] = torch.as_tensor(obs), reward, terminated, truncated
        s.success[e], s.busy_time[e] = success, 0.001
        if final is not None:
            s.final_obs[e] = torch.as_tensor(final)
        self.current[e] = obs


class SimulatedClock:
    """A clock that only moves when the simulated workers let time pass."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class TimedFakeWorkers(FakeWorkers):
    """FakeWorkers whose envs take fixed step times on a simulated clock: env e's result arrives step_times[e]
    simulated seconds after its action was sent, and poll(timeout) lets at most `timeout` seconds pass."""

    def __init__(self, args, slots, step_times, clock):
        super().__init__(args, slots, np.ones(args.num_envs), {"version": 0})
        self.step_times, self.clock, self.due = step_times, clock, {}

    def send_step(self, envs):
        super().send_step(envs)
        for e in envs:
            self.due[int(e)] = self.clock.now + self.step_times[e]

    def poll(self, timeout):
        if self.initial:
            arrived, self.initial = self.initial, []
            return arrived
        first = min(self.due[e] for e in self.stepping)
        if first > self.clock.now + timeout:
            self.clock.now += max(timeout, 1e-4)  # a poll takes some time (and a tiny timeout must move the clock)
            return []
        self.clock.now = max(self.clock.now, first)
        arrived = [e for e in self.stepping if self.due[e] <= self.clock.now]
        for e in arrived:
            self.deliver(e)
        return arrived


@pytest.mark.parametrize(
    "mode, terminal, bootstrap",
    [
        ("ver", False, "truncated"),
        ("ver", True, "truncated"),
        ("ver", True, "always"),
        ("nover", False, "truncated"),
        ("sync", True, "always"),
    ],
)
def test_recurrent_collector_matches_a_step_by_step_recomputation_over_the_logged_trajectories(
    mode, terminal, bootstrap
):
    """The LSTM agent's weights change after every rollout. Recomputed step by step over each env's logged
    transitions, with the weights of the version that acted and a zero state at episode starts: the stored
    recurrent state (the one the step acted from), log-probability, value and version of every step, and its
    advantage and return, where V(s_{t+1}) comes from the version of the rollout that completed the step, at an
    episode end from the true last observation and the env's own recurrent state (0 at a termination with
    --bootstrap-at-done truncated). Rollouts have T x N steps (NoVER/sync: T from each env), faster envs give more
    steps in VER, and the steps in flight are carried into the next rollout, none lost or repeated."""
    T, N, K = 6, 4, 10
    toy = ToyChainWorkerConfig(
        horizon=8, block_length=2, num_actions=3, progression_prob=0.5, terminal_horizon=terminal
    )
    args = ver.resolve_args(
        ver.Args(
            env_id="ToyChain-v0",
            num_envs=N,
            num_steps=T,
            toy=toy,
            num_minibatches=1,
            variable_experience=mode == "ver",
            sync=mode == "sync",
            cuda=False,
            recurrent=True,
            bootstrap_at_done=bootstrap,
            inference_min_batch=None if mode == "sync" else 1,
        ),
        world_size=1,
    )
    env = ver.make_env(args)
    torch.manual_seed(0)
    agent = ver.Agent(
        env.observation_space,
        env.action_space,
        args.recurrent,
        args.ent_coef,
        args.learned_ent_coef,
        hidden_sizes=(16,),
        lstm_hidden_size=8,
    )
    slots = ver.SharedSlots(N, env)
    test_state = {"version": 0}
    workers = FakeWorkers(args, slots, [0.9, 0.6, 0.3, 0.15], test_state)
    obs_rms = ver.RunningMeanStd((), "cpu", enabled=False)  # ToyChain's block index: not normalized
    collector = ver.Collector(args, workers, slots, agent, obs_rms, torch.device("cpu"))
    weights, batches, carried = [], [], 0
    total_steps = np.zeros(N)
    for k in range(K):
        weights.append(copy.deepcopy(agent.state_dict()))
        rollout = collector.collect()
        assert rollout.env_steps == T * N
        total_steps += rollout.steps_per_env
        if mode != "ver":
            assert (rollout.steps_per_env == T).all()
        batch = ver.build_batch(collector.storage, N, T, GAMMA, LAM)
        assert batch["lengths"].sum() == T * N
        batches.append(batch)
        carried += collector.start_next_rollout()
        test_state["version"] = k + 1
        with torch.no_grad():  # a learner's update: new weights for the next rollout
            for p in agent.parameters():
                p.add_(0.3 * torch.randn_like(p))
    assert (carried > 0) == (mode == "ver")
    if mode == "ver":  # over 10 rollouts, the faster an env, the more steps it gave (per rollout: not always)
        assert total_steps[0] > total_steps[1] > total_steps[2] > total_steps[3], total_steps
    if mode == "sync":
        assert set(rollout.inference_batch_sizes) == {N}

    policies = []
    for state in weights:
        policy = copy.deepcopy(agent)
        policy.load_state_dict(state)
        policies.append(policy)
    for e in range(N):
        state = None
        rows = []  # (batch index, row in it) of env e's steps, in time order
        for k, batch in enumerate(batches):
            rows += [(k, i) for i in np.flatnonzero(batch["env_ids"] == e)]
        assert len(rows) > 0 and len(workers.log[e]) >= len(rows)
        expected = {}
        for (k, i), (obs, action, version, reward, terminated, truncated, next_obs) in zip(rows, workers.log[e]):
            if state is None:
                state = policies[0].initial_state(1, "cpu")
            with torch.no_grad():
                dist, value, next_state = policies[version].step(torch.tensor([int(obs)]), state)
                if terminated and bootstrap == "truncated":
                    next_value = 0.0
                else:
                    next_value = float(policies[k].step(torch.tensor([int(next_obs)]), next_state)[1][0])
            batch = batches[k]
            assert int(batch["obs"][i]) == int(obs)
            torch.testing.assert_close(
                batch["hidden"][i], torch.stack(state)[:, :, 0], atol=1e-5, rtol=1e-5
            )  # (float32: batched vs one env)
            assert float(batch["logprobs"][i]) == pytest.approx(
                float(dist.log_prob(torch.tensor(int(action)))), abs=1e-5
            )
            assert float(batch["values"][i]) == pytest.approx(float(value), abs=1e-5)
            expected.setdefault(k, []).append((i, reward, float(value), next_value, terminated or truncated))
            state = None if terminated or truncated else next_state
        for k, steps in expected.items():
            i, reward, value, next_value, done = (np.array(x) for x in zip(*steps))
            advantages = reference_gae_per_env(reward, value, next_value, done, GAMMA, LAM)
            np.testing.assert_allclose(batches[k]["advantages"][i].numpy(), advantages, atol=1e-4)
            np.testing.assert_allclose(batches[k]["returns"][i].numpy(), advantages + value, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------------
# The observation normalizer (obs_rms): Box observations (ManiSkill) only
# ----------------------------------------------------------------------------------------------------------------------
def test_running_mean_std_equals_numpy_over_all_batches_clips_at_10_and_is_the_identity_when_off():
    rng = np.random.default_rng(0)
    batches = [rng.normal([5.0, -50.0, 0.0], [1.0, 10.0, 100.0], size=(n, 3)) for n in (1, 7, 600, 3, 389)]
    obs_rms = ver.RunningMeanStd((3,), "cpu", enabled=True)
    for batch in batches:
        obs_rms.update(torch.as_tensor(batch, dtype=torch.float32))
    data = np.concatenate(batches)
    assert float(obs_rms.count) == pytest.approx(len(data) + 1e-4)  # (the prior: a pseudo-count of 1e-4, mean 0, var 1)
    np.testing.assert_allclose(obs_rms.mean.numpy(), data.mean(0), rtol=1e-5)
    np.testing.assert_allclose(obs_rms.var.numpy(), data.var(0), rtol=1e-4)
    far = torch.tensor([[5.0, -50.0, 1e5], [5.0, -50.0, -1e5], [6.0, -40.0, 100.0]])
    normalized = obs_rms.normalize(far)
    assert normalized[0, 2] == 10.0 and normalized[1, 2] == -10.0
    expected = (far[2].double().numpy() - data.mean(0)) / data.std(0)
    np.testing.assert_allclose(normalized[2].numpy(), expected, rtol=1e-4)
    off = ver.RunningMeanStd((), "cpu", enabled=False)  # a Discrete observation (ToyChain's block index)
    blocks = torch.tensor([3, 1, 4])
    off.update(blocks)
    assert off.normalize(blocks) is blocks and off.mean == 0.0 and off.var == 1.0 and off.count == torch.tensor(1e-4)


def test_merge_ranks_gives_every_rank_the_statistics_of_all_ranks_observations(monkeypatch):
    """DD-PPO: after a merge, both ranks hold numpy's mean and variance of the observations of both ranks, and a second
    merge counts only what came since the first. The all-reduce (a sum over the ranks) is simulated in this process:
    each rank's contribution is added to the other's."""
    rng = np.random.default_rng(1)
    ranks = [ver.RunningMeanStd((2,), "cpu", enabled=True) for _ in range(2)]
    seen = [[], []]
    monkeypatch.setattr(ver.dist, "is_initialized", lambda: True)
    for round_ in range(2):
        for rank, obs_rms in enumerate(ranks):
            for size in (300, 101 + 50 * rank):
                batch = rng.normal([1.0, -20.0], [2.0, 5.0], size=(size, 2))
                seen[rank].append(batch)
                obs_rms.update(torch.as_tensor(batch, dtype=torch.float32))
        new = [obs_rms.totals() - obs_rms.merged for obs_rms in ranks]
        for rank, obs_rms in enumerate(ranks):
            monkeypatch.setattr(ver.dist, "all_reduce", lambda tensor, other=new[1 - rank]: tensor.add_(other))
            obs_rms.merge_ranks()
        data = np.concatenate(seen[0] + seen[1])
        for obs_rms in ranks:
            assert float(obs_rms.count) == pytest.approx(len(data) + 1e-4)
            np.testing.assert_allclose(obs_rms.mean.numpy(), data.mean(0), rtol=1e-5)
            np.testing.assert_allclose(obs_rms.var.numpy(), data.var(0), rtol=1e-4)
    monkeypatch.setattr(ver.dist, "is_initialized", lambda: False)
    alone = ver.RunningMeanStd((2,), "cpu", enabled=True)
    alone.update(torch.ones(4, 2))
    before = (alone.mean.clone(), alone.var.clone(), alone.count.clone())
    alone.merge_ranks()  # one process: nothing to merge
    assert all(torch.equal(old, now) for old, now in zip(before, (alone.mean, alone.var, alone.count)))


class BoxEnv:
    """make_env's interface with ManiSkill-like Box observations far from zero mean and unit scale (means 5, -50, 0;
    scales 1, 10, 100), a 2-d Box action and 3-step episodes (truncated; the step that ends one returns the next one's
    first observation and the true last one). `returned` logs what reset() and step() returned."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def __init__(self):
        self.rng, self.t, self.returned = np.random.default_rng(0), 0, []

    def observe(self):
        return (self.rng.normal(size=3) * [1.0, 10.0, 100.0] + [5.0, -50.0, 0.0]).astype(np.float32)

    def reset(self, seed=None):
        self.rng, self.t = np.random.default_rng(seed), 0
        self.returned.append(self.observe())
        return self.returned[-1]

    def step(self, action):
        self.t += 1
        obs, final = self.observe(), None
        if self.t == 3:
            obs, final, self.t = self.observe(), obs, 0
        self.returned.append(obs)
        return obs, float(np.sum(action)), False, final is not None, final, False

    def close(self):
        pass


def normalized(raw, mean, var):
    """The observation normalization, written out: ((x - mean) / sqrt(var + 1e-8)) clipped to +-10."""
    return ((raw - mean) / torch.sqrt(var + 1e-8)).clamp(-10.0, 10.0)


def spy_on_policy(monkeypatch, agent, obs_rms):
    """Records every agent.step call: (the observations it was given, obs_rms's mean, var and count at that moment)."""
    calls, step = [], agent.step

    def recording_step(obs, state):
        calls.append((obs.clone(), obs_rms.mean.clone(), obs_rms.var.clone(), float(obs_rms.count)))
        return step(obs, state)

    monkeypatch.setattr(agent, "step", recording_step)
    return calls, step


def test_the_collector_acts_on_and_stores_normalized_box_observations_and_bootstraps_with_them(monkeypatch):
    """Box observations (BoxEnv, through the collector users run, env workers simulated): obs_rms is updated with
    exactly the observations the policy acts on, before it acts on them (its mean and variance are then numpy's over
    them); the policy sees them normalized with the statistics of that moment; the storage keeps what the policy saw
    (the learner trains on it); V(s_{t+1}) of a bootstrap is the value of the normalized observation, and bootstrapping
    does not update the statistics."""
    monkeypatch.setattr(ver, "make_env", lambda args, **kwargs: BoxEnv())
    N = 3
    args = ver.resolve_args(  # (ToyChain-v0 only picks the presets: make_env builds BoxEnvs)
        ver.Args(num_envs=N, num_steps=4, num_minibatches=1, cuda=False, inference_min_batch=1), world_size=1
    )
    env = BoxEnv()
    slots = ver.SharedSlots(N, env)
    obs_rms = ver.RunningMeanStd(slots.obs.shape[1:], "cpu", enabled=True)
    torch.manual_seed(0)
    agent = ver.Agent(env.observation_space, env.action_space, False, 0.0, False, hidden_sizes=(16,))
    calls, step = spy_on_policy(monkeypatch, agent, obs_rms)
    acted = []  # the raw observations of every action, in order

    class RecordingWorkers(FakeWorkers):
        def send_step(self, envs):  # the policy's last call acted on these envs, whose slots still hold their obs
            raw = slots.obs[torch.as_tensor(envs)].clone()
            seen, mean, var, count = calls[-1]
            acted.append(raw)
            assert count == pytest.approx(sum(len(batch) for batch in acted) + 1e-4)  # updated before acting
            torch.testing.assert_close(seen, normalized(raw, mean, var))
            assert torch.equal(collector.storage.obs[torch.as_tensor(collector.inflight_row[envs])], seen)
            super().send_step(envs)

    collector = ver.Collector(
        args, RecordingWorkers(args, slots, [0.9, 0.5, 0.2], {"version": 0}), slots, agent, obs_rms, "cpu"
    )
    for _ in range(3):
        collector.collect()
        collector.start_next_rollout()
    raw = torch.cat(acted).double().numpy()
    assert len(raw) >= 3 * 4 * N and (np.abs(raw.mean(0)) > 4).any()
    assert float(obs_rms.count) == pytest.approx(len(raw) + 1e-4)
    np.testing.assert_allclose(obs_rms.mean.numpy(), raw.mean(0), rtol=1e-5)
    np.testing.assert_allclose(obs_rms.var.numpy(), raw.var(0), rtol=1e-4)

    final_obs = torch.tensor([[5.0, -50.0, 0.0], [1e5, -40.0, 10.0]])  # (the second one is clipped)
    slots.final_obs[:2] = final_obs
    count, next_values = float(obs_rms.count), collector.storage.next_values
    collector.bootstrap(np.array([0, 1]), np.array([0, 1]), slots.final_obs)
    with torch.no_grad():
        expected, unnormalized = (
            step(normalized(final_obs, obs_rms.mean, obs_rms.var), None)[1],
            step(final_obs, None)[1],
        )
    torch.testing.assert_close(next_values[:2], expected)
    assert float(obs_rms.count) == count
    assert (expected - unnormalized).abs().min() > 1e-3  # (raw observations would give other values)


def test_evaluate_normalizes_with_the_current_statistics_and_does_not_update_them(monkeypatch):
    env = BoxEnv()
    obs_rms = ver.RunningMeanStd((3,), "cpu", enabled=True)
    history = np.random.default_rng(0).normal([5.0, -50.0, 0.0], [1.0, 10.0, 100.0], (64, 3))
    obs_rms.update(torch.as_tensor(history, dtype=torch.float32))
    mean, var, count = obs_rms.mean.clone(), obs_rms.var.clone(), float(obs_rms.count)
    torch.manual_seed(0)
    agent = ver.Agent(env.observation_space, env.action_space, False, 0.0, False, hidden_sizes=(16,))
    calls, _ = spy_on_policy(monkeypatch, agent, obs_rms)
    metrics = ver.evaluate(agent, env, obs_rms, num_episodes=2, seed=0, device="cpu")
    assert metrics["eval/episode_len"] == 3 and len(calls) == 6
    seen = torch.cat([obs for obs, *_ in calls])
    torch.testing.assert_close(seen, normalized(torch.as_tensor(np.stack(env.returned[:6])), mean, var))
    assert float(obs_rms.count) == count and torch.equal(obs_rms.mean, mean)


# ----------------------------------------------------------------------------------------------------------------------
# Argument validation (before any env or process starts)
# ----------------------------------------------------------------------------------------------------------------------
def test_defaults_follow_habitat_lab_and_conventions():
    a = ver.resolve_args(ver.Args(num_envs=6, sync=True, cuda=False), world_size=1)
    assert (a.variable_experience, a.inference_min_batch) == (False, 6)
    a = ver.resolve_args(ver.Args(num_envs=16, cuda=False), world_size=1)
    assert (a.variable_experience, a.inference_min_batch) == (True, 10)  # N / 1.5
    assert a.bootstrap_at_done == "truncated" and a.toy.autoreset_mode == "same_step" and a.sync_frac == 0.6
    a = ver.resolve_args(ver.Args(num_envs=8, num_steps=16, total_timesteps=10_000, cuda=False), world_size=2)
    assert a.batch_size == 128


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_envs=3, num_steps=7, num_minibatches=4), "--num-minibatches 4: must divide the batch"),
        (dict(env_id="NoSuchEnv-v9"), "NoSuchEnv-v9"),
        (dict(toy=ToyChainWorkerConfig(horizon=52)), "--toy.horizon"),
        (dict(toy=ToyChainWorkerConfig(slow_env_factor=0.0)), "--toy.slow-env-factor"),
        (dict(evaluate=True), "--evaluate needs --checkpoint"),
    ],
)
def test_bad_flag_combinations_are_rejected_with_the_flag_named(kwargs, message):
    with pytest.raises(ver.ArgsError, match=message):
        ver.resolve_args(ver.Args(cuda=False, **kwargs), world_size=1)


OUT_OF_DOMAIN = [  # (flag, a value outside its domain): every numeric flag of the script, --toy.* included
    ("--seed", -1),
    ("--num-envs", 0),
    ("--num-envs", -4),
    ("--total-timesteps", 0),
    ("--learning-rate", -1e-3),
    ("--num-steps", 0),
    ("--gamma", 1.5),
    ("--gae-lambda", 1.7),
    ("--num-minibatches", 0),
    ("--update-epochs", 0),
    ("--clip-coef", -0.2),
    ("--ent-coef", -0.01),
    ("--target-entropy", math.nan),
    ("--vf-coef", -0.5),
    ("--max-grad-norm", 0.0),
    ("--target-kl", 0.0),
    ("--inference-min-batch", 0),
    ("--sync-frac", 1.2),
    ("--eval-freq", -3),
    ("--num-eval-episodes", 0),
    ("--progress-interval", 0.5),
    ("--toy.horizon", 0),
    ("--toy.block-length", 0),
    ("--toy.num-actions", 1),
    ("--toy.progression-prob", -0.1),
    ("--toy.mastery-threshold", -1),
    ("--toy.reset-lambda", -1.0),
    ("--toy.step-time-mean", -0.1),
    ("--toy.step-time-spread", -1.0),
    ("--toy.step-time-jitter", -1.0),
    ("--toy.slow-rank-factor", 0.0),
    ("--toy.slow-env-factor", -2.0),
]


def args_with(flag, value, **kwargs):
    name = flag[2:].replace("-", "_")
    if name.startswith("toy."):
        return ver.Args(cuda=False, toy=replace(ToyChainWorkerConfig(), **{name[4:]: value}), **kwargs)
    return ver.Args(cuda=False, **{name: value}, **kwargs)


@pytest.mark.parametrize("flag, value", OUT_OF_DOMAIN)
def test_a_numeric_flag_outside_its_domain_is_refused_naming_the_flag_value_and_domain(flag, value):
    """resolve_args alone (fast). The --toy.* flags are checked by toy_chain_env.py, in the same words."""
    expected = f"{flag} {value}: must be "
    with pytest.raises(ver.ArgsError, match="^" + expected.replace("[", r"\[")):
        ver.resolve_args(args_with(flag, value), world_size=1)


def test_the_out_of_domain_table_covers_every_numeric_flag():
    numeric = set()
    for config, prefix in ((ver.Args(), "--"), (ToyChainWorkerConfig(), "--toy.")):
        for name, value in vars(config).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) or value is None:
                numeric.add(prefix + name.replace("_", "-"))
    numeric -= {"--wandb-entity", "--checkpoint", "--bootstrap-at-done", "--batch-size", "--world-size"}
    numeric -= {"--toy.task-seed", "--toy.crash-at-step"}  # any integer; a test hook, not a flag
    assert numeric == {flag for flag, _ in OUT_OF_DOMAIN}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(learned_ent_coef=True, ent_coef=0.0), "--ent-coef 0.0: must be in [1e-4, 1] with --learned-ent-coef"),
        (dict(checkpoint="no/such/file.pt"), "--checkpoint no/such/file.pt: no such file"),
    ],
)
def test_other_bad_values_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ver.ArgsError, match=re.escape(message)):
        ver.resolve_args(ver.Args(cuda=False, **kwargs), world_size=1)


DELAYS = ToyChainWorkerConfig(step_time_mean=0.001)
DOES_NOTHING = [  # (flags, ranks, the refusal): options of one mode given in another
    (dict(sync_frac=0.5), 1, "--sync-frac 0.5: does nothing without --sync under torchrun (DD-PPO's preemption)"),
    (dict(sync_frac=0.5, sync=True), 1, "--sync-frac 0.5: does nothing without --sync under torchrun"),
    (dict(sync_frac=0.5), 2, "--sync-frac 0.5: does nothing without --sync under torchrun"),
    (dict(target_entropy=-1.0), 1, "--target-entropy -1.0: does nothing without --learned-ent-coef"),
    (dict(inference_min_batch=3, sync=True), 1, "--inference-min-batch 3: does nothing with --sync"),
    (dict(wandb_entity="team"), 1, "--wandb-entity team: does nothing without --track"),
    (dict(wandb_project_name="p"), 1, "--wandb-project-name p: does nothing without --track"),
    (dict(quiet=True, progress_interval=5.0), 1, "--progress-interval 5.0: does nothing with --quiet"),
    (dict(toy=replace(DELAYS, slow_rank_factor=9.0)), 1, "--toy.slow-rank-factor 9.0: does nothing on one rank"),
    (
        dict(toy=ToyChainWorkerConfig(slow_env_factor=9.0)),
        1,
        "--toy.slow-env-factor 9.0: does nothing without --toy.step-time-mean > 0",
    ),
    (dict(toy=ToyChainWorkerConfig(step_time_spread=1.0)), 1, "--toy.step-time-spread 1.0: does nothing without --toy"),
    (dict(toy=ToyChainWorkerConfig(step_time_jitter=0.0)), 1, "--toy.step-time-jitter 0.0: does nothing without --toy"),
    (
        dict(env_id="PushCube-v1", toy=ToyChainWorkerConfig(horizon=50)),
        1,
        "--toy.horizon 50: does nothing on PushCube-v1",
    ),
    (
        dict(env_id="PushCube-v1", toy=replace(DELAYS, crash_at_step=3)),
        1,
        "--toy.step-time-mean 0.001: does nothing on",
    ),
]
ACTS = [  # the same options where they act: accepted
    (dict(sync_frac=0.5, sync=True), 2),
    (dict(target_entropy=-1.0, learned_ent_coef=True), 1),
    (dict(inference_min_batch=3), 1),
    (dict(wandb_entity="team", wandb_project_name="p", track=True), 1),
    (
        dict(
            toy=replace(DELAYS, slow_rank_factor=9.0, slow_env_factor=9.0, step_time_spread=1.0, step_time_jitter=0.0)
        ),
        2,
    ),
    (dict(toy=ToyChainWorkerConfig(horizon=50)), 1),
]


@pytest.mark.parametrize("kwargs, world_size, message", DOES_NOTHING)
def test_a_flag_given_where_it_does_nothing_is_refused_naming_what_it_needs(kwargs, world_size, message):
    with pytest.raises(ver.ArgsError, match="^" + re.escape(message)):
        ver.resolve_args(ver.Args(cuda=False, **kwargs), world_size=world_size)


@pytest.mark.parametrize("kwargs, world_size", ACTS)
def test_the_same_flags_are_accepted_where_they_act(kwargs, world_size):
    ver.resolve_args(ver.Args(cuda=False, **kwargs), world_size=world_size)


def saved(tmp_path, contents, name="ckpt.pt"):
    """A file at tmp_path/name: bytes as they are, anything else torch.save'd."""
    path = tmp_path / name
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        torch.save(contents, path)
    return str(path)


OURS = {"script": "ppo_ver.py", "env_id": "ToyChain-v0", "global_step": 1000}


@pytest.mark.parametrize(
    "contents, message",
    [
        (b"localhost\n", "--checkpoint {}: not a checkpoint of ppo_ver.py (Weights only load failed"),
        ({"model": {}, "global_step": 3}, '--checkpoint {}: not a checkpoint of ppo_ver.py (no "script" in it)'),
        ([1, 2], '--checkpoint {}: not a checkpoint of ppo_ver.py (no "script" in it)'),
        ({"script": "ppo_ver.py", "env_id": "ToyChain-v0"}, '--checkpoint {}: not a checkpoint of ppo_ver.py (no "glo'),
        ({**OURS, "script": "cleanba_ppo.py"}, "--checkpoint {}: a checkpoint of cleanba_ppo.py, not of ppo_ver.py"),
        ({**OURS, "env_id": "PickCube-v1"}, "--checkpoint {}: a checkpoint of PickCube-v1, not of ToyChain-v0"),
        (OURS, "--total-timesteps 1000: the checkpoint is at global step 1000 already; pass a larger value"),
    ],
)
def test_a_checkpoint_that_is_not_this_scripts_or_already_at_the_total_is_refused(tmp_path, contents, message):
    path = saved(tmp_path, contents)
    with pytest.raises(ver.ArgsError, match="^" + re.escape(message.format(path))):
        ver.resolve_args(ver.Args(cuda=False, checkpoint=path, total_timesteps=1000), world_size=1)
    if contents is OURS:  # a larger total continues it; an evaluation has no total
        ver.resolve_args(ver.Args(cuda=False, checkpoint=path, total_timesteps=1001), world_size=1)
        ver.resolve_args(ver.Args(cuda=False, checkpoint=path, evaluate=True), world_size=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(output_dir="elsewhere"), "--output-dir elsewhere: does nothing on a resume, which continues in the"),
        (dict(exp_name="other"), "--exp-name other: does nothing on a resume"),
        (dict(evaluate=True, num_envs=4), "--num-envs 4: does nothing with --evaluate"),
        (dict(evaluate=True, save_model=True), "--save-model True: does nothing with --evaluate"),
        (dict(evaluate=True, toy=DELAYS), "--toy.step-time-mean 0.001: does nothing with --evaluate"),
        (dict(evaluate=True, quiet=True), "--quiet True: does nothing with --evaluate"),
    ],
)
def test_flags_that_do_nothing_on_a_resume_or_an_evaluation_are_refused(tmp_path, kwargs, message):
    path = saved(tmp_path, OURS)
    with pytest.raises(ver.ArgsError, match="^" + re.escape(message)):
        total = {} if kwargs.get("evaluate") else dict(total_timesteps=2000)
        ver.resolve_args(ver.Args(cuda=False, checkpoint=path, **total, **kwargs), world_size=1)
    evaluation = dict(evaluate=True, seed=3, num_eval_episodes=2, recurrent=True, toy=ToyChainWorkerConfig(horizon=50))
    ver.resolve_args(ver.Args(cuda=False, checkpoint=path, **evaluation), world_size=1)  # what an evaluation uses


def test_a_resume_with_another_batch_or_an_evaluation_under_torchrun_is_refused(tmp_path):
    """T x N x ranks steps per iteration as the checkpoint's run (global_step and iteration move together), and one
    process evaluates (ranks would all write the same eval json)."""
    path = saved(tmp_path, {**OURS, "steps_per_iteration": 64})
    message = "--num-steps, --num-envs and ranks: T x N x ranks = 32 x 16 x 1 = 512 steps per iteration, the "
    with pytest.raises(ver.ArgsError, match="^" + re.escape(message + "checkpoint's run 64; resume with the same")):
        ver.resolve_args(ver.Args(cuda=False, checkpoint=path, total_timesteps=2000), world_size=1)
    ver.resolve_args(ver.Args(cuda=False, checkpoint=path, total_timesteps=2000, num_envs=8, num_steps=8), world_size=1)
    ver.resolve_args(ver.Args(cuda=False, checkpoint=path, total_timesteps=2000, num_envs=4, num_steps=8), world_size=2)
    ver.resolve_args(ver.Args(cuda=False, checkpoint=path, evaluate=True), world_size=1)
    with pytest.raises(ver.ArgsError, match="^" + re.escape("--evaluate: one process evaluates; run it without")):
        ver.resolve_args(ver.Args(cuda=False, checkpoint=path, evaluate=True), world_size=2)


def test_random_generators_go_into_a_checkpoint_and_come_back(tmp_path):
    """rng_state and set_rng_state, through torch.save and torch.load(weights_only=True): torch's and the numpy
    Generator of minibatches and fill_from_previous draw again what they drew after the save."""
    rng = np.random.default_rng(5)
    torch.manual_seed(3)
    path = saved(tmp_path, ver.rng_state(rng, torch.device("cpu")))

    def draws():
        return torch.rand(3).tolist(), rng.random(3).tolist()

    expected = draws()
    draws()  # every generator moved on
    ver.set_rng_state(torch.load(path, weights_only=True), rng, torch.device("cpu"))
    assert draws() == expected


def test_the_progress_line_format():
    latest = {"charts/episodic_return": -12.3, "charts/success_rate": 0.41, "ver/straggler_share": 0.1875}
    line = ver.progress_line(245760, 3000000, 4096.4, 60.0, {**latest, "losses/value_loss": 1.0})
    assert line == (
        "progress global_step=245760/3000000 (8%) SPS=4096 elapsed=0:01:00 left=0:11:12 "
        "charts/episodic_return=-12.3 charts/success_rate=0.41 ver/straggler_share=0.19"
    )
    assert (
        ver.progress_line(0, 100, 0.0, 97390.0, {}) == "progress global_step=0/100 (0%) SPS=0 elapsed=27:03:10 left=?"
    )
    assert ver.progress_line(99, 100, 0.5, 1.0, {}).endswith("(99%) SPS=0 elapsed=0:00:01 left=0:00:02")


def test_the_toy_chain_runs_in_same_step_mode_only_and_another_mode_is_refused_not_replaced():
    """An env worker resets its chain in the step that ends an episode: --toy.autoreset-mode offers same_step alone,
    and a config that asks for next_step is refused naming the flag."""
    config = replace(ToyChainWorkerConfig(), autoreset_mode="next_step")
    with pytest.raises(
        ver.ArgsError, match="^--toy.autoreset-mode next_step: env workers run their chain in same_step"
    ):
        ver.resolve_args(ver.Args(cuda=False, toy=config), world_size=1)
    proc = subprocess.run([sys.executable, SCRIPT, "--toy.autoreset-mode", "next_step"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--toy.autoreset-mode" in proc.stderr


def test_the_settings_block_lists_every_resolved_field_in_order_within_120_columns_then_the_device():
    args = ver.resolve_args(ver.Args(cuda=False, num_envs=4), world_size=1)
    text = ver.format_settings(args, torch.device("cpu"))
    lines = text.splitlines()
    assert lines[0] == "settings:" and max(len(line) for line in lines) <= 120
    pairs = " ".join(lines[1:]).split(" ")
    assert pairs[:3] == [f"exp_name={args.exp_name}", "seed=1", "torch_deterministic=True"]
    assert "num_envs=4" in pairs and "toy.horizon=200" in pairs and "toy.autoreset_mode=same_step" in pairs
    assert pairs.index("num_envs=4") < pairs.index("bootstrap_at_done=truncated") < pairs.index("toy.horizon=200")
    assert len(pairs) == len(vars(args)) - 1 + len(vars(args.toy)) - 1 + 1 and pairs[-1] == "device=cpu"
    assert "crash_at_step" not in text  # a test hook, not a setting
    maniskill_args = ver.resolve_args(ver.Args(env_id="PushCube-v1", cuda=False), world_size=1)
    maniskill = ver.format_settings(maniskill_args, torch.device("cpu"))
    assert "env_id=PushCube-v1" in maniskill and "toy." not in maniskill  # the toy chain's settings on it only


# ----------------------------------------------------------------------------------------------------------------------
# The script as a user runs it, asserting on what it wrote
# ----------------------------------------------------------------------------------------------------------------------
SCRIPT = os.path.join(ROOT, "ppo_ver.py")
HETEROGENEOUS_TOY = [
    "--env-id",
    "ToyChain-v0",
    "--num-envs",
    "4",
    "--num-steps",
    "16",
    "--toy.horizon",
    "20",
    "--toy.step-time-mean",
    "0.002",
    "--toy.step-time-spread",
    "1.0",
    "--toy.step-time-jitter",
    "0.3",
    "--num-eval-episodes",
    "4",
    "--no-cuda",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def output_dir_flag(args, tmp_path):
    """--output-dir tmp_path, except with --checkpoint: a resume continues in the checkpoint's folder, an evaluation
    writes beside the checkpoint (and both refuse the flag)."""
    return [] if "--checkpoint" in args else ["--output-dir", str(tmp_path)]


def run_script(args, tmp_path, timeout=300, check=True, launcher=None):
    """Runs the script in its own process group, killed whole if it runs past `timeout` (no orphans), its stdout into a
    file beside `tmp_path` (as a log file: progress lines are plain lines), with --output-dir tmp_path unless resuming."""
    command = (launcher or [sys.executable]) + [SCRIPT, *output_dir_flag(args, tmp_path), *args]
    with open(f"{tmp_path}.stdout.txt", "w+") as stdout:
        proc = subprocess.Popen(
            command,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        stdout.seek(0)
        out = stdout.read()
    if check:
        assert proc.returncode == 0, out[-3000:] + err[-5000:]
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def only_run_dir(tmp_path, pattern="*"):
    dirs = [d for d in glob.glob(os.path.join(str(tmp_path), pattern)) if os.path.isdir(d)]
    assert len(dirs) == 1, dirs
    return dirs[0]


def load_summary(run_dir):
    return json.load(open(os.path.join(run_dir, "summary.json")))


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def steps_of(run_dir, tag):
    """The global steps at which TensorBoard shows `tag` (events a resume purged left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


EVALUATION_LINE = r"global_step=\d+ eval/return=\S+ eval/episode_len=\S+ eval/success_once=\S+ eval/success_at_end=\S+"


@pytest.mark.parametrize("mode", ["ver", "nover", "sync"])
def test_toy_chain_with_heterogeneous_step_times(tmp_path, mode):
    """VER, NoVER and SyncOnRL from the same script on ToyChain with episode- and action-level stragglers. VER runs
    with env 0 100x slower (--toy.slow-env-factor: 200 ms a step against 2 ms; its first episode's speed factor,
    seeded, is 1.03, and the run ends before that episode does), so that in every rollout the other envs give their
    T steps long before env 0 can, however loaded the machine: uneven steps, importance weights below 1 and carried
    steps (env 0's is in flight at nearly every rollout's end) hold by construction. NoVER's and sync's even steps hold by construction too."""
    flag = {"ver": ["--toy.slow-env-factor", "100"], "nover": ["--no-variable-experience"], "sync": ["--sync"]}[mode]
    run_script(HETEROGENEOUS_TOY + ["--total-timesteps", "640", "--eval-freq", "5"] + flag, tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary, config = load_summary(run_dir), json.load(open(os.path.join(run_dir, "config.json")))
    assert config["variable_experience"] == (mode == "ver") and config["sync"] == (mode == "sync")
    assert config["bootstrap_at_done"] == "truncated" and config["toy"]["autoreset_mode"] == "same_step"
    assert summary["global_step"] == 640 and summary["iteration"] == 10 and summary["env_busy_time_s"] > 0
    for key in (
        "eval/return",
        "eval/success_at_end",
        "charts/episodic_return",
        "losses/value_loss",
        "toy/accuracy",
        "time/rollout",
        "time/update",
        "ver/env_utilization",
    ):
        assert key in summary, key
    s = scalars(run_dir)
    steps_min, steps_max = s["ver/steps_per_env_min"], s["ver/steps_per_env_max"]
    if mode == "ver":  # no per-env quota: fast envs give more; inflight actions are carried over
        assert min(b - a for a, b in zip(steps_min, steps_max)) > 0 and max(s["ver/inflight_carried"]) > 0
        assert max(s["ver/importance_weight_min"]) < 1.0
        # env 0 (fewer than T steps) at least, and never all 4 (the rollout's T x N steps: some env gave T or more)
        assert 0.25 <= min(s["ver/straggler_share"]) <= max(s["ver/straggler_share"]) <= 0.75
    else:
        assert steps_min == steps_max == [16.0] * 10 and set(s["ver/importance_weight_min"]) == {1.0}
        assert set(s["ver/straggler_share"]) == {0.0}  # every env gave its T steps
    if mode == "sync":  # step all envs, wait for all of them, act on all
        assert set(s["ver/inference_batch_size_mean"]) == {4.0}
    assert len(s["eval/return"]) == 2  # at iteration 5 and at the end


PROGRESS_LINE = re.compile(
    r"progress global_step=(\d+)/320 \((\d+)%\) SPS=\d+ elapsed=\d+:\d\d:\d\d left=(\d+:\d\d:\d\d|\?)"
    r"( charts/episodic_return=\S+ charts/success_rate=\S+)? ver/straggler_share=(\d\.\d\d)"
)


@pytest.mark.slow
def test_progress_lines_in_a_log_file_and_none_with_quiet(tmp_path):
    """Progress lines every --progress-interval 1 s, in a file as a log would hold them. Every step of the chains
    sleeps 50 ms (env 0's 200 ms, no jitter): each rollout of T x N = 64 steps from 4 envs takes 0.75 s at least, so the
    5 rollouts print 2 lines at least, however fast the machine; env 0 gives fewer than T steps (a straggler)."""
    flags = ["--num-envs", "4", "--num-steps", "16", "--total-timesteps", "320", "--toy.step-time-mean", "0.05"]
    flags += ["--toy.step-time-jitter", "0", "--toy.slow-env-factor", "4", "--eval-freq", "0", "--no-cuda"]
    flags += ["--num-eval-episodes", "1", "--progress-interval", "1"]
    out = run_script(flags, tmp_path / "loud").stdout
    lines = [line for line in out.splitlines() if line.startswith("progress")]
    assert len(lines) >= 2 and "\r" not in out, out
    matches = [PROGRESS_LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    steps = [int(match[1]) for match in matches]
    assert steps == sorted(set(steps)) and all(int(m[2]) == 100 * int(m[1]) // 320 for m in matches)
    assert max(float(match[5]) for match in matches) >= 0.25  # (env 0, 4x slower than the others)
    assert "ver/straggler_share" in scalars(only_run_dir(tmp_path / "loud"))
    quiet_flags = flags[:-2] + ["--quiet", "--total-timesteps", "128"]  # (--quiet refuses --progress-interval)
    quiet = run_script(quiet_flags, tmp_path / "quiet").stdout
    assert "\nprogress " not in quiet and "settings:" in quiet and "eval/return=" in quiet


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_recurrent_save_resume_and_evaluate(tmp_path, device):
    """--recurrent (LSTM over packed sequences; cuDNN on a GPU), checkpoints that resume and evaluate."""
    first = tmp_path / "first"
    common = HETEROGENEOUS_TOY[:-1] + [
        "--recurrent",
        "--eval-freq",
        "2",
        "--toy.step-time-mean",
        "0.001",
        "--cuda" if device == "cuda" else "--no-cuda",
    ]
    run_script(common + ["--total-timesteps", "256", "--save-model"], first)
    run_dir = only_run_dir(first)
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.pt"))) == [
        "ckpt_128.pt",
        "final_ckpt.pt",
    ]
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    assert ckpt["global_step"] == 256 and ckpt["iteration"] == 4
    assert ckpt["script"] == "ppo_ver.py" and ckpt["env_id"] == "ToyChain-v0" and ckpt["wandb_id"] is None
    assert any(k.startswith("lstm.") for k in ckpt["model"]) and ckpt["optimizer"]["state"]
    assert set(ckpt["obs_rms"]) == {"mean", "var", "count"}  # the checkpoint's layout; ToyChain's block index is
    assert float(ckpt["obs_rms"]["count"]) == pytest.approx(1e-4)  # not normalized: obs_rms was never updated
    assert set(ckpt["rng"]) == {"torch", "cuda", "generator"}
    assert len(ckpt["envs"]["states"]) == 4 and ckpt["envs"]["obs"].shape == (4,)  # the 4 chains' states

    # A resume from the checkpoint at iteration 2 continues that run: same directory, TensorBoard from step 128 on.
    middle = os.path.join(run_dir, "ckpt_128.pt")
    proc = run_script(
        common + ["--total-timesteps", "512", "--save-model", "--checkpoint", middle], tmp_path / "second"
    )
    assert f"resuming {run_dir} at global step 128 (iteration 2)\n" in proc.stdout
    assert (
        "start anew" not in proc.stdout and only_run_dir(first) == run_dir and not os.path.exists(tmp_path / "second")
    )
    resumed = load_summary(run_dir)
    assert resumed["global_step"] == 512 and resumed["iteration"] == 8
    assert steps_of(run_dir, "charts/SPS") == list(range(64, 513, 64))  # no duplicated or backward steps
    assert json.load(open(os.path.join(run_dir, "config.json")))["total_timesteps"] == 512
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.pt"))) == [
        "ckpt_128.pt",
        "ckpt_256.pt",
        "ckpt_384.pt",
        "final_ckpt.pt",
    ]

    # --evaluate: one line as the evaluations print, eval_final_ckpt.json beside the checkpoint, no run directory.
    flags = ["--toy.horizon", "20", "--recurrent", "--num-eval-episodes", "4", common[-1]]
    final = os.path.join(run_dir, "final_ckpt.pt")
    proc = run_script(flags + ["--evaluate", "--checkpoint", final], tmp_path / "third")
    evaluation = [line for line in proc.stdout.splitlines() if line.startswith("global_step=")]
    assert len(evaluation) == 1 and re.fullmatch(EVALUATION_LINE, evaluation[0]) and "resuming" not in proc.stdout
    assert evaluation[0].startswith("global_step=512 ")
    result = json.load(open(os.path.join(run_dir, "eval_final_ckpt.json")))
    assert result["checkpoint"] == final and result["global_step"] == 512 and result["num_eval_episodes"] == 4
    assert result["eval_seed"] == 1 + 10_000 + 8 and f"eval/return={result['eval/return']:.4g} " in evaluation[0]
    assert os.listdir(first) == [os.path.basename(run_dir)] and not os.path.exists(tmp_path / "third")


def wait_for(workers, envs):
    """Polls `workers` until every env in `envs` has arrived."""
    waiting = set(envs)
    while waiting:
        waiting -= set(workers.poll(math.inf))


@pytest.mark.slow
def test_toy_chain_workers_send_their_state_and_restart_from_it():
    """Two toy chains in worker processes step 12 times (their targets: they move on to block 2), env 0 once more
    (in flight while the states are fetched: its result is left to the next poll()). Workers started from the fetched
    states report the saved observations first, then step exactly as the originals (same actions, 40 steps)."""
    args = ver.resolve_args(ver.Args(cuda=False, num_envs=2, toy=ToyChainWorkerConfig(horizon=50)), world_size=1)
    env = ver.make_env(args, evaluation=True)
    targets = draw_target_actions(args.toy)
    slots = [ver.SharedSlots(2, env) for _ in range(2)]
    first = ver.EnvWorkers(args, slots[0], rank=0)
    second = None
    try:
        wait_for(first, [0, 1])
        for _ in range(12):
            slots[0].action[:] = targets[slots[0].obs]
            first.send_step([0, 1])
            wait_for(first, [0, 1])
        first.send_step([0])
        states = first.fetch_states()
        assert first.poll(0) == [0] and len(states) == 2  # env 0's result, read on the way, is not lost
        saved_obs = slots[0].obs.clone()
        assert saved_obs.tolist() != [0, 0]  # (not where a reset starts)
        second = ver.EnvWorkers(args, slots[1], 0, {"states": states, "obs": saved_obs})
        wait_for(second, [0, 1])
        assert torch.equal(slots[1].obs, saved_obs)
        actions = torch.randint(0, args.toy.num_actions, (40, 2), generator=torch.Generator().manual_seed(0))
        for action in actions:
            for workers, slot in zip((first, second), slots):
                slot.action[:] = action
                workers.send_step([0, 1])
                wait_for(workers, [0, 1])
            for name in ("obs", "reward", "terminated", "truncated", "success"):
                assert torch.equal(getattr(slots[0], name), getattr(slots[1], name)), name
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.slow
def test_a_resume_continues_the_run_its_tensorboard_wandb_run_generators_and_toy_chains(tmp_path, monkeypatch, capsys):
    """In this process (W&B's init replaced: no network): a run with --track saves ckpt_32.pt at iteration 2 and ends
    at 64; resumed from ckpt_32.pt to 96, it continues in the same folder, TensorBoard from step 32 on (the first run's
    later events dropped), the same W&B run (the id W&B gave, stored), with the checkpoint's random generators and its
    chains' states (the restored workers first report the saved observations)."""
    import wandb

    inits = []
    monkeypatch.setattr(
        wandb, "init", lambda **kwargs: inits.append(kwargs) or SimpleNamespace(id=kwargs["id"] or "a1")
    )
    restored = {}
    set_rng_state = ver.set_rng_state
    monkeypatch.setattr(
        ver, "set_rng_state", lambda state, *more: set_rng_state(restored.setdefault("rng", state), *more)
    )

    class FirstObservations(ver.EnvWorkers):
        def __init__(self, args, slots, rank, saved=None):
            super().__init__(args, slots, rank, saved)
            self.slots = slots

        def poll(self, timeout):
            arrived = super().poll(timeout)
            for env in arrived:
                restored.setdefault("first_obs", {}).setdefault(env, int(self.slots.obs[env]))
            return arrived

    monkeypatch.setattr(ver, "EnvWorkers", FirstObservations)
    sigterm = signal.getsignal(signal.SIGTERM)
    common = dict(cuda=False, num_envs=2, num_steps=8, num_minibatches=1, eval_freq=2, num_eval_episodes=2, track=True)
    common.update(save_model=True, toy=ToyChainWorkerConfig(horizon=20))
    try:
        ver.main(ver.Args(**common, total_timesteps=64, output_dir=str(tmp_path)))
        run_dir = only_run_dir(tmp_path)
        checkpoint = torch.load(os.path.join(run_dir, "ckpt_32.pt"), weights_only=True)
        restored.clear()
        summary = ver.main(ver.Args(**common, total_timesteps=96, checkpoint=os.path.join(run_dir, "ckpt_32.pt")))
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert f"resuming {run_dir} at global step 32 (iteration 2)\n" in capsys.readouterr().out
    assert summary["global_step"] == 96 and summary["iteration"] == 6 and only_run_dir(tmp_path) == run_dir
    assert steps_of(run_dir, "charts/SPS") == [16, 32, 48, 64, 80, 96]
    assert [(init["id"], init["resume"]) for init in inits] == [(None, "allow"), ("a1", "allow")]
    assert checkpoint["wandb_id"] == "a1" and restored["rng"]["generator"] == checkpoint["rng"]["generator"]
    assert torch.equal(restored["rng"]["torch"], checkpoint["rng"]["torch"])
    assert restored["first_obs"] == dict(enumerate(checkpoint["envs"]["obs"].tolist()))


def toy_main(total_timesteps, **kwargs):
    """ver.main in this process on 2 toy chains (H = 20), T = 8, checkpoints at every second iteration (of 16 steps)."""
    sigterm = signal.getsignal(signal.SIGTERM)
    toy = ToyChainWorkerConfig(horizon=20)
    try:
        return ver.main(
            ver.Args(
                cuda=False,
                num_envs=2,
                num_steps=8,
                num_minibatches=1,
                update_epochs=1,
                eval_freq=2,
                toy=toy,
                num_eval_episodes=1,
                save_model=True,
                total_timesteps=total_timesteps,
                **kwargs,
            )
        )
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def test_a_resume_restores_each_envs_episode_so_far_keeps_the_wandb_id_and_takes_the_learning_rate(
    tmp_path, monkeypatch
):
    """The checkpoint holds each env's episode so far (counters matching its chain's step in the episode, the steps
    in flight included; whether it starts; the LSTM state), and the resume's collector starts from them; a resume
    without --track keeps the W&B id; the optimizer learns at the resume's --learning-rate."""
    import wandb

    monkeypatch.setattr(wandb, "init", lambda **kwargs: SimpleNamespace(id=kwargs["id"] or "a1"))
    toy_main(48, recurrent=True, track=True, output_dir=str(tmp_path))
    run_dir = only_run_dir(tmp_path)
    checkpoint = torch.load(os.path.join(run_dir, "ckpt_32.pt"), weights_only=True)
    episodes = checkpoint["envs"]["collector"]
    steps = [int(state["episode_step"][0]) for state in checkpoint["envs"]["states"]]
    assert episodes["episode_length"].tolist() == steps and max(steps) > 0
    started = {}
    learning_rates = []

    class Started(ver.Collector):
        def collect(self, stop_early=None):
            started.setdefault("lengths", self.episode_length.copy())
            started.setdefault("starts", self.episode_start.copy())
            started.setdefault("state", [state.clone() for state in self.recurrent_state])
            return super().collect(stop_early)

    ppo_update = ver.ppo_update
    monkeypatch.setattr(ver, "Collector", Started)
    monkeypatch.setattr(
        ver,
        "ppo_update",
        lambda args, agent, optimizer, *more: (
            learning_rates.append(optimizer.param_groups[0]["lr"]) or ppo_update(args, agent, optimizer, *more)
        ),
    )
    toy_main(64, recurrent=True, learning_rate=1e-3, checkpoint=os.path.join(run_dir, "ckpt_32.pt"))
    assert started["lengths"].tolist() == steps and started["starts"].tolist() == episodes["episode_start"].tolist()
    assert all(torch.equal(*pair) for pair in zip(started["state"], episodes["recurrent_state"]))
    assert learning_rates == [1e-3, 1e-3]
    assert torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)["wandb_id"] == "a1"


def test_a_refused_or_interrupted_resume_leaves_the_run_directory_as_it_was(tmp_path, monkeypatch):
    """A checkpoint of another network, W&B failing, Ctrl-C while the env workers start: config.json, summary.json,
    the TensorBoard events (a purge marker would drop the later ones) and the checkpoints byte for byte as before."""
    import wandb

    toy_main(48, output_dir=str(tmp_path))
    run_dir = only_run_dir(tmp_path)
    checkpoint = os.path.join(run_dir, "ckpt_32.pt")

    def contents():
        return {path: open(path, "rb").read() for path in glob.glob(os.path.join(run_dir, "*"))}

    before = contents()
    with pytest.raises(ver.ArgsError, match="not a checkpoint of this configuration"):
        toy_main(64, recurrent=True, checkpoint=checkpoint)

    def failing(**kwargs):
        raise wandb.errors.CommError("no network")

    monkeypatch.setattr(wandb, "init", failing)
    with pytest.raises(wandb.errors.CommError):
        toy_main(64, track=True, checkpoint=checkpoint)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ver, "EnvWorkers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        toy_main(64, checkpoint=checkpoint)
    assert contents() == before


@pytest.mark.slow
def test_ver_learns_the_toy_chain_with_heterogeneous_step_times(tmp_path):
    """VER's uneven sampling, corrected by truncated importance weights, still solves the chain (H = 50). Env 0
    steps 50x slower (--toy.slow-env-factor), so the sampling is uneven however loaded the machine.
    Seeds 1-5 on this 2-core CPU (with the slow env 0): eval success_at_end 1.0 for all five, final toy/accuracy
    0.992-1.0, last rollout's minimum importance weight 0.53-0.70. Earlier, without the slow env, one run on a busy
    machine ended at accuracy 0.89 (the last batch's mix depends on the workers' timing, and toy/accuracy is one batch
    of a stochastic policy), so asserted: eval success >= 0.9 and training accuracy > 0.7 (0.05 at first)."""
    run_script(
        [
            "--env-id",
            "ToyChain-v0",
            "--num-envs",
            "8",
            "--num-steps",
            "32",
            "--total-timesteps",
            "20480",
            "--toy.horizon",
            "50",
            "--toy.step-time-mean",
            "0.001",
            "--toy.step-time-spread",
            "1.0",
            "--toy.slow-env-factor",
            "50",
            "--eval-freq",
            "0",
            "--num-eval-episodes",
            "32",
            "--no-cuda",
        ],
        tmp_path,
    )
    run_dir = only_run_dir(tmp_path)
    summary, s = load_summary(run_dir), scalars(run_dir)
    assert min(s["ver/importance_weight_min"]) < 1.0 and s["toy/accuracy"][0] < 0.2  # 20 actions: ~0.05 at first
    assert summary["eval/success_at_end"] >= 0.9 and summary["toy/accuracy"] > 0.7


def test_maniskill_evaluation_builds_a_new_scene_for_every_episode_and_ignores_terminations():
    """ManiSkill's evaluation protocol in evaluate(): each of the episodes (one after another on one env) starts in a
    newly built scene (reconfiguration at every reset of the evaluation env; a training env never rebuilds its scene),
    and runs the whole horizon: a success termination does not end it (a policy that always succeeds terminates at
    its first step)."""
    args = ver.resolve_args(ver.Args(env_id="PushCube-v1", cuda=False))
    env, train_env = ver.make_env(args, evaluation=True), ver.make_env(args)
    rebuilt = {"eval": [], "train": []}
    for name, one_env in (("eval", env), ("train", train_env)):
        reconfigure = one_env.env.unwrapped._reconfigure
        one_env.env.unwrapped._reconfigure = lambda options, f=reconfigure, name=name: rebuilt[name].append(f(options))
    train_env.reset(seed=0)
    train_env.step(np.zeros(train_env.action_space.shape))
    train_env.env.unwrapped.evaluate = lambda: {"success": torch.tensor([True])}  # success (and termination) always
    env.env.unwrapped.evaluate = train_env.env.unwrapped.evaluate
    assert train_env.step(np.zeros(train_env.action_space.shape))[2]  # training: the success terminates
    agent = ver.Agent(env.observation_space, env.action_space, False, 0.0, False, hidden_sizes=(8,))
    obs_rms = ver.RunningMeanStd(env.observation_space.shape, "cpu", enabled=True)
    metrics = ver.evaluate(agent, env, obs_rms, num_episodes=3, seed=0, device="cpu")
    env.close()
    train_env.close()
    assert metrics["eval/episode_len"] == 50 and metrics["eval/success_once"] == metrics["eval/success_at_end"] == 1.0
    assert len(rebuilt["eval"]) >= 3 and rebuilt["train"] == []


@pytest.mark.slow
def test_maniskill_cpu_task_with_two_workers(tmp_path):
    """A ManiSkill3 task on CPU simulation, one physx_cpu env per worker process (continuous actions, a recurrent
    policy with a learned entropy coefficient); ManiSkill tasks bootstrap at every episode end by default. Its Box
    observations are normalized: the checkpoint holds obs_rms, updated with every observation acted on; a resume
    restores it and goes on updating it (its envs start anew, as it says), and --evaluate uses it (the resumed run's
    final evaluation again)."""
    policy = ["--env-id", "PickCube-v1", "--no-cuda", "--recurrent", "--learned-ent-coef", "--ent-coef", "0.01"]
    common = policy + ["--num-envs", "2", "--num-steps", "20", "--num-minibatches", "2", "--eval-freq", "0"]
    common += ["--num-eval-episodes", "1", "--save-model"]
    run_script(common + ["--total-timesteps", "120"], tmp_path / "first", timeout=600)
    run_dir = only_run_dir(tmp_path / "first")
    summary = load_summary(run_dir)
    assert summary["global_step"] == 120 and summary["eval/episode_len"] == 50
    assert {"eval/success_once", "eval/success_at_end", "charts/episodic_return"} <= set(summary)
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["bootstrap_at_done"] == "always"
    assert math.isfinite(summary["losses/value_loss"]) and summary["losses/ent_coef"] != 0.01  # alpha was learned
    checkpoint = os.path.join(run_dir, "final_ckpt.pt")
    saved = torch.load(checkpoint, weights_only=True)
    obs_rms = saved["obs_rms"]
    assert 120 <= obs_rms["count"] <= 122 + 1e-3  # the 120 steps' observations, and those of the (<= 2) in flight
    assert obs_rms["mean"].abs().max() > 0.01 and (obs_rms["var"] - 1).abs().max() > 0.01
    assert saved["envs"] is None and saved["env_id"] == "PickCube-v1"  # (ManiSkill's state cannot be saved)

    proc = run_script(
        common + ["--total-timesteps", "160", "--checkpoint", checkpoint], tmp_path / "resumed", timeout=600
    )
    assert f"resuming {run_dir} at global step 120 (iteration 3)" in proc.stdout
    assert "resume: the envs' state is not in the checkpoint (PickCube-v1): they start anew" in proc.stdout
    resumed = torch.load(checkpoint, weights_only=True)["obs_rms"]  # (the resumed run's, in the same folder)
    assert 160 <= resumed["count"] <= 164 + 1e-3  # the checkpoint's 120-122 and the 40 new steps' observations
    assert load_summary(run_dir)["global_step"] == 160
    proc = run_script(
        policy + ["--num-eval-episodes", "1", "--checkpoint", checkpoint, "--evaluate"], tmp_path / "eval"
    )
    result = json.load(open(os.path.join(run_dir, "eval_final_ckpt.json")))
    assert result["eval/return"] == load_summary(run_dir)["eval/return"] and result["global_step"] == 160


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ver", "sync"])
def test_torchrun_preempts_the_straggling_rank_and_fills_its_batch(tmp_path, mode):
    """The plumbing of DD-PPO's preemption with 2 ranks (gloo). Rank 0's envs step 100x slower
    (--toy.slow-rank-factor: 200 ms a step against 2 ms), so that no scheduling of a loaded machine can rescue it:
    its first, unpreempted rollout measures Time(S) (16 steps per env: 3.2 s), and rank 1 collects its T x N steps
    (16 rounds of 2 ms steps) long before rank 0 can. VER: every rank stops at the t* of Sec. 2.3 (where and
    whether the rule stops is pinned with injected step times in the collector test above); --sync: DD-PPO's rule,
    a rank stops once --sync-frac 0.5 of the ranks (the fast one) finished. Asserted: rank 0 is preempted, its batch
    is filled from its previous rollout, and the weights stay identical on both ranks."""
    flags = ["--sync", "--sync-frac", "0.5"] if mode == "sync" else []
    run_script(
        HETEROGENEOUS_TOY
        + ["--total-timesteps", "640", "--eval-freq", "0", "--toy.step-time-spread", "0", "--toy.slow-rank-factor"]
        + ["100"]
        + flags,
        tmp_path,
        launcher=TORCHRUN,
    )
    run_dir = only_run_dir(tmp_path)  # one run directory (rank 0's)
    summary = load_summary(run_dir)
    assert summary["global_step"] >= 640 and summary["ddp/max_weight_difference"] == 0.0
    assert json.load(open(os.path.join(run_dir, "config.json")))["world_size"] == 2
    s = scalars(run_dir)
    filled, preempted = s["ver/filled_fraction"], s["ver/preempted_ranks"]
    assert filled[0] == 0.0 and preempted[0] == 0.0  # no rule before the first rollout's measurements
    assert max(filled[1:]) > 0.0 and max(preempted[1:]) >= 1, (filled, preempted)
    if mode == "ver":
        assert len(s["ver/preemption_time"]) == len(filled) - 1


# ----------------------------------------------------------------------------------------------------------------------
# Reliability: crashes, killed workers, Ctrl-C; no hang, no orphan processes
# ----------------------------------------------------------------------------------------------------------------------
def process_tree(pid):
    """(descendant pid, depth) pairs of a process, read from /proc."""
    children = {}
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            content = open(path).read()
        except OSError:
            continue
        fields = content[content.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(content.split()[0]))
    out, stack = [], [(pid, 0)]
    while stack:
        parent, depth = stack.pop()
        for child in children.get(parent, []):
            out.append((child, depth + 1))
            stack.append((child, depth + 1))
    return out


def alive(pid):
    try:
        content = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return content[content.rindex(")") + 2] != "Z"


class Watched:
    """The script in a subprocess (its own process group), with every descendant process it ever had recorded."""

    def __init__(self, args, tmp_path, launcher=None):
        self.proc = subprocess.Popen(
            (launcher or [sys.executable]) + [SCRIPT, *output_dir_flag(args, tmp_path), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        # SIGINT as from a terminal, even when pytest runs in the background (a shell starts jobs with it ignored)
        self.seen = {}
        self.start = time.time()

    def watch(self):
        self.seen.update(process_tree(self.proc.pid))

    def workers(self):
        return [pid for pid, depth in process_tree(self.proc.pid) if depth == 2]  # forkserver children

    def wait_for_workers(self, n):
        deadline = time.time() + 120
        while time.time() < deadline and len(self.workers()) < n:
            self.watch()
            time.sleep(0.2)
        time.sleep(2.0)
        self.watch()

    def wait(self, timeout):
        """Waits up to `timeout` s from now for the run to end (then kills its group); returns its exit code, output
        and the seconds since it started."""
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.watch()
            time.sleep(0.1)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, out, err, time.time() - self.start

    def assert_nothing_left(self):
        deadline = time.time() + 15
        while time.time() < deadline and any(alive(p) for p in self.seen):
            time.sleep(0.2)
        assert self.seen and not [p for p in self.seen if alive(p)]


# The script run unmodified, with its toy chain's test hook set: env workers crash in their 40th step() call.
CRASH_AT_STEP_40 = """
import runpy, sys, tyro
cli = tyro.cli
def cli_with_a_crash(cls, **kwargs):
    args = cli(cls, **kwargs)
    args.toy.crash_at_step = 40
    return args
tyro.cli = cli_with_a_crash
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_crashing_worker_ends_the_run_with_its_traceback(tmp_path):
    launcher = [sys.executable, "-c", CRASH_AT_STEP_40]
    run = Watched(HETEROGENEOUS_TOY + ["--total-timesteps", "1000000"], tmp_path, launcher=launcher)
    code, _, err, _ = run.wait(timeout=120)  # a hang would be killed there (exit code -9)
    assert code == 1, err[-3000:]
    assert "an env worker failed" in err and "Traceback" in err and "deliberate crash in step() call 40" in err
    run.assert_nothing_left()
    summary = load_summary(only_run_dir(tmp_path))
    assert "deliberate crash" in summary["error"] and summary["global_step"] < 1000000


@pytest.mark.slow
def test_a_killed_worker_ends_the_run_and_nothing_is_left_behind(tmp_path):
    run = Watched(HETEROGENEOUS_TOY + ["--total-timesteps", "1000000", "--eval-freq", "0"], tmp_path)
    run.wait_for_workers(4)
    victim = run.workers()[1]
    os.kill(victim, signal.SIGKILL)
    code, _, err, _ = run.wait(timeout=120)  # a hang would be killed there (exit code -9, no message)
    assert code == 1 and f"(pid {victim}) died with exit code -9" in err, err[-3000:]
    run.assert_nothing_left()


def ctrl_c(run):
    """SIGINT to the run's process group, as from a terminal; returns (exit code, stderr, seconds to its exit)."""
    run.watch()
    os.killpg(run.proc.pid, signal.SIGINT)
    sent = time.time()
    code, _, err, _ = run.wait(timeout=60)  # (a run that ignored it would be killed there and fail below)
    return code, err, time.time() - sent


@pytest.mark.slow
def test_ctrl_c_in_training_writes_the_summary_and_a_checkpoint_within_10_s(tmp_path):
    run = Watched(HETEROGENEOUS_TOY + ["--total-timesteps", "1000000", "--eval-freq", "2", "--save-model"], tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and not glob.glob(os.path.join(str(tmp_path), "*", "ckpt_*.pt")):
        run.watch()
        time.sleep(0.2)
    time.sleep(1.0)
    code, err, seconds = ctrl_c(run)
    assert code == 130 and seconds < 10, (seconds, err[-3000:])
    run.assert_nothing_left()
    run_dir = only_run_dir(tmp_path)
    summary = load_summary(run_dir)
    assert summary["interrupted"] is True and summary["global_step"] > 0
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    assert ckpt["global_step"] == summary["global_step"] and ckpt["iteration"] == summary["iteration"]
    periodic = torch.load(glob.glob(os.path.join(run_dir, "ckpt_*.pt"))[0], weights_only=True)
    assert len(periodic["envs"]["states"]) == 4  # (at Ctrl-C, a pipe read it cut short would leave them out)


def forkserver_processes(run):
    """(pid, depth) of the run's forkserver (depth 1) and its workers (depth 2; helpers of its imports have other
    command lines)."""
    found = []
    for pid, depth in process_tree(run.proc.pid):
        try:
            if "multiprocessing.forkserver" in open(f"/proc/{pid}/cmdline").read():
                found.append((pid, depth))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forkserver", "workers"])
def test_ctrl_c_while_the_maniskill_env_workers_start_ends_the_run_within_10_s(tmp_path, phase):
    """SIGINT once the forkserver exists (it imports ManiSkill for seconds before it can start a worker), or once the
    4 workers exist (each builds its scene for seconds on 2 cores): the run ends within 10 s, no process prints a
    traceback (the forkserver and the workers leave Ctrl-C to the main process), and none is left behind."""
    flags = ["--env-id", "PickCube-v1", "--num-envs", "4", "--num-steps", "4", "--num-minibatches", "1", "--no-cuda"]
    run = Watched(flags + ["--total-timesteps", "100000", "--save-model"], tmp_path)
    wanted = [(1, 1)] if phase == "forkserver" else [(1, 1)] + [(4, 2)]
    deadline = time.time() + 120
    while time.time() < deadline:
        depths = [depth for _, depth in forkserver_processes(run)]
        if all(depths.count(depth) >= count for count, depth in wanted):
            break
        time.sleep(0.02)
    time.sleep(
        1.0
    )  # (the forkserver past its interpreter's start-up, into its imports: a KeyboardInterrupt would show)
    code, err, seconds = ctrl_c(run)
    assert code == 130 and seconds < 10 and "Traceback" not in err, (depths, seconds, err[-3000:])
    assert depths.count(1) == 1 and depths.count(2) >= (4 if phase == "workers" else 0), depths
    run.assert_nothing_left()
    summary = load_summary(only_run_dir(tmp_path))
    assert summary["interrupted"] is True and summary["global_step"] == 0 and "iteration" not in summary
    assert not glob.glob(os.path.join(only_run_dir(tmp_path), "*.pt"))  # nothing trained, nothing saved


@pytest.mark.slow
def test_ctrl_c_in_an_evaluation_ends_it_within_10_s_and_writes_nothing(tmp_path):
    """--evaluate of 100,000 episodes of 200 steps (hours): SIGINT a second after the settings are printed."""
    env = ver.make_env(ver.resolve_args(ver.Args(cuda=False), world_size=1), evaluation=True)
    agent = ver.Agent(env.observation_space, env.action_space, False, 0.01, False)
    rms = ver.RunningMeanStd((), "cpu", enabled=False)
    contents = {"script": "ppo_ver.py", "env_id": "ToyChain-v0", "model": agent.state_dict(), "global_step": 64}
    path = saved(
        tmp_path, {**contents, "iteration": 1, "obs_rms": {"mean": rms.mean, "var": rms.var, "count": rms.count}}
    )
    run = Watched(["--evaluate", "--checkpoint", path, "--num-eval-episodes", "100000", "--no-cuda"], tmp_path)
    for line in run.proc.stdout:  # (the settings end with the device)
        if "device=" in line:
            break
    time.sleep(1.0)
    code, err, seconds = ctrl_c(run)
    assert code == 130 and seconds < 10 and "Traceback" not in err, (seconds, err[-3000:])
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no eval_ckpt.json, no run directory


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-envs", "3", "--num-steps", "7"], "error: --num-minibatches 4: must divide the batch T*N = 7*3 = 21"),
        (["--num-envs", "0"], "error: --num-envs 0: must be >= 1"),  # (it hung)
        (["--num-steps", "0"], "error: --num-steps 0: must be >= 1"),
        (["--checkpoint", "no_such_checkpoint.pt"], "error: --checkpoint no_such_checkpoint.pt: no such file"),
        (["--checkpoint", "/etc/hostname"], "error: --checkpoint /etc/hostname: not a checkpoint of ppo_ver.py ("),
    ],
)
def test_bad_flags_exit_early_with_a_message_and_start_nothing(tmp_path, flags, message):
    proc = run_script(flags, tmp_path, check=False, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_ranks_whose_torchrun_was_killed_stop_write_the_summary_and_leave_nothing(tmp_path):
    """torchrun killed with SIGKILL (as by the out-of-memory killer) cannot stop its ranks, which run in sessions of
    their own. Each rank sees at the next iteration that its parent process changed; all ranks stop there together,
    as at Ctrl-C: rank 0 writes summary.json, and every rank, forkserver and env worker ends."""
    flags = ["--env-id", "ToyChain-v0", "--num-envs", "2", "--num-steps", "8", "--num-minibatches", "1", "--no-cuda"]
    run = Watched(flags + ["--eval-freq", "0", "--total-timesteps", "100000000"], tmp_path, launcher=TORCHRUN)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len([pid for pid, depth in process_tree(run.proc.pid) if depth == 3]) < 4:
            run.watch()  # torchrun, its 2 ranks, their forkservers, then 2 env workers per rank
            time.sleep(0.2)
        time.sleep(5.0)  # some iterations
        run.watch()
        assert len(run.seen) >= 8, run.seen
        os.kill(run.proc.pid, signal.SIGKILL)
        deadline = time.time() + 120
        while time.time() < deadline and any(alive(pid) for pid in run.seen):
            time.sleep(0.2)
        assert not [pid for pid in run.seen if alive(pid)]
        out, err = run.proc.communicate(timeout=30)
    finally:
        for pid in run.seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if run.proc.poll() is None:
            run.proc.kill()
    assert "is gone: stopping" in err and "Traceback" not in err, err[-3000:]
    summary = load_summary(only_run_dir(tmp_path))
    assert summary["interrupted"] is True and summary["global_step"] > 0 and summary["iteration"] > 0
