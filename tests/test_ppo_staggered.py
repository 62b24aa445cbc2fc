"""ppo_staggered.py: GAE under both autoreset modes, reset bookkeeping (stale steps, reset gates), the stagger
schedule, networks, argument validation, and smoke runs as a user runs the script."""

import glob
import json
import math
import os
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

import ppo_staggered as ppo
from toy_chain_env import ToyChainConfig, ToyChainVectorEnv

GAMMA, LAM = 0.9, 0.8


# ----------------------------------------------------------------------------------------------------------------------
# GAE and bootstrapping
# ----------------------------------------------------------------------------------------------------------------------
def col(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype).view(-1, 1)


def test_gae_same_step_hand_worked():
    # One env: s0 -> s1 terminates (reset to s0'), s0' -> s1' truncates (true last obs s2', reset to s0'').
    rewards, values = col(1, 2, 3, 4), col(0.5, 1.0, 1.5, 2.0)
    terms = col(0, 1, 0, 0, dtype=torch.bool)
    dones = col(0, 1, 0, 1, dtype=torch.bool)
    final_values, final_mask = col(0, 0, 0, 2.5), col(0, 0, 0, 1, dtype=torch.bool)  # V(s2') = 2.5
    last_value = torch.tensor([3.0])  # V(s0''): must not be used for the truncated step
    next_values = ppo.bootstrap_values(values, last_value, final_values, final_mask)
    assert next_values.view(-1).tolist() == [1.0, 1.5, 2.0, 2.5]
    adv, ret = ppo.compute_gae(rewards, values, next_values, terms, dones, GAMMA, LAM)
    # deltas: 1+.9*1-.5 = 1.4 | 2-1 = 1.0 (terminal) | 3+.9*2-1.5 = 3.3 | 4+.9*2.5-2 = 4.25 (truncated: V(s2'))
    # A3 = 4.25; A2 = 3.3 + .72*4.25 = 6.36; A1 = 1.0 (episode end); A0 = 1.4 + .72*1.0 = 2.12
    np.testing.assert_allclose(adv.view(-1).numpy(), [2.12, 1.0, 6.36, 4.25], rtol=1e-6)
    np.testing.assert_allclose(ret.view(-1).numpy(), [2.62, 2.0, 7.86, 6.25], rtol=1e-6)


def test_gae_next_step_hand_worked_equals_same_step_on_the_valid_steps():
    # The same trajectory in next-step mode: the step after each episode end is a stale reset step (obs = the
    # old episode's last obs sT / s2', reward 0, action ignored), masked out; truncation bootstraps V(s2') directly.
    rewards, values = col(1, 2, 0, 3, 4, 0), col(0.5, 1.0, 7.0, 1.5, 2.0, 2.5)  # V(sT) = 7 is never used
    terms = col(0, 1, 0, 0, 0, 0, dtype=torch.bool)
    truncs = col(0, 0, 0, 0, 1, 0, dtype=torch.bool)
    no_final = torch.zeros(6, 1, dtype=torch.bool)
    next_values = ppo.bootstrap_values(values, torch.tensor([3.0]), torch.zeros(6, 1), no_final)
    adv, _ = ppo.compute_gae(rewards, values, next_values, terms, terms | truncs, GAMMA, LAM)

    stale = torch.zeros(1, dtype=torch.bool)
    valid = []
    for t in range(6):
        v, _, stale, _, _ = ppo.reset_bookkeeping(stale, torch.zeros(1, dtype=torch.bool), terms[t], truncs[t],
                                                  no_final[t], torch.zeros(1, dtype=torch.long), True, True)
        valid.append(v.item())
    assert valid == [True, True, False, True, True, False]
    np.testing.assert_allclose(adv.view(-1)[torch.tensor(valid)].numpy(), [2.12, 1.0, 6.36, 4.25], rtol=1e-6)


def reference_gae(rewards, values, true_next_values, terms, dones, gamma, lam):
    """Independent reference: for each env and step, sum (gamma*lam)^l delta_{t+l} until the episode ends."""
    K, N = rewards.shape
    adv = np.zeros((K, N))
    for i in range(N):
        for t in range(K):
            total, coef = 0.0, 1.0
            for u in range(t, K):
                delta = rewards[u, i] + gamma * (0.0 if terms[u, i] else true_next_values[u, i]) - values[u, i]
                total += coef * delta
                if dones[u, i]:
                    break
                coef *= gamma * lam
            adv[t, i] = total
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_a_per_episode_reference_on_random_rollouts(seed):
    rng = np.random.default_rng(seed)
    K, N = 16, 5
    rewards, values = rng.normal(size=(K, N)), rng.normal(size=(K, N))
    terms = rng.random((K, N)) < 0.1
    truncs = (rng.random((K, N)) < 0.1) & ~terms
    dones = terms | truncs
    last_value = rng.normal(size=N)
    final_values = rng.normal(size=(K, N))  # same-step: V(final_obs) where an env reset after truncation
    final_mask = truncs
    true_next = np.concatenate([values[1:], last_value[None]], 0)
    true_next = np.where(final_mask, final_values, true_next)
    expected = reference_gae(rewards, values, true_next, terms, dones, GAMMA, LAM)
    t = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    next_values = ppo.bootstrap_values(t(values), t(last_value), t(final_values), torch.as_tensor(final_mask))
    adv, ret = ppo.compute_gae(t(rewards), t(values), next_values, torch.as_tensor(terms), torch.as_tensor(dones),
                               GAMMA, LAM)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ret.numpy(), expected + values, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------------
# Reset bookkeeping: stale steps, waiting for the gate, immediate resets
# ----------------------------------------------------------------------------------------------------------------------
def run_bookkeeping(terms, truncs, finals, next_step_mode, gate_mode):
    b = lambda x: torch.tensor([bool(x)])  # noqa: E731
    stale = waiting = b(0)
    step = torch.tensor([0])
    rows = []
    for te, tr, fi in zip(terms, truncs, finals):
        valid, end, stale, waiting, step_next = ppo.reset_bookkeeping(stale, waiting, b(te), b(tr), b(fi), step,
                                                                      next_step_mode, gate_mode)
        rows.append((valid.item(), end.item(), step.item()))
        step = step_next
    return rows


def test_bookkeeping_gate_mode_masks_a_terminated_env_until_its_truncation_resets_it():
    # same-step, gate: terminates at t=1 (not reset), waits t=2..4; its horizon ends (truncation + reset) at t=4.
    rows = run_bookkeeping(terms=[0, 1, 0, 1, 0, 0], truncs=[0, 0, 0, 0, 1, 0], finals=[0, 0, 0, 0, 1, 0],
                           next_step_mode=False, gate_mode=True)
    assert [r[0] for r in rows] == [True, True, False, False, False, True]  # valid
    assert [r[1] for r in rows] == [False, True, False, False, False, False]  # the episode ended at the termination
    assert [r[2] for r in rows] == [0, 1, 2, 3, 4, 0]  # episode step restarts after the gate


def test_bookkeeping_immediate_mode_resets_at_termination():
    rows = run_bookkeeping(terms=[0, 1, 0, 0], truncs=[0, 0, 0, 0], finals=[0, 1, 0, 0],
                           next_step_mode=False, gate_mode=False)
    assert [r[0] for r in rows] == [True] * 4
    assert [r[1] for r in rows] == [False, True, False, False]
    assert [r[2] for r in rows] == [0, 1, 0, 1]


def test_bookkeeping_next_step_masks_the_stale_step_and_restarts_the_episode_step_after_it():
    rows = run_bookkeeping(terms=[0, 0, 0, 0], truncs=[0, 1, 0, 0], finals=[0, 0, 0, 0],
                           next_step_mode=True, gate_mode=True)
    assert [r[0] for r in rows] == [True, True, False, True]
    assert [r[2] for r in rows] == [0, 1, 2, 0]


# ----------------------------------------------------------------------------------------------------------------------
# Stagger schedule (Sec. 3.3, App. B.1)
# ----------------------------------------------------------------------------------------------------------------------
def test_groups_are_contiguous_and_balanced():
    groups = ppo.stagger_groups(10, 4)
    assert groups.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert ppo.stagger_groups(8, 1).tolist() == [0] * 8


def test_group_j_starts_so_that_it_is_at_step_j_times_s_after_the_advance():
    assert ppo.stagger_start_steps(4, 5) == [15, 10, 5, 0]
    assert ppo.stagger_start_steps(1, 8) == [0]


def stagger_args(num_groups, step, gate=True):
    return SimpleNamespace(num_stagger_groups=num_groups, stagger_step=step,
                           partial_reset_mode="gate" if gate else "immediate")


def fresh_state(n):
    state = {k: torch.zeros(n, dtype=torch.bool) for k in ("stale", "waiting")}
    state["episode_step"] = torch.zeros(n, dtype=torch.long)
    return state


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
@pytest.mark.parametrize("device", DEVICES)
def test_after_the_advance_group_j_is_at_episode_step_j_times_s_and_a_batch_covers_every_stage(mode, device):
    H, K, N = 40, 5, 32
    groups_n = math.ceil(H / K)
    envs = ToyChainVectorEnv(N, ToyChainConfig(horizon=H, autoreset_mode=mode), device=device)
    obs, _ = envs.reset(seed=0)
    state = fresh_state(N)
    state = {k: v.to(device) for k, v in state.items()}
    groups = ppo.stagger_groups(N, groups_n, device)
    random_act = lambda o: torch.randint(0, 20, (N,), device=device)  # noqa: E731
    ppo.advance_for_stagger(envs, obs, state, groups, stagger_args(groups_n, K), random_act,
                            lambda o, update: o)
    assert torch.equal(envs.episode_step, groups * K)  # the env's own clock
    assert torch.equal(state["episode_step"], groups * K)  # the script's bookkeeping agrees
    steps = []
    for _ in range(K):
        steps.append(state["episode_step"].clone())
        *_, terminated, truncated, info = envs.step(random_act(None))
        _, _, state["stale"], state["waiting"], state["episode_step"] = ppo.reset_bookkeeping(
            state["stale"], state["waiting"], terminated, truncated, info.get("_final_obs", torch.zeros_like(truncated)),
            state["episode_step"], mode == "next_step", True)
    stats = ppo.batch_temporal_stats(torch.stack(steps), torch.ones(K, N, dtype=torch.bool, device=device), H, K)
    assert stats["stage_coverage"] == 1.0 and stats["stage_entropy"] > 0.99
    naive = ppo.batch_temporal_stats(torch.stack(steps) % K, torch.ones(K, N, dtype=torch.bool), H, K)
    assert naive["stage_coverage"] == 1 / groups_n and naive["stage_entropy"] == 0.0


class EarlyTerminationEnv(gym.vector.VectorEnv):
    """A same-step env that keeps running after a termination (as ManiSkillVecEnv in gate mode): env i terminates
    when its episode reaches step terminate_at[i] (-1: never) and is reset only by its time limit H."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, horizon, terminate_at):
        self.num_envs, self.horizon = len(terminate_at), horizon
        self.terminate_at = torch.tensor(terminate_at)
        self.elapsed = torch.zeros(self.num_envs, dtype=torch.long)
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (1,))
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (1,))

    def reset(self, *, seed=None, options=None):
        mask = torch.ones(self.num_envs, dtype=torch.bool) if options is None else options["reset_mask"]
        self.elapsed[mask] = 0
        return self.elapsed.float().view(-1, 1), {}

    def step(self, actions):
        self.elapsed += 1
        terminated = self.elapsed == self.terminate_at
        truncated = self.elapsed >= self.horizon
        final_obs = self.elapsed.float().view(-1, 1)
        self.elapsed[truncated] = 0
        info = {"final_obs": final_obs, "_final_obs": truncated.clone(), "success": terminated}
        return self.elapsed.float().view(-1, 1), torch.ones(self.num_envs), terminated, truncated, info


def test_gate_masks_an_early_terminated_env_until_its_groups_gate_then_resets_it_with_the_group():
    # H = 8, two groups of two envs, S = 4: group 0 starts at step 0, group 1 at step 4 (its gates: t = 3, 11, ...).
    # Env 1 (group 0) terminates at its episode step 2 (t = 1); env 3 (group 1) at episode step 6 (t = 1).
    H, S = 8, 4
    envs = EarlyTerminationEnv(H, terminate_at=[-1, 2, -1, 6])
    obs, _ = envs.reset()
    state = fresh_state(4)
    groups = ppo.stagger_groups(4, 2)
    zero_act = lambda o: torch.zeros(4, 1)  # noqa: E731
    ppo.advance_for_stagger(envs, obs, state, groups, stagger_args(2, S), zero_act, lambda o, update: o)
    assert envs.elapsed.tolist() == [0, 0, 4, 4]
    valid_rows, step_rows = [], []
    for _ in range(12):
        step_rows.append(state["episode_step"].tolist())
        _, _, terminated, truncated, info = envs.step(zero_act(None))
        valid, _, state["stale"], state["waiting"], state["episode_step"] = ppo.reset_bookkeeping(
            state["stale"], state["waiting"], terminated, truncated, info["_final_obs"], state["episode_step"],
            False, True)
        valid_rows.append(valid.tolist())
    valid_env1 = [row[1] for row in valid_rows]
    valid_env3 = [row[3] for row in valid_rows]
    # env 1: terminal transition t=1 is trained on; t=2..7 masked (waiting); group 0's gate resets it after t=7;
    # in its next episode it terminates again at t=9 and waits again.
    assert valid_env1 == [True, True] + [False] * 6 + [True, True, False, False]
    # env 3: terminal at t=1; masked t=2..3; group 1's gate (t=3) resets it; terminates again at t=9 (step 6).
    assert valid_env3 == [True, True, False, False] + [True] * 6 + [False, False]
    assert [row[1] for row in step_rows][8] == 0 and [row[0] for row in step_rows][8] == 0  # reset with its group
    assert [row[3] for row in step_rows][4] == 0 and [row[2] for row in step_rows][4] == 0
    assert all(all(row[i] for i in (0, 2)) for row in valid_rows)  # envs that never terminate are never masked


def test_immediate_mode_never_masks():
    envs = EarlyTerminationEnv(8, terminate_at=[2, -1])
    envs.reset()
    state = fresh_state(2)
    for _ in range(10):
        _, _, terminated, truncated, info = envs.step(torch.zeros(2, 1))
        valid, _, state["stale"], state["waiting"], state["episode_step"] = ppo.reset_bookkeeping(
            state["stale"], state["waiting"], terminated, truncated, info["_final_obs"], state["episode_step"],
            False, False)
        assert valid.all()


# ----------------------------------------------------------------------------------------------------------------------
# Other pure pieces
# ----------------------------------------------------------------------------------------------------------------------
def test_forgetting_matrix_is_best_so_far_minus_current():
    accuracy = np.array([[0.2, 0.9], [0.6, 0.5], [0.4, 0.95]])
    np.testing.assert_allclose(ppo.forgetting_matrix(accuracy), [[0, 0], [0, 0.4], [0.2, 0]])


def test_running_mean_std_matches_numpy():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 4)) for n in (7, 50, 13)]
    rms = ppo.RunningMeanStd((4,), "cpu", epsilon=1e-12)
    for batch in batches:
        rms.update(torch.as_tensor(batch, dtype=torch.float64))
    data = np.concatenate(batches)
    np.testing.assert_allclose(rms.mean.numpy(), data.mean(0), rtol=1e-9)
    np.testing.assert_allclose(rms.var.numpy(), data.var(0), rtol=1e-9)


def test_episode_stats_count_only_trained_on_steps_and_restart_at_episode_ends():
    stats = ppo.EpisodeStats(2, "cpu")
    b = lambda *x: torch.tensor(x, dtype=torch.bool)  # noqa: E731
    # env 0: rewards 1, 2 (ends, success), then 5; env 1: 1, (masked 10), 3 (ends, no success at the end)
    stats.step(torch.tensor([1.0, 1.0]), b(1, 1), b(0, 1), b(0, 0))
    ended = stats.step(torch.tensor([2.0, 10.0]), b(1, 0), b(1, 0), b(1, 0))
    assert ended["return"][0] == 3.0 and ended["episode_len"][0] == 2 and ended["success_once"][0]
    ended = stats.step(torch.tensor([5.0, 3.0]), b(1, 1), b(0, 0), b(0, 1))
    assert ended["return"][1] == 4.0 and ended["episode_len"][1] == 2
    assert ended["success_once"][1] and not ended["success_at_end"][1]  # success earlier in the episode only
    assert stats.ret.tolist() == [5.0, 0.0] and stats.len.tolist() == [1, 0]


def test_masked_mean():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
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
    direct_logits = agent.actor(obs)
    dist = torch.distributions.Categorical(logits=direct_logits)
    torch.testing.assert_close(logprob, dist.log_prob(actions))
    torch.testing.assert_close(entropy, dist.entropy())
    torch.testing.assert_close(value, agent.critic(obs)[:, 0])
    # gradients are the same too
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


# ----------------------------------------------------------------------------------------------------------------------
# Arguments: presets and early, clear errors
# ----------------------------------------------------------------------------------------------------------------------
def test_toy_preset_is_table_2():
    a = ppo.resolve_args(ppo.Args(env_id="ToyChain-v0", cuda=False))
    assert (a.num_envs, a.num_steps, a.gamma, a.gae_lambda, a.num_minibatches, a.ent_coef) == (512, 5, 0.99, 0.95, 4, 0.01)
    assert a.num_iterations == 150 and a.minibatch_size == 640 and a.target_kl is None
    assert a.num_stagger_groups == 40 and a.stagger_step == 5  # ceil(H/K) = ceil(200/5), S = K
    naive = ppo.resolve_args(ppo.Args(env_id="ToyChain-v0", cuda=False, stagger=False))
    assert naive.num_stagger_groups == 1


def test_stackcube_preset_is_table_3():
    assert ppo.PRESETS["StackCube-v1"] == dict(num_steps=8, horizon=100, gamma=0.8, gae_lambda=0.9, num_envs=4096)
    a = ppo.resolve_args(ppo.Args(env_id="StackCube-v1", cuda=False))
    assert (a.num_steps, a.resolved_horizon, a.gamma, a.gae_lambda) == (8, 100, 0.8, 0.9)
    assert (a.ent_coef, a.target_kl, a.num_minibatches, a.norm_obs) == (0.005, 0.1, 4, True)
    assert a.resolved_sim_backend == "physx_cpu" and a.num_envs == 8  # CPU simulation: one process per env
    b = ppo.resolve_args(ppo.Args(env_id="StackCube-v1", cuda=False, num_envs=16, num_steps=10, gamma=0.5))
    assert (b.num_envs, b.num_steps, b.gamma, b.num_stagger_groups) == (16, 10, 0.5, 10)  # flags override presets


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_steps=300), "--num-steps K=300 is longer than the task horizon H=200"),
        (dict(num_envs=10, num_minibatches=4, num_steps=5), "does not split into --num-minibatches 4"),
        (dict(num_envs=8, num_stagger_groups=9), "--num-stagger-groups N_B=9 exceeds --num-envs N=8"),
        (dict(num_stagger_groups=3, stagger=False), "contradicts --no-stagger"),
        (dict(stagger_step=100), "past the horizon"),
        (dict(env_id="NoSuchTask-v9"), "is not ToyChain-v0 or a registered ManiSkill3 task"),
        (dict(toy=ToyChainConfig(horizon=52)), "--toy.horizon"),
        (dict(horizon=10), "--toy.horizon"),
        (dict(cudagraphs=True), "--cudagraphs needs CUDA"),
        (dict(evaluate=True), "--evaluate needs --checkpoint"),
        (dict(checkpoint="/nonexistent/ckpt.pt"), "no such file"),
        (dict(total_timesteps=100), "less than one batch"),
    ],
)
def test_bad_input_is_rejected_with_the_flag_named(kwargs, message):
    with pytest.raises(ppo.ArgsError, match=message.replace("*", r"\*").replace("(", r"\(")):
        ppo.resolve_args(ppo.Args(cuda=False, **kwargs))


def test_missing_vulkan_driver_is_reported_before_maniskill_starts(monkeypatch):
    monkeypatch.setenv("VK_DRIVER_FILES", "/nonexistent/vulkan_icd.json")
    assert "do not exist" in ppo.find_vulkan_problem()
    with pytest.raises(ppo.ArgsError, match="Vulkan driver .* README.md"):
        ppo.resolve_args(ppo.Args(env_id="StackCube-v1", cuda=False))


# ----------------------------------------------------------------------------------------------------------------------
# Smoke tests: the script as a user runs it, asserting on what it wrote
# ----------------------------------------------------------------------------------------------------------------------
SCRIPT = os.path.join(ROOT, "ppo_staggered.py")
TOY_SMALL = ["--env-id", "ToyChain-v0", "--num-envs", "64", "--toy.horizon", "50", "--num-minibatches", "4",
             "--eval-freq", "2", "--num-eval-envs", "16", "--no-progress-bar"]


def run_script(args, tmp_path, timeout=600, check=True):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--output-dir", str(tmp_path), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def only_run_dir(tmp_path, pattern="*"):
    dirs = [d for d in glob.glob(os.path.join(str(tmp_path), pattern)) if os.path.isdir(d)]
    assert len(dirs) == 1, dirs
    return dirs[0]


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("stagger, mode", [(True, "next_step"), (False, "same_step")])
@pytest.mark.parametrize("device", DEVICES)
def test_toy_chain_smoke(tmp_path, stagger, mode, device):
    args = TOY_SMALL + ["--total-timesteps", "3200", "--toy.autoreset-mode", mode,
                        "--stagger" if stagger else "--no-stagger"] + (["--no-cuda"] if device == "cpu" else [])
    run_script(args, tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert summary["global_step"] == 3200 and summary["iteration"] == 10 and summary["sps"] > 0
    assert config["num_stagger_groups"] == (10 if stagger else 1) and config["toy"]["autoreset_mode"] == mode
    for key in ("eval/return", "eval/success_once", "eval/success_at_end", "charts/episodic_return",
                "toy/accuracy", "toy/forgetting_mean", "stagger/value_mse", "losses/value_loss"):
        assert key in summary, key
    s = scalars(run_dir)
    assert [step for step, _ in s["charts/SPS"]] == [320 * i for i in range(1, 11)]
    coverage = [v for _, v in s["stagger/stage_coverage"]]
    if stagger:  # every batch holds every stage of the horizon (Sec. 3.3)
        assert min(coverage) == 1.0
        assert summary["advance_env_steps"] == 9 * 5 * 64
    else:  # naive: one K-step window per batch (Sec. 3.2)
        assert max(coverage) == pytest.approx(0.1)
        assert summary["advance_env_steps"] == 0
    valid = [v for _, v in s["stagger/valid_fraction"]]
    assert min(valid) < 1.0 if mode == "next_step" and stagger else min(valid) == 1.0  # stale steps are masked
    for png in ("toy_block_occupancy.png", "toy_forgetting_matrix.png"):
        assert os.path.getsize(os.path.join(run_dir, png)) > 1000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir)
    acc.Reload()
    assert {"toy/block_occupancy", "toy/forgetting_matrix"} <= set(acc.Tags()["images"])
    assert {"toy/block_occupancy", "stagger/episode_step"} <= set(acc.Tags()["histograms"])
    diag = np.load(os.path.join(run_dir, "toy_diagnostics.npz"))
    assert diag["occupancy"].shape == (10, 10) and diag["forgetting"].min() >= 0
    np.testing.assert_allclose(diag["occupancy"].sum(1), 64, rtol=1e-5)  # every env is in some block at every step


def test_toy_chain_learns_and_staggering_helps(tmp_path):
    """App. C setting (H = 200, p_prog = 0.5, 150 updates) with 128 envs: staggered PPO solves the chain, naive PPO
    does much worse and forgets more (seeds 1-3 gave 0.92-0.98 vs 0.16-0.53 success, 0.03 vs 0.12-0.14 forgetting)."""
    common = ["--env-id", "ToyChain-v0", "--num-envs", "128", "--toy.horizon", "200", "--toy.progression-prob", "0.5",
              "--total-timesteps", str(128 * 5 * 150), "--eval-freq", "1000", "--num-eval-envs", "256",
              "--no-progress-bar", "--no-cuda"]
    results = {}
    for name, flag in (("stag", "--stagger"), ("naive", "--no-stagger")):
        run_script(common + [flag, "--exp-name", name], tmp_path)
        results[name] = json.load(open(os.path.join(only_run_dir(tmp_path, f"*__{name}__*"), "summary.json")))
    assert results["stag"]["eval/success_at_end"] > 0.8
    assert results["stag"]["eval/success_at_end"] > results["naive"]["eval/success_at_end"] + 0.2
    assert results["stag"]["toy/forgetting_mean_overall"] < 0.5 * results["naive"]["toy/forgetting_mean_overall"]


def test_save_model_then_resume_continues_the_global_step_then_evaluate(tmp_path):
    first = tmp_path / "first"
    run_script(TOY_SMALL + ["--total-timesteps", "1280", "--save-model", "--no-cuda"], first)
    run_dir = only_run_dir(first)
    ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.pt")))
    assert ckpts == ["ckpt_0.pt", "ckpt_640.pt", "final_ckpt.pt"]
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=False)
    assert ckpt["global_step"] == 1280 and ckpt["iteration"] == 4
    assert set(ckpt) >= {"agent", "optimizer", "obs_rms", "rng", "args"} and ckpt["optimizer"]["state"]

    second = tmp_path / "second"
    proc = run_script(TOY_SMALL + ["--total-timesteps", "2560", "--no-cuda", "--checkpoint",
                                   os.path.join(run_dir, "final_ckpt.pt")], second)
    assert "resuming from" in proc.stdout
    resumed = only_run_dir(second)
    summary = json.load(open(os.path.join(resumed, "summary.json")))
    assert summary["global_step"] == 2560
    assert [step for step, _ in scalars(resumed)["charts/SPS"]] == [1600, 1920, 2240, 2560]

    third = tmp_path / "third"
    run_script(TOY_SMALL + ["--evaluate", "--no-cuda", "--checkpoint", os.path.join(run_dir, "final_ckpt.pt")], third)
    evaluated = json.load(open(os.path.join(only_run_dir(third), "summary.json")))
    assert evaluated["global_step"] == 1280 and 0.0 <= evaluated["eval/success_at_end"] <= 1.0
    assert "charts/SPS" not in evaluated and "eval/return" in evaluated


def test_same_seed_gives_the_same_run_and_policy_advance_works(tmp_path):
    args = TOY_SMALL + ["--total-timesteps", "960", "--no-cuda", "--stagger-advance", "policy"]
    first, second = tmp_path / "a", tmp_path / "b"
    run_script(args, first)
    run_script(args, second)
    a, b = (json.load(open(os.path.join(only_run_dir(d), "summary.json"))) for d in (first, second))
    for key in ("losses/value_loss", "losses/policy_loss", "eval/return", "toy/accuracy", "stagger/value_mse"):
        assert a[key] == b[key], key
    assert a["advance_env_steps"] == 9 * 5 * 64
    run_script(args[:-2] + ["--seed", "2"], tmp_path / "c")
    c = json.load(open(os.path.join(only_run_dir(tmp_path / "c"), "summary.json")))
    assert c["losses/value_loss"] != a["losses/value_loss"]


def test_track_mirrors_to_wandb_offline(tmp_path):
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, SCRIPT, "--output-dir", str(tmp_path / "runs"), *TOY_SMALL,
                           "--total-timesteps", "640", "--no-cuda", "--track"], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*", "*.wandb"))
    assert json.load(open(os.path.join(only_run_dir(tmp_path / "runs"), "summary.json")))["global_step"] == 640


def test_compile_option_trains(tmp_path):
    """--compile (torch.compile of the policy step and the PPO update, LeanRL-style) on the CPU."""
    run_script(TOY_SMALL + ["--total-timesteps", "1280", "--compile", "--no-cuda"], tmp_path, timeout=900)
    summary = json.load(open(os.path.join(only_run_dir(tmp_path), "summary.json")))
    assert summary["global_step"] == 1280 and math.isfinite(summary["losses/value_loss"])
    assert json.load(open(os.path.join(only_run_dir(tmp_path), "config.json")))["compile"] is True


def test_bad_flag_exits_early_with_a_message_and_writes_nothing(tmp_path):
    proc = run_script(["--env-id", "ToyChain-v0", "--num-steps", "300"], tmp_path, check=False)
    assert proc.returncode == 2
    assert "--num-steps K=300 is longer than the task horizon H=200" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_ctrl_c_writes_the_summary_and_a_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, SCRIPT, "--output-dir", str(tmp_path), "--save-model", "--no-cuda",
                             *TOY_SMALL, "--total-timesteps", str(10**8)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    trained = lambda: [p for p in glob.glob(os.path.join(str(tmp_path), "*", "ckpt_*.pt"))  # noqa: E731
                       if not p.endswith("ckpt_0.pt")]  # a checkpoint written after some training
    while time.time() < deadline and not trained():
        time.sleep(0.2)
    assert trained(), "no checkpoint after training started"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["interrupted"] is True and summary["global_step"] > 0
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=False)
    assert ckpt["global_step"] == summary["global_step"] and ckpt["iteration"] == summary["iteration"]
    assert not glob.glob(os.path.join(run_dir, "*.tmp"))


def test_stackcube_cpu_simulation_smoke(tmp_path):
    """StackCube-v1 on CPU simulation (physx_cpu, 2 worker processes), staggered, with an evaluation video."""
    args = ["--env-id", "StackCube-v1", "--num-envs", "2", "--num-eval-envs", "1", "--horizon", "20",
            "--num-steps", "4", "--total-timesteps", "80", "--eval-freq", "5", "--capture-video", "--no-cuda",
            "--no-progress-bar"]
    run_script(args, tmp_path, timeout=900)
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["global_step"] == 80 and summary["advance_env_steps"] == 4 * 2
    assert summary["eval/episode_len"] == 20 and "eval/success_once" in summary and "eval/return" in summary
    s = scalars(run_dir)
    first_batch = dict((k, v[0][1]) for k, v in s.items() if k.startswith("stagger/episode_step"))
    assert first_batch["stagger/episode_step_min"] == 0 and first_batch["stagger/episode_step_max"] == 7
    assert "charts/episodic_return" in s  # group 0's first 20-step episode ended during training
    assert glob.glob(os.path.join(run_dir, "videos", "**", "*.mp4"), recursive=True)
