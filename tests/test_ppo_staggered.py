"""ppo_staggered.py: GAE and bootstrapping, reset bookkeeping (stale steps, reset gates), the stagger schedule,
networks, presets and argument checks; then the training loop as users run it, on a small ManiSkill-like env
(early success terminations), on ToyChain, and on ManiSkill3's CPU simulation; and under torchrun (gloo): the update
of 2 ranks x 64 envs against 1 rank x 128 envs, the observation statistics merged across ranks, a one-process
checkpoint resumed on 2 ranks with identical weights, a killed rank, Ctrl-C."""

import copy
import glob
import importlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
import typing
from dataclasses import replace
from datetime import timedelta
from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import DEVICES, ROOT

import ppo_staggered as ppo
from toy_chain_env import ToyChainConfig, ToyChainDiagnostics, forgetting_matrix

GAMMA, LAM = 0.9, 0.8


# ---- GAE and bootstrapping -------------------------------------------------------------------------------------------
def col(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype).view(-1, 1)


def test_gae_hand_worked_with_a_termination_and_a_truncation():
    # One env: s0 -> s1 terminates, s0' -> s1' is truncated; next_values hold V of the true next states.
    rewards, values, next_values = col(1, 2, 3, 4), col(0.5, 1.0, 1.5, 2.0), col(1.0, 1.5, 2.0, 2.5)
    terms, dones = col(0, 1, 0, 0, dtype=torch.bool), col(0, 1, 0, 1, dtype=torch.bool)
    adv, ret = ppo.compute_gae(rewards, values, next_values, terms, dones, GAMMA, LAM)
    # deltas: 1+.9*1-.5 = 1.4 | 2-1 = 1.0 (terminal) | 3+.9*2-1.5 = 3.3 | 4+.9*2.5-2 = 4.25 (truncated: V(s2'))
    # A3 = 4.25; A2 = 3.3 + .72*4.25 = 6.36; A1 = 1.0 (episode end); A0 = 1.4 + .72*1.0 = 2.12
    np.testing.assert_allclose(adv.view(-1).numpy(), [2.12, 1.0, 6.36, 4.25], rtol=1e-6)
    np.testing.assert_allclose(ret.view(-1).numpy(), [2.62, 2.0, 7.86, 6.25], rtol=1e-6)
    # --bootstrap-at-done always: the termination bootstraps V(s1) = 1.5 as well: delta_1 = 2 + .9*1.5 - 1 = 2.35
    adv, _ = ppo.compute_gae(rewards, values, next_values, terms & False, dones, GAMMA, LAM)
    np.testing.assert_allclose(adv.view(-1).numpy()[:2], [1.4 + 0.72 * 2.35, 2.35], rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_rlax_on_random_rollouts_with_episode_ends(seed):
    """DeepMind rlax's truncated_generalized_advantage_estimation, one env at a time. rlax uses one discount for the
    bootstrap and the trace (delta_t = r_t + d_t v_{t+1} - v_t, A_t = delta_t + d_t lambda A_{t+1}); with
    d_t = gamma (1 - done_t), our bootstrap gamma (1 - no_bootstrap_t) next_values_t goes into its reward."""
    import rlax

    rng = np.random.default_rng(seed)
    K, N = 12, 4
    rewards, values, next_values = (rng.normal(size=(K, N)).astype(np.float32) for _ in range(3))
    dones = rng.random((K, N)) < 0.25
    no_bootstrap = dones & (rng.random((K, N)) < 0.5)
    adv, ret = ppo.compute_gae(
        *(torch.as_tensor(x) for x in (rewards, values, next_values, no_bootstrap, dones)), GAMMA, LAM
    )
    for i in range(N):
        discount = GAMMA * (1.0 - dones[:, i])
        v_next = np.append(values[1:, i], 0.0)
        reward = rewards[:, i] + GAMMA * (1.0 - no_bootstrap[:, i]) * next_values[:, i] - discount * v_next
        expected = rlax.truncated_generalized_advantage_estimation(
            reward.astype(np.float32), discount.astype(np.float32), LAM, np.append(values[:, i], 0.0).astype(np.float32)
        )
        np.testing.assert_allclose(adv[:, i].numpy(), np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret.numpy(), adv.numpy() + values, rtol=1e-6)


# ---- Reset bookkeeping: stale steps, waiting for the gate, immediate resets ------------------------------------------
def run_bookkeeping(terms, truncs, finals, next_step_mode):
    """One env's (valid, episode_end, episode step at the observation) of each step, by ResetState."""
    flag = lambda x: torch.tensor([bool(x)])  # noqa: E731
    resets = ppo.ResetState(1, "cpu", next_step_mode)
    rows = []
    for terminated, truncated, final in zip(terms, truncs, finals):
        episode_step = resets.episode_step.item()
        valid, episode_end = resets.step(flag(terminated), flag(truncated), flag(final))
        rows.append((valid.item(), episode_end.item(), episode_step))
    return rows


def test_bookkeeping_masks_a_terminated_env_until_its_gate_truncates_and_resets_it():
    # same-step, gate: terminates at t=1 (not reset), waits t=2..4; its horizon ends (truncation + reset) at t=4.
    rows = run_bookkeeping(
        terms=[0, 1, 0, 1, 0, 0],
        truncs=[0, 0, 0, 0, 1, 0],
        finals=[0, 0, 0, 0, 1, 0],
        next_step_mode=False,
    )
    assert [r[0] for r in rows] == [True, True, False, False, False, True]  # valid
    assert [r[1] for r in rows] == [False, True, False, False, False, False]  # the episode ended at the termination
    assert [r[2] for r in rows] == [0, 1, 2, 3, 4, 0]  # episode step restarts after the gate


def test_bookkeeping_immediate_mode_resets_at_termination():
    rows = run_bookkeeping(terms=[0, 1, 0, 0], truncs=[0, 0, 0, 0], finals=[0, 1, 0, 0], next_step_mode=False)
    assert [r[0] for r in rows] == [True] * 4
    assert [r[1] for r in rows] == [False, True, False, False]
    assert [r[2] for r in rows] == [0, 1, 0, 1]


def test_bookkeeping_next_step_masks_the_stale_step_and_restarts_the_episode_step_after_it():
    rows = run_bookkeeping(terms=[0, 0, 0, 0], truncs=[0, 1, 0, 0], finals=[0, 0, 0, 0], next_step_mode=True)
    assert [r[0] for r in rows] == [True, True, False, True]
    assert [r[2] for r in rows] == [0, 1, 2, 0]


def test_bookkeeping_next_step_an_end_that_the_loop_reset_in_its_step_leaves_no_stale_step():
    # next-step env, but the loop itself truncated and reset it at t=1 (a random start's cut, the advance's start)
    rows = run_bookkeeping(terms=[0, 0, 0], truncs=[0, 1, 0], finals=[0, 1, 0], next_step_mode=True)
    assert [r[0] for r in rows] == [True, True, True]
    assert [r[1] for r in rows] == [False, True, False]
    assert [r[2] for r in rows] == [0, 1, 0]


# ---- Stagger schedule and other pure pieces ------------------------------------------------------------------------
def test_groups_are_contiguous_and_balanced_and_group_j_starts_at_step_j_times_s():
    assert ppo.stagger_groups(10, 4).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert ppo.stagger_groups(8, 1).tolist() == [0] * 8
    assert ppo.stagger_start_steps(4, 5) == [15, 10, 5, 0]
    assert ppo.stagger_start_steps(1, 8) == [0]


def test_reset_gates_are_every_s_steps_in_group_order_and_reset_the_waiting_and_the_just_terminated():
    # N_B = 3, S = 2, H = 6: groups start at advance steps 4, 2, 0 and every H steps after: a gate at every even step
    starts = ppo.stagger_start_steps(3, 2)
    assert [clock for clock in range(13) if ppo.is_reset_gate(clock, starts, 6)] == [0, 2, 4, 6, 8, 10, 12]
    # H = 100, K = S = 8, N_B = 13: group 0 starts at 96, so the gate after it comes 4 steps later (at 100 = 0 mod H)
    starts = ppo.stagger_start_steps(13, 8)
    gates = [clock for clock in range(90, 210) if ppo.is_reset_gate(clock, starts, 100)]
    assert gates == [96, *range(100, 200, 8), 200, 208]
    resets = ppo.ResetState(4, "cpu", next_step_mode=False)
    no = torch.zeros(4, dtype=torch.bool)
    resets.step(torch.tensor([True, False, False, False]), no, no)  # env 0 terminates: it waits
    assert resets.waiting.tolist() == [True, False, False, False]
    terminated = torch.tensor([False, True, True, False])  # env 1 terminates now; env 2 too, and its env reset it
    assert resets.gated(terminated, torch.tensor([False, False, True, False])).tolist() == [True, True, False, False]


def test_batch_temporal_stats_coverage():
    steps = torch.tensor([[0, 5, 10, 15], [1, 6, 11, 16]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    assert ppo.batch_temporal_stats(steps, valid, horizon=20, window=5)["stagger/stage_coverage"] == 1.0
    assert ppo.batch_temporal_stats(steps % 5, valid, horizon=20, window=5)["stagger/stage_coverage"] == 0.25
    assert ppo.batch_temporal_stats(steps, valid & (steps < 10), 20, 5)["stagger/episode_step_max"] == 6


def test_forgetting_matrix_is_best_so_far_minus_current():
    accuracy = np.array([[0.2, 0.9], [0.6, 0.5], [0.4, 0.95]])
    np.testing.assert_allclose(forgetting_matrix(accuracy), [[0, 0], [0, 0.4], [0.2, 0]])


def test_running_mean_std_matches_numpy():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 4)) for n in (7, 50, 13)]
    rms = ppo.RunningMeanStd((4,), "cpu")
    rms.count = torch.tensor(1e-12, dtype=torch.float64)
    for batch in batches:
        rms.update(torch.as_tensor(batch, dtype=torch.float64))
    data = np.concatenate(batches)
    np.testing.assert_allclose(rms.mean.numpy(), data.mean(0), rtol=1e-9)
    np.testing.assert_allclose(rms.var.numpy(), data.var(0), rtol=1e-9)


def test_running_mean_std_adds_the_masked_rows_and_an_empty_batch_changes_nothing():
    rms = ppo.RunningMeanStd((2,), "cpu")
    rms.update(torch.tensor([[1.0, 2.0], [100.0, 100.0], [3.0, 4.0]]), torch.tensor([True, False, True]))
    torch.testing.assert_close(rms.mean, torch.tensor([2.0, 3.0]), rtol=1e-3, atol=1e-3)  # (the prior: count 1e-4)
    torch.testing.assert_close(rms.var, torch.tensor([1.0, 1.0]), rtol=1e-3, atol=1e-3)
    state = (rms.mean.clone(), rms.var.clone(), rms.count.clone())
    rms.update(torch.zeros(0, 2))  # an empty batch: its mean and variance would be NaN
    rms.update(torch.ones(3, 2), torch.zeros(3, dtype=torch.bool))  # every env waits
    for before, after in zip(state, (rms.mean, rms.var, rms.count)):
        assert torch.equal(before, after)
    reward_rms = ppo.RunningMeanStd((), "cpu")
    reward_rms.update(torch.tensor([]))
    assert torch.isfinite(reward_rms.scale(torch.tensor([1.0, -2.0]))).all()


def test_discounted_returns_of_reward_scaling_restart_after_an_episode_end_and_skip_waiting_steps():
    """One env, gamma 0.5: rewards 1, 2 (the episode ends), 4, a waiting step (its reward 100 not trained on), 8;
    the rollout starts with G = 2 carried over from the one before."""
    rewards = col(1.0, 2.0, 4.0, 100.0, 8.0)
    valid = col(1, 1, 1, 0, 1, dtype=torch.bool)
    dones = col(0, 1, 0, 0, 0, dtype=torch.bool)
    returns, carried = ppo.discounted_returns(rewards, valid, dones, 0.5, torch.tensor([2.0]))
    # 2 * .5 + 1 = 2 | 2 * .5 + 2 = 3 (the end) | restarted: 4 | 4 * .5 = 2 (waiting: no reward) | 2 * .5 + 8 = 9
    assert returns.view(-1).tolist() == [2.0, 3.0, 4.0, 2.0, 9.0] and carried.tolist() == [9.0]


def test_reward_scaling_matches_gymnasium_normalize_reward():
    """--normalize-reward on one env without episode ends: the discounted returns the loop accumulates, their running
    statistics (one update per rollout) and the scaled rewards are those of Gymnasium's NormalizeReward (per step)."""
    rewards = np.random.default_rng(0).normal(2.0, 3.0, size=40)
    wrapped = gym.wrappers.NormalizeReward(gym.make("CartPole-v1"), gamma=0.9)
    reference = []
    for reward in rewards:
        wrapped.discounted_reward = wrapped.discounted_reward * 0.9 + reward  # its step's statistics, no env step
        wrapped.return_rms.update(wrapped.discounted_reward)
        reference.append(reward / np.sqrt(wrapped.return_rms.var + wrapped.epsilon))
    rms = ppo.RunningMeanStd((), "cpu")
    discounted = torch.zeros(1, dtype=torch.float64)
    for rollout in np.split(rewards, 5):  # K = 8, no episode end, every step trained on
        valid, dones = torch.ones(8, 1, dtype=torch.bool), torch.zeros(8, 1, dtype=torch.bool)
        returns, discounted = ppo.discounted_returns(torch.as_tensor(rollout).view(8, 1), valid, dones, 0.9, discounted)
        rms.update(returns, valid)
    np.testing.assert_allclose(rms.var.item(), wrapped.return_rms.var.item(), rtol=1e-6)  # (float32 start)
    scaled = rms.scale(torch.as_tensor(rewards, dtype=torch.float64))
    assert scaled[-1].item() == pytest.approx(reference[-1], rel=1e-6)  # the same statistics at the last step
    np.testing.assert_allclose(rms.scale(torch.tensor([1e6, -1e6])).numpy(), [10.0, -10.0])  # clipped to +-10
    assert ppo.RunningMeanStd((), "cpu", enabled=False).scale(torch.tensor([5.0])).item() == 5.0


def advantage_batch():
    """64 advantages, a mean far from 0 (so that sqrt(E[A^2]) is not the std), about 70% of them valid; and their
    normalization computed here with torch's own mean and (population) std over the valid ones."""
    generator = torch.Generator().manual_seed(0)
    advantages = 5.0 + 2.0 * torch.randn(64, generator=generator)
    valid = torch.rand(64, generator=generator) > 0.3
    valid_advantages = advantages[valid].double()
    expected = (advantages - valid_advantages.mean()) / (valid_advantages.std(unbiased=False) + 1e-8)
    return advantages, valid, expected.float()


def test_advantages_are_normalized_with_the_mean_and_std_of_the_valid_entries():
    advantages, valid, expected = advantage_batch()
    normalized, count = ppo.normalize_advantages(advantages, valid)
    torch.testing.assert_close(normalized[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert count.item() == valid.sum().item()


def test_masked_mean():
    x = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    assert ppo.masked_mean(x, torch.tensor([True, True, True, False])).item() == 2.0
    assert ppo.masked_mean(x, torch.zeros(4, dtype=torch.bool)).item() == 0.0


def test_gaussian_agent_log_prob_and_entropy_match_torch_distributions():
    torch.manual_seed(0)
    agent = ppo.GaussianAgent(6, 3)
    obs = torch.randn(5, 6)
    action, logprob, entropy, value = agent.get_action_and_value(obs)
    dist = torch.distributions.Normal(agent.actor_mean(obs), agent.actor_logstd.exp().expand(5, 3))
    torch.testing.assert_close(logprob, dist.log_prob(action).sum(-1))
    torch.testing.assert_close(entropy, dist.entropy().sum(-1))
    assert value.shape == (5,) and torch.allclose(agent.actor_logstd, torch.tensor(-0.5))


def test_chain_agent_per_block_evaluation_equals_evaluating_every_sample():
    torch.manual_seed(0)
    agent = ppo.ChainAgent(num_blocks=12, num_actions=7).double()  # float64: summation order does not matter
    obs, actions = torch.randint(0, 12, (300,)), torch.randint(0, 7, (300,))
    _, logprob, entropy, value = agent.get_action_and_value(obs, actions)
    dist = torch.distributions.Categorical(logits=agent.actor(obs))
    torch.testing.assert_close(logprob, dist.log_prob(actions))
    torch.testing.assert_close(entropy, dist.entropy())
    torch.testing.assert_close(value, agent.critic(obs)[:, 0])
    (logprob.sum() + value.sum()).backward()
    grads = [p.grad.clone() for p in agent.parameters()]
    agent.zero_grad()
    (dist.log_prob(actions).sum() + agent.critic(obs)[:, 0].sum()).backward()
    for g, p in zip(grads, agent.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_chain_agent_samples_from_its_policy():
    torch.manual_seed(0)
    agent = ppo.ChainAgent(num_blocks=1, num_actions=3)
    with torch.no_grad():
        agent.actor[1][-1].bias.copy_(torch.tensor([0.0, 1.0, 2.0]))
        agent.actor[1][-1].weight.zero_()
    actions, *_ = agent.get_action_and_value(torch.zeros(60000, dtype=torch.long))
    probs = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1)
    np.testing.assert_allclose(torch.bincount(actions, minlength=3).float().numpy() / 60000, probs.numpy(), atol=0.01)


# ---- Presets and early, clear errors -------------------------------------------------------------------------------
def test_toy_preset_is_table_2():
    a = ppo.resolve_args(ppo.Args(env_id="ToyChain-v0", cuda=False))
    assert (a.num_envs, a.num_steps, a.gamma, a.gae_lambda, a.num_minibatches, a.ent_coef) == (
        512,
        5,
        0.99,
        0.95,
        4,
        0.01,
    )
    assert a.num_iterations == 150 and a.minibatch_size == 640 and a.target_kl == 0
    assert a.num_stagger_groups == 40 and a.stagger_step == 5  # ceil(H/K) = ceil(200/5), S = K
    assert a.bootstrap_at_done == "truncated" and a.stagger
    naive = ppo.resolve_args(ppo.Args(env_id="ToyChain-v0", cuda=False, stagger=False))
    assert naive.num_stagger_groups == 1 and not naive.stagger


def test_stackcube_preset_is_table_3_and_without_cuda_a_short_cpu_trial_says_so(capsys):
    assert ppo.PRESETS["StackCube-v1"] == dict(num_steps=8, horizon=100, gamma=0.8, gae_lambda=0.9, num_envs=4096)
    a = ppo.resolve_args(ppo.Args(env_id="StackCube-v1", cuda=False))
    assert (a.num_steps, a.horizon, a.gamma, a.gae_lambda) == (8, 100, 0.8, 0.9)
    assert (a.ent_coef, a.target_kl, a.bootstrap_at_done) == (0.005, 0.1, "always")
    assert a.resolved_sim_backend == "physx_cpu" and (a.num_envs, a.total_timesteps) == (8, 30_000)
    note = capsys.readouterr().out
    assert "CUDA GPU" in note and "4096 envs" in note and "2e+08 steps" in note and "override" in note
    # fewer envs than ceil(H/K) = 13 groups: N_B = N and S = floor(H / N_B), so the groups spread over the horizon
    assert (a.num_stagger_groups, a.stagger_step) == (8, 12) and 7 * 12 < 100
    b = ppo.resolve_args(
        ppo.Args(
            env_id="StackCube-v1",
            cuda=False,
            num_envs=16,
            num_steps=10,
            gamma=0.5,
            bootstrap_at_done="truncated",
            stagger=False,
        )
    )
    assert (b.num_envs, b.num_steps, b.gamma, b.num_stagger_groups) == (16, 10, 0.5, 1)  # flags override presets
    assert b.bootstrap_at_done == "truncated" and b.reset_scheme == "naive"


def test_mujoco_preset_and_fewer_envs_than_groups_spread_over_the_horizon():
    a = ppo.resolve_args(ppo.Args(env_id="HalfCheetah-v5", cuda=False))
    assert (a.num_envs, a.num_steps, a.horizon, a.gamma, a.gae_lambda) == (256, 8, 1000, 0.99, 0.95)
    assert (a.ent_coef, a.target_kl, a.bootstrap_at_done, a.normalize_reward) == (0.0, 0.0, "truncated", True)
    assert not ppo.resolve_args(ppo.Args(cuda=False)).normalize_reward  # ToyChain (and ManiSkill): off
    assert (a.num_stagger_groups, a.stagger_step, a.minibatch_size) == (125, 8, 256)  # ceil(1000 / 8) groups, S = K
    few = ppo.resolve_args(ppo.Args(env_id="Hopper-v5", cuda=False, num_envs=64))
    # 64 < 125 groups: S = floor(1000 / 64) = 15, so the last group starts at 63 * 15 = 945 < H
    assert (few.num_stagger_groups, few.stagger_step) == (64, 15)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_steps=300), "--num-steps K=300 is longer than the task horizon H=200"),
        (dict(num_envs=10, num_minibatches=4, num_steps=5), "does not split into --num-minibatches 4"),
        (dict(env_id="NoSuchTask-v9"), "is not ToyChain-v0, a ManiSkill3 task or a Gymnasium id"),
        (dict(toy=ToyChainConfig(horizon=52)), "--toy.horizon"),
        (dict(evaluate=True), "--evaluate needs --checkpoint"),
        (dict(total_timesteps=100), "less than one batch"),
        (dict(cudagraphs=True), "--cudagraphs: one process on a CUDA GPU only"),  # a GPU machine's --no-cuda too
        # flags that would do nothing there
        (dict(horizon=50), "--horizon 50: ToyChain-v0's horizon is --toy.horizon"),
        (dict(env_id="HalfCheetah-v5", toy=ToyChainConfig(horizon=50)), "--toy.horizon: an option of ToyChain-v0, not"),
        (dict(capture_video=True), "--capture-video: ToyChain-v0 renders nothing"),
        (dict(stagger=False, advance_actions="random"), "--advance-actions random: no stagger advance runs (naive"),
        (dict(reset_scheme="random-start", advance_actions="random"), "--advance-actions random: no stagger advance"),
        (dict(evaluate=True, save_model=True), "--save-model, --track: --evaluate writes no run"),
        (dict(wandb_entity="team"), "--wandb-project-name, --wandb-entity: only with --track"),
        (dict(quiet=True, progress_interval=5.0), "--progress-interval: --quiet prints no progress lines"),
    ],
)
def test_bad_input_is_rejected_with_the_flag_named(kwargs, message):
    with pytest.raises(ppo.ArgsError, match=message.replace("*", r"\*").replace("(", r"\(")):
        ppo.resolve_args(ppo.Args(cuda=False, **kwargs))


OUT_OF_DOMAIN = [  # (Args fields, the start of the error: the flag, its value, its domain)
    (dict(seed=-1), "--seed -1: must be >= 0"),
    (dict(num_envs=0), "--num-envs 0: must be >= 1"),
    (dict(num_envs=-4), "--num-envs -4: must be >= 1"),
    (dict(num_eval_envs=0), "--num-eval-envs 0: must be >= 1"),
    (dict(horizon=0), "--horizon 0: must be >= 1"),
    (dict(total_timesteps=0), "--total-timesteps 0: must be >= 1"),
    (dict(learning_rate=-1e-3), "--learning-rate -0.001: must be > 0"),
    (dict(num_steps=0), "--num-steps 0: must be >= 1"),
    (dict(gamma=1.5), "--gamma 1.5: must be in [0, 1]"),
    (dict(gae_lambda=1.7), "--gae-lambda 1.7: must be in [0, 1]"),
    (dict(num_minibatches=0), "--num-minibatches 0: must be >= 1"),
    (dict(update_epochs=0), "--update-epochs 0: must be >= 1"),
    (dict(clip_coef=-0.2), "--clip-coef -0.2: must be > 0"),
    (dict(ent_coef=-0.01), "--ent-coef -0.01: must be >= 0"),
    (dict(vf_coef=-0.5), "--vf-coef -0.5: must be >= 0"),
    (dict(max_grad_norm=0.0), "--max-grad-norm 0.0: must be > 0"),
    (dict(target_kl=-0.1), "--target-kl -0.1: must be >= 0"),
    (dict(eval_freq=-3), "--eval-freq -3: must be >= 0"),
    (dict(progress_interval=0.5), "--progress-interval 0.5: must be >= 1"),
    (dict(checkpoint="no/such/ckpt.pt"), "--checkpoint no/such/ckpt.pt: no such file"),
    (dict(toy=ToyChainConfig(horizon=0)), "--toy.horizon"),
    (dict(toy=ToyChainConfig(block_length=0)), "--toy.block-length"),
    (dict(toy=ToyChainConfig(num_actions=1)), "--toy.num-actions"),
    (dict(toy=ToyChainConfig(progression_prob=1.5)), "--toy.progression-prob"),
    (dict(toy=ToyChainConfig(mastery_threshold=-1)), "--toy.mastery-threshold"),
    (dict(toy=ToyChainConfig(reset_lambda=-1.0)), "--toy.reset-lambda"),
    (dict(toy=ToyChainConfig(step_time_mean=-1.0)), "--toy.step-time-mean"),
    (dict(toy=ToyChainConfig(step_time_spread=-1.0)), "--toy.step-time-spread"),
    (dict(toy=ToyChainConfig(step_time_jitter=-1.0)), "--toy.step-time-jitter"),
]


@pytest.mark.parametrize("kwargs, message", OUT_OF_DOMAIN)
def test_every_numeric_flag_out_of_its_domain_is_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ppo.ArgsError, match="^" + re.escape(message)):
        ppo.resolve_args(ppo.Args(cuda=False, **kwargs))


def test_the_domain_table_covers_every_numeric_flag():
    """A numeric field added to Args or ToyChainConfig without a row above fails here (--toy.task-seed: any seed)."""

    def numeric(cls):
        hints = typing.get_type_hints(cls, include_extras=True)  # (Suppress-ed derived fields are Annotated)
        return {
            name for name, hint in hints.items() if hint in (int, float, typing.Optional[int], typing.Optional[float])
        }

    checked = set()
    for kwargs, message in OUT_OF_DOMAIN:
        checked.add(message.split()[0][2:].replace("-", "_"))
    assert numeric(ppo.Args) <= checked
    assert {f"toy.{name}" for name in numeric(ToyChainConfig)} - {"toy.task_seed"} <= checked


def test_the_settings_name_the_toy_chains_options_on_the_toy_chain_alone_and_never_its_test_hook():
    toy = ppo.format_settings(ppo.resolve_args(ppo.Args(cuda=False)), torch.device("cpu"))
    assert "toy.horizon=200" in toy and "crash_at_step" not in toy and toy.endswith("device=cpu")
    assert "toy." not in ppo.format_settings(ppo.resolve_args(ppo.Args(env_id="Hopper-v5", cuda=False)), "cpu")


def test_capture_video_on_gymnasium_sets_the_first_mujoco_gl_that_renders_and_else_refuses(monkeypatch):
    """Headless (no DISPLAY, MUJOCO_GL unset), --capture-video probes egl, then osmesa, each in a subprocess that
    renders a frame of the task, before MuJoCo is imported, and keeps the first that works; where none does, it
    refuses."""
    monkeypatch.setenv("MUJOCO_GL", "unset below, restored after the test")
    monkeypatch.delenv("MUJOCO_GL")
    monkeypatch.delenv("DISPLAY", raising=False)
    tried = []

    def probe(works):
        def run(command, env, **kwargs):
            tried.append(env["MUJOCO_GL"])
            assert "Hopper-v5" in command[-1] and "render" in command[-1]
            return subprocess.CompletedProcess(command, 0 if env["MUJOCO_GL"] in works else 1, b"", b"GLError: none")

        return types.SimpleNamespace(run=run)

    monkeypatch.setattr(ppo, "subprocess", probe(works=()))
    with pytest.raises(
        ppo.ArgsError, match=r"--capture-video: Hopper-v5 renders no frame here \(MUJOCO_GL egl, osmesa"
    ):
        ppo.resolve_args(ppo.Args(env_id="Hopper-v5", cuda=False, capture_video=True))
    assert tried == ["egl", "osmesa"] and "MUJOCO_GL" not in os.environ
    monkeypatch.setattr(ppo, "subprocess", probe(works=("osmesa",)))
    assert ppo.resolve_args(ppo.Args(env_id="Hopper-v5", cuda=False, capture_video=True)).capture_video
    assert tried[2:] == ["egl", "osmesa"] and os.environ["MUJOCO_GL"] == "osmesa"


def test_missing_vulkan_driver_is_reported_before_maniskill_starts(monkeypatch):
    monkeypatch.setattr(ppo.glob, "glob", lambda pattern: [])
    monkeypatch.delenv("VK_DRIVER_FILES", raising=False)
    monkeypatch.delenv("VK_ICD_FILENAMES", raising=False)
    with pytest.raises(ppo.ArgsError, match="Vulkan .* bash .ci/install_system.sh"):
        ppo.resolve_args(ppo.Args(env_id="StackCube-v1", cuda=False))


# ---- The training loop on a small ManiSkill-like task ----------------------------------------------------------------
RESETS = []  # (env instance, its steps so far, episode step at which it was reset, whether the episode had terminated)


class SuccessEnv(gym.Env):
    """ManiSkill in miniature: a constant observation (ones), reward 1 per step, a success termination at episode step
    `terminate_at` (0: never), the time limit H from gym.make. Like ManiSkill, it keeps running after a success, and
    then pays `reward_after_success` per step and observes 1000s: steps a correct run never trains on, nor normalizes
    (they wait for a reset gate)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,))
    action_space = gym.spaces.Box(-1.0, 1.0, (1,))
    instances = 0

    def __init__(self, terminate_at: int, reward_after_success: float = 1000.0):
        self.terminate_at, self.reward_after_success = terminate_at, reward_after_success
        self.index, SuccessEnv.instances = SuccessEnv.instances, SuccessEnv.instances + 1
        self.t = self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.t > 0:
            RESETS.append((self.index, self.steps, self.t, 0 < self.terminate_at <= self.t))
        self.t = 0
        return np.ones(2, dtype=np.float32), {}

    def step(self, action):
        self.t, self.steps = self.t + 1, self.steps + 1
        after_success = 0 < self.terminate_at < self.t
        reward = self.reward_after_success if after_success else 1.0
        return (
            np.full(2, 1000.0 if after_success else 1.0, dtype=np.float32),
            reward,
            self.t == self.terminate_at,
            False,
            {"success": self.t == self.terminate_at},
        )


gym.register("SuccessAt3-v0", entry_point=SuccessEnv, kwargs=dict(terminate_at=3))
gym.register("NeverTerminates-v0", entry_point=SuccessEnv, kwargs=dict(terminate_at=0))
gym.register("SuccessAt1-v0", entry_point=SuccessEnv, kwargs=dict(terminate_at=1))


def train_in_process(tmp_path, **kwargs):
    RESETS.clear()
    SuccessEnv.instances = 0
    args = ppo.Args(cuda=False, output_dir=str(tmp_path), **{"num_eval_envs": 1, "eval_freq": 1000, **kwargs})
    return ppo.main(args)


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("stagger", [True, False])
def test_an_early_success_waits_masked_for_the_next_gate_or_resets_at_once(tmp_path, stagger):
    """H = 10, 4 envs (staggered: in 2 groups 5 steps apart, so a reset gate every 5 steps); every episode succeeds
    (terminates) at its step 3. Staggered: the env runs on, masked, and resets at the next gate, 2 steps later (not at
    its own group's, 7 steps later); 3 of every 5 steps are trained on, and the 1000-per-step rewards after the success
    never reach the losses. Naive: it resets at step 3."""
    summary = train_in_process(
        tmp_path,
        env_id="SuccessAt3-v0",
        horizon=10,
        num_envs=4,
        num_steps=5,
        num_minibatches=2,
        total_timesteps=4 * 5 * 8,
        stagger=stagger,
    )
    advance = 5 if stagger else 0
    assert summary["global_step"] == 160 and summary["advance_env_steps"] == advance * 4
    # envs 0-3 train (the next one evaluates); the first `advance` steps are the stagger advance
    training_resets = [(t, ended) for index, steps, t, ended in RESETS if index < 4 and steps > advance]
    after_success = {t for t, ended in training_resets if ended}
    assert after_success == ({5} if stagger else {3})
    s = scalars(summary["run_dir"])
    valid = [v for _, v in s["stagger/valid_fraction"]]
    assert valid[-1] == pytest.approx(0.6 if stagger else 1.0)
    assert summary["charts/episodic_length"] == 3 and summary["charts/episodic_return"] == 3
    assert summary["losses/value_loss"] < 20 and abs(summary["losses/policy_loss"]) < 1


@pytest.mark.parametrize("stagger", [True, False])
def test_the_observation_normalizer_learns_from_the_observations_trained_on_only(tmp_path, stagger):
    """The run of the test above: the observations are ones, except the 1000s of an env that runs on after its success
    (waiting for a gate, or in the advance). The normalizer holds ones only: the 96 trained-on observations of the
    staggered run (0.6 of 160) and the last one of each env (all four just reset at a gate); the naive run's 160 and
    its first 4."""
    summary = train_in_process(
        tmp_path,
        env_id="SuccessAt3-v0",
        horizon=10,
        num_envs=4,
        num_steps=5,
        num_minibatches=2,
        total_timesteps=4 * 5 * 8,
        stagger=stagger,
        save_model=True,
    )
    obs_rms = torch.load(os.path.join(summary["run_dir"], "final_ckpt.pt"), weights_only=True)["obs_rms"]
    assert obs_rms["count"].item() == pytest.approx((100 if stagger else 164) + 1e-4)
    torch.testing.assert_close(obs_rms["mean"], torch.ones(2), rtol=1e-5, atol=1e-5)
    assert obs_rms["var"].max().item() < 1e-5


def test_a_rollout_in_which_every_env_waits_trains_on_nothing_and_leaves_no_nan(tmp_path):
    """2 envs, H = 40, K = 4: 2 groups S = 20 steps apart, every episode ends at its first step, so each env waits
    19 steps for the next gate and 4 of the 10 rollouts hold no trained-on step. Reward scaling (on) and the
    observation normalizer then get empty batches; they skip them, and every loss stays finite."""
    summary = train_in_process(
        tmp_path,
        env_id="SuccessAt1-v0",
        horizon=40,
        num_envs=2,
        num_steps=4,
        num_minibatches=2,
        total_timesteps=2 * 4 * 10,
        save_model=True,
    )
    s = scalars(summary["run_dir"])
    assert [value for _, value in s["stagger/valid_fraction"]] == [0.25, 0, 0, 0, 0, 0.25, 0, 0, 0, 0]
    for name in ("losses/value_loss", "losses/policy_loss", "losses/approx_kl", "losses/explained_variance"):
        assert all(math.isfinite(value) for _, value in s[name]), name
    checkpoint = torch.load(os.path.join(summary["run_dir"], "final_ckpt.pt"), weights_only=True)
    assert all(torch.isfinite(weight).all() for weight in checkpoint["model"].values())
    for name in ("obs_rms", "reward_rms"):
        assert all(torch.isfinite(checkpoint[name][key]).all() for key in ("mean", "var")), name


@pytest.mark.parametrize("advance_actions", ["random", "policy"])
def test_the_advance_steps_with_its_actions(tmp_path, monkeypatch, advance_actions):
    """The actions the staggered advance steps the envs with (4 envs, H = 10, K = 5: 5 advance steps): uniform
    samples of the action space seeded with --seed (the same draws as a space seeded here), or the initial policy's
    mean action on the (not yet normalized) observation, the initial agent's (copied before training)."""
    stepped = []
    vec_step = ppo.PartialResetVecEnv.step
    monkeypatch.setattr(
        ppo.PartialResetVecEnv, "step", lambda self, actions: stepped.append(actions.clone()) or vec_step(self, actions)
    )
    original_agent = []
    monkeypatch.setattr(ppo, "stagger_advance", partial(copy_agent_then_advance, ppo.stagger_advance, original_agent))
    train_in_process(
        tmp_path,
        env_id="NeverTerminates-v0",
        horizon=10,
        num_envs=4,
        num_steps=5,
        num_minibatches=2,
        total_timesteps=4 * 5,
        advance_actions=advance_actions,
    )
    advance = torch.stack(stepped[:5])  # (5 steps, 4 envs, 1)
    if advance_actions == "random":
        space = gym.vector.utils.batch_space(gym.spaces.Box(-1.0, 1.0, (1,)), 4)
        space.seed(1)  # --seed 1 (+ global step 0)
        expected = torch.as_tensor(np.stack([space.sample() for _ in range(5)]))
        assert advance.abs().max() <= 1.0 and advance.std() > 0.3  # (uniform in [-1, 1]: std 0.58)
    else:
        with torch.no_grad():
            expected = original_agent[0].deterministic_action(torch.ones(4, 2)).expand(5, 4, 1)
        assert expected.abs().min() > 0  # (small, but not zero)
    torch.testing.assert_close(advance, expected)


def copy_agent_then_advance(advance, copies, envs, resets, agent, *rest):
    copies.append(copy.deepcopy(agent))
    return advance(envs, resets, agent, *rest)


class ScheduledSuccessEnv(SuccessEnv):
    """SuccessEnv whose instance i (the training envs are built first) succeeds at its episode step TERMINATE_AT[i]."""

    TERMINATE_AT = {0: 1, 2: 3, 4: 5, 5: 4}

    def __init__(self):
        super().__init__(terminate_at=0)
        self.terminate_at = self.TERMINATE_AT.get(self.index, 0)


gym.register("ScheduledSuccess-v0", entry_point=ScheduledSuccessEnv)


def test_a_hand_worked_schedule_of_reset_gates(tmp_path, monkeypatch):
    """N = 6 envs in N_B = 3 groups ({0, 1}, {2, 3}, {4, 5}), H = 6, K = S = 2: groups start at advance steps 4, 2, 0
    and reach H every 6 steps after, so some group's gate comes at every even clock (env steps since the first reset).
    Env i succeeds (terminates) at its episode step 1, never, 3, never, 5, 4. Worked by hand:
      advance  clock 1: env 0 terminates, waits. 2: group 1 starts; env 0 resets with it. 3: env 0 terminates again.
               4: group 0 starts with env 0; env 5 terminates at this gate and resets at once (its wait: 0 steps).
               Training starts at episode steps 0, 0, 2, 2, 4, 0.
      training clock 5: envs 0, 2, 4 terminate. 6: group 2's gate (env 4's time limit) resets 0 and 2 too.
               7: env 0 terminates. 8: group 1's gate (env 3's time limit): env 0 resets, env 5 terminates there and
               resets. 9: envs 0 and 2 terminate. 10: group 0's gate (env 1's time limit) resets them.
    A terminated env is masked from the step after its termination to its reset: never more than one step here.
    Waiting for its own group's gate (the old rule) would keep env 0 masked from clock 6 to 10; resetting at once
    would mask nothing."""
    episode_steps = []

    class RecordingResetState(ppo.ResetState):
        def step(self, terminated, truncated, reset_mask):
            result = super().step(terminated, truncated, reset_mask)
            episode_steps.append(self.episode_step.tolist())
            return result

    batches = []
    ppo_update = ppo.ppo_update
    monkeypatch.setattr(ppo, "ResetState", RecordingResetState)
    monkeypatch.setattr(
        ppo, "ppo_update", lambda *a: batches.append(a[2]["valid"].view(2, 6).clone()) or ppo_update(*a)
    )
    summary = train_in_process(
        tmp_path,
        env_id="ScheduledSuccess-v0",
        horizon=6,
        num_envs=6,
        num_steps=2,
        num_minibatches=2,
        total_timesteps=6 * 2 * 3,
    )
    assert summary["advance_env_steps"] == 4 * 6
    assert episode_steps[3] == [0, 0, 2, 2, 4, 0]  # when training starts (after the 4 advance steps)
    valid = torch.cat(batches).int().tolist()  # training steps (clock 5 to 10) x envs
    assert valid == [
        [1, 1, 1, 1, 1, 1],
        [0, 1, 0, 1, 0, 1],  # clock 6: envs 0, 2 and 4 wait (terminated at clock 5)
        [1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 1, 1],  # clock 8: env 0 waits (terminated at 7); env 5 terminates at this gate: no wait
        [1, 1, 1, 1, 1, 1],
        [0, 1, 0, 1, 1, 1],  # clock 10: envs 0 and 2 wait (terminated at 9)
    ]
    assert episode_steps[4:] == [
        [1, 1, 3, 3, 5, 1],
        [0, 2, 0, 4, 0, 2],  # gate at clock 6: envs 0 and 2 reset, env 4 by its time limit (it terminated at 5)
        [1, 3, 1, 5, 1, 3],
        [0, 4, 2, 0, 2, 0],  # gate at clock 8: envs 0 and 5 reset, env 3 by its time limit
        [1, 5, 3, 1, 3, 1],
        [0, 0, 0, 2, 4, 2],  # gate at clock 10: envs 0 and 2 reset, env 1 by its time limit
    ]
    # (env, clock, its episode step when reset, whether the episode had terminated) of every reset after the first
    expected = [(0, 2, 2, True), (2, 2, 2, False), (3, 2, 2, False), (0, 4, 2, True), (1, 4, 4, False)]
    expected += [(5, 4, 4, True), (0, 6, 2, True), (2, 6, 4, True), (4, 6, 6, True), (0, 8, 2, True)]
    expected += [(3, 8, 6, False), (5, 8, 4, True), (0, 10, 2, True), (1, 10, 6, False), (2, 10, 4, True)]
    assert sorted((index, steps, t, ended) for index, steps, t, ended in RESETS if index < 6) == sorted(expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "env_id, horizon, bootstrap, expected",
    [
        ("SuccessAt3-v0", 4, "always", 2.0),  # V = 1 + gamma V: the success bootstraps V(final obs) = V
        ("SuccessAt3-v0", 4, "truncated", (1.75 + 1.5 + 1) / 3),  # returns 1.75, 1.5, 1 of the 3 steps of an episode
        ("NeverTerminates-v0", 3, "truncated", 2.0),  # the time limit at step 3 bootstraps V(final obs) = V
    ],
)
def test_value_targets_follow_bootstrap_at_done(tmp_path, env_id, horizon, bootstrap, expected):
    """The learned value of the (constant) observation converges to the fixed point of the value targets, which
    differs between bootstrapping V(final obs) at an episode end and bootstrapping 0 (gamma 0.5, lambda 1).
    Episodes last 3 steps and so do rollouts, so every batch has the same targets."""
    summary = train_in_process(
        tmp_path,
        env_id=env_id,
        horizon=horizon,
        num_envs=8,
        num_steps=3,
        num_minibatches=2,
        total_timesteps=8 * 3 * 60,
        stagger=False,
        gamma=0.5,
        gae_lambda=1.0,
        learning_rate=1e-3,
        ent_coef=0.0,
        bootstrap_at_done=bootstrap,
        normalize_reward=False,  # the fixed points above are in raw reward units
        save_model=True,
    )
    ckpt = torch.load(os.path.join(summary["run_dir"], "final_ckpt.pt"), weights_only=True)
    agent = ppo.GaussianAgent(2, 1)
    agent.load_state_dict(ckpt["model"])
    rms = ppo.RunningMeanStd((2,), "cpu")
    rms.mean, rms.var, rms.count = (ckpt["obs_rms"][key] for key in ("mean", "var", "count"))
    value = agent.get_value(rms.normalize(torch.ones(1, 2))).item()
    assert value == pytest.approx(expected, abs=0.1)
    assert json.load(open(os.path.join(summary["run_dir"], "config.json")))["bootstrap_at_done"] == bootstrap


def record_gae(monkeypatch) -> list:
    """Makes the training loop's calls of compute_gae append their inputs and outputs (dicts of (K, N) tensors),
    with the values the rollout's agent gives every ToyChain block at that moment (before the update)."""
    calls, agents = [], []
    make_agent, compute_gae = ppo.make_agent, ppo.compute_gae

    def recording_make_agent(envs):
        agents.append(make_agent(envs))
        return agents[-1]

    def recording_compute_gae(rewards, values, next_values, no_bootstrap, dones, gamma, gae_lambda):
        advantages, returns = compute_gae(rewards, values, next_values, no_bootstrap, dones, gamma, gae_lambda)
        with torch.no_grad():
            block_values = agents[-1].get_value(agents[-1].blocks)
        tensors = dict(rewards=rewards, values=values, next_values=next_values, dones=dones, returns=returns)
        tensors.update(no_bootstrap=no_bootstrap, block_values=block_values)
        calls.append({name: tensor.clone() for name, tensor in tensors.items()} | {"gamma": gamma})  # (buffers reused)
        return advantages, returns

    monkeypatch.setattr(ppo, "make_agent", recording_make_agent)
    monkeypatch.setattr(ppo, "compute_gae", recording_compute_gae)
    return calls


def test_a_same_step_truncation_bootstraps_the_value_of_the_final_observation_not_the_reset_one(tmp_path, monkeypatch):
    """Same-step autoreset (ManiSkill's mode): the step that truncates returns the new episode's first observation;
    its value target must bootstrap V(info["final_obs"]). A chain of 2 blocks with p_prog = 1 ends every 10-step
    episode in block 1 and restarts in block 0, so V(final obs) = V(block 1) != V(reset obs) = V(block 0). K = 4:
    the truncations fall inside a rollout (step 10 = rollout 3, t = 1) and at a rollout's end (step 20 = rollout 5,
    t = 3). The expected target r + gamma V(block 1) uses the values the test computes from the rollout's agent."""
    calls = record_gae(monkeypatch)
    train_in_process(
        tmp_path,
        env_id="ToyChain-v0",
        toy=ToyChainConfig(horizon=10, progression_prob=1.0, autoreset_mode="same_step"),
        stagger=False,
        num_envs=4,
        num_steps=4,
        num_minibatches=2,
        total_timesteps=4 * 4 * 5,
    )
    checked = 0
    for iteration, t in ((3, 1), (5, 3)):
        call = calls[iteration - 1]
        assert call["dones"][t].all() and not call["no_bootstrap"][t].any()  # every env truncates here
        final_value, reset_value = call["block_values"][1], call["block_values"][0]
        assert abs(final_value - reset_value) > 1e-3  # the two bootstraps differ, so the test can tell them apart
        torch.testing.assert_close(call["next_values"][t], final_value.expand(4))
        torch.testing.assert_close(call["returns"][t], call["rewards"][t] + call["gamma"] * final_value)
        checked += 1
    assert checked == 2


def test_random_start_first_episode_lengths_are_uniform_over_1_to_h_per_env():
    """--reset-scheme random-start (legged_gym's init_at_random_ep_len): each env's own length, uniform in [1, H]."""
    lengths = ppo.random_start_lengths(30000, 10, seed=3)
    assert lengths.min() == 1 and lengths.max() == 10
    np.testing.assert_allclose(torch.bincount(lengths, minlength=11)[1:].numpy() / 30000, 0.1, atol=0.01)
    assert torch.equal(lengths, ppo.random_start_lengths(30000, 10, seed=3))  # reproducible from the seed
    assert not torch.equal(lengths, ppo.random_start_lengths(30000, 10, seed=4))


def test_reset_scheme_flags():
    random_start = ppo.resolve_args(ppo.Args(cuda=False, reset_scheme="random-start"))
    assert (random_start.num_stagger_groups, random_start.stagger) == (1, False)
    naive = ppo.resolve_args(ppo.Args(cuda=False, stagger=False))
    assert naive.reset_scheme == "naive" and naive.num_stagger_groups == 1
    assert ppo.resolve_args(ppo.Args(cuda=False)).reset_scheme == "staggered"
    with pytest.raises(ppo.ArgsError, match="--no-stagger means --reset-scheme naive"):
        ppo.resolve_args(ppo.Args(cuda=False, stagger=False, reset_scheme="random-start"))


@pytest.mark.parametrize("mode", ["same_step", "next_step"])
def test_random_start_cuts_each_first_episode_at_its_length_and_bootstraps_the_final_observation(
    tmp_path, monkeypatch, mode
):
    """The training loop with --reset-scheme random-start on a chain of 4 blocks with p_prog = 1 (after s steps an
    episode is in block min(s // 5, 3)), H = 20, 16 envs, 40 steps: env e's first episode ends (a truncation, not a
    termination) after random_start_lengths(16, 20, seed)[e] steps, its value target bootstraps V(block of the final
    observation), and its next episode starts at once and lasts the full H. The cut first episodes stay out of the episode statistics,
    and in next-step mode the step after a cut is trained on (the loop reset the env: no stale reset step follows):
    every recorded episode has H trained-on steps."""
    calls = record_gae(monkeypatch)
    summary = train_in_process(
        tmp_path,
        env_id="ToyChain-v0",
        toy=ToyChainConfig(horizon=20, progression_prob=1.0, autoreset_mode=mode),
        reset_scheme="random-start",
        num_envs=16,
        num_steps=5,
        num_minibatches=2,
        total_timesteps=16 * 5 * 9,
    )
    lengths = ppo.random_start_lengths(16, 20, seed=1)
    assert len(set(lengths.tolist())) > 5 and summary["advance_env_steps"] == 0
    dones = torch.cat([call["dones"] for call in calls])  # (45, 16): every step of the run
    for env in range(16):
        ends = dones[:, env].nonzero()[:, 0].tolist()
        first = lengths[env].item() - 1
        stale_step = mode == "next_step" and first == 19  # (the env's own time limit: a next-step reset step follows)
        assert ends[:2] == [first, first + 20 + stale_step], (env, ends)
        call, t = calls[first // 5], first % 5
        assert not call["no_bootstrap"][t, env]
        final_value = call["block_values"][min(lengths[env].item() // 5, 3)]
        torch.testing.assert_close(call["next_values"][t, env], final_value)
        torch.testing.assert_close(call["returns"][t, env], call["rewards"][t, env] + call["gamma"] * final_value)
    episode_lengths = [value for _, value in scalars(summary["run_dir"])["charts/episodic_length"]]
    assert episode_lengths and set(episode_lengths) == {20.0}
    assert json.load(open(os.path.join(summary["run_dir"], "config.json")))["reset_scheme"] == "random-start"


# ---- Host syncs: none per env step in the rollout, none per minibatch in the update ----------------------------------
SYNC_METHODS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")


def count_host_syncs(monkeypatch, env_steps: list):
    """Counts, while the training loop runs in this process, every call that makes the host wait for a CUDA device:
    Tensor.item/__bool__/__float__/__int__/tolist/cpu/numpy called from ppo_staggered.py or toy_chain_env.py (torch's
    own uses on CPU tensors, e.g. Adam's step counter, are not device syncs on a GPU either), torch.cuda.synchronize
    and the script's clock() (on a CPU clock() does not reach torch.cuda.synchronize, so it is counted itself). On the
    CPU these calls cost nothing, but they are the same calls a CUDA run makes. Every step() of the training env
    (the one with 8 envs) appends (syncs so far, syncs so far outside PartialResetVecEnv) to `env_steps`."""
    counts = {"all": 0, "loop": 0}
    ours = (os.path.join(ROOT, "ppo_staggered.py"), os.path.join(ROOT, "toy_chain_env.py"))

    def counted(original, always=False):
        def wrapper(*args, **kwargs):
            frame = sys._getframe(1)
            if always or frame.f_code.co_filename in ours:
                counts["all"] += 1
                counts["loop"] += not frame.f_code.co_qualname.startswith("PartialResetVecEnv")
            return original(*args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counted(lambda *args: None, always=True))
    monkeypatch.setattr(ppo, "clock", counted(ppo.clock, always=True))
    make_env = ppo.make_env

    def recording_make_env(args, num_envs, *rest, **kwargs):
        envs = make_env(args, num_envs, *rest, **kwargs)
        if num_envs == 8:
            step = envs.step

            def recorded_step(actions):
                env_steps.append((counts["all"], counts["loop"]))
                return step(actions)

            envs.step = recorded_step
        return envs

    monkeypatch.setattr(ppo, "make_env", recording_make_env)


@pytest.mark.parametrize("env_id", ["ToyChain-v0/same_step", "ToyChain-v0/next_step", "SuccessAt3-v0"])
def test_the_training_loop_makes_no_host_sync_per_env_step_and_none_per_minibatch(tmp_path, monkeypatch, env_id):
    """Per env step of a rollout (and of the stagger advance) the loop makes no host sync: no timer around the env
    step, and the same-step bootstrap reads whether any env reset from the env (info holds final_obs only then), not
    from the mask. ToyChain (a torch env, as ManiSkill on the GPU) makes none either; PartialResetVecEnv makes its one
    reset decision (and, for CPU envs, its action copy), which ManiSkill's own vector wrapper makes too. The update's
    syncs do not grow with the number of minibatches: the target-KL check is once per epoch."""
    per_update = {}
    for num_minibatches in (2, 8):
        env_steps = []
        with monkeypatch.context() as patch:
            count_host_syncs(patch, env_steps)
            name, _, mode = env_id.partition("/")
            toy = ToyChainConfig(horizon=20, autoreset_mode=mode) if mode else ToyChainConfig()
            summary = train_in_process(
                tmp_path / str(num_minibatches),
                env_id=name,
                toy=toy,
                horizon=None if mode else 20,
                num_envs=8,
                num_steps=10,
                num_minibatches=num_minibatches,
                update_epochs=2,
                target_kl=1e9,  # checked, never reached
                total_timesteps=8 * 10 * 3,
            )
        advance = summary["advance_env_steps"] // 8
        assert advance == 10 and len(env_steps) == advance + 3 * 10
        rollout_starts = {advance + 10 * i for i in range(3)}
        loop_syncs = [
            env_steps[i][1] - env_steps[i - 1][1] for i in range(1, len(env_steps)) if i not in rollout_starts
        ]
        assert len(loop_syncs) == 9 + 3 * 9 and max(loop_syncs) == 0, loop_syncs  # between the steps of a rollout
        per_update[num_minibatches] = [env_steps[i][0] - env_steps[i - 1][0] for i in sorted(rollout_starts)[1:]]
    assert per_update[2] == per_update[8], per_update


# ---- A run continued from its checkpoint, and an evaluation of one ---------------------------------------------------
TOY_TINY = dict(cuda=False, num_envs=16, toy=ToyChainConfig(horizon=20), num_minibatches=2, num_eval_envs=8)


def toy_run(output_dir, **kwargs):
    """ppo_staggered's main on ToyChain, 16 envs, H = 20: 4 groups S = 5 steps apart (an advance of 15 steps)."""
    return ppo.main(ppo.Args(output_dir=str(output_dir), **{**TOY_TINY, **kwargs}))


def final_checkpoint(run_dir):
    return torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)


def assert_same_tensors(expected, got):
    """Every tensor in two nested dicts/lists (a state_dict, Adam's state) is the same, bit for bit."""
    if torch.is_tensor(expected):
        assert torch.equal(expected, got)
    elif isinstance(expected, dict):
        assert expected.keys() == got.keys()
        for key in expected:
            assert_same_tensors(expected[key], got[key])
    elif isinstance(expected, (list, tuple)):
        for item, other in zip(expected, got, strict=True):
            assert_same_tensors(item, other)
    else:
        assert expected == got


def test_a_resumed_toy_run_ends_bit_identical_to_the_uninterrupted_run_in_the_same_run_directory(tmp_path, capsys):
    """12 iterations with a checkpoint every 4. Resumed from the checkpoint of iteration 4 in the run's own directory,
    and a finished 6-iteration run continued to 12, both end with the uninterrupted run's weights, Adam state and
    evaluation: a checkpoint holds the random generators, the loop's state and the chains' (and there is no
    learning-rate schedule: the rate is the same at every update). A resumed run skips the advance; its TensorBoard
    steps continue the run's, none repeated; its env steps simulated count the one advance: (N_B - 1) S N + steps."""
    whole = toy_run(tmp_path / "whole", total_timesteps=960, eval_freq=4, save_model=True)
    expected = final_checkpoint(whole["run_dir"])
    assert whole["advance_env_steps"] == 3 * 5 * 16 and whole["env_steps_simulated"] == 3 * 5 * 16 + 960
    assert expected["script"] == "ppo_staggered.py" and expected["loop"]["training_step"] == 60
    assert set(expected["rng"]) == {"torch", "cuda", "numpy", "python"} and expected["rng"]["cuda"] is None
    short = toy_run(tmp_path / "short", total_timesteps=480, eval_freq=4, save_model=True)
    capsys.readouterr()
    continued = toy_run(
        tmp_path / "elsewhere",
        total_timesteps=960,
        eval_freq=4,
        save_model=True,
        checkpoint=os.path.join(short["run_dir"], "final_ckpt.pt"),
    )
    resumed = toy_run(
        tmp_path / "whole",
        total_timesteps=960,
        eval_freq=4,
        save_model=True,
        checkpoint=os.path.join(whole["run_dir"], "ckpt_320.pt"),
    )
    out = capsys.readouterr().out
    assert f"resuming {short['run_dir']} at global step 480 (iteration 6)" in out
    assert f"resuming {whole['run_dir']} at global step 320 (iteration 4)" in out and "stagger:" not in out
    assert (continued["run_dir"], resumed["run_dir"]) == (short["run_dir"], whole["run_dir"])
    assert not (tmp_path / "elsewhere").exists() and len(os.listdir(tmp_path / "whole")) == 1
    for run in (continued, resumed):
        for name in ("eval/return", "eval/success_at_end", "losses/value_loss", "toy/forgetting_mean_overall"):
            assert run[name] == whole[name], name  # (App. E's forgetting: over every update of the run)
        assert run["env_steps_simulated"] == 3 * 5 * 16 + 960
        assert_same_tensors(expected["model"], final_checkpoint(run["run_dir"])["model"])
        assert_same_tensors(expected["optimizer"], final_checkpoint(run["run_dir"])["optimizer"])
    for run_dir in (whole["run_dir"], short["run_dir"]):  # TensorBoard: each scalar's steps once, in order
        for tag, events in scalars(run_dir).items():
            steps = [step for step, _ in events]
            assert steps == sorted(set(steps)), (tag, steps)
        assert [step for step, _ in scalars(run_dir)["charts/SPS"]] == list(range(80, 961, 80))
    assert [step for step, _ in scalars(whole["run_dir"])["eval/return"]] == [0, 320, 640, 960]
    assert [step for step, _ in scalars(short["run_dir"])["eval/return"]] == [0, 320, 480, 640, 960]  # (its end's)
    capsys.readouterr()  # other settings (another p_prog): the chains' state does not fit them
    toy = ToyChainConfig(horizon=20, progression_prob=0.4)
    toy_run(tmp_path, total_timesteps=1280, toy=toy, checkpoint=os.path.join(whole["run_dir"], "ckpt_640.pt"))
    restart = "resume: the envs' settings differ from the checkpoint's: envs start anew and re-stagger (advance of 15"
    assert restart + " steps x 16 envs = 240 env steps)" in capsys.readouterr().out.splitlines()


def test_a_toy_checkpoint_of_another_device_type_re_staggers_and_a_cpu_run_leaves_cuda_alone(
    tmp_path, monkeypatch, capsys
):
    """The chains' generator is the device's (MT19937 on the CPU, Philox on CUDA): a checkpoint of another device type
    (faked: its layout says CUDA) restarts and re-staggers the envs. A CPU run neither reads nor restores CUDA's random
    state (that would start CUDA, and fail where fewer GPUs are visible)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a machine with a GPU, the run on the CPU)
    for name in ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: pytest.fail("CUDA's random state in a CPU run"))
    run = toy_run(tmp_path, total_timesteps=160, save_model=True)
    path = os.path.join(run["run_dir"], "final_ckpt.pt")
    checkpoint = torch.load(path, weights_only=True)
    layout = checkpoint["loop"]["layout"]
    layout[layout.index("cpu")] = "cuda"
    torch.save(checkpoint, path)
    capsys.readouterr()
    toy_run(tmp_path, total_timesteps=320, checkpoint=path)
    restart = "resume: the envs' settings differ from the checkpoint's: envs start anew and re-stagger (advance of 15"
    assert restart + " steps x 16 envs = 240 env steps)" in capsys.readouterr().out.splitlines()


def test_a_resume_with_another_batch_shape_is_refused_naming_the_flags(tmp_path, monkeypatch):
    """A checkpoint's global step counts iterations of N*K*ranks env steps: a resume (not --evaluate) with another
    number is refused before any env starts; 2 ranks of half the envs are the same iterations."""
    run = toy_run(tmp_path, total_timesteps=160, save_model=True)
    checkpoint = os.path.join(run["run_dir"], "final_ckpt.pt")
    assert torch.load(checkpoint, weights_only=True)["steps_per_iteration"] == 16 * 5
    message = "--num-envs 32, --num-steps 5, 1 ranks: 160 env steps an iteration, the checkpoint's 80: pass ones whose"
    with pytest.raises(ppo.ArgsError, match=re.escape(message + " N*K*ranks is 80")):
        ppo.resolve_args(ppo.Args(cuda=False, num_envs=32, total_timesteps=960, checkpoint=checkpoint))
    assert ppo.resolve_args(ppo.Args(cuda=False, num_envs=32, evaluate=True, checkpoint=checkpoint)).evaluate
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (
        ppo.resolve_args(ppo.Args(cuda=False, num_envs=8, total_timesteps=960, checkpoint=checkpoint)).world_size == 2
    )


def test_a_checkpoint_written_by_ctrl_c_within_an_iteration_holds_no_loop_state_and_its_resume_re_staggers(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C in the middle of a rollout (the 3rd env step of iteration 3): the chains and the loop are 3 steps on from
    the weights and global_step, so the final checkpoint holds no loop state. A run resumed from it starts its envs
    anew and re-staggers, says so in one line with what the advance costs, and counts both advances."""
    steps, make_env = [], ppo.make_env

    def interrupting_make_env(args, num_envs, device, evaluation, **kwargs):
        envs = make_env(args, num_envs, device, evaluation, **kwargs)
        step = envs.step

        def step_or_interrupt(actions):
            steps.append(actions)
            if len(steps) == 15 + 2 * 5 + 3:  # (the advance, 2 rollouts of K = 5, 3 steps of the third)
                raise KeyboardInterrupt
            return step(actions)

        envs.step = envs.step if evaluation else step_or_interrupt
        return envs

    with monkeypatch.context() as patch:
        patch.setattr(ppo, "make_env", interrupting_make_env)
        with pytest.raises(KeyboardInterrupt):
            toy_run(tmp_path, total_timesteps=800, save_model=True)
    run_dir = only_run_dir(tmp_path)
    checkpoint, summary = final_checkpoint(run_dir), json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["interrupted"] and checkpoint["global_step"] == summary["global_step"] == 160
    assert checkpoint["loop"] is None and checkpoint["rng"]["torch"].dtype == torch.uint8
    capsys.readouterr()
    resumed = toy_run(tmp_path, total_timesteps=320, checkpoint=os.path.join(run_dir, "final_ckpt.pt"))
    lines = capsys.readouterr().out.splitlines()
    restart = [line for line in lines if line.startswith("resume: ")]
    assert restart == [
        "resume: the checkpoint holds no loop state (written within an iteration, or by several ranks): envs start anew"
        " and re-stagger (advance of 15 steps x 16 envs = 240 env steps)"
    ]
    assert resumed["advance_env_steps"] == 480 and resumed["env_steps_simulated"] == 480 + 320


def test_a_run_resumed_from_ctrl_c_in_an_evaluation_logs_that_evaluation(tmp_path, monkeypatch):
    """Ctrl-C in the evaluation at global step 160 (--eval-freq 2): the final checkpoint at 160 says that no evaluation
    was logged there, so the resumed run logs it; a checkpoint written by the evaluation says it was (none repeated)."""
    eval_steps, make_env = [], ppo.make_env

    def interrupting_make_env(args, num_envs, device, evaluation, **kwargs):
        envs = make_env(args, num_envs, device, evaluation, **kwargs)
        step = envs.step

        def step_or_interrupt(actions):
            eval_steps.append(actions)
            if len(eval_steps) == 20 + 5:  # (the evaluation at 0, 5 steps of the one at 160)
                raise KeyboardInterrupt
            return step(actions)

        envs.step = step_or_interrupt if evaluation else envs.step
        return envs

    with monkeypatch.context() as patch:
        patch.setattr(ppo, "make_env", interrupting_make_env)
        with pytest.raises(KeyboardInterrupt):
            toy_run(tmp_path, total_timesteps=320, eval_freq=2, save_model=True)
    run_dir = only_run_dir(tmp_path)
    interrupted = final_checkpoint(run_dir)
    assert interrupted["global_step"] == 160 and not interrupted["evaluated"]
    assert torch.load(os.path.join(run_dir, "ckpt_0.pt"), weights_only=True)["evaluated"]
    toy_run(
        tmp_path, total_timesteps=320, eval_freq=2, save_model=True, checkpoint=os.path.join(run_dir, "final_ckpt.pt")
    )
    assert [step for step, _ in scalars(run_dir)["eval/return"]] == [0, 160, 320]
    assert torch.load(os.path.join(run_dir, "ckpt_160.pt"), weights_only=True)["evaluated"]


def test_a_resumed_run_continues_its_wandb_run_and_re_staggers_a_simulator_whose_state_is_not_saved(
    tmp_path, monkeypatch, capsys
):
    """--track stores the W&B run's id in the checkpoint, and the resumed run continues that W&B run (resume="allow"):
    wandb.init is replaced here, no network. On a Gymnasium task (as on ManiSkill) the simulator's state is not in the
    checkpoint: the envs start anew and re-stagger, in one line that says what the advance costs."""
    import wandb

    inits = []
    monkeypatch.setattr(
        wandb, "init", lambda **kwargs: inits.append(kwargs) or types.SimpleNamespace(id=f"id{len(inits)}")
    )
    common = dict(env_id="SuccessAt3-v0", horizon=10, num_envs=4, num_steps=5, num_minibatches=2, track=True)
    first = train_in_process(tmp_path, total_timesteps=40, save_model=True, **common)
    capsys.readouterr()
    checkpoint = os.path.join(first["run_dir"], "final_ckpt.pt")
    second = train_in_process(tmp_path, total_timesteps=80, checkpoint=checkpoint, **common)
    assert inits[0]["id"] is None and inits[1]["id"] == "id1" == torch.load(checkpoint)["wandb_id"]  # (the new run's)
    assert inits[1]["resume"] == "allow" and inits[1]["name"] == os.path.basename(first["run_dir"])
    line = (
        "resume: the simulator's state is not in the checkpoint: envs start anew and re-stagger (advance of 5 steps x"
    )
    assert line + " 4 envs = 20 env steps)" in capsys.readouterr().out.splitlines()
    assert second["run_dir"] == first["run_dir"] and second["global_step"] == 80
    assert second["advance_env_steps"] == 2 * 20 and second["env_steps_simulated"] == 2 * 20 + 80


def run_files(run_dir) -> dict:
    return {name: open(os.path.join(run_dir, name), "rb").read() for name in sorted(os.listdir(run_dir))}


def test_a_resume_whose_networks_do_not_fit_is_refused_and_leaves_the_run_as_it_was(tmp_path, monkeypatch):
    """Another --toy.num-actions: the checkpoint's networks do not fit. The resume is refused (exit 2) before it writes
    into the run: config.json, summary.json and the TensorBoard events stay byte for byte (no purge marker, no new
    event file), and no W&B run is resumed."""
    import wandb

    run = toy_run(tmp_path, total_timesteps=160, save_model=True)
    files = run_files(run["run_dir"])
    monkeypatch.setattr(wandb, "init", lambda **kwargs: pytest.fail("a W&B run was resumed"))
    with pytest.raises(ppo.ArgsError, match="--checkpoint: its networks do not fit these settings"):
        toy_run(
            tmp_path,
            total_timesteps=320,
            track=True,
            toy=ToyChainConfig(horizon=20, num_actions=7),
            checkpoint=os.path.join(run["run_dir"], "final_ckpt.pt"),
        )
    assert run_files(run["run_dir"]) == files


def test_evaluate_prints_one_result_line_and_writes_its_json_beside_the_checkpoint_not_a_run_directory(
    tmp_path, capsys
):
    run = toy_run(tmp_path, total_timesteps=160, save_model=True)
    checkpoint = os.path.join(run["run_dir"], "ckpt_0.pt")
    capsys.readouterr()
    toy_run(tmp_path, evaluate=True, checkpoint=checkpoint, seed=3)
    lines = capsys.readouterr().out.splitlines()
    results = [line for line in lines if line.startswith("global_step=")]
    assert len(results) == 1 and not [line for line in lines if "resum" in line]
    pattern = r"global_step=0 eval/return=(\S+) eval/success_once=\S+ eval/success_at_end=\S+ eval/episode_len=20.000"
    assert re.fullmatch(pattern, results[0])
    assert os.listdir(tmp_path) == [os.path.basename(run["run_dir"])]  # no run directory of the evaluation's
    record = json.load(open(os.path.join(run["run_dir"], "eval_ckpt_0.json")))
    assert (record["checkpoint"], record["global_step"], record["eval_seed"]) == (checkpoint, 0, 3)
    assert record["num_eval_envs"] == record["episodes"] == 8
    assert results[0].split()[1] == f"eval/return={record['eval/return']:.3f}"


class VideoWriterStub:
    """imageio's writer in miniature: a few bytes into its file per frame; a Ctrl-C at the 3rd frame of the test."""

    frames = 0

    def __init__(self, path, fps):
        self.path, self.closed = path, False
        VideoWriterStub.writers.append(self)

    def append_data(self, frame):
        VideoWriterStub.frames += 1
        if VideoWriterStub.frames == 3:
            raise KeyboardInterrupt
        with open(self.path, "ab") as file:
            file.write(b"frame")

    def close(self):
        self.closed = True


def test_an_evaluations_videos_are_closed_and_renamed_when_whole_and_a_ctrl_c_leaves_no_mp4(tmp_path, monkeypatch):
    """A Gymnasium task's evaluation films into {video}_env{i}.part.mp4, closes the writers whatever happens and renames
    each to .mp4 at the end: a Ctrl-C in the evaluation leaves no broken .mp4 under a final name."""
    VideoWriterStub.writers, VideoWriterStub.frames = [], 0
    monkeypatch.setattr(ppo.imageio, "get_writer", VideoWriterStub)
    monkeypatch.setattr(SuccessEnv, "render", lambda self: np.zeros((4, 4, 3), dtype=np.uint8))
    args = ppo.resolve_args(ppo.Args(cuda=False, env_id="SuccessAt3-v0", horizon=10, num_envs=2, num_minibatches=2))
    eval_envs = ppo.make_env(args, 2, torch.device("cpu"), evaluation=True)
    agent, obs_rms = ppo.GaussianAgent(2, 1), ppo.RunningMeanStd((2,), torch.device("cpu"))
    (tmp_path / "interrupted").mkdir()
    (tmp_path / "whole").mkdir()
    with pytest.raises(KeyboardInterrupt):
        ppo.evaluate(agent, eval_envs, obs_rms, 10, 0, False, str(tmp_path / "interrupted" / "global_step_0"))
    assert all(writer.closed for writer in VideoWriterStub.writers)
    assert sorted(os.listdir(tmp_path / "interrupted")) == [
        "global_step_0_env0.part.mp4",
        "global_step_0_env1.part.mp4",
    ]
    ppo.evaluate(agent, eval_envs, obs_rms, 10, 0, False, str(tmp_path / "whole" / "global_step_0"))
    assert sorted(os.listdir(tmp_path / "whole")) == ["global_step_0_env0.mp4", "global_step_0_env1.mp4"]
    eval_envs.close()


def test_the_toy_diagnostics_are_written_whole(tmp_path, monkeypatch):
    """toy_diagnostics.npz is written to a temporary file and renamed: a Ctrl-C while it is written leaves no file."""
    diagnostics = types.SimpleNamespace(occupancy=[np.ones(4)], accuracy=[np.full(4, 0.5)])
    path = tmp_path / "toy_diagnostics.npz"
    savez = np.savez

    def interrupted_savez(file, **arrays):
        (open(file, "wb") if isinstance(file, (str, os.PathLike)) else file).write(b"half an npz")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted_savez)
    with pytest.raises(KeyboardInterrupt):
        ToyChainDiagnostics.save(diagnostics, path)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(np, "savez", savez)
    assert ToyChainDiagnostics.save(diagnostics, path) == 0.0
    assert os.listdir(tmp_path) == ["toy_diagnostics.npz"] and np.load(path)["accuracy"].shape == (1, 4)


# ---- The GPU simulation's path on the CPU: nothing read after a reset wrote into it ----------------------------------
class ResetWritesIntoItsOutputs(gym.Env):
    """ManiSkill's GPU simulation in miniature: one batched env of N envs (not a Gymnasium VectorEnv) whose reset by
    env_idx writes into the tensors it returned before, as a GPU simulation may write into its output buffers: here
    NaN into the reset envs' rows of every observation and reward it handed out. Env i succeeds (terminates) at its
    episode step 2 + i % 3 and runs on; the time limit H truncates it. Whatever the training loop reads of a returned
    observation or reward after a reset wrote into it is NaN, and NaN reaches the weights."""

    def __init__(self, num_envs, horizon):
        self.num_envs, self.horizon, self.device = num_envs, horizon, torch.device("cpu")
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (2,))
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (1,))
        self.t = torch.zeros(num_envs, dtype=torch.long)
        self.handed_out, self.partial_resets = [], 0

    def hand_out(self, tensor):
        self.handed_out.append(tensor)
        return tensor

    def observation(self):
        return self.hand_out(torch.stack([self.t / self.horizon, torch.arange(self.num_envs) % 3.0], 1))

    def reset(self, *, seed=None, options=None):
        rows = torch.arange(self.num_envs) if options is None else options["env_idx"]
        self.partial_resets += options is not None
        for tensor in self.handed_out:
            tensor[rows] = float("nan")
        self.t[rows] = 0
        return self.observation(), {}

    def step(self, actions):
        self.t += 1
        terminated = self.t == 2 + torch.arange(self.num_envs) % 3
        reward = self.hand_out(1.0 + actions[:, 0].clamp(-1, 1))
        return self.observation(), reward, terminated, self.t >= self.horizon, {"success": terminated}


@pytest.mark.parametrize("scheme", ["staggered", "naive", "random-start"])
def test_the_batched_gpu_path_reads_no_observation_or_reward_after_a_reset_wrote_into_it(tmp_path, monkeypatch, scheme):
    """The branch a ManiSkill GPU run takes (PartialResetVecEnv over a batched env, resets by env_idx), on the CPU,
    through the training loop: its partial resets at the time limit and at termination (naive), the loop's resets
    inside a step (the gates, random start's cuts), the bootstrap V(final obs), the normalizers and the evaluation.
    Every final observation and reward the loop uses is read before a reset, or copied: no NaN reaches the weights."""
    made = []

    def make_batched(args, num_envs, device, evaluation, video_dir=None):
        made.append(ResetWritesIntoItsOutputs(num_envs, args.horizon))
        return ppo.PartialResetVecEnv(made[-1], num_envs, device, reset_on_termination=not (evaluation or args.stagger))

    monkeypatch.setattr(ppo, "make_env", make_batched)
    summary = train_in_process(
        tmp_path,
        env_id="NeverTerminates-v0",
        horizon=12,
        num_envs=6,
        num_steps=4,
        num_minibatches=2,
        total_timesteps=6 * 4 * 6,
        reset_scheme=scheme,
        eval_freq=3,
        save_model=True,
    )
    assert made[0].partial_resets >= 6 and made[1].partial_resets >= 1  # (training: gates, cuts or ends; evaluation)
    checkpoint = final_checkpoint(summary["run_dir"])
    for name, tensor in [
        *checkpoint["model"].items(),
        *checkpoint["obs_rms"].items(),
        *checkpoint["reward_rms"].items(),
    ]:
        assert torch.isfinite(tensor).all(), name
    for name in ("losses/value_loss", "charts/episodic_return", "eval/return"):
        assert math.isfinite(summary[name]), name


def test_the_normalizers_first_update_holds_the_observations_of_the_envs_trained_on_alone(tmp_path, monkeypatch):
    """The observations training starts from, after the advance, go into the observation normalizer for the envs
    trained on only. No env waits at the advance's end on its own (its last step is a gate), so env 0 is made to wait
    there for the next gate, with an observation of 1000s: the normalizer still holds ones alone."""
    advance = ppo.stagger_advance

    def advance_then_env_0_waits(envs, resets, *rest):
        raw_obs = advance(envs, resets, *rest)
        resets.waiting[0] = True
        return torch.where(torch.arange(4)[:, None] == 0, 1000.0, raw_obs)

    monkeypatch.setattr(ppo, "stagger_advance", advance_then_env_0_waits)
    summary = train_in_process(
        tmp_path,
        env_id="NeverTerminates-v0",
        horizon=10,
        num_envs=4,
        num_steps=5,
        num_minibatches=2,
        total_timesteps=4 * 5 * 2,
        save_model=True,
    )
    obs_rms = final_checkpoint(summary["run_dir"])["obs_rms"]
    torch.testing.assert_close(obs_rms["mean"], torch.ones(2), rtol=1e-5, atol=1e-5)
    # env 0 waits for the gate at the first rollout's last step: 3 of the start, 3 x 4 + 4, the second rollout's 4 x 5
    assert obs_rms["var"].max().item() < 1e-5 and obs_rms["count"].item() == pytest.approx(3 + 16 + 20 + 1e-4)


# ---- The script as a user runs it (subprocesses), asserting on what it wrote --------------------------------------
SCRIPT = os.path.join(ROOT, "ppo_staggered.py")
TOY_SMALL = [
    "--env-id",
    "ToyChain-v0",
    "--num-envs",
    "64",
    "--toy.horizon",
    "50",
    "--num-minibatches",
    "4",
    "--eval-freq",
    "2",
    "--num-eval-envs",
    "16",
]


def run_script(args, tmp_path, timeout=600, check=True):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--output-dir", str(tmp_path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:  # on a timeout (or any error) the run and its env worker processes go too
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if check:
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def only_run_dir(tmp_path, pattern="*"):
    dirs = [d for d in glob.glob(os.path.join(str(tmp_path), pattern)) if os.path.isdir(d)]
    assert len(dirs) == 1, dirs
    return dirs[0]


MUJOCO_SMALL = ["--num-envs", "8", "--num-minibatches", "2", "--num-eval-envs", "1", "--eval-freq", "2", "--no-cuda"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "scheme, advance, step_min, windows",
    [("staggered", 7 * 12 * 8, 0, 11), ("naive", 0, 16, 1), ("random-start", 0, 2, 3)],
)
def test_mujoco_smoke_of_each_reset_scheme(tmp_path, scheme, advance, step_min, windows):
    """HalfCheetah-v5 (no terminations) with H = 100: 8 envs, 3 rollouts of K = 8; the last batch's episode steps.
    Staggered: 8 groups S = 12 steps apart (advance 7 * 12 steps), so the batch spans 11 of the 13 K-step windows of
    the horizon; naive: every env at steps 16-23, one window; random-start (seed 1): env 5's first episode is cut at
    step 14, so it is at steps 2-9. Every evaluation runs one whole H-step episode."""
    args = ["--env-id", "HalfCheetah-v5", "--horizon", "100", "--total-timesteps", "192", "--reset-scheme", scheme]
    proc = run_script([*args, *MUJOCO_SMALL], tmp_path)
    # a quiet start: the settings (the device in use; no toy chain's), and no warning repeated (MuJoCo's 'settotalmass')
    assert proc.stdout.startswith("settings:\n") and "device=cpu" in proc.stdout and "toy." not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)) and "settotalmass" not in proc.stderr, proc.stderr[:2000]
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["global_step"] == 192 and summary["advance_env_steps"] == advance
    assert summary["stagger/episode_step_min"] == step_min
    assert summary["stagger/stage_coverage"] == pytest.approx(windows / 13)
    assert summary["eval/episode_len"] == 100 and math.isfinite(summary["eval/return"])
    assert [step for step, _ in scalars(run_dir)["eval/return"]] == [0, 128, 192]


def test_mujoco_advance_actions_are_uniform_in_the_bounds_and_the_env_clips_the_policys():
    """The staggered advance steps envs.action_space.sample(): uniform in HalfCheetah's [-1, 1] box, not in Gymnasium
    ClipAction's unbounded box (whose samples are N(0, 1), clipped: they flip most cheetahs before training). The
    policy's Gaussian actions beyond the bounds are clipped: stepping 5.0 is stepping 1.0."""
    args = ppo.resolve_args(ppo.Args(env_id="HalfCheetah-v5", cuda=False, num_envs=2))
    envs = ppo.make_env(args, 2, torch.device("cpu"), evaluation=False)
    try:
        assert np.all(envs.action_space.low == -1.0) and np.all(envs.action_space.high == 1.0)
        envs.action_space.seed(0)
        samples = np.stack([envs.action_space.sample() for _ in range(200)])
        assert np.abs(samples).max() <= 1.0
        assert np.mean(np.abs(samples) > 0.5) == pytest.approx(0.5, abs=0.05)  # N(0, 1): 0.62
        next_obs = []
        for action in (5.0, 1.0):
            envs.reset(seed=3)
            obs, _, _, _, _ = envs.step(torch.full((2, 6), action))
            next_obs.append(obs)
        assert torch.equal(next_obs[0], next_obs[1])
    finally:
        envs.close()


@pytest.mark.slow
def test_mujoco_evaluation_is_one_episode_to_its_fall_and_returns_the_sum_of_its_rewards(tmp_path):
    """Hopper-v5: eval/return and eval/episode_len are those of one episode of the final checkpoint's deterministic
    policy stepped here with Gymnasium itself, to the fall (a termination ends it) or the 1000-step limit."""
    args = ["--env-id", "Hopper-v5", "--total-timesteps", "128", "--save-model", *MUJOCO_SMALL]
    run_script(args, tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    checkpoint = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    agent = ppo.GaussianAgent(11, 3)
    agent.load_state_dict(checkpoint["model"])
    rms = ppo.RunningMeanStd((11,), "cpu")
    rms.mean = checkpoint["obs_rms"]["mean"]
    rms.var = checkpoint["obs_rms"]["var"]
    env = gym.make("Hopper-v5")
    obs, _ = env.reset(seed=1 + summary["global_step"])  # evaluate's seed: --seed + global step
    episode_return = 0.0
    episode_len = 0
    done = False
    while not done:
        with torch.no_grad():
            action = agent.deterministic_action(rms.normalize(torch.as_tensor(obs, dtype=torch.float32)[None]))
        obs, reward, terminated, truncated, _ = env.step(np.clip(action[0].numpy(), -1.0, 1.0))
        episode_return += reward
        episode_len += 1
        done = terminated or truncated
    assert episode_len < 1000  # the untrained Hopper falls
    assert summary["eval/episode_len"] == episode_len
    assert summary["eval/return"] == pytest.approx(episode_return, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stagger, mode", [(True, "next_step"), (False, "same_step")])
@pytest.mark.parametrize("device", DEVICES)
def test_toy_chain_smoke(tmp_path, stagger, mode, device):
    args = (
        TOY_SMALL
        + ["--total-timesteps", "3200", "--toy.autoreset-mode", mode, "--stagger" if stagger else "--no-stagger"]
        + (["--no-cuda"] if device == "cpu" else [])
    )
    run_script(args, tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert summary["global_step"] == 3200 and summary["sps"] > 0
    assert config["num_stagger_groups"] == (10 if stagger else 1) and config["toy"]["autoreset_mode"] == mode
    for key in (
        "eval/return",
        "eval/success_once",
        "eval/success_at_end",
        "charts/episodic_return",
        "toy/accuracy",
        "toy/forgetting_mean",
        "stagger/value_mse",
        "losses/value_loss",
    ):
        assert key in summary, key
    s = scalars(run_dir)
    assert [step for step, _ in s["charts/SPS"]] == [320 * i for i in range(1, 11)]
    coverage = [v for _, v in s["stagger/stage_coverage"]]
    if stagger:  # every batch holds every stage of the horizon (Sec. 3.3)
        assert min(coverage) == 1.0 and summary["advance_env_steps"] == 9 * 5 * 64
    else:  # naive: one K-step window per batch (Sec. 3.2)
        assert max(coverage) == pytest.approx(0.1) and summary["advance_env_steps"] == 0
    valid = [v for _, v in s["stagger/valid_fraction"]]
    assert min(valid) < 1.0 if mode == "next_step" and stagger else min(valid) == 1.0  # stale steps are masked
    diag = np.load(os.path.join(run_dir, "toy_diagnostics.npz"))
    assert diag["occupancy"].shape == (10, 10) and diag["accuracy"].shape == (10, 10)
    np.testing.assert_allclose(diag["occupancy"].sum(1), 64, rtol=1e-5)  # every env is in some block at every step


@pytest.mark.slow
def test_toy_chain_learns_and_staggering_helps(tmp_path):
    """Fig. 2a at H = 300 (Table 2: N = 512, K = 5, 150 updates, p_prog = 0.5): staggered PPO solves the chain,
    naive PPO does not (the paper: 0.95 vs 0.14 at H = 300). Seeds 1-5, one torch thread (conftest.py): eval success
    0.953, 0.812, 0.727, 1.0, 0.988 staggered vs 0.090, 0.031, 0.066, 0.062, 0.484 naive (smallest gap 0.50, seed 5),
    forgetting 0.007-0.016 vs 0.124-0.147 (largest ratio 0.13, seed 3)."""
    common = [
        "--env-id",
        "ToyChain-v0",
        "--toy.horizon",
        "300",
        "--eval-freq",
        "1000",
        "--num-eval-envs",
        "256",
        "--no-cuda",
        "--seed",
        "1",
    ]
    results = {}
    for name, flag in (("stag", "--stagger"), ("naive", "--no-stagger")):
        run_script(common + [flag, "--exp-name", name], tmp_path)
        results[name] = json.load(open(os.path.join(only_run_dir(tmp_path, f"*__{name}__*"), "summary.json")))
    assert results["stag"]["eval/success_at_end"] > 0.6
    assert results["stag"]["eval/success_at_end"] > results["naive"]["eval/success_at_end"] + 0.3
    assert results["stag"]["toy/forgetting_mean_overall"] < 0.3 * results["naive"]["toy/forgetting_mean_overall"]


@pytest.mark.slow
def test_save_model_then_resume_continues_the_global_step_then_evaluate(tmp_path):
    first = tmp_path / "first"
    run_script(TOY_SMALL + ["--total-timesteps", "1280", "--save-model", "--no-cuda"], first)
    run_dir = only_run_dir(first)
    ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.pt")))
    assert ckpts == ["ckpt_0.pt", "ckpt_640.pt", "final_ckpt.pt"]
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    assert ckpt["global_step"] == 1280 and ckpt["iteration"] == 4 and ckpt["optimizer"]["state"]
    assert set(ckpt) == {
        *("script", "env_id", "model", "optimizer", "global_step", "iteration", "obs_rms", "reward_rms"),
        *("steps_per_iteration", "wandb_id", "advance_env_steps", "evaluated", "rng", "loop"),
    }
    assert set(ckpt["obs_rms"]) == set(ckpt["reward_rms"]) == {"mean", "var", "count"}

    second = tmp_path / "second"  # (unused: the run continues in its own directory)
    args = TOY_SMALL + [
        "--total-timesteps",
        "2560",
        "--no-cuda",
        "--checkpoint",
        os.path.join(run_dir, "final_ckpt.pt"),
    ]
    proc = run_script(args, second)
    assert f"resuming {run_dir} at global step 1280 (iteration 4)" in proc.stdout.splitlines() and not second.exists()
    assert json.load(open(os.path.join(run_dir, "summary.json")))["global_step"] == 2560
    assert [step for step, _ in scalars(run_dir)["charts/SPS"]] == list(range(320, 2561, 320))

    third = tmp_path / "third"
    proc = run_script(
        TOY_SMALL + ["--evaluate", "--no-cuda", "--checkpoint", os.path.join(run_dir, "ckpt_640.pt")], third
    )
    assert [line for line in proc.stdout.splitlines() if line.startswith("global_step=")][0].startswith(
        "global_step=640 "
    )
    evaluated = json.load(open(os.path.join(run_dir, "eval_ckpt_640.json")))
    assert evaluated["global_step"] == 640 and 0.0 <= evaluated["eval/success_at_end"] <= 1.0 and not third.exists()


@pytest.mark.slow
def test_same_seed_gives_the_same_run(tmp_path):
    args = TOY_SMALL + ["--total-timesteps", "960", "--no-cuda"]
    for name, extra in (("a", []), ("b", []), ("c", ["--seed", "2"])):
        run_script(args + extra, tmp_path / name)
    a, b, c = (json.load(open(os.path.join(only_run_dir(tmp_path / d), "summary.json"))) for d in ("a", "b", "c"))
    for key in ("losses/value_loss", "losses/policy_loss", "eval/return", "toy/accuracy", "stagger/value_mse"):
        assert a[key] == b[key], key
    assert c["losses/value_loss"] != a["losses/value_loss"]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cudagraphs_replays_the_eager_computation_on_a_gpu(tmp_path):
    """--cudagraphs replays the policy step and the minibatch gradients as CUDA graphs (tensordict's CudaGraphModule):
    the same kernels as eager, so the same losses up to float rounding. (On a machine with a GPU, CudaGraphModule
    would also capture CPU work, whose replay does nothing: resolve_args refuses --cudagraphs with --no-cuda.)"""
    args = TOY_SMALL + ["--total-timesteps", "960"]
    for name, extra in (("eager", []), ("graphs", ["--cudagraphs"])):
        run_script(args + extra, tmp_path / name)
    eager, graphs = (
        json.load(open(os.path.join(only_run_dir(tmp_path / d), "summary.json"))) for d in ("eager", "graphs")
    )
    for key in ("losses/value_loss", "losses/policy_loss", "eval/return", "toy/accuracy"):
        assert graphs[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_track_mirrors_to_wandb_offline(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--output-dir",
            str(tmp_path / "runs"),
            *TOY_SMALL,
            "--total-timesteps",
            "640",
            "--no-cuda",
            "--track",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*", "*.wandb"))
    assert json.load(open(os.path.join(only_run_dir(tmp_path / "runs"), "summary.json")))["global_step"] == 640


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-steps", "300"], "--num-steps K=300 is longer than the task horizon H=200"),
        (["--num-envs", "0"], "--num-envs 0: must be >= 1"),
        (["--gamma", "1.5"], "--gamma 1.5: must be in [0, 1]"),
        (["--checkpoint", "no/such/ckpt.pt"], "--checkpoint no/such/ckpt.pt: no such file"),
    ],
)
def test_bad_flag_exits_early_with_a_message_and_writes_nothing(tmp_path, argv, message):
    proc = run_script(["--env-id", "ToyChain-v0", *argv], tmp_path, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []


def write_checkpoint(path, **entries):
    torch.save(entries, path)
    return str(path)


def test_checkpoints_of_another_script_or_task_and_files_that_are_none_are_refused_before_any_env_starts(
    tmp_path, monkeypatch
):
    """--checkpoint is read in resolve_args (weights_only): a file that is not a torch checkpoint, a dict that names no
    script, another script's or another task's checkpoint are refused, naming what was found; as is a checkpoint
    already at --total-timesteps, which would continue nothing."""
    monkeypatch.setattr(ppo, "make_env", lambda *args, **kwargs: pytest.fail("an env was built"))
    notes = tmp_path / "notes.pt"
    notes.write_text("not a checkpoint")
    refused = {
        str(notes): f"--checkpoint {notes}: not a checkpoint of ppo_staggered.py (",
        write_checkpoint(tmp_path / "a.pt", model={}): "a.pt: not a checkpoint of ppo_staggered.py",
        write_checkpoint(
            tmp_path / "b.pt", script="cleanba_ppo.py"
        ): "b.pt: a checkpoint of cleanba_ppo.py, not of ppo",
        write_checkpoint(tmp_path / "c.pt", script="ppo_staggered.py", env_id="HalfCheetah-v5"): (
            "c.pt: a checkpoint of HalfCheetah-v5, not of ToyChain-v0"
        ),
        write_checkpoint(tmp_path / "d.pt", script="ppo_staggered.py", env_id="ToyChain-v0", global_step=384000): (
            "--total-timesteps 384000: the checkpoint is at global step 384000 already; pass a larger value"
        ),
    }
    if os.path.exists("/etc/hostname"):
        refused["/etc/hostname"] = "--checkpoint /etc/hostname: not a checkpoint of ppo_staggered.py ("
    for checkpoint, message in refused.items():
        with pytest.raises(ppo.ArgsError, match=re.escape(message)):
            ppo.main(ppo.Args(cuda=False, output_dir=str(tmp_path / "runs"), checkpoint=checkpoint))
    assert not (tmp_path / "runs").exists()
    args = ppo.Args(cuda=False, total_timesteps=384000 + 2560, checkpoint=str(tmp_path / "d.pt"))
    assert ppo.resolve_args(args).num_iterations == 151  # (a larger total continues the run)


def test_a_file_that_is_no_checkpoint_exits_with_a_message_and_no_traceback(tmp_path):
    not_a_checkpoint = tmp_path / "notes.pt"
    not_a_checkpoint.write_text("not a checkpoint")
    proc = run_script(TOY_SMALL + ["--no-cuda", "--checkpoint", str(not_a_checkpoint)], tmp_path / "runs", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: --checkpoint {not_a_checkpoint}: not a checkpoint of ppo_staggered.py (")


@pytest.mark.slow
def test_eval_freq_0_evaluates_only_at_the_end_and_the_settings_are_printed_first(tmp_path):
    proc = run_script(TOY_SMALL + ["--total-timesteps", "960", "--eval-freq", "0", "--no-cuda"], tmp_path)
    assert [step for step, _ in scalars(only_run_dir(tmp_path))["eval/return"]] == [960]
    settings = proc.stdout.split("\nglobal_step=")[0].splitlines()  # (the block before the first evaluation)
    assert settings[0] == "settings:" and all(len(line) <= 120 for line in settings)
    pairs = " ".join(settings[1:]).split()
    assert pairs[:3] == ["exp_name=ppo_staggered", "seed=1", "torch_deterministic=True"]  # in field order
    for pair in (
        "num_envs=64",
        "gamma=0.99",
        "eval_freq=0",
        "toy.horizon=50",
        "toy.block_length=5",
        "num_iterations=3",
    ):
        assert pair in pairs, pair  # resolved: presets and derived sizes filled in


PROGRESS = re.compile(
    r"progress global_step=(\d+)/(\d+) \((\d+)%\) SPS=(\d+) elapsed=(\d+):(\d\d):(\d\d) left=(\d+:\d\d:\d\d|\?)"
    r"( charts/episodic_return=\S+ charts/success_rate=\S+)?"
)


@pytest.mark.slow
def test_progress_lines_in_a_log_file_every_interval_and_none_with_quiet(tmp_path):
    """30 iterations of 16 envs whose chain steps sleep 16 x 2 ms (training lasts 5 s at least): with stdout to a
    file and --progress-interval 1, at least 3 progress lines in the documented format, global_step rising, its
    percent rounded down, SPS that of charts/SPS at that step (rounded), the time left at that speed; with --quiet,
    none (the evaluations still print)."""
    args = [*SLOW_CHAIN, "--num-envs", "16", "--toy.horizon", "20", "--toy.step-time-mean", "0.002", "--no-cuda"]
    args += ["--num-eval-envs", "4", "--total-timesteps", str(16 * 5 * 30), "--eval-freq", "0"]
    for name, extra in (("log", ["--progress-interval", "1"]), ("quiet", ["--quiet"])):
        with open(tmp_path / f"{name}.txt", "w") as log:  # (no PYTHONUNBUFFERED: each line is flushed as printed)
            command = [sys.executable, SCRIPT, "--output-dir", str(tmp_path / name), *args, *extra]
            subprocess.run(command, stdout=log, stderr=subprocess.PIPE, cwd=ROOT, timeout=600, check=True)
    lines = (tmp_path / "log.txt").read_text().splitlines()
    progress = [PROGRESS.fullmatch(line) for line in lines if line.startswith("progress ")]
    assert len(progress) >= 3 and all(progress), lines
    steps = [int(match[1]) for match in progress]
    assert steps == sorted(set(steps)) and {int(match[2]) for match in progress} == {2400}
    sps = dict(scalars(only_run_dir(tmp_path / "log"))["charts/SPS"])
    for match, step in zip(progress, steps):
        assert int(match[3]) == 100 * step // 2400 and int(match[4]) == round(sps[step])
        hours, minutes, seconds = (int(part) for part in match[8].split(":"))
        assert abs(hours * 3600 + minutes * 60 + seconds - (2400 - step) / int(match[4])) <= 1
    assert progress[-1][9]  # (episodes of H = 20 steps have ended: the latest return and success follow)
    quiet = (tmp_path / "quiet.txt").read_text()
    assert "progress " not in quiet and "global_step=2400 eval/return=" in quiet


@pytest.mark.slow
def test_capture_video_films_mujoco_evaluations_and_an_evaluation_films_beside_its_checkpoint(tmp_path):
    """Hopper-v5 on this CPU machine (headless: MUJOCO_GL chosen by a probe), H = 10: the final evaluation films each
    of its 2 envs, an mp4 of 10 frames (the untrained Hopper does not fall in 10 steps) that imageio reads back;
    --evaluate of a copy of the final checkpoint films its env beside the copy, and says where."""
    import imageio

    args = ["--env-id", "Hopper-v5", "--horizon", "10", "--num-envs", "2", "--num-steps", "5", "--num-minibatches", "2"]
    args += ["--total-timesteps", "20", "--eval-freq", "0", "--capture-video", "--no-cuda"]
    run_script([*args, "--num-eval-envs", "2", "--save-model"], tmp_path / "train")
    run_dir = only_run_dir(tmp_path / "train")
    videos = sorted(glob.glob(os.path.join(run_dir, "videos", "*")))
    assert [os.path.basename(video) for video in videos] == ["global_step_20_env0.mp4", "global_step_20_env1.mp4"]
    for video in videos:
        assert open(video, "rb").read(12)[4:8] == b"ftyp"  # an MP4 (ISO media) file
        frames = [frame for frame in imageio.get_reader(video)]  # (not list(): its length reads as infinite)
        assert len(frames) == 10 and frames[0].ndim == 3 and frames[0].std() > 0
    beside = tmp_path / "beside"
    beside.mkdir()
    shutil.copy(os.path.join(run_dir, "final_ckpt.pt"), beside)
    evaluated = run_script(
        [*args, "--num-eval-envs", "1", "--evaluate", "--checkpoint", str(beside / "final_ckpt.pt")], tmp_path / "eval"
    )
    assert evaluated.stdout.splitlines()[-1] == f"videos: {beside / 'videos'}"
    assert os.listdir(beside / "videos") == ["global_step_20_env0.mp4"] and (beside / "eval_final_ckpt.json").exists()
    assert not (tmp_path / "eval").exists()


def live_group_members(pgid):
    """The processes (zombies excluded) of process group `pgid`: a run started with start_new_session=True."""
    members = []
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            if os.getpgid(pid) == pgid and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                members.append(pid)
        except (OSError, IndexError):  # it ended meanwhile
            pass
    return members


def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:  # it ended meanwhile
        return ""


def interrupt_when(ready, args, tmp_path, frozen=False):
    """Runs the script as from a terminal, its output to files (tmp_path/out.txt, err.txt: read them as it runs), sends
    its process group SIGINT once ready(proc) holds, waits for it to end and for its group to empty (no process left
    behind); returns its return code and the seconds from the signal to its end. frozen: every check of ready(proc)
    is made with the run's process group stopped (SIGSTOP), and SIGINT is queued before it continues, so that the run
    cannot move past the state that was checked, however the machine schedules the test and the run."""
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--output-dir", str(tmp_path), "--save-model", "--no-cuda", *args],
            cwd=ROOT,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # as if from a terminal, even when pytest itself runs in the background (where a shell starts jobs with
    try:  # SIGINT ignored); Ctrl-C reaches the whole process group
        deadline, is_ready = time.time() + 300, False
        while time.time() < deadline and not is_ready:
            time.sleep(0.05)
            if frozen:
                os.killpg(proc.pid, signal.SIGSTOP)
            is_ready = ready(proc)
            if is_ready:
                os.killpg(proc.pid, signal.SIGINT)  # (pending until the group continues)
                signalled = time.time()
            if frozen:
                os.killpg(proc.pid, signal.SIGCONT)
        assert is_ready, "the run never reached the point where it is to be interrupted"
        proc.wait(timeout=60)
        seconds = time.time() - signalled
        deadline = time.time() + 30
        while time.time() < deadline and live_group_members(proc.pid):
            time.sleep(0.1)
        assert not live_group_members(proc.pid), "processes of the run were left behind"
        return proc.returncode, seconds
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def printed(tmp_path, text):
    """Whether the run of interrupt_when has printed a line that starts with `text` (its stdout goes to a file)."""
    return any(line.startswith(text) for line in (tmp_path / "out.txt").read_text().splitlines())


@pytest.mark.slow
def test_ctrl_c_in_training_ends_the_run_within_10_s_with_its_summary_and_a_checkpoint(tmp_path):
    """SIGINT to the process group once training has printed a progress line (every second here): the run ends within
    10 s (130), its summary.json and final_ckpt.pt written whole (no temporary file left), at the same global step."""
    args = [*TOY_SMALL, "--total-timesteps", str(10**8), "--progress-interval", "1"]
    code, seconds = interrupt_when(lambda proc: printed(tmp_path, "progress "), args, tmp_path)
    assert code == 130 and seconds < 10
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["interrupted"] is True and summary["global_step"] > 0
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    assert ckpt["global_step"] == summary["global_step"]
    assert not glob.glob(os.path.join(run_dir, "*.tmp"))


SLOW_CHAIN = [
    "--toy.step-time-jitter",
    "0",
    "--num-minibatches",
    "2",
]  # (each chain's step sleeps --toy.step-time-mean)


@pytest.mark.slow
def test_ctrl_c_during_the_stagger_advance_ends_the_run_within_10_s(tmp_path):
    """SIGINT once the advance's line is printed: 16 envs, H = 2000 (16 groups S = 125 steps apart: 1875 steps) whose
    steps sleep 16 x 5 ms, an advance of 150 s at least, so the signal comes within it however slow the machine."""
    args = ["--num-envs", "16", "--toy.horizon", "2000", "--toy.step-time-mean", "0.005", *SLOW_CHAIN]
    code, seconds = interrupt_when(lambda proc: printed(tmp_path, "stagger: 16 groups S = 125 apart"), args, tmp_path)
    assert code == 130 and seconds < 10
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["interrupted"] is True and summary["global_step"] == 0 and not glob.glob(f"{run_dir}/*.pt*")


@pytest.mark.slow
def test_ctrl_c_in_an_evaluation_ends_the_run_within_10_s_with_a_checkpoint_that_continues_the_loop(tmp_path):
    """An evaluation every iteration, 32 envs for H = 100 steps that sleep 32 x 2 ms (6.4 s at least), of a run of 4
    envs (rollouts of 40 ms): the progress line at the end of iteration 1 comes right before iteration 2's evaluation,
    during which the signal comes. The checkpoint is of the state between two iterations: it holds the loop's."""
    args = ["--num-envs", "4", "--toy.horizon", "100", "--toy.step-time-mean", "0.002", *SLOW_CHAIN]
    args += ["--num-eval-envs", "32", "--eval-freq", "1", "--progress-interval", "1"]
    code, seconds = interrupt_when(lambda proc: printed(tmp_path, "progress "), args, tmp_path)
    assert code == 130 and seconds < 10
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    assert summary["interrupted"] is True and ckpt["global_step"] == summary["global_step"] == 20
    assert ckpt["loop"]["training_step"] == 5 and [step for step, _ in scalars(run_dir)["eval/return"]] == [0]


@pytest.mark.slow
def test_ctrl_c_while_the_envs_start_writes_the_summary_and_leaves_no_process(tmp_path):
    """SIGINT while ManiSkill's CPU-simulation worker processes start (the run has child processes, training has not
    begun): the run ends within 10 s, summary.json says interrupted, no checkpoint, and the workers end with the run.
    The state is checked with the run stopped (a worker runs and no checkpoint, not even the first evaluation's, has
    begun), so a loaded machine cannot let the run reach training between the check and the signal."""
    args = [
        "--env-id",
        "StackCube-v1",
        "--num-envs",
        "2",
        "--num-eval-envs",
        "1",
        "--horizon",
        "20",
        "--num-steps",
        "4",
    ]

    # Ready once a multiprocessing worker runs: not on any child, as the SAPIEN import runs `sh -c nvidia-smi` before
    # the run directory exists.
    def starting(proc):
        no_checkpoint = not glob.glob(os.path.join(str(tmp_path), "*", "*.pt*"))
        return no_checkpoint and any("multiprocessing" in cmdline(pid) for pid in live_group_members(proc.pid))

    code, seconds = interrupt_when(starting, args, tmp_path, frozen=True)
    assert code == 130 and seconds < 10
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["interrupted"] is True and summary["global_step"] == 0
    assert not glob.glob(os.path.join(run_dir, "*.pt"))


@pytest.mark.slow
def test_stackcube_cpu_simulation_smoke_then_an_evaluation_with_videos_beside_the_checkpoint(tmp_path):
    """StackCube-v1 on CPU simulation (physx_cpu, 2 worker processes), staggered; then --evaluate of its final
    checkpoint with --capture-video, whose videos go beside the checkpoint (the path printed). Without CUDA no env
    process warns that it falls back from GPU rendering."""
    args = [
        "--env-id",
        "StackCube-v1",
        "--num-envs",
        "2",
        "--num-eval-envs",
        "1",
        "--horizon",
        "20",
        "--num-steps",
        "4",
        "--total-timesteps",
        "80",
        "--eval-freq",
        "5",
        "--save-model",
        "--no-cuda",
    ]
    trained = run_script(args, tmp_path, timeout=900)
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["global_step"] == 80 and summary["advance_env_steps"] == 10 * 2  # S = floor(20 / 2)
    assert summary["eval/episode_len"] == 20 and "eval/success_once" in summary and "eval/return" in summary
    s = scalars(run_dir)
    assert s["stagger/episode_step_min"][0][1] == 0 and s["stagger/episode_step_max"][0][1] == 13
    assert "charts/episodic_return" in s  # group 0's first 20-step episode ended during training
    checkpoint = os.path.join(run_dir, "final_ckpt.pt")
    args.remove("--save-model")  # (--evaluate saves nothing: refused with it)
    evaluated = run_script(args + ["--evaluate", "--checkpoint", checkpoint, "--capture-video"], tmp_path / "eval")
    assert evaluated.stdout.splitlines()[-1] == f"videos: {os.path.join(run_dir, 'videos')}"
    assert glob.glob(os.path.join(run_dir, "videos", "**", "*.mp4"), recursive=True)
    assert "Requested to use render device" not in trained.stderr + evaluated.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "env_id", ["PushT-v1", "MS-HumanoidWalk-v1", "TwoRobotPickCube-v1", "UnitreeG1TransportBox-v1"]
)
def test_every_table_3_preset_whose_assets_ship_builds_and_trains(tmp_path, env_id):
    """One iteration of each Table 3 preset on CPU simulation (StackCube-v1 above; AnymalC-Reach-v1 downloads its
    robot on first use), with H = 2K to keep the evaluations short."""
    K = ppo.PRESETS[env_id]["num_steps"]
    run_script(
        [
            "--env-id",
            env_id,
            "--num-envs",
            "2",
            "--num-eval-envs",
            "1",
            "--horizon",
            str(2 * K),
            "--num-minibatches",
            "2",
            "--total-timesteps",
            str(2 * K),
            "--no-cuda",
        ],
        tmp_path,
        timeout=900,
    )
    summary = json.load(open(os.path.join(only_run_dir(tmp_path), "summary.json")))
    assert summary["global_step"] == 2 * K and math.isfinite(summary["losses/value_loss"])
    assert "eval/return" in summary


# ---- DDP: torchrun ranks (gloo on the CPU) ---------------------------------------------------------------------------
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_gloo_group(rank, world_size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))


def update_of_rank(rank, world_size, port, out_dir):
    """ppo_update of rank `rank` of `world_size` on its envs' columns of one (K = 4, 128 envs) batch, from the same
    weights. The shuffling is the identity, so that minibatch m of one rank (steps 2m and 2m + 1 of all 128 envs) is
    the union of minibatch m of the ranks. The batch's old log-probabilities are the policy's less 0.5: an approx KL
    of about 0.15 (each rank's share about 0.075), above --target-kl 0.11, so that the update stops after epoch 1."""
    join_gloo_group(rank, world_size, port)
    torch.randperm = lambda n, device=None: torch.arange(n, device=device)
    K, num_envs = 4, 128 // world_size
    args = ppo.Args(update_epochs=3, num_minibatches=2, target_kl=0.11, ent_coef=0.01, max_grad_norm=1e9)  # (no clip)
    args.batch_size, args.minibatch_size = K * num_envs, K * num_envs // 2
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    agent = ppo.ChainAgent(num_blocks=10, num_actions=4)
    obs, actions = (
        torch.randint(0, 10, (K, 128), generator=generator),
        torch.randint(0, 4, (K, 128), generator=generator),
    )
    with torch.no_grad():
        logprobs = agent.get_action_and_value(obs, actions)[1] - 0.5
    columns = slice(rank * num_envs, (rank + 1) * num_envs)
    batch = dict(
        obs=obs,
        actions=actions,
        logprobs=logprobs,
        advantages=torch.randn((K, 128), generator=generator),
        returns=torch.randn((K, 128), generator=generator),
        valid=torch.rand((K, 128), generator=generator) > 0.2,
    )
    batch = {key: value[:, columns].flatten(0, 1) for key, value in batch.items()}
    optimizer = torch.optim.Adam(agent.parameters(), lr=3e-4, eps=1e-5)
    losses = ppo.ppo_update(partial(ppo.minibatch_gradients, agent, optimizer, args), optimizer, batch, args)
    result = {
        "params": [p.detach() for p in agent.parameters()],
        "grads": [p.grad for p in agent.parameters()],
        "losses": losses,
        "adam_steps": max(int(state["step"]) for state in optimizer.state.values()),
    }
    torch.save(result, os.path.join(out_dir, f"update_{world_size}_{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_of_64_envs_take_the_update_of_one_rank_of_128_envs(tmp_path):
    """The loss means are over the trained-on steps of all ranks and the gradients are SUMMED over the ranks (not
    averaged), and the target-KL stop is decided on the KL of all ranks: the same Adam steps, gradients and losses."""
    for world_size in (1, 2):
        mp.spawn(update_of_rank, args=(world_size, free_port(), str(tmp_path)), nprocs=world_size, join=True)
    one = torch.load(tmp_path / "update_1_0.pt")
    assert one["adam_steps"] == 2  # the KL of all rows stopped it after epoch 1 (2 minibatches)
    for rank in (0, 1):
        two = torch.load(tmp_path / f"update_2_{rank}.pt")
        assert two["adam_steps"] == one["adam_steps"]
        torch.testing.assert_close(two["grads"], one["grads"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(two["params"], one["params"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(two["losses"], one["losses"], rtol=1e-6, atol=1e-7)


def advantages_of_rank(rank, world_size, port, out_dir):
    """normalize_advantages on rank `rank`'s half of advantage_batch()."""
    join_gloo_group(rank, world_size, port)
    advantages, valid, _ = advantage_batch()
    half = slice(32 * rank, 32 * (rank + 1))
    normalized, count = ppo.normalize_advantages(advantages[half], valid[half])
    torch.save({"normalized": normalized, "count": count}, os.path.join(out_dir, f"advantages_{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_normalize_advantages_with_the_mean_and_std_of_the_valid_entries_of_both(tmp_path):
    mp.spawn(advantages_of_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"advantages_{rank}.pt") for rank in (0, 1)]
    _, valid, expected = advantage_batch()
    normalized = torch.cat([rank["normalized"] for rank in ranks])
    torch.testing.assert_close(normalized[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert ranks[0]["count"].item() == ranks[1]["count"].item() == valid.sum().item()


class SeedClockEnv(gym.Env):
    """Observes [the seed of its first reset, its episode step] and is paid that seed each step: what an env sees and
    earns depends on which env it is, never on the actions, so 2 ranks of N envs see what 1 rank of 2N envs sees."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,))
    action_space = gym.spaces.Box(-1.0, 1.0, (1,))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.first_seed = seed if seed is not None else self.first_seed
        self.t = 0
        return np.array([self.first_seed, 0.0], dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.first_seed, self.t], dtype=np.float32), float(self.first_seed), False, False, {}


gym.register("SeedClock-v0", entry_point=SeedClockEnv)


def normalizers_of_rank(rank, world_size, port, out_dir):
    """ppo_staggered's main as rank `rank` of `world_size` (gloo; one process alone if 1) on SeedClock-v0, 8 envs in
    all (naive resets, H = 5, 2 updates); saves this rank's observation and reward normalizers at the end."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    made = []

    class RecordedRunningMeanStd(ppo.RunningMeanStd):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    ppo.RunningMeanStd = RecordedRunningMeanStd
    num_envs = 8 // world_size
    args = ppo.Args(env_id="SeedClock-v0", cuda=False, output_dir=os.path.join(out_dir, str(world_size)), horizon=5)
    args = replace(args, num_envs=num_envs, num_steps=5, num_minibatches=2, total_timesteps=80, stagger=False)
    ppo.main(replace(args, num_eval_envs=1, eval_freq=0))
    obs_rms, reward_rms = made  # (in the order main makes them)
    state = {
        "obs_rms": {"mean": obs_rms.mean, "var": obs_rms.var, "count": obs_rms.count},
        "reward_rms": {"mean": reward_rms.mean, "var": reward_rms.var, "count": reward_rms.count},
    }
    torch.save(state, os.path.join(out_dir, f"normalizers_{world_size}_{rank}.pt"))


@pytest.mark.slow
def test_two_gloo_ranks_of_4_envs_normalize_as_one_rank_of_8(tmp_path):
    """After every update the ranks merge what their normalizers learned: both end with the statistics of the
    observations (and discounted returns) of all 8 envs, those of one process stepping all 8."""
    mp.spawn(normalizers_of_rank, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    mp.spawn(normalizers_of_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    one = torch.load(tmp_path / "normalizers_1_0.pt")
    two = [torch.load(tmp_path / f"normalizers_2_{rank}.pt") for rank in (0, 1)]
    assert one["obs_rms"]["count"].item() == pytest.approx(8 * 11 + 1e-4)  # the first observations, 10 steps' after
    for name in ("obs_rms", "reward_rms"):
        for key in ("mean", "var", "count"):
            assert torch.equal(two[0][name][key], two[1][name][key]), (name, key)
            torch.testing.assert_close(two[0][name][key], one[name][key], rtol=1e-5, atol=1e-5)


def merge_of_rank(rank, world_size, port, out_dir):
    """Each rank normalizes 3-d observations of its own: two rollouts of its own batches, a merge after each."""
    join_gloo_group(rank, world_size, port)
    rms = ppo.RunningMeanStd((3,), "cpu")
    for rollout in range(2):
        for batch in observation_batches(rank, rollout):
            rms.update(torch.as_tensor(batch))
        rms.merge_ranks()
    torch.save({"mean": rms.mean, "var": rms.var, "count": rms.count}, os.path.join(out_dir, f"rms_{rank}.pt"))
    torch.distributed.destroy_process_group()


def observation_batches(rank, rollout):
    rng = np.random.default_rng([rank, rollout])
    return [rng.normal(3.0 + rank, 2.0 + rollout, size=(n, 3)).astype(np.float32) for n in (7, 50, 13)]


@pytest.mark.slow
def test_observation_statistics_merged_across_ranks_are_those_of_all_observations(tmp_path):
    """After each merge every rank holds the mean and variance of the observations of all ranks (each counted once,
    though the ranks share the statistics of the merge before) against numpy's over all of them."""
    mp.spawn(merge_of_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    data = np.concatenate(
        [batch for rank in (0, 1) for rollout in (0, 1) for batch in observation_batches(rank, rollout)]
    )
    merged = [torch.load(tmp_path / f"rms_{rank}.pt") for rank in (0, 1)]
    for key in ("mean", "var", "count"):
        assert torch.equal(merged[0][key], merged[1][key]), key
    np.testing.assert_allclose(merged[0]["count"].item(), len(data) + 1e-4, rtol=1e-6)
    np.testing.assert_allclose(merged[0]["mean"].numpy(), data.mean(0), rtol=1e-5)
    np.testing.assert_allclose(merged[0]["var"].numpy(), data.var(0), rtol=1e-5)


def run_torchrun(args, tmp_path):
    """torchrun with 2 ranks (gloo), in its own process group, killed whole on a timeout."""
    proc = subprocess.Popen(
        [*TORCHRUN, SCRIPT, "--output-dir", str(tmp_path), "--no-cuda", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal, even in the background
    )
    return proc


def children(pid):
    """The live child processes of `pid` (torchrun starts each rank in a session of its own)."""
    found = []
    for name in (name for name in os.listdir("/proc") if name.isdigit()):
        try:
            state, ppid = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):  # it ended meanwhile
            continue
        if int(ppid) == pid and state != "Z":
            found.append(int(name))
    return found


def ranks_of(proc):
    """{rank: pid} of a torchrun run, once both ranks run (or as many as were seen before it ended)."""
    deadline, ranks = time.time() + 300, {}
    while time.time() < deadline and len(ranks) < 2 and proc.poll() is None:
        ranks = {environment_of(pid).get("RANK"): pid for pid in children(proc.pid)}
        time.sleep(0.1)
    return ranks


def environment_of(pid):
    try:
        entries = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return {}
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in entries if b"=" in entry)


def finish(proc, timeout=600):
    """Waits for a torchrun run (killed, ranks included, if it runs past `timeout`); checks that no process of it is
    left; returns its return code and output."""
    ranks = ranks_of(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        for pid in [*ranks.values(), proc.pid]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # (already gone: the normal case)
                pass
        proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(pid) for pid in ranks.values()):
        time.sleep(0.1)
    assert not [pid for pid in ranks.values() if alive(pid)], "ranks of the run were left behind"
    return proc.returncode, out, err


def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_torchrun_resumes_a_one_process_checkpoint_on_two_ranks(tmp_path):
    """A checkpoint of one process of 128 envs resumes under torchrun with 2 ranks of 64, in its run directory: the
    ranks' envs start anew and re-stagger (one line says so, from rank 0), every update counts the env steps of both
    ranks (2 x 64 x 5) and only rank 0 writes."""
    one_process = [arg if arg != "64" else "128" for arg in TOY_SMALL]  # (iterations of 640 env steps, as 2 x 64)
    run_script(one_process + ["--total-timesteps", "1280", "--save-model", "--no-cuda"], tmp_path / "first")
    run_dir = only_run_dir(tmp_path / "first")
    args = TOY_SMALL + ["--total-timesteps", "3840", "--checkpoint", os.path.join(run_dir, "final_ckpt.pt")]
    code, out, err = finish(run_torchrun([*args, "--save-model"], tmp_path / "second"))
    assert code == 0, out[-3000:] + err[-3000:]
    restart = "resume: 2 torchrun ranks run their own envs: envs start anew and re-stagger (advance of 45 steps x 128"
    assert out.count("resume: ") == 1 and restart + " envs = 5760 env steps)" in out.splitlines()
    assert not (tmp_path / "second").exists()
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["world_size"] == 2 and config["num_envs"] == 64 and config["num_iterations"] == 6
    assert summary["global_step"] == 3840
    assert [step for step, _ in scalars(run_dir)["charts/SPS"]] == [640, 1280, 1920, 2560, 3200, 3840]
    assert torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)["iteration"] == 6
    assert summary["advance_env_steps"] == 45 * 128 + 45 * 128  # (the one process's advance, then the ranks')


@pytest.mark.slow
def test_a_killed_rank_ends_the_torchrun_run_non_zero_and_leaves_no_process(tmp_path):
    """Rank 1 is killed (SIGKILL) in the middle of training: rank 0, in or entering a collective, fails or is ended
    by torchrun, writes its summary.json, and torchrun exits non-zero naming the killed rank; nothing is left."""
    args = TOY_SMALL + ["--total-timesteps", str(10**8), "--save-model", "--eval-freq", "1"]
    proc = run_torchrun(args, tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and len(glob.glob(os.path.join(str(tmp_path), "*", "ckpt_*.pt"))) < 3:
        time.sleep(0.2)  # a few updates made
    os.kill(ranks_of(proc)["1"], signal.SIGKILL)
    code, out, err = finish(proc, timeout=300)  # a hang would be killed there
    assert code != 0 and "exitcode  : -9" in err, err[-3000:]
    summary = json.load(open(os.path.join(only_run_dir(tmp_path), "summary.json")))
    assert summary["global_step"] > 0


@pytest.mark.slow
def test_ctrl_c_under_torchrun_ends_every_rank_and_rank_0_writes_the_summary_and_a_checkpoint(tmp_path):
    """Ctrl-C in a terminal reaches torchrun and both ranks (one process group), and torchrun passes it on to the
    ranks once more: the ranks stop together before an iteration, rank 0 writes summary.json and final_ckpt.pt."""
    proc = run_torchrun(TOY_SMALL + ["--total-timesteps", str(10**8), "--save-model", "--eval-freq", "1"], tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and len(glob.glob(os.path.join(str(tmp_path), "*", "ckpt_*.pt"))) < 3:
        time.sleep(0.2)  # a few updates made
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, timeout=300)  # a hang would be killed there
    assert code != 0 and out.count("interrupted: writing summary.json") == 1, out[-3000:] + err[-3000:]
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["interrupted"] is True and summary["global_step"] > 0
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    assert ckpt["global_step"] == summary["global_step"]


# ---- The GPU path, checked on the CPU ---------------------------------------------------------------------------------
class BatchedEnvStub(gym.Env):
    """What gym.make returns for a batched ManiSkill task, reduced to the kwargs it got and one frame per sub-env."""

    def __init__(self, num_envs, **kwargs):
        self.num_envs, self.kwargs = num_envs, kwargs
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (2,))

    def render(self):
        return np.zeros((self.num_envs, 4, 4, 3), dtype=np.uint8)


class RecordEpisodeStub(gym.Wrapper):
    def __init__(self, env, output_dir, **kwargs):
        super().__init__(env)
        self.kwargs = kwargs


@pytest.mark.parametrize("video", [True, False])
def test_maniskill_envs_render_on_the_ranks_gpu_and_a_video_shows_at_most_8_envs(monkeypatch, video):
    """torchrun rank 1 (physx_cuda:1): its envs render on cuda:1, not on ManiSkill's default (GPU 0), and a video env's
    frames are those of the first 8 of its 128 sub-envs, tiled 2 x 4. (Not "none": PushT-v1 needs a render system.)"""
    record = importlib.import_module("mani_skill.utils.wrappers.record")
    monkeypatch.setattr(gym, "make", lambda env_id, num_envs, **kwargs: BatchedEnvStub(num_envs, **kwargs))
    monkeypatch.setattr(record, "RecordEpisode", RecordEpisodeStub)
    args = ppo.Args(env_id="PushCube-v1", resolved_sim_backend="physx_cuda:1", horizon=50)
    env = ppo.make_maniskill_env(args, 128, evaluation=True, video_dir="videos" if video else None)
    assert env.unwrapped.kwargs["sim_backend"] == "physx_cuda:1"
    assert env.unwrapped.kwargs["render_backend"] == "cuda:1"
    if video:
        assert env.render().shape[0] == 8 and env.video_nrows == 2
        assert env.kwargs["avoid_overwriting_video"]  # (a resume and --evaluate film into the run's videos/)


def test_cpu_simulation_records_the_first_8_eval_envs(monkeypatch):
    """CPU simulation (one env per process): of 12 evaluation envs, the first 8 record a video each."""
    video_dirs = []

    def record_video_dir(args, num_envs, evaluation, video_dir):
        video_dirs.append(video_dir)
        return gym.make("CartPole-v1")  # (a stand-in: no ManiSkill env is built)

    def build_each_env(fns, **kwargs):
        for fn in fns:
            fn()
        raise InterruptedError

    monkeypatch.setattr(ppo, "make_maniskill_env", record_video_dir)
    monkeypatch.setattr(gym.vector, "AsyncVectorEnv", build_each_env)
    args = ppo.Args(env_id="PushCube-v1", resolved_sim_backend="physx_cpu", horizon=50)
    with pytest.raises(InterruptedError):
        ppo.make_env(args, 12, torch.device("cpu"), evaluation=True, video_dir="videos")
    assert video_dirs == [f"videos/env{i}" for i in range(8)] + [None] * 4


def test_anymal_under_torchrun_is_refused_early_while_its_robot_is_not_downloaded(monkeypatch):
    """Every rank would ask (input()) and download the robot at the same moment: refused, naming the command."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = importlib.import_module("mani_skill.utils.assets.data")
    monkeypatch.setattr(data, "is_data_source_downloaded", lambda uid: uid != "anymal_c")
    with pytest.raises(ppo.ArgsError, match="python -m mani_skill.utils.download_asset anymal_c"):
        ppo.resolve_args(ppo.Args(env_id="AnymalC-Reach-v1", cuda=False))
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: ManiSkill's own prompt
    assert ppo.resolve_args(ppo.Args(env_id="AnymalC-Reach-v1", cuda=False)).world_size == 1


def counted_update_of_rank(rank, world_size, port, out_dir):
    """update_of_rank, counting the all-reduces of the update."""
    calls = []
    all_reduce = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda tensor, *a, **kw: calls.append(tensor.numel()) or all_reduce(tensor, *a, **kw)
    update_of_rank(rank, world_size, port, out_dir)
    json.dump(calls, open(os.path.join(out_dir, f"all_reduces_{rank}.json"), "w"))


@pytest.mark.slow
def test_an_update_under_torchrun_makes_two_all_reduces_per_minibatch(tmp_path):
    """The 2-rank update of the test above (2 minibatches, stopped by the KL after epoch 1): per minibatch one
    all-reduce of the loss's three scalar shares and one of all gradients, flat; then the KL and the statistics."""
    mp.spawn(counted_update_of_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    num_parameters = sum(p.numel() for p in ppo.ChainAgent(num_blocks=10, num_actions=4).parameters())
    for rank in (0, 1):
        calls = json.load(open(tmp_path / f"all_reduces_{rank}.json"))
        assert calls == [3, num_parameters, 3, num_parameters, 1, 6], calls


def main_of_rank(rank, world_size, port, out_dir):
    """ppo_staggered's main as torchrun's rank `rank` (gloo) on a small ToyChain run; records which envs it built."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    built, make_env = [], ppo.make_env
    ppo.make_env = lambda args, num_envs, device, evaluation, **kw: (
        built.append(evaluation) or make_env(args, num_envs, device, evaluation, **kw)
    )
    ppo_update = ppo.ppo_update

    def recorded_update(gradients, optimizer, batch, args):  # saves this rank's weights after every update
        losses = ppo_update(gradients, optimizer, batch, args)
        torch.save(optimizer.param_groups[0]["params"], os.path.join(out_dir, f"weights_{rank}.pt"))
        return losses

    ppo.ppo_update = recorded_update
    args = ppo.Args(env_id="ToyChain-v0", cuda=False, output_dir=out_dir, num_envs=16, num_eval_envs=4)
    summary = ppo.main(replace(args, toy=ToyChainConfig(horizon=20), total_timesteps=2 * 16 * 5 * 2, eval_freq=1))
    json.dump({"built": built, "summary": summary}, open(os.path.join(out_dir, f"main_{rank}.json"), "w"))


@pytest.mark.slow
def test_under_torchrun_rank_0_alone_builds_an_evaluation_env_and_the_ranks_end_with_the_same_weights(tmp_path):
    """Rank 0 alone evaluates; the ranks start from rank 0's weights (their seeds differ) and take the same updates."""
    mp.spawn(main_of_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.load(open(tmp_path / f"main_{rank}.json")) for rank in (0, 1)]
    assert ranks[0]["built"] == [False, True] and ranks[1]["built"] == [False]
    assert "eval/return" in ranks[0]["summary"] and ranks[0]["summary"]["global_step"] == 320
    weights = [torch.load(tmp_path / f"weights_{rank}.pt") for rank in (0, 1)]
    assert all(torch.equal(weight_0, weight_1) for weight_0, weight_1 in zip(*weights))


@pytest.mark.slow
def test_ranks_whose_torchrun_is_killed_stop_and_rank_0_writes_the_summary(tmp_path):
    """kill -9 of torchrun leaves its ranks (sessions of their own) as orphans: each sees its parent change and
    stops at the next iteration, as at Ctrl-C; rank 0 writes summary.json. Whatever happens, nothing is left."""
    proc = run_torchrun(TOY_SMALL + ["--total-timesteps", str(10**8), "--save-model", "--eval-freq", "1"], tmp_path)
    ranks = {}
    try:
        ranks = ranks_of(proc)
        deadline = time.time() + 300
        while time.time() < deadline and len(glob.glob(os.path.join(str(tmp_path), "*", "ckpt_*.pt"))) < 3:
            time.sleep(0.2)  # a few updates made
        assert len(ranks) == 2 and proc.poll() is None
        proc.kill()
        out, err = proc.communicate(timeout=120)  # (the pipes close once both ranks are gone)
        deadline = time.time() + 30
        while time.time() < deadline and any(alive(pid) for pid in ranks.values()):
            time.sleep(0.1)
        assert not [pid for pid in ranks.values() if alive(pid)], "the ranks trained on without their launcher"
    finally:
        for pid in [*ranks.values(), proc.pid]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    summary = json.load(open(os.path.join(only_run_dir(tmp_path), "summary.json")))
    assert summary["interrupted"] is True and summary["global_step"] > 0, out[-3000:] + err[-3000:]


@pytest.mark.slow
def test_the_gpu_simulation_branch_trains_with_cpu_simulation(tmp_path, monkeypatch):
    """The branch a GPU run takes (one batched ManiSkill env in this process, PartialResetVecEnv resetting by env_idx),
    with gym.make given physx_cpu instead of physx_cuda:0 and one env. PushCube-v1, H = 6, K = 4, 3 iterations: the
    time limits fall at training steps 6 (iteration 2, t = 1) and 12 (iteration 3, t = 3). The task is made to
    succeed exactly at its time limit, so a success read after the reset would be lost."""
    H, K = 6, 4
    made, reconfigurations, env_resets, raw_steps, vec_steps, gae_calls = [], [], [], [], [], []
    make, resolve, compute_gae, vec_step = gym.make, ppo.resolve_args, ppo.compute_gae, ppo.PartialResetVecEnv.step

    def cpu_make(env_id, **kwargs):
        env = make(env_id, **{**kwargs, "sim_backend": "physx_cpu", "render_backend": "gpu"})  # (GPU or CPU: any)
        base, evaluation = env.unwrapped, kwargs["reconfiguration_freq"] == 1
        made.append(kwargs)
        evaluate, reconfigure, reset, step = base.evaluate, base._reconfigure, env.reset, env.step
        base.evaluate = lambda: {**evaluate(), "success": base.elapsed_steps >= H}
        base._reconfigure = lambda options: reconfigurations.append(evaluation) or reconfigure(options)
        if not evaluation:
            env.reset = lambda **kw: env_resets.append(kw.get("options")) or reset(**kw)
            env.step = lambda action: raw_steps.append(step(action)) or raw_steps[-1]
        return env

    def recording_vec_step(self, actions):
        result = vec_step(self, actions)
        vec_steps.append((self.batched_maniskill, self.reset_on_termination, result))
        return result

    def recording_compute_gae(rewards, values, next_values, no_bootstrap, dones, gamma, gae_lambda):
        gae_calls.append([tensor.clone() for tensor in (rewards, values, next_values, no_bootstrap, dones)])
        return compute_gae(rewards, values, next_values, no_bootstrap, dones, gamma, gae_lambda)

    monkeypatch.setattr(gym, "make", cpu_make)
    monkeypatch.setattr(ppo, "resolve_args", lambda args: replace(resolve(args), resolved_sim_backend="physx_cuda:0"))
    monkeypatch.setattr(ppo.PartialResetVecEnv, "step", recording_vec_step)
    monkeypatch.setattr(ppo, "compute_gae", recording_compute_gae)
    args = ppo.Args(env_id="PushCube-v1", cuda=False, output_dir=str(tmp_path), num_envs=1, num_eval_envs=1)
    args = replace(args, stagger=False)  # (immediate partial resets: the training env's PartialResetVecEnv below)
    summary = ppo.main(replace(args, horizon=H, num_steps=K, num_minibatches=2, total_timesteps=3 * K, eval_freq=2))

    assert [(kwargs["sim_backend"], kwargs["render_backend"]) for kwargs in made] == [("physx_cuda:0", "cuda:0")] * 2
    training = [result for batched, reset_on_termination, result in vec_steps if batched and reset_on_termination]
    assert len(training) == 3 * K  # (no stagger advance with one env)
    # partial resets by env_idx at the time limits, and final_obs (the true last observation) only there
    assert [step for step, (_, _, _, truncated, _) in enumerate(training, 1) if truncated.any()] == [6, 12]
    assert [options for options in env_resets if options] == [{"env_idx": torch.tensor([0])}] * 2
    for step in (6, 12):
        raw_obs, vec_obs, info = raw_steps[step - 1][0], training[step - 1][0], training[step - 1][4]
        torch.testing.assert_close(info["final_obs"], raw_obs)
        assert not torch.equal(vec_obs, raw_obs)  # the reset one
        assert info["success"].tolist() == [True]  # read before the reset
    assert ["final_obs" in info for *_, info in training].count(True) == 2
    # V(final obs) bootstrapped at the time limit (t = 1 of iteration 2), V(next obs) elsewhere
    rewards, values, next_values, no_bootstrap, dones = gae_calls[1]
    assert dones[:, 0].tolist() == [False, True, False, False] and not no_bootstrap.any()
    assert next_values[1, 0] != values[2, 0]
    torch.testing.assert_close(next_values[[0, 2], 0], values[[1, 3], 0])
    # the episodes succeeded at their last step: read before the reset, in training and in evaluation
    assert summary["charts/success_rate"] == 1.0 and summary["eval/success_at_end"] == 1.0
    # the evaluation env builds a new scene at its every reset (3 evaluations: iterations 1 and 3, the end), the
    # training env never after its creation
    assert reconfigurations.count(False) == 0 and reconfigurations.count(True) >= 3
    assert json.load(open(os.path.join(summary["run_dir"], "summary.json")))["global_step"] == 3 * K
