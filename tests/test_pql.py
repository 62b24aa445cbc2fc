"""pql.py: n-step targets (termination, truncation, an episode end inside the window, both autoreset modes), the
categorical projection, mixed exploration, speed-ratio control, the learners' targets, argument validation, and
runs of the script as a user runs it (toy chain, ManiSkill on CPU simulation, checkpoints, failures, Ctrl-C)."""

import dataclasses
import glob
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import types

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import DEVICES, ROOT

import pql
from toy_chain_env import ToyChainContinuousConfig

GAMMA = 0.5


# ----------------------------------------------------------------------------------------------------------------------
# n-step targets (Sec. 3, Table B.1: n = 3) with termination and truncation kept apart
# ----------------------------------------------------------------------------------------------------------------------
def cols(*rows, dtype=torch.float32):
    """(n, N) tensor from n rows of N values."""
    return torch.tensor(rows, dtype=dtype)


def test_nstep_targets_hand_worked():
    # n = 3, gamma = 0.5, rewards 1, 2, 4 in every column; the columns differ in where the episode ends:
    #   0: no end                 R = 1 + 1 + 1 = 3,  discount 0.5^3 = 0.125 (bootstrap from step 2's next obs)
    #   1: terminated at step 1   R = 1 + 0.5*2 = 2,  discount 0             (nothing after a terminal state)
    #   2: truncated at step 1    R = 2,              discount 0.5^2 = 0.25  (bootstrap from the true final obs)
    #   3: terminated at step 0   R = 1,              discount 0
    #   4: truncated at step 0    R = 1,              discount 0.5
    #   5: truncated at step 2    R = 3,              discount 0.125
    #   6: terminated at step 2   R = 3,              discount 0
    #   7: truncated at 0, terminated at 2 (the next episode's end must not leak in): R = 1, discount 0.5
    rewards = cols([1] * 8, [2] * 8, [4] * 8)
    terms = cols([0, 0, 0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    truncs = cols([0, 0, 0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0], dtype=torch.bool)
    returns, discounts, last = pql.nstep_targets(rewards, terms, terms | truncs, GAMMA)
    assert returns.tolist() == [3, 2, 2, 1, 1, 3, 3, 1]
    assert discounts.tolist() == [0.125, 0, 0.25, 0, 0.5, 0.125, 0, 0.5]
    assert last.tolist() == [2, 1, 1, 0, 0, 2, 2, 0]


def test_nstep_one_step_is_the_td_target():
    r, te, tr = cols([1.5, 2.0, 3.0]), cols([0, 1, 0], dtype=torch.bool), cols([0, 0, 1], dtype=torch.bool)
    returns, discounts, last = pql.nstep_targets(r, te, te | tr, 0.9)
    assert returns.tolist() == [1.5, 2.0, 3.0] and last.tolist() == [0, 0, 0]
    np.testing.assert_allclose(discounts.numpy(), [0.9, 0.0, 0.9])


def push_all(assembler, steps):
    """Pushes (obs, reward, terminated, truncated, true_next_obs) of one env; returns the emitted transitions."""
    out = []
    for obs, reward, te, tr, nxt in steps:
        t = assembler.push(
            torch.tensor([[float(obs)]]),
            torch.tensor([[0.0]]),
            torch.tensor([float(reward)]),
            torch.tensor([bool(te)]),
            torch.tensor([bool(tr)]),
            torch.tensor([[float(nxt)]]),
        )
        if t is not None:
            out.append((t["obs"].item(), t["reward"].item(), t["discount"].item(), t["next_obs"].item()))
    return out


# One env, n = 3, gamma = 0.5. Episode 1: obs 0, 1, 2; truncated at its third step: the true final obs is 3 (the env
# already returned the reset obs 10, and the Actor passes info["final_obs"] = 3). Episode 2: obs 10, 11; terminated at
# its second step (true next obs 12, reset obs 20). Then obs 20.
TRAJECTORY = [
    (0, 1, 0, 0, 1),
    (1, 2, 0, 0, 2),
    (2, 4, 0, 1, 3),
    (10, 8, 0, 0, 11),
    (11, 16, 1, 0, 12),
    (20, 32, 0, 0, 21),
]


def test_nstep_assembler_hand_worked_truncated():
    assert push_all(pql.NStepAssembler(3, GAMMA, "truncated"), TRAJECTORY) == [
        (0, 3.0, 0.125, 3.0),  # 1 + 0.5*2 + 0.25*4, truncation at the window's end: gamma^3 V(3)
        (1, 4.0, 0.25, 3.0),  # 2 + 0.5*4, the truncation inside the window cuts it: gamma^2 V(true final 3)
        (2, 4.0, 0.5, 3.0),  # the truncated step itself: gamma V(3), never V(reset obs 10)
        (10, 16.0, 0.0, 12.0),  # 8 + 0.5*16, then a termination: no bootstrap
    ]


def test_nstep_assembler_hand_worked_always():
    # --bootstrap-at-done always (ManiSkill): the termination bootstraps too, gamma^2 V(12), like a truncation
    assert push_all(pql.NStepAssembler(3, GAMMA, "always"), TRAJECTORY)[3] == (10, 16.0, 0.25, 12.0)


def reference_nstep(rewards, terms, truncs, true_next, n, gamma, bootstrap_at_done):
    """Independent reference: walk forward from each step until n steps or the episode's end."""
    T, N = rewards.shape
    out = []
    for t in range(T - n + 1):
        row = []
        for i in range(N):
            ret, disc, nxt = 0.0, gamma**n, true_next[t + n - 1, i]
            for k in range(n):
                ret += gamma**k * rewards[t + k, i]
                if terms[t + k, i] or truncs[t + k, i]:
                    cut = terms[t + k, i] and bootstrap_at_done == "truncated"
                    disc = 0.0 if cut else gamma ** (k + 1)
                    nxt = true_next[t + k, i]
                    break
            row.append((ret, disc, nxt))
        out.append(row)
    return out


@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("bootstrap_at_done", ["truncated", "always"])
def test_nstep_assembler_matches_a_reference_on_random_trajectories(n, bootstrap_at_done):
    rng = np.random.default_rng(n)
    T, N, gamma = 40, 6, 0.9
    rewards = rng.normal(size=(T, N))
    terms = rng.random((T, N)) < 0.1
    truncs = (rng.random((T, N)) < 0.1) & ~terms
    true_next = rng.normal(size=(T, N))
    assembler = pql.NStepAssembler(n, gamma, bootstrap_at_done)
    got = []
    for t in range(T):
        f = lambda x, dtype=torch.float64: torch.as_tensor(x[t], dtype=dtype)  # noqa: E731
        out = assembler.push(
            f(rewards)[:, None],
            torch.zeros(N, 1),
            f(rewards),
            f(terms, torch.bool),
            f(truncs, torch.bool),
            f(true_next)[:, None],
        )
        if out is not None:
            got.append(list(zip(out["reward"].tolist(), out["discount"].tolist(), out["next_obs"][:, 0].tolist())))
    expected = reference_nstep(rewards, terms, truncs, true_next, n, gamma, bootstrap_at_done)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# Distributional critic (PQL-D, App. C)
# ----------------------------------------------------------------------------------------------------------------------
def test_categorical_projection_hand_worked():
    support = torch.tensor([-1.0, 0.0, 1.0])
    probs = torch.tensor([[0.2, 0.5, 0.3]] * 3)
    returns, discounts = torch.tensor([0.5, -2.0, 2.0]), torch.tensor([0.5, 0.0, 1.0])
    projected = pql.categorical_projection(probs, returns, discounts, support)
    # row 0: atoms move to 0.5 + 0.5 * {-1, 0, 1} = {0, 0.5, 1}: 0.2 -> 0; 0.5 split equally between 0 and 1; 0.3 -> 1
    # row 1: terminal (discount 0), R = -2 clamps to -1: all mass on -1; row 2: everything beyond 1 clamps to 1
    torch.testing.assert_close(projected, torch.tensor([[0.0, 0.45, 0.55], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))


def reference_projection(probs, returns, discounts, support):
    """Independent loop version of Bellemare et al. (2017), Alg. 1."""
    B, K = probs.shape
    v_min, v_max = support[0], support[-1]
    dz = (v_max - v_min) / (K - 1)
    out = np.zeros((B, K))
    for b in range(B):
        for j in range(K):
            tz = min(max(returns[b] + discounts[b] * support[j], v_min), v_max)
            pos = (tz - v_min) / dz
            lo, hi = int(math.floor(pos)), int(math.ceil(pos))
            if lo == hi:
                out[b, lo] += probs[b, j]
            else:
                out[b, lo] += probs[b, j] * (hi - pos)
                out[b, hi] += probs[b, j] * (pos - lo)
    return out


def test_categorical_projection_matches_a_reference_and_keeps_the_mean():
    rng = np.random.default_rng(0)
    B, K = 64, 51
    support = np.linspace(-10, 10, K)
    probs = rng.dirichlet(np.ones(K), size=B)
    returns, discounts = rng.uniform(-3, 3, B), rng.choice([0.0, 0.99**3, 0.5], B)
    t = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    projected = pql.categorical_projection(t(probs), t(returns), t(discounts), t(support)).numpy()
    np.testing.assert_allclose(projected, reference_projection(probs, returns, discounts, support), atol=1e-12)
    np.testing.assert_allclose(projected.sum(1), 1.0, atol=1e-12)
    # where no atom is clamped, the projection keeps the mean: E = R + discount * E[Z]
    inside = np.all(np.abs(returns[:, None] + discounts[:, None] * support[None]) <= 10, axis=1)
    np.testing.assert_allclose(
        (projected * support).sum(1)[inside], (returns + discounts * (probs * support).sum(1))[inside], atol=1e-9
    )


def test_distributional_critic_target_takes_the_lower_mean_head_and_sums_to_one():
    args = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, distributional=True, target_noise_std=0.0))
    v = pql.VLearner(args, 10, 4, 16, torch.device("cpu"))
    next_obs = torch.randn(32, 10)
    returns, discounts = torch.randn(32), torch.full((32,), 0.97)
    target = v.target(returns, discounts, next_obs)
    assert target.shape == (32, 51)
    torch.testing.assert_close(target.sum(-1), torch.ones(32))
    with torch.no_grad():
        logits1, logits2 = v.critic_target(next_obs, v.policy(next_obs))
        p1, p2 = logits1.softmax(-1), logits2.softmax(-1)
        s = v.critic.support
        chosen = torch.where(((p1 * s).sum(-1) <= (p2 * s).sum(-1))[:, None], p1, p2)
    torch.testing.assert_close(
        target,
        torch.as_tensor(
            reference_projection(
                chosen.double().numpy(), returns.double().numpy(), discounts.double().numpy(), s.double().numpy()
            ),
            dtype=torch.float32,
        ),
        atol=1e-5,
        rtol=1e-5,
    )


def test_scalar_critic_target_is_the_min_of_the_target_heads():
    args = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, target_noise_std=0.0))
    v = pql.VLearner(args, 10, 4, 16, torch.device("cpu"))
    with torch.no_grad():
        for p in v.critic_target.q2.parameters():
            p.add_(0.1)  # make the two target heads differ
    next_obs, returns, discounts = torch.randn(8, 10), torch.randn(8), torch.tensor([0.0, 0.5] * 4)
    with torch.no_grad():
        action = v.policy(next_obs)
        x = torch.cat([next_obs, action], -1)
        expected = returns + discounts * torch.min(v.critic_target.q1(x), v.critic_target.q2(x))[:, 0]
    torch.testing.assert_close(v.target(returns, discounts, next_obs), expected)


def test_each_network_sync_carries_the_networks_of_sec_3_1():
    """Sec. 3.1: the P-learner maximizes the V-learner's newest Q functions (its online critic, not the target
    networks, a slow Polyak copy), and the V-learner's target policy is the policy the P-learner trains (relayed by the
    Actor). After three V-updates (online and target critics differ), what each learner sends back is its online
    network, and what each receives is loaded into the network it uses."""
    args = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, batch_size=8))
    v_learner = pql.VLearner(args, 10, 4, 64, torch.device("cpu"))
    p_learner = pql.PLearner(args, 10, 4, 64, torch.device("cpu"))
    vector = lambda module: torch.nn.utils.parameters_to_vector(module.parameters()).detach()  # noqa: E731
    stats = {"obs_mean": torch.zeros(10), "obs_var": torch.ones(10)}
    transitions = {"obs": torch.randn(16, 10), "action": torch.rand(16, 4), "reward": torch.randn(16)}
    transitions.update(next_obs=torch.randn(16, 10), discount=torch.full((16,), 0.9), **stats)
    new_policy = torch.randn_like(vector(p_learner.policy))
    v_learner.receive({**transitions, "policy": new_policy})
    assert torch.equal(vector(v_learner.policy), new_policy)  # the target policy: what the Actor relayed
    for _ in range(3):
        v_learner.update()
    sent = pql.network_sent_back("v_learner", v_learner)
    assert set(sent) == {"critic"} and torch.equal(sent["critic"], vector(v_learner.critic))
    assert not torch.allclose(sent["critic"], vector(v_learner.critic_target))
    p_learner.receive({"obs": transitions["obs"], "critic": sent["critic"], **stats})
    assert torch.equal(vector(p_learner.critic), sent["critic"])  # the P-learner maximizes the newest Q functions
    p_learner.update()
    sent = pql.network_sent_back("p_learner", p_learner)
    assert set(sent) == {"policy"} and torch.equal(sent["policy"], vector(p_learner.policy))


def wait_until(condition, what, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.01)


def test_the_v_learner_process_sends_back_its_online_critic(tmp_path):
    """The V-learner process as the Actor runs it, one step at a time, in an order fixed by its counters (no race):
    data of one Actor step allows it 8 updates; then new data, to which it answers with its critic; then a checkpoint
    request. The critic it sent is the online critic of its checkpoint, not the target networks (which differ from it
    after 8 soft updates)."""
    args = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, batch_size=8))
    policy, critic, _ = pql.initial_networks(args, 10, 4, "cpu")
    policy_numel = sum(p.numel() for p in policy.parameters())
    critic_numel = sum(p.numel() for p in critic.parameters())
    shapes = {"obs": (16, 10), "action": (16, 4), "reward": (16,), "next_obs": (16, 10), "discount": (16,)}
    inbox = pql.SlotRing({**shapes, "policy": (policy_numel,), "obs_mean": (10,), "obs_var": (10,)}, "cpu", 4)
    outbox = pql.SlotRing({"critic": (critic_numel,)}, "cpu", 2)
    message = {k: torch.rand_like(slot) for k, slot in inbox.slots[0].items() if k != "obs_var"}
    message["obs_var"] = torch.ones(10)
    counters = torch.multiprocessing.RawValue(pql.SharedCounters)
    counters.p_learner.updates = 100  # the P-learner never holds the V-learner back here
    ctx = torch.multiprocessing.get_context("spawn")
    stop = ctx.Event()
    process = ctx.Process(
        target=pql.learner_process,
        args=("v_learner", args, (10, 4, 64), inbox, outbox, counters, stop, str(tmp_path), 1),
        daemon=True,
    )
    process.start()
    try:
        inbox.put(message)
        counters.actor_steps = 1  # one Actor step: 8 V-updates (beta_a:v = 1:8)
        wait_until(lambda: counters.v_learner.updates == 8, "8 V-updates")
        inbox.put(message)
        wait_until(lambda: outbox.written.value == 2, "the answer to the second message")
        counters.checkpoint_requests = 1
        wait_until(lambda: counters.v_learner.served == 1, "the checkpoint")
        assert counters.v_learner.updates == 8  # no update since the answer
        assert counters.v_learner.loss > 0 and counters.p_learner.served == 0  # its last loss, for the Actor's log
        state = torch.load(tmp_path / "v_learner_state.pt", weights_only=True)
        critic.load_state_dict(state["model"]["critic"])
        sent = outbox.slots[1]["critic"]
        assert torch.equal(sent, torch.nn.utils.parameters_to_vector(critic.parameters()))
        critic.load_state_dict(state["model"]["critic_target"])
        assert not torch.allclose(sent, torch.nn.utils.parameters_to_vector(critic.parameters()))
    finally:
        stop.set()
        process.join(timeout=30)
        process.kill()
    assert not list(tmp_path.glob("*_error.txt"))


# ----------------------------------------------------------------------------------------------------------------------
# Mixed exploration (Sec. 3.3)
# ----------------------------------------------------------------------------------------------------------------------
def test_mixed_exploration_sigmas_are_spread_uniformly_over_the_range():
    torch.testing.assert_close(pql.mixed_exploration_sigmas(4, 0.05, 0.8), torch.tensor([0.05, 0.3, 0.55, 0.8]))
    n = 4096
    sigmas = pql.mixed_exploration_sigmas(n, 0.05, 0.8)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    torch.testing.assert_close(sigmas.double(), 0.05 + (i - 1) / (n - 1) * 0.75)  # sigma_i of Sec. 3.3
    assert pql.mixed_exploration_sigmas(1, 0.05, 0.8).tolist() == [pytest.approx(0.05)]


def test_explore_adds_noise_of_each_envs_sigma_and_clips():
    sigmas = torch.tensor([0.05, 0.2, 0.4])
    mean = torch.zeros(3, 20000)
    generator = torch.Generator().manual_seed(0)
    actions = pql.explore(mean, sigmas, generator)
    np.testing.assert_allclose(actions.std(1).numpy(), sigmas.numpy(), rtol=0.03)
    clipped = pql.explore(torch.full((3, 1000), 0.95), sigmas, generator)
    assert clipped.max() <= 1.0 and (clipped[2] == 1.0).float().mean() > 0.4


# ----------------------------------------------------------------------------------------------------------------------
# Speed-ratio control (Sec. 3.2)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "beta_a_v, beta_p_v", [(1 / 8, 1 / 2), (1 / 4, 1.0), (1 / 12, 1 / 3), (2.0, 1 / 2), (1.0, 2.0)]
)
def test_ratio_control_never_deadlocks_and_keeps_the_ratios(beta_a_v, beta_p_v):
    """Three processes of random, changing speeds act whenever their rule allows: none ever waits for a state that
    cannot change (no deadlock), and the counts stay within a few updates of the target ratios."""
    rng = random.Random(0)
    k_v, k_p = 1 / beta_a_v, 1 / beta_p_v
    A = V = P = 0
    for tick in range(60_000):
        if tick % 1000 == 0:
            speeds = [rng.uniform(0.1, 10.0) for _ in range(3)]
        allowed = [
            pql.actor_may_step(A, V, beta_a_v),
            pql.v_may_update(V, A, P, beta_a_v, beta_p_v),
            pql.p_may_update(P, V, beta_p_v),
        ]
        assert any(allowed), (A, V, P)
        who = rng.choices(range(3), weights=speeds)[0]
        if allowed[who]:
            if who == 0:
                A += 1
            elif who == 1:
                V += 1
            else:
                P += 1
        assert V <= k_v * A + 1e-9 and V >= k_v * (A - 2) - 1 - 1e-9  # within two Actor steps
        assert k_p * P <= V + 1e-9 and V <= k_p * P + 2 * max(k_p, 1) + 1e-9  # within two P-updates
    assert A > 100


# ----------------------------------------------------------------------------------------------------------------------
# Other pieces
# ----------------------------------------------------------------------------------------------------------------------
def test_replay_buffer_wraps_around_and_samples_only_what_it_holds():
    buf = pql.ReplayBuffer(5, {"x": ()}, torch.device("cpu"))
    buf.add({"x": torch.tensor([1.0, 2.0, 3.0])})
    g = torch.Generator().manual_seed(0)
    assert set(buf.sample(200, g)["x"].tolist()) == {1.0, 2.0, 3.0}
    buf.add({"x": torch.tensor([4.0, 5.0, 6.0, 7.0])})
    assert buf.data["x"].tolist() == [6.0, 7.0, 3.0, 4.0, 5.0] and buf.size == 5 and buf.pos == 2
    buf.add({"x": torch.arange(10.0, 22.0)})  # more than the capacity: the newest 5
    assert sorted(buf.data["x"].tolist()) == [17.0, 18.0, 19.0, 20.0, 21.0]


def test_soft_update():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    expected = [0.95 * pa.detach() + 0.05 * pb.detach() for pa, pb in zip(a.parameters(), b.parameters())]
    pql.soft_update_(a, b, 0.05)
    for p, e in zip(a.parameters(), expected):
        torch.testing.assert_close(p.detach(), e)


def test_running_mean_std_matches_numpy():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 4)) for n in (7, 50, 13)]
    rms = pql.RunningMeanStd((4,), "cpu", epsilon=1e-12)
    for batch in batches:
        rms.update(torch.as_tensor(batch, dtype=torch.float32))  # updated in place: float32 statistics
    data = np.concatenate(batches)
    np.testing.assert_allclose(rms.mean.numpy(), data.mean(0), rtol=1e-5)
    np.testing.assert_allclose(rms.var.numpy(), data.var(0), rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# Arguments: presets and early, clear errors
# ----------------------------------------------------------------------------------------------------------------------
def test_defaults_are_table_b1(capsys):
    a = pql.Args()
    assert (a.batch_size, a.buffer_size, a.learning_rate, a.max_grad_norm, a.nstep, a.tau) == (
        None,
        5_000_000,
        5e-4,
        0.5,
        3,
        0.05,
    )
    assert (a.warm_up_steps, a.sigma_min, a.sigma_max, a.beta_p_v) == (32, 0.05, 0.8, 1 / 2)
    assert (pql.NUM_ATOMS, pql.V_MIN, pql.V_MAX) == (51, -10.0, 10.0)
    gpu = {name: values["gpu"] for name, values in pql.PRESETS.items()}
    # Table B.1, but ManiSkill's own discount (its PPO and SAC baselines): 0.99 learned nothing
    assert (gpu["num_envs"], gpu["batch_size"], gpu["beta_a_v"], gpu["gamma"]) == (4096, 8192, 1 / 8, 0.8)
    toy = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False))
    assert (toy.gamma, toy.beta_a_v) == (0.99, 1 / 8)
    r = pql.resolve_args(pql.Args(env_id="PickCube-v1", cuda=False))
    assert r.sim_backend == "physx_cpu" and r.num_envs == 8 and r.resolved_horizon == 50
    assert (r.gamma, r.batch_size, r.beta_a_v, r.eval_freq) == (0.8, 256, 1 / 4, 250)  # CPU preset (README, pql)
    assert pql.resolve_args(pql.Args(env_id="PickCube-v1", cuda=False, gamma=0.99, beta_a_v=0.5)).gamma == 0.99
    assert (
        "note: without CUDA, PickCube-v1 runs a short trial on CPU simulation (preset cpu)" in capsys.readouterr().out
    )
    assert r.actor_device == r.v_learner_device == r.p_learner_device == "cpu" and r.norm_obs


def resolve_on_four_gpus(**fields):
    """resolve_args on a machine with 4 visible GPUs, the current one GPU 3 (it only names devices: no GPU needed)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "device_count", lambda: 4)
        patch.setattr(torch.cuda, "current_device", lambda: 3)
        return pql.resolve_args(pql.Args(**fields))


@pytest.mark.parametrize(
    "actor_device, sim_backend",
    [("cpu", "physx_cpu"), ("cuda", "physx_cuda:3"), ("cuda:0", "physx_cuda:0"), ("cuda:1", "physx_cuda:1")],
)
def test_the_simulation_runs_on_the_actors_gpu_and_renders_nowhere(monkeypatch, actor_device, sim_backend):
    """ManiSkill reads a GPU index only from "physx_cuda:N" (parse_sim_and_render_backend): from a bare "physx_cuda"
    ManiSkill takes the current torch device and SAPIEN its first CUDA device, which differ when CUDA_VISIBLE_DEVICES
    reorders the GPUs. So the simulation gets the Actor's GPU by its index (plain cuda: the current device, here 3).
    No video is recorded: render_backend "none", else ManiSkill builds a render system on the first GPU. Checked on
    the keyword arguments that gym.make receives."""
    resolved = resolve_on_four_gpus(env_id="PickCube-v1", actor_device=actor_device)
    assert resolved.sim_backend == sim_backend
    assert resolved.v_learner_device == resolved.p_learner_device == actor_device
    assert resolved.num_envs == (8 if actor_device == "cpu" else 4096)  # the GPU preset for every GPU
    made = []

    def make(env_id, **kwargs):
        made.append(kwargs)
        raise StopIteration  # (the env itself is not needed)

    monkeypatch.setattr(gym, "make", make)
    with pytest.raises(StopIteration):
        pql.make_maniskill_env(resolved, 1, evaluation=False)
    assert made[0]["sim_backend"] == sim_backend and made[0]["render_backend"] == "none"


def test_a_multi_robot_task_gets_the_flattened_action_space(monkeypatch):
    """TwoRobotPickCube-v1 has a Dict action space (one Box of 8 per robot) that FlattenActionSpaceWrapper flattens.
    ManiSkillVecEnv's GPU path (one batched env in this process, physx_cuda) must expose the flat Box (16,) that the
    networks are built on. Here the same path runs ManiSkill's CPU simulation (gym.make gets physx_cpu instead of
    physx_cuda): it steps with (1, 16) actions and resets partially at the horizon."""
    args = resolve_on_four_gpus(env_id="TwoRobotPickCube-v1", actor_device="cuda", horizon=3, num_envs=1)
    assert args.sim_backend == "physx_cuda:3"
    make = gym.make
    monkeypatch.setattr(gym, "make", lambda *a, **kwargs: make(*a, **{**kwargs, "sim_backend": "physx_cpu"}))
    envs = pql.ManiSkillVecEnv(args, 1, torch.device("cpu"), evaluation=False)
    try:
        assert envs.gpu and isinstance(envs.single_action_space, gym.spaces.Box)
        assert envs.single_action_space.shape == (16,)
        envs.reset(seed=0)
        for _ in range(3):
            obs, reward, terminated, truncated, info = envs.step(torch.zeros(1, 16))
        assert obs.shape == info["final_obs"].shape == (1, np.prod(envs.single_observation_space.shape))
        assert truncated.tolist() == [True] and info["_final_obs"].tolist() == [True]  # the partial reset ran
    finally:
        envs.close()


def test_evaluation_envs_build_a_new_scene_at_every_reset_and_there_are_8_on_the_cpu():
    """ManiSkill's evaluation protocol: an evaluation env is reconfigured (its scene built anew) at every reset, a
    training env never after its creation; CPU simulation evaluates 8 envs by default, not a few coin flips."""
    args = pql.resolve_args(pql.Args(env_id="PushCube-v1", cuda=False))
    assert args.num_eval_envs == 8
    handler = signal.getsignal(signal.SIGINT)  # (make_maniskill_env ignores Ctrl-C, as in a worker process)
    try:
        envs = {evaluation: pql.make_maniskill_env(args, 1, evaluation) for evaluation in (False, True)}
    finally:
        signal.signal(signal.SIGINT, handler)
    for evaluation, env in envs.items():
        rebuilt = []
        reconfigure = env.unwrapped._reconfigure
        env.unwrapped._reconfigure = lambda options, reconfigure=reconfigure: rebuilt.append(reconfigure(options))
        for seed in range(3):
            env.reset(seed=seed)
        env.close()
        assert len(rebuilt) == (3 if evaluation else 0), evaluation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(env_id="ToyChain-v0"), "is not ToyChainContinuous-v0 or a registered ManiSkill3 task"),
        (dict(total_timesteps=64 * 30), "nothing would be learned"),
        (dict(evaluate=True), "--evaluate needs --checkpoint"),
        (dict(checkpoint="no/such/ckpt.pt"), "--checkpoint no/such/ckpt.pt: no such file"),
        (dict(toy=ToyChainContinuousConfig(action_dim=0, autoreset_mode="same_step")), "--toy.action-dim"),
        (dict(toy=ToyChainContinuousConfig(autoreset_mode="next_step")), "--toy.autoreset-mode"),
    ],
)
def test_bad_input_is_rejected_with_the_flag_named(kwargs, message):
    kwargs = {"env_id": pql.TOY_ENV_ID, **kwargs}
    with pytest.raises(pql.ArgsError, match=re.escape(message)):
        pql.resolve_args(pql.Args(cuda=False, **kwargs))


def toy(**fields):
    return ToyChainContinuousConfig(autoreset_mode="same_step", **fields)


def tiny_checkpoint(path, env_id=pql.TOY_ENV_ID, obs_dim=40, act_dim=4, iteration=0, **fields):
    """A checkpoint as pql.py writes it (untrained networks of the task's preset) at Actor step `iteration` of 8 envs
    (the toy chain's default: 40 blocks, actions of 4 dimensions)."""
    args = pql.resolve_args(pql.Args(env_id=env_id, cuda=False, num_envs=8, **fields))
    serial = pql.SerialLearners(args, (obs_dim, act_dim, 1))
    obs_rms = vars(pql.RunningMeanStd((obs_dim,), "cpu"))
    actor = {"global_step": 8 * iteration, "iteration": iteration, "obs_rms": obs_rms, "wandb_id": None}
    pql.save_checkpoint(path, args, None, torch.multiprocessing.RawValue(pql.SharedCounters), serial, actor, None)
    return str(path)


def test_a_checkpoint_of_another_kind_is_refused_naming_what_it_found(tmp_path):
    """Before any env or process starts: a file that torch cannot load, a dict without "script", a checkpoint of
    another script and one of another task; each refused with one line naming the flag and what it found."""
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    no_script = tmp_path / "no_script.pt"
    torch.save({"model": {}, "global_step": 0}, no_script)
    other_script = tmp_path / "cleanba.pt"
    torch.save({"script": "cleanba_ppo.py", "env_id": pql.TOY_ENV_ID}, other_script)
    maniskill = tiny_checkpoint(tmp_path / "pushcube.pt", "PushCube-v1", 35, 8)
    cases = [
        (text, "not a checkpoint of pql.py ("),
        (no_script, 'not a checkpoint of pql.py (no "script" in it)'),
        (other_script, "a checkpoint of cleanba_ppo.py, not of pql.py"),
        (maniskill, f"a checkpoint of PushCube-v1, not of --env-id {pql.TOY_ENV_ID}"),
    ]
    for path, message in cases:
        with pytest.raises(pql.ArgsError) as error:
            pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, checkpoint=str(path)))
        assert str(error.value).startswith(f"--checkpoint {path}: {message}") and "\n" not in str(error.value)


def test_a_resume_continues_the_runs_envs_and_needs_steps_left(tmp_path):
    """A resume carries the Actor's state over (observations, the n-step window, the toy chain's state): the same
    --num-envs, --nstep and --toy.* as the checkpoint's run, and a --total-timesteps beyond the checkpoint."""
    checkpoint = tiny_checkpoint(tmp_path / "ckpt.pt", iteration=100)  # at global step 800

    def resume(**fields):
        return pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, checkpoint=checkpoint, **fields))

    refused = [
        (dict(num_envs=16), "--num-envs 16: the checkpoint's run has 8; a resume continues it with that"),
        (dict(num_envs=8, nstep=1), "--nstep 1: the checkpoint's run has 3"),
        (dict(num_envs=8, toy=toy(horizon=100)), "--toy.horizon 100: the checkpoint's run has 200"),
        (dict(num_envs=8, total_timesteps=800), "--total-timesteps 800: the checkpoint is at global step 800 already"),
        (dict(num_envs=8, total_timesteps=8 * 132), "--total-timesteps 1056: 32 Actor steps left after the checkpoint"),
        (dict(num_envs=8, distributional=True), "--distributional True: the checkpoint's run has False"),
    ]
    for fields, message in refused:
        with pytest.raises(pql.ArgsError, match=re.escape(message)):
            resume(**fields)
    assert resume(num_envs=8, total_timesteps=8 * 133).num_actor_steps == 133  # (33 steps left: one learns)
    evaluation = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, checkpoint=checkpoint, evaluate=True))
    assert evaluation.num_envs == 64  # (--evaluate steps no training envs)
    with pytest.raises(pql.ArgsError, match=re.escape("--distributional True: the checkpoint's run has False; its")):
        pql.resolve_args(
            pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, checkpoint=checkpoint, evaluate=True, distributional=True)
        )
    on_cuda = torch.load(checkpoint, weights_only=True)  # a checkpoint of a run on CUDA: generators of CUDA
    on_cuda["args"] = on_cuda["args"].replace('"cpu"', '"cuda"')
    torch.save(on_cuda, tmp_path / "on_cuda.pt")
    with pytest.raises(pql.ArgsError, match=re.escape("--actor-device cpu: the checkpoint's run has cuda")):
        pql.resolve_args(
            pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, num_envs=8, checkpoint=str(tmp_path / "on_cuda.pt"))
        )


def test_a_resume_trains_with_its_learning_rate_not_the_checkpoints(tmp_path):
    checkpoint = tiny_checkpoint(tmp_path / "ckpt.pt", learning_rate=1e-3)
    resumed = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, num_envs=8, checkpoint=checkpoint))
    resumed = dataclasses.replace(resumed, learning_rate=2e-4)
    for learner in (pql.VLearner, pql.PLearner):
        assert learner(resumed, 40, 4, 1, torch.device("cpu")).optimizer.param_groups[0]["lr"] == 2e-4, learner


UNUSED = [  # (Args fields, the start of the message): a flag given where it would do nothing
    (dict(horizon=50), f"--horizon 50: does nothing here ({pql.TOY_ENV_ID} takes --toy.horizon)"),
    (dict(env_id="PushCube-v1", toy=toy(horizon=50)), f"--toy.horizon 50: does nothing here (it sets {pql.TOY_ENV_ID}"),
    (dict(capture_video=True), "--capture-video True: does nothing here (the toy chain has no renderer"),
    (dict(ddpg_n=True, sequential=True), "--sequential True: does nothing here (--ddpg-n runs the baseline"),
    (dict(ddpg_n=True, p_learner_device="cpu"), "--p-learner-device cpu: does nothing here (--ddpg-n updates"),
    (dict(ddpg_n=True, beta_p_v=0.25), "--beta-p-v 0.25: does nothing here (--ddpg-n makes one policy update"),
    (dict(quiet=True, progress_interval=5.0), "--progress-interval 5.0: does nothing here (--quiet prints no"),
    (dict(wandb_entity="team"), "--wandb-entity team: does nothing here (it names the W&B run of --track)"),
    (dict(evaluate=True, batch_size=64), "--batch-size 64: does nothing here (--evaluate only evaluates"),
    (dict(evaluate=True, output_dir="x"), "--output-dir x: does nothing here (--evaluate only evaluates"),
    (dict(output_dir="x"), "--output-dir x: does nothing here (a resumed run continues in its checkpoint's directory)"),
    (dict(exp_name="x"), "--exp-name x: does nothing here (a resumed run continues in its checkpoint's directory)"),
]


@pytest.mark.parametrize("fields, message", UNUSED, ids=[message.split(":")[0] for _, message in UNUSED])
def test_a_flag_that_would_do_nothing_is_refused_saying_what_to_use(tmp_path, fields, message):
    with_checkpoint = {"evaluate", "output_dir", "exp_name"} & set(fields)  # (an evaluation or a resume)
    checkpoint = tiny_checkpoint(tmp_path / "ckpt.pt") if with_checkpoint else None
    fields = {"env_id": pql.TOY_ENV_ID, "cuda": False, "checkpoint": checkpoint, **fields}
    with pytest.raises(pql.ArgsError, match=re.escape(message)):
        pql.resolve_args(pql.Args(**fields))


OUT_OF_DOMAIN = [  # (the flag, Args fields that put it outside its domain): every numeric flag
    ("--seed", dict(seed=-1)),
    ("--num-envs", dict(num_envs=0)),
    ("--num-envs", dict(num_envs=-4)),
    ("--num-eval-envs", dict(num_eval_envs=0)),
    ("--horizon", dict(horizon=0)),
    ("--beta-a-v", dict(beta_a_v=0.0)),
    ("--beta-a-v", dict(beta_a_v=2.0, ddpg_n=True)),
    ("--beta-p-v", dict(beta_p_v=-0.5)),
    ("--total-timesteps", dict(total_timesteps=0)),
    ("--gamma", dict(gamma=1.5)),
    ("--gamma", dict(gamma=float("nan"))),
    ("--nstep", dict(nstep=0)),
    ("--tau", dict(tau=1.5)),
    ("--batch-size", dict(batch_size=0)),
    ("--buffer-size", dict(buffer_size=0)),
    ("--learning-rate", dict(learning_rate=-1e-3)),
    ("--max-grad-norm", dict(max_grad_norm=0.0)),
    ("--warm-up-steps", dict(warm_up_steps=-1)),
    ("--reward-scale", dict(reward_scale=0.0)),
    ("--sigma-min", dict(sigma_min=-0.1)),
    ("--sigma-max", dict(sigma_min=0.5, sigma_max=0.1)),
    ("--target-noise-std", dict(target_noise_std=-1.0)),
    ("--eval-freq", dict(eval_freq=-3)),
    ("--actor-device", dict(actor_device="cuda:7")),
    ("--actor-device", dict(actor_device="tpu")),
    ("--v-learner-device", dict(v_learner_device="cuda:4")),
    ("--p-learner-device", dict(p_learner_device="cuda:4")),
    ("--toy.horizon", dict(toy=toy(horizon=0))),
    ("--toy.block-length", dict(toy=toy(block_length=0))),
    ("--toy.num-actions", dict(toy=toy(num_actions=1))),
    ("--toy.progression-prob", dict(toy=toy(progression_prob=1.5))),
    ("--toy.mastery-threshold", dict(toy=toy(mastery_threshold=-1))),
    ("--toy.reset-lambda", dict(toy=toy(reset_lambda=-1.0))),
    ("--toy.step-time-mean", dict(toy=toy(step_time_mean=-1.0))),
    ("--toy.step-time-spread", dict(toy=toy(step_time_spread=-1.0))),
    ("--toy.step-time-jitter", dict(toy=toy(step_time_jitter=-1.0))),
    ("--toy.action-dim", dict(toy=toy(action_dim=0))),
    ("--toy.target-radius", dict(toy=toy(target_radius=0.0))),
]


@pytest.mark.parametrize("flag, fields", OUT_OF_DOMAIN, ids=[f"{flag}:{fields}" for flag, fields in OUT_OF_DOMAIN])
def test_every_numeric_flag_outside_its_domain_is_an_error_naming_it(flag, fields):
    """Every numeric flag has a domain; a value outside it is refused before anything starts, with an ArgsError that
    begins with the flag and says the domain (`--num-envs 0: must be >= 1`). (A machine with 4 GPUs here.)"""
    with pytest.raises(pql.ArgsError) as error:
        resolve_on_four_gpus(**{"env_id": pql.TOY_ENV_ID, "cuda": False, **fields})
    assert re.match(re.escape(flag) + r"[ :]", str(error.value)) and "must be" in str(error.value), str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-envs", "0"], "--num-envs 0: must be >= 1"),
        (["--sigma-min", "0.5", "--sigma-max", "0.1"], "--sigma-max 0.1: must be >= --sigma-min (0.5)"),
        (["--horizon", "50"], f"--horizon 50: does nothing here ({pql.TOY_ENV_ID} takes --toy.horizon)"),
        (["--checkpoint", __file__], f"--checkpoint {__file__}: not a checkpoint of pql.py ("),  # (a text file)
    ],
)
def test_bad_flags_exit_with_code_2_and_one_line_naming_the_flag(tmp_path, flags, message):
    proc = run_script(TOY_SMALL + flags, None if "--checkpoint" in flags else tmp_path, check=False)  # (a resume's)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and os.listdir(tmp_path) == []


def test_the_resolved_settings_are_in_field_order_in_lines_of_at_most_120_characters():
    """Every setting in field order, then the devices in use; the toy chain's only on it, never its test hook."""
    args = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False))
    lines = pql.format_settings(args).splitlines()
    assert lines[0] == "settings:" and all(len(line) <= 120 for line in lines[1:]) and len(lines) > 5
    pairs = " ".join(lines[1:]).split(" ")
    names = [field.name for field in dataclasses.fields(pql.Args) if field.name != "toy"]
    names[names.index("bootstrap_at_done") : names.index("bootstrap_at_done")] = [
        f"toy.{field.name}" for field in dataclasses.fields(ToyChainContinuousConfig) if field.name != "crash_at_step"
    ]
    assert [pair.split("=")[0] for pair in pairs] == names + ["device"]
    for pair in ("gamma=0.99", "toy.horizon=200", "hidden_dims=(256,256)", "eval_freq=25", "sim_backend=torch"):
        assert pair in pairs
    assert pairs[-1] == "device=cpu"
    on_two_gpus = resolve_on_four_gpus(env_id="PushCube-v1", actor_device="cuda:0", v_learner_device="cuda:1")
    pairs = " ".join(pql.format_settings(on_two_gpus).splitlines()[1:]).split(" ")
    assert pairs[-1] == "device=cuda:0,cuda:1" and not [pair for pair in pairs if pair.startswith("toy.")]


# ----------------------------------------------------------------------------------------------------------------------
# Runs of the script, as a user runs it, asserting on what it wrote
# ----------------------------------------------------------------------------------------------------------------------
SCRIPT = os.path.join(ROOT, "pql.py")
TOY_SMALL = [
    "--env-id",
    "ToyChainContinuous-v0",
    "--toy.horizon",
    "50",
    "--num-envs",
    "32",
    "--num-eval-envs",
    "16",
    "--batch-size",
    "256",
    "--warm-up-steps",
    "8",
    "--eval-freq",
    "20",
    "--no-cuda",
]


def start_script(args, tmp_path, script=SCRIPT, stdout=subprocess.PIPE, unbuffered=True):
    """python pql.py ... (--output-dir tmp_path unless None) in its own process group (so that a test that fails can
    kill all it started); unbuffered: with PYTHONUNBUFFERED=1, else without (what it flushes comes when flushed)."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    return subprocess.Popen(
        [sys.executable, script, *(["--output-dir", str(tmp_path)] if tmp_path is not None else []), *args],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(env, PYTHONUNBUFFERED="1") if unbuffered else env,
    )


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish(proc, timeout):
    """Waits for the run (its stdout, stderr); on a timeout kills its process group and fails."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the run did not end within {timeout} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    finally:
        kill_group(proc)  # nothing it started may outlive the test


def run_script(args, tmp_path, timeout=600, check=True, script=SCRIPT):
    proc = start_script(args, tmp_path, script)
    stdout, stderr = finish(proc, timeout)
    if check:
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def only_run_dir(tmp_path, pattern="*"):
    dirs = [d for d in glob.glob(os.path.join(str(tmp_path), pattern)) if os.path.isdir(d)]
    assert len(dirs) == 1, dirs
    return dirs[0]


def read_summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def learner_pids(stdout):
    return {role: int(pid) for role, pid in re.findall(r"(V-learner|P-learner) started: pid (\d+)", stdout)}


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(  # the fast tier runs PQL's three processes; its two other modes run with the slow tests
    "mode",
    ["parallel", pytest.param("sequential", marks=pytest.mark.slow), pytest.param("ddpg_n", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("device", DEVICES)
def test_toy_chain_smoke(tmp_path, mode, device):
    args = TOY_SMALL + ["--total-timesteps", str(32 * 60)]
    args += {"parallel": [], "sequential": ["--sequential"], "ddpg_n": ["--ddpg-n"]}[mode]
    args += ["--cuda"] if device == "cuda" else []
    proc = run_script(args, tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary, config = read_summary(run_dir), json.load(open(os.path.join(run_dir, "config.json")))
    assert summary["global_step"] == 32 * 60 and summary["iteration"] == 60 and summary["sps"] > 0
    assert config["bootstrap_at_done"] == "truncated"  # the toy chain's default
    assert config["actor_device"] == ("cpu" if device == "cpu" else "cuda")
    # 60 Actor steps, learning from step 8: 52 learning steps, 8 V-updates each; PQL's schedule (parallel and its
    # serial ablation) 1 P-update per 2 V-updates, DDPG(n) an actor update with every critic update
    p_updates = 416 if mode == "ddpg_n" else 208
    assert (summary["pql/learning_steps"], summary["pql/v_updates"], summary["pql/p_updates"]) == (52, 416, p_updates)
    for key in (
        "eval/return",
        "eval/success_once",
        "eval/success_at_end",
        "eval/episode_len",
        "losses/qf_loss",
        "losses/actor_loss",
        "charts/episodic_return",
        "charts/SPS",
    ):
        assert key in summary, key
    assert summary["eval/episode_len"] == 50 and math.isfinite(summary["losses/qf_loss"])
    assert [step for step, _ in scalars(run_dir)["eval/return"]] == [0, 640, 1280, 1920]
    assert ("started: pid" in proc.stdout) == (mode == "parallel")


@pytest.mark.slow
def test_eval_freq_0_evaluates_only_at_the_end_and_the_settings_are_printed_first(tmp_path):
    proc = run_script(TOY_SMALL + ["--total-timesteps", str(32 * 20), "--sequential", "--eval-freq", "0"], tmp_path)
    run_dir = only_run_dir(tmp_path)
    assert [step for step, _ in scalars(run_dir)["eval/return"]] == [640]  # the final evaluation only
    assert proc.stdout.startswith("settings:\n") and "eval_freq=0" in proc.stdout and "toy.horizon=50" in proc.stdout


@pytest.mark.slow
def test_ratio_control_holds_on_a_short_run(tmp_path):
    """Non-default ratios beta_a:v = 1:4, beta_p:v = 1:1, three processes: every ratio logged from 25 learning steps
    on (Actor step 33 = 8 warm-up + 25) is within 10% of its target, and the run ends exactly on it. This holds by
    construction, whatever the scheduling: the rules bound V within [k_v (A - 2), k_v A] and P within
    [V - 2 k_p, V / k_p] (test_ratio_control_never_deadlocks_and_keeps_the_ratios): at most 8% off from A = 27 on."""
    args = TOY_SMALL + ["--total-timesteps", str(32 * 100), "--beta-a-v", "0.25", "--beta-p-v", "1.0"]
    run_script(args, tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary = read_summary(run_dir)
    assert summary["pql/ratio_a_v"] == 0.25 and summary["pql/ratio_p_v"] == 1.0
    assert summary["pql/v_updates"] == 4 * 92
    logged = scalars(run_dir)
    a_v, p_v = ([v for step, v in logged[name] if step >= 32 * 33] for name in ("pql/ratio_a_v", "pql/ratio_p_v"))
    assert len(a_v) >= 13
    assert all(abs(v / 0.25 - 1) <= 0.1 for v in a_v), a_v
    assert all(abs(v - 1) <= 0.1 for v in p_v), p_v


# ----------------------------------------------------------------------------------------------------------------------
# The Actor loop as users run it (three processes), in this process: what it hands the envs, and its host syncs
# ----------------------------------------------------------------------------------------------------------------------
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class RecordingEnvs:
    """The training envs of the run, recording before each step the observation, the action and the number of host
    syncs counted so far."""

    def __init__(self, envs, syncs):
        self.envs, self.syncs, self.steps = envs, syncs, []

    def __getattr__(self, name):
        return getattr(self.envs, name)

    def reset(self, **kwargs):
        self.obs, info = self.envs.reset(**kwargs)
        return self.obs, info

    def step(self, action):
        self.steps.append((self.obs.clone(), action.clone(), self.syncs[0]))
        self.obs, *rest = self.envs.step(action)
        return (self.obs, *rest)


@pytest.fixture(scope="module")
def actor_run(tmp_path_factory):
    """main() of a toy chain run (16 envs, 200 Actor steps, learning rate 1e-30, far below a float32 step of any
    parameter: the policy stays the initial one) with
    the training envs recorded and the host syncs counted: calls that make the host wait for a device's result
    (Tensor.item, .tolist, .cpu, .numpy, bool(), float(), int(); torch.cuda.synchronize) made by pql.py's own lines
    on tensors outside shared memory (the shared counters and CPU slots are host memory on every device)."""
    args = pql.Args(
        env_id=pql.TOY_ENV_ID,
        toy=ToyChainContinuousConfig(horizon=50, autoreset_mode="same_step"),
        num_envs=16,
        num_eval_envs=2,
        total_timesteps=16 * 200,
        warm_up_steps=8,
        batch_size=64,
        eval_freq=100,
        learning_rate=1e-30,
        sigma_min=0.02,
        sigma_max=0.2,
        cuda=False,
        output_dir=str(tmp_path_factory.mktemp("actor_run")),
    )
    syncs, recorded = [0], []

    def counted(original):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller == pql.__file__ and not (args and torch.is_tensor(args[0]) and args[0].is_shared()):
                syncs[0] += 1
            return original(*args, **kwargs)

        return wrapper

    def make_env(args, num_envs, device, evaluation, video_dir=None):
        envs = make_env.original(args, num_envs, device, evaluation, video_dir)
        if not evaluation:
            recorded.append(RecordingEnvs(envs, syncs))
        return recorded[-1] if not evaluation else envs

    make_env.original = pql.make_env
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pql, "make_env", make_env)
        for method in SYNC_METHODS:
            patch.setattr(torch.Tensor, method, counted(getattr(torch.Tensor, method)))
        patch.setattr(torch.cuda, "synchronize", counted(torch.cuda.synchronize))
        try:
            summary = pql.main(args)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
    return pql.resolve_args(args), summary, recorded[0].steps


@pytest.mark.slow
def test_the_actor_loop_makes_no_host_sync_per_env_step(actor_run):
    """Issue 25: the Actor must not wait for the GPU at every env step (a sync also waits for PhysX's streams). Between
    two env steps pql.py's lines make no host sync, except where the loop logs (every LOG_EVERY steps: it reads the
    episode statistics) or evaluates; measured: 0 syncs between all other steps, 160 of the 199 gaps."""
    args, summary, steps = actor_run
    assert summary["iteration"] == len(steps) == 200
    gaps = [(t, after[2] - before[2]) for t, (before, after) in enumerate(zip(steps, steps[1:]))]
    quiet = [count for t, count in gaps if (t + 1) % pql.LOG_EVERY != 0 and (t + 1) % args.eval_freq != 0]
    assert len(quiet) == 160 and sum(quiet) == 0, [(t, count) for t, count in gaps if count]
    assert sum(count for _, count in gaps) > 0  # the counting works: logging reads the episode statistics


@pytest.mark.slow
def test_the_actor_explores_each_env_with_its_own_sigma(actor_run):
    """Sec. 3.3 mixed exploration in the Actor loop as it runs: env i's noise (the action it gets minus pi(s), the
    initial policy, which a learning rate of 1e-30 keeps) has the std sigma_i of linspace(0.02, 0.2) over the 16 envs:
    768 samples per env (192 learning steps x 4 action dims), measured within 8% of sigma_i (the run is deterministic:
    the Actor alone draws its noise). One sigma for every env fails (the first and last envs' stds differ 10-fold)."""
    args, _, steps = actor_run
    explored = steps[args.warm_up_steps :]
    obs, actions = torch.stack([s[0] for s in explored]), torch.stack([s[1] for s in explored])
    obs_dim = obs.shape[-1]
    policy, _, _ = pql.initial_networks(args, obs_dim, args.toy.action_dim, "cpu")
    with torch.no_grad():
        noise = actions - policy(pql.RunningMeanStd((obs_dim,), "cpu").normalize(obs))  # the initial statistics
    measured = noise.transpose(0, 1).reshape(args.num_envs, -1).std(1)
    assert (actions.abs() < 1.0).all()  # nothing clipped: the std is the noise's
    print("measured / sigma:", (measured / pql.mixed_exploration_sigmas(16, 0.02, 0.2)).tolist())
    np.testing.assert_allclose(measured.numpy(), pql.mixed_exploration_sigmas(16, 0.02, 0.2).numpy(), rtol=0.12)


def run_in_process(**fields):
    """main() in this process (its Ctrl-C handlers undone afterwards)."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return pql.main(pql.Args(cuda=False, **fields))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


class AliasingBatchedEnv:
    """A batched env as ManiSkill's GPU simulation may behave: reset() writes into the very tensors that step()
    returned (the observations and info["success"]). Env i's episodes last 2 + i % 3 steps and end in success; its
    observation is (step of the episode, episodes begun, i), so the true last observation of each is known."""

    def __init__(self, num_envs):
        self.num_envs = num_envs
        self.unwrapped = self
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.lengths = 2 + torch.arange(num_envs) % 3

    def reset(self, seed=None, options=None):
        if options is None:
            self.obs = torch.stack(
                [torch.zeros(self.num_envs), torch.zeros(self.num_envs), torch.arange(self.num_envs)], 1
            )
            self.success = torch.zeros(self.num_envs, dtype=torch.bool)
            return self.obs, {}
        index = options["env_idx"]
        self.obs[index, 0] = 0.0  # written into the tensors the last step returned
        self.obs[index, 1] += 1.0
        self.success[index] = False
        return self.obs, {}

    def step(self, action):
        self.obs = self.obs + torch.tensor([1.0, 0.0, 0.0])
        truncated = self.obs[:, 0] == self.lengths
        self.success = truncated.clone()
        reward = torch.ones(self.num_envs)
        return self.obs, reward, torch.zeros(self.num_envs, dtype=torch.bool), truncated, {"success": self.success}

    def close(self):
        pass


def test_the_batched_path_copies_what_the_partial_reset_overwrites(tmp_path, monkeypatch):
    """ManiSkillVecEnv's GPU path (one batched env, partial resets by env index) with a batched env whose reset
    writes into the tensors its step returned, through the Actor (--sequential, 6 envs, n = 3): every transition handed
    to the V-learner's replay buffer bootstraps from an observation of its own episode, the true last one where the
    episode ended (step = its length), n or fewer steps on, with discount gamma^m; every episode's success is counted
    (training and evaluation). Without the copies the bootstrap observation is the next episode's first and no
    success is seen."""
    args = pql.resolve_args(pql.Args(env_id="PushCube-v1", cuda=False))
    monkeypatch.setattr(
        pql, "make_maniskill_env", lambda args, num_envs, evaluation, video_dir: AliasingBatchedEnv(num_envs)
    )
    batched = dataclasses.replace(args, sim_backend="physx_cuda:0")  # (the GPU path, here on the CPU)
    monkeypatch.setattr(
        pql,
        "make_env",
        lambda args, num_envs, device, evaluation, video_dir=None: pql.ManiSkillVecEnv(
            batched, num_envs, device, evaluation
        ),
    )
    added = []
    add = pql.ReplayBuffer.add

    def recording_add(buffer, batch):
        if "next_obs" in batch:  # the V-learner's
            added.append({name: value.clone() for name, value in batch.items()})
        add(buffer, batch)

    monkeypatch.setattr(pql.ReplayBuffer, "add", recording_add)
    gamma = 0.5
    summary = run_in_process(
        env_id="PushCube-v1",
        num_envs=6,
        num_eval_envs=6,
        horizon=8,
        total_timesteps=6 * 30,
        warm_up_steps=3,
        batch_size=16,
        eval_freq=0,
        gamma=gamma,
        sequential=True,
        output_dir=str(tmp_path),
    )
    obs = torch.cat([batch["obs"] for batch in added])
    next_obs = torch.cat([batch["next_obs"] for batch in added])
    discount = torch.cat([batch["discount"] for batch in added])
    lengths = 2 + obs[:, 2] % 3
    assert len(added) == 28 and torch.equal(next_obs[:, 1:], obs[:, 1:])  # the same env, the same episode
    steps = next_obs[:, 0] - obs[:, 0]
    assert torch.equal(next_obs[:, 0], torch.minimum(obs[:, 0] + 3, lengths)) and (steps >= 1).all()
    torch.testing.assert_close(discount, gamma**steps)
    assert summary["charts/success_rate"] == 1.0 and summary["eval/success_once"] == 1.0


class TrajectoryRecorder:
    """Training envs that record each step's action, what the step returned and the global generators' states."""

    def __init__(self, envs, record):
        self.envs, self.record = envs, record

    def __getattr__(self, name):
        return getattr(self.envs, name)

    def step(self, action):
        generators = (bytes(torch.get_rng_state().numpy()), np.random.get_state()[1].tobytes(), random.getstate())
        obs, reward, terminated, truncated, info = self.envs.step(action)
        self.record.append((action.clone(), obs.clone(), reward.clone(), generators))
        return obs, reward, terminated, truncated, info


def test_a_resume_continues_the_actor_where_its_checkpoint_left_it(tmp_path, monkeypatch):
    """--sequential on the toy chain (H = 10) with a learning rate of 1e-30, so that no network changes: run A takes 20
    Actor steps of 8 envs and checkpoints at step 15, mid-episode; run B resumes there. B's steps are A's steps 15-19:
    the same actions and env steps (the chains' state, the exploration generator and the normalizer restored), the same
    transitions to the replay buffer from its first step on (the n-step window), the same numpy and Python generators
    (drawn from between the runs), the same statistics of the episodes that span the checkpoint and the same final
    evaluation; the learners' generators and the counts come back too. With --track (wandb.init stubbed: no network)
    B continues A's W&B run: the id A made, stored in the checkpoint, with resume="allow"."""
    import wandb

    inits, steps, added = [], [], []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: inits.append(kwargs))
    make_env = pql.make_env
    monkeypatch.setattr(
        pql,
        "make_env",
        lambda args, num_envs, device, evaluation, video_dir=None: (
            make_env(args, num_envs, device, evaluation)
            if evaluation
            else TrajectoryRecorder(make_env(args, num_envs, device, evaluation), steps)
        ),
    )
    add = pql.ReplayBuffer.add

    def recording_add(buffer, batch):
        if "next_obs" in batch:  # the V-learner's
            added.append({name: value.clone() for name, value in batch.items()})
        add(buffer, batch)

    monkeypatch.setattr(pql.ReplayBuffer, "add", recording_add)
    updates = []  # B's: by learner
    for learner in (pql.VLearner, pql.PLearner):
        monkeypatch.setattr(
            learner,
            "update",
            lambda self, *obs, update=learner.update: updates.append(type(self)) or update(self, *obs),
        )
    run = dict(env_id=pql.TOY_ENV_ID, toy=toy(horizon=10), num_envs=8, total_timesteps=8 * 20, warm_up_steps=4)
    run.update(num_eval_envs=2, batch_size=16, learning_rate=1e-30, norm_obs=True, sequential=True, eval_freq=15)
    summary_a = run_in_process(**run, track=True, save_model=True, output_dir=str(tmp_path))
    run_dir = only_run_dir(tmp_path)
    checkpoint = os.path.join(run_dir, "ckpt_120.pt")
    ckpt = torch.load(checkpoint, weights_only=True)
    steps_a, added_a = steps[:], added[:]
    steps.clear()
    added.clear()
    updates.clear()
    np.random.rand()  # the global generators move on
    random.random()
    summary_b = run_in_process(**run, track=True, save_model=True, checkpoint=checkpoint)
    assert len(steps_a) == 20 and len(steps) == 5
    for mine, theirs in zip(steps, steps_a[15:]):
        assert all(torch.equal(value, other) for value, other in zip(mine[:3], theirs[:3])) and mine[3] == theirs[3]
    assert len(added_a) == 18 and len(added) == 5  # A's windows of 3 steps are full from step 2 on, B's at once
    for mine, theirs in zip(added, added_a[13:]):
        assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    for name in ("charts/episodic_return", "charts/episodic_length", "charts/success_rate", "eval/return"):
        assert summary_b[name] == summary_a[name], name
    assert ckpt["counts"] == {"actor_steps": 11, "v_updates": 88, "p_updates": 44}  # learning from step 4
    assert (summary_b["pql/learning_steps"], summary_b["pql/v_updates"]) == (12, 96)  # B's warm-up: steps 15-18
    assert (updates.count(pql.VLearner), updates.count(pql.PLearner)) == (8, 4)  # not (96, 48): the counts continue
    resumed = pql.resolve_args(pql.Args(**run, cuda=False, checkpoint=checkpoint))
    seeded = torch.Generator().manual_seed(resumed.seed + 1).get_state()
    v_learner = pql.VLearner(resumed, 2, 4, 1, torch.device("cpu"))
    assert torch.equal(v_learner.generator.get_state(), ckpt["rng"]["v_learner"])
    assert not torch.equal(seeded, ckpt["rng"]["v_learner"])  # (it drew 88 batches)
    p_learner = pql.PLearner(resumed, 2, 4, 1, torch.device("cpu"))
    assert torch.equal(p_learner.generator.get_state(), ckpt["rng"]["p_learner"])
    assert [init["id"] for init in inits] == [ckpt["wandb_id"]] * 2 and len(ckpt["wandb_id"]) == 8
    assert inits[1]["resume"] == "allow" and inits[1]["name"] == os.path.basename(run_dir)


def test_a_refused_or_interrupted_resume_leaves_the_run_as_it_was(tmp_path, monkeypatch):
    """A resume refused (another --distributional) and one interrupted while its envs start (Ctrl-C) write nothing
    into the run: config.json, summary.json and the TensorBoard event files stay byte-identical, and no file is added."""
    run = dict(env_id=pql.TOY_ENV_ID, toy=toy(horizon=10), num_envs=8, total_timesteps=8 * 12, warm_up_steps=4)
    run.update(num_eval_envs=2, batch_size=16, sequential=True, eval_freq=0, save_model=True)
    run_in_process(**run, output_dir=str(tmp_path))
    run_dir = only_run_dir(tmp_path)
    checkpoint = os.path.join(run_dir, "final_ckpt.pt")
    files = {name: open(os.path.join(run_dir, name), "rb").read() for name in os.listdir(run_dir)}
    resume = dict(run, total_timesteps=8 * 24, checkpoint=checkpoint)
    with pytest.raises(pql.ArgsError):
        run_in_process(**resume, distributional=True)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pql, "make_env", interrupted)
    assert run_in_process(**resume)["interrupted"]
    assert {name: open(os.path.join(run_dir, name), "rb").read() for name in os.listdir(run_dir)} == files


def start_parallel_run(tmp_path, monkeypatch, steps, recorder=TrajectoryRecorder, **fields):
    """An in-process run of PQL's three processes on the toy chain; `steps` records each training env step."""
    make_env = pql.make_env
    monkeypatch.setattr(
        pql,
        "make_env",
        lambda args, num_envs, device, evaluation, video_dir=None: (
            make_env(args, num_envs, device, evaluation)
            if evaluation
            else recorder(make_env(args, num_envs, device, evaluation), steps)
        ),
    )
    run = dict(env_id=pql.TOY_ENV_ID, toy=toy(horizon=10), num_envs=8, total_timesteps=8 * 30, warm_up_steps=4)
    return run_in_process(**run, num_eval_envs=2, batch_size=16, eval_freq=0, output_dir=str(tmp_path), **fields)


def test_ctrl_c_while_the_actor_hands_a_step_over_checkpoints_after_that_step(tmp_path, monkeypatch):
    """Ctrl-C while the Actor waits for room in a learner's slots (its envs have stepped): final_ckpt.pt holds as many
    Actor steps as the envs took, not one fewer."""
    steps, looks = [], []
    has_room = pql.SlotRing.has_room

    def full_once_at_step_10(ring):
        looks.append(len(steps))
        if len(steps) == 10 and looks.count(10) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # (noted by the Actor's handler)
            return False
        return has_room(ring)

    monkeypatch.setattr(pql.SlotRing, "has_room", full_once_at_step_10)
    summary = start_parallel_run(tmp_path, monkeypatch, steps, save_model=True)
    ckpt = torch.load(os.path.join(only_run_dir(tmp_path), "final_ckpt.pt"), weights_only=True)
    assert summary["interrupted"] and len(steps) == 10 and ckpt["iteration"] == 10 and ckpt["global_step"] == 80


class NaNRewards(TrajectoryRecorder):
    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward * math.nan, terminated, truncated, info


def test_a_learners_nan_loss_is_logged(tmp_path, monkeypatch):
    """NaN rewards make the V-learner's loss NaN: it is logged (and in summary.json) as NaN, not left out."""
    summary = start_parallel_run(tmp_path, monkeypatch, [], recorder=NaNRewards)
    assert math.isnan(summary["losses/qf_loss"])


def test_the_progress_line_reads_as_documented():
    """The line of a run of 3M env steps at 257,760 of them (8.6%, rounded down), 4,096 steps/s, a minute in: the time
    left is 669 s; then the latest return and success, the three processes' counts and the ratios measured/target."""
    args = pql.resolve_args(pql.Args(env_id=pql.TOY_ENV_ID, cuda=False, total_timesteps=3_000_000))
    counters = pql.SharedCounters()
    counters.actor_steps = 1200
    counters.v_learner.updates = 9601
    counters.p_learner.updates = 4800
    last = {"charts/SPS": 4096.4, "charts/episodic_return": -12.3456, "charts/success_rate": 0.41}
    assert pql.progress_line(args, 257_760, 4096.4, 60.7, last, counters) == (
        "progress global_step=257760/3000000 (8%) SPS=4096 elapsed=0:01:00 left=0:11:09 charts/episodic_return=-12.35 "
        "charts/success_rate=0.41 actor_steps=1200 v_updates=9601 p_updates=4800 a:v=0.125/0.125 p:v=0.500/0.500"
    )
    counters.v_learner.updates = 0
    assert pql.progress_line(args, 0, 0.0, 97_390.0, {}, counters) == (
        "progress global_step=0/3000000 (0%) SPS=0 elapsed=27:03:10 left=? actor_steps=1200 v_updates=0 "
        "p_updates=4800 a:v=?/0.125 p:v=?/0.500"
    )


def test_progress_lines_come_at_the_interval_and_quiet_has_none(tmp_path, monkeypatch, capsys):
    """In-process, with a clock that moves on 0.25 s at each look (about 1.5 s per Actor step): a progress line at
    most once a --progress-interval, the first one interval after training starts; none with --quiet (whose run of 20
    Actor steps lasts 30 s of that clock, longer than the default interval of 15 s)."""
    looks = iter(range(10**6))
    monkeypatch.setattr(pql, "time", types.SimpleNamespace(time=lambda: 0.25 * next(looks), sleep=time.sleep))
    run = dict(env_id=pql.TOY_ENV_ID, toy=toy(horizon=10), num_envs=8, total_timesteps=8 * 20, warm_up_steps=4)
    run.update(num_eval_envs=2, batch_size=16, sequential=True, eval_freq=0, progress_interval=2.0)
    run_in_process(**run, output_dir=str(tmp_path / "a"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("progress ")]
    elapsed = [int(line.split("elapsed=0:00:")[1][:2]) for line in lines]
    assert len(lines) >= 3 and elapsed[0] >= 2 and all(b - a >= 2 for a, b in zip(elapsed, elapsed[1:])), lines
    run.pop("progress_interval")
    run_in_process(**run, quiet=True, output_dir=str(tmp_path / "b"))
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("progress ")]


# ----------------------------------------------------------------------------------------------------------------------
# Q-learning checked against closed-form values. The chain below is deterministic and fully observed: block length 1
# and p_prog = 1 move the agent one block per step, so step t of an episode is block t (observation one-hot(t)), and a
# deterministic policy pi collects a fixed reward r_t in block t. At the horizon H the episode is truncated and the true
# final observation is block H - 1 again; so, bootstrapping from it, Q(H - 1) = r_{H-1} / (1 - gamma) (it is the reset
# observation, block 0, only if the Actor bootstraps from the wrong one), and Q(t) = r_t + gamma Q(t + 1) before. With
# --toy.terminal-horizon the episode terminates instead: Q(t) is the finite sum of the discounted rewards to H, or, with
# --bootstrap-at-done always, the same as for a truncation.
# ----------------------------------------------------------------------------------------------------------------------
CHAIN_GAMMA = 0.9
CHAIN = [
    "--env-id",
    "ToyChainContinuous-v0",
    "--toy.block-length",
    "1",
    "--toy.progression-prob",
    "1.0",
    "--num-envs",
    "16",
    "--num-eval-envs",
    "2",
    "--batch-size",
    "256",
    "--warm-up-steps",
    "8",
    "--gamma",
    str(CHAIN_GAMMA),
    "--reward-scale",
    "1",
    "--target-noise-std",
    "0",
    "--norm-obs",
    "True",
    "--save-model",
    "--no-cuda",
]


def closed_form_q(rewards, gamma, bootstrap_last):
    q = np.zeros(len(rewards))
    q[-1] = rewards[-1] / (1 - gamma) if bootstrap_last else rewards[-1]
    for t in range(len(rewards) - 2, -1, -1):
        q[t] = rewards[t] + gamma * q[t + 1]
    return q


def learned_and_true_q(run_dir, gamma, bootstrap_last):
    """From final_ckpt.pt: min(Q1, Q2)(s_t, pi(s_t)) along one episode of the saved policy (observations normalized
    with the saved statistics, as the run did), and the closed-form Q of that policy from the rewards it collects."""
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
    config = json.load(open(os.path.join(run_dir, "config.json")))
    toy = ToyChainContinuousConfig(**config["toy"])
    policy = pql.Policy(toy.horizon, toy.action_dim, tuple(config["hidden_dims"]))
    critic = pql.Critic(toy.horizon, toy.action_dim, tuple(config["hidden_dims"]))
    policy.load_state_dict(ckpt["model"]["policy"])
    critic.load_state_dict(ckpt["model"]["critic"])
    obs_rms = pql.RunningMeanStd(ckpt["obs_rms"]["mean"].shape, "cpu")
    obs_rms.mean, obs_rms.var = ckpt["obs_rms"]["mean"], ckpt["obs_rms"]["var"]
    env = gym.make_vec(pql.TOY_ENV_ID, num_envs=1, config=toy, device="cpu")
    obs, _ = env.reset(seed=0)
    learned, rewards = [], []
    with torch.no_grad():
        for _ in range(toy.horizon):
            normalized = obs_rms.normalize(obs)
            action = policy(normalized)
            learned.append(torch.min(*critic.q_values(normalized, action)).item())
            obs, reward, *_ = env.step(action)
            rewards.append(reward.item())
    return np.array(learned), closed_form_q(np.array(rewards), gamma, bootstrap_last)


@pytest.mark.slow
@pytest.mark.parametrize(
    "episode_end, bootstrap_last",
    [
        ([], True),
        (["--toy.terminal-horizon"], False),
        (["--toy.terminal-horizon", "--bootstrap-at-done", "always"], True),
    ],
)
def test_v_learner_finds_the_closed_form_q_of_a_fixed_policy(tmp_path, episode_end, bootstrap_last):
    """The V-learner alone (three processes; beta_p:v ~ 0: the P-learner never updates, so the policy stays the
    initial one; no exploration or target noise) on the 5-block deterministic chain: after 150 Actor steps of 16 envs
    every Q(s_t, pi(s_t)) is within 6% of the closed form. Measured (seeds 1-5, all three cases): at most 1.9% off.
    Breaking the normalizer hand-over (learners on raw observations) puts it 30% off (seed 1), bootstrapping a
    truncation from the reset observation 24% (seed 1; the closed forms of the two differ by 20-42% for seeds 1-5),
    a wrong --bootstrap-at-done rule several times."""
    args = CHAIN + [
        "--toy.horizon",
        "5",
        "--toy.task-seed",
        "2",
        "--total-timesteps",
        str(16 * 150),
        "--beta-p-v",
        "1e-9",
        "--sigma-min",
        "0",
        "--sigma-max",
        "0",
        "--eval-freq",
        "1000",
        *episode_end,
    ]
    run_script(args, tmp_path)
    run_dir = only_run_dir(tmp_path)
    assert read_summary(run_dir)["pql/p_updates"] == 0
    learned, true = learned_and_true_q(run_dir, CHAIN_GAMMA, bootstrap_last)
    assert np.abs(learned - true).max() <= 0.06 * np.abs(true).max(), (learned, true)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["parallel", "ddpg_n"])
def test_learning_on_the_deterministic_chain_with_the_q_of_the_learned_policy(tmp_path, mode):
    """The 10-block deterministic chain, gamma 0.8, 1-step targets (n-step returns of exploratory actions would bias
    Q below the Q of the deterministic policy): the eval return rises from that of the untrained policy (2.62-2.80
    for seeds 1-5, of at most 5) to 4.82-4.88 after 200 Actor steps of 16 envs, and the critic's Q of the final
    policy is within 30% of its closed form (measured 13-15% below it, seeds 1-5, both modes: the critic smooths the
    peak of the reward around the target action). Without the network syncs this fails (seed 1): an Actor that never
    gets the P-learner's policy explores around the initial one, and Q ends 54% below; a P-learner that never gets the
    critics climbs a random Q (returns below 0); a V-learner whose target policy stays the initial one learns the Q
    of that policy (49% below)."""
    args = CHAIN + [
        "--toy.horizon",
        "10",
        "--total-timesteps",
        str(16 * 200),
        "--eval-freq",
        "25",
        "--nstep",
        "1",
        "--gamma",
        "0.8",
    ]
    run_script(args + (["--ddpg-n"] if mode == "ddpg_n" else []), tmp_path)
    run_dir = only_run_dir(tmp_path)
    returns = [v for _, v in scalars(run_dir)["eval/return"]]
    assert returns[0] < 3.0 and returns[-1] >= 4.5, returns
    learned, true = learned_and_true_q(run_dir, 0.8, bootstrap_last=True)
    assert np.abs(learned - true).max() <= 0.3 * np.abs(true).max(), (learned, true)


@pytest.mark.slow
def test_maniskill_cpu_simulation_smoke(tmp_path):
    """PickCube-v1 on CPU simulation (physx_cpu, 2 env worker processes) with the three processes."""
    args = [
        "--env-id",
        "PickCube-v1",
        "--num-envs",
        "2",
        "--num-eval-envs",
        "1",
        "--horizon",
        "20",
        "--total-timesteps",
        "120",
        "--warm-up-steps",
        "10",
        "--batch-size",
        "32",
        "--eval-freq",
        "25",
        "--no-cuda",
    ]
    run_script(args, tmp_path, timeout=900)
    run_dir = only_run_dir(tmp_path)
    summary = read_summary(run_dir)
    assert summary["global_step"] == 120 and summary["pql/learning_steps"] == 50
    assert summary["pql/v_updates"] == 200 and summary["pql/ratio_a_v"] == 0.25  # the CPU preset's beta_a:v, 1:4
    assert summary["eval/episode_len"] == 20 and "eval/success_once" in summary and "eval/return" in summary
    assert "charts/episodic_return" in summary  # episodes of 20 steps ended during training
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["sim_backend"] == "physx_cpu" and config["norm_obs"] is True and config["gamma"] == 0.8
    assert config["bootstrap_at_done"] == "always"  # ManiSkill's default (its own PPO and SAC bootstrap every end)


EVAL_LINE = re.compile(
    r"global_step=(\d+) eval/return=\S+ eval/success_once=\S+ eval/success_at_end=\S+ eval/episode_len=\d+"
)


@pytest.mark.slow
def test_save_model_then_evaluate_then_resume(tmp_path):
    """A run of 40 Actor steps with checkpoints; --evaluate of its final checkpoint (one line, eval_final_ckpt.json
    beside it, no run directory); a resume to 60 steps in the same run directory and TensorBoard stream (no step twice),
    with the counts carried on; a second resume to 60 refused; an evaluation with other networks refused."""
    first = tmp_path / "first"
    run_script(TOY_SMALL + ["--total-timesteps", str(32 * 40), "--save-model", "--distributional"], first)
    run_dir = only_run_dir(first)
    ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.pt")))
    assert ckpts == ["ckpt_640.pt", "final_ckpt.pt"]
    final = os.path.join(run_dir, "final_ckpt.pt")
    ckpt = torch.load(final, weights_only=True)
    layout = {"script", "env_id", "model", "optimizer", "rng", "counts", "global_step", "iteration", "obs_rms"}
    assert set(ckpt) == layout | {"wandb_id", "actor", "args"} and ckpt["script"] == "pql.py"
    assert ckpt["env_id"] == pql.TOY_ENV_ID and ckpt["wandb_id"] is None  # (no --track)
    assert set(ckpt["model"]) == {"policy", "critic", "critic_target"} and set(ckpt["rng"]) == {
        "v_learner",
        "p_learner",
    }
    assert set(ckpt["optimizer"]) == {"policy", "critic"} and set(ckpt["obs_rms"]) == {"mean", "var", "count"}
    assert ckpt["iteration"] == 40 and ckpt["global_step"] == 1280 and ckpt["optimizer"]["policy"]["state"]
    assert (
        set(ckpt["actor"]) == {"rng", "explore", "obs", "window", "episode", "env"} and "block" in ckpt["actor"]["env"]
    )
    assert set(ckpt["actor"]["rng"]) == {"torch", "cuda", "numpy", "python"} and len(ckpt["actor"]["window"]) == 2
    assert ckpt["counts"]["actor_steps"] == 32 and ckpt["optimizer"]["critic"]["state"]
    critic = ckpt["model"]["critic"]
    assert critic["q1.0.weight"].shape == (256, 10 + 4) and critic["q1.4.weight"].shape[0] == 51
    assert "eval/return" in read_summary(run_dir)

    runs = set(glob.glob(os.path.join(ROOT, "runs", "*")))
    evaluation = [*TOY_SMALL[:4], "--num-eval-envs", "16", "--no-cuda", "--distributional", "--evaluate"]
    proc = run_script([*evaluation, "--checkpoint", final], None)
    results = [line for line in proc.stdout.splitlines() if line.startswith("global_step=")]
    assert len(results) == 1 and EVAL_LINE.fullmatch(results[0]) and results[0].startswith("global_step=1280 ")
    assert "started: pid" not in proc.stdout and "resuming" not in proc.stdout  # no learner processes, no resume
    evaluated = json.loads(open(os.path.join(run_dir, "eval_final_ckpt.json")).read())
    assert evaluated["global_step"] == 1280 and evaluated["checkpoint"] == final and evaluated["eval_seed"] == 10_041
    assert evaluated["num_eval_envs"] == evaluated["num_eval_episodes"] == 16 and evaluated["eval/episode_len"] == 50
    assert f"eval/return={evaluated['eval/return']:.4g} " in results[0] and abs(evaluated["eval/return"]) <= 25.0
    assert set(glob.glob(os.path.join(ROOT, "runs", "*"))) == runs and only_run_dir(first) == run_dir

    resume = TOY_SMALL + ["--total-timesteps", str(32 * 60), "--distributional", "--save-model", "--checkpoint", final]
    proc = run_script(resume, None)
    assert f"resuming {run_dir} at global step 1280 (iteration 40)" in proc.stdout
    assert (
        "resume: the replay buffers are not in the checkpoint: the learners refill them (a warm-up of 8" in proc.stdout
    )
    resumed = read_summary(run_dir)
    assert resumed["global_step"] == 32 * 60 and resumed["iteration"] == 60
    # the counts go on: 32 learning steps before, then 8 warm-up steps (with the saved policy) and 12 learning steps
    assert resumed["pql/learning_steps"] == 32 + 12 and resumed["pql/v_updates"] == 8 * 44
    assert json.load(open(os.path.join(run_dir, "config.json")))["total_timesteps"] == 32 * 60
    logged = scalars(run_dir)  # one stream: every step once, in order
    assert [step for step, _ in logged["eval/return"]] == [0, 640, 1280, 1920]
    sps_steps = [step for step, _ in logged["charts/SPS"]]
    assert sps_steps == sorted(set(sps_steps)) and sps_steps[-1] == 1920
    assert glob.glob(os.path.join(run_dir, "events.out.tfevents.*")) and only_run_dir(first) == run_dir

    proc = run_script(resume, None, check=False)  # from the resumed run's final checkpoint, at its end
    message = "--total-timesteps 1920: the checkpoint is at global step 1920 already; pass a larger value"
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {message}"
    proc = run_script(evaluation[:-2] + ["--evaluate", "--checkpoint", final], None, check=False)
    assert proc.returncode == 2 and "--distributional False: the checkpoint's run has True" in proc.stderr


# pql.py with one learner's update() failing after 20 updates. A spawned process imports the main script (this one)
# first, so the patch holds in the learner processes too.
CRASHING_LEARNER = """
import sys

sys.path.insert(0, {root!r})
import pql
import tyro

working_update = pql.{cls}.update


def crashing_update(self, *args):
    self.updates_done = getattr(self, "updates_done", 0) + 1
    if self.updates_done > 20:
        raise RuntimeError("the {cls} fails on purpose")
    return working_update(self, *args)


pql.{cls}.update = crashing_update
if __name__ == "__main__":
    try:
        pql.main(tyro.cli(pql.Args))
    except pql.ProcessFailed as error:
        print(f"error: {{error}}", file=sys.stderr)
        sys.exit(1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("role", ["v_learner", "p_learner"])
def test_a_crashing_learner_ends_the_run_with_its_traceback(tmp_path, role):
    cls = {"v_learner": "VLearner", "p_learner": "PLearner"}[role]
    script = tmp_path / "crashing_pql.py"
    script.write_text(CRASHING_LEARNER.format(root=ROOT, cls=cls))
    runs = tmp_path / "runs"
    proc = run_script(TOY_SMALL + ["--total-timesteps", str(32 * 10**4)], runs, check=False, timeout=300, script=script)
    assert proc.returncode == 1, proc.stderr[-2000:]  # (a hang runs into the timeout)
    name = {"v_learner": "V-learner", "p_learner": "P-learner"}[role]
    assert f"error: the {name} process failed" in proc.stderr
    assert "Traceback" in proc.stderr and f"RuntimeError: the {cls} fails on purpose" in proc.stderr
    assert read_summary(only_run_dir(runs))["interrupted"] is False  # summary.json is written on failure too
    for pid in learner_pids(proc.stdout).values():
        assert not pid_alive(pid)


def start_long_run(tmp_path, extra=()):
    """A long run; returns it and its learners' pids once both have started."""
    proc = start_script([*TOY_SMALL, "--total-timesteps", str(32 * 10**5), *extra], tmp_path)
    pids, lines = {}, []
    deadline = time.time() + 300
    while len(pids) < 2 and time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        pids.update(learner_pids(line))
    if len(pids) < 2:
        kill_group(proc)
        pytest.fail("the learners did not start:\n" + "".join(lines))
    return proc, pids


def wait_for_file(tmp_path, pattern, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and not glob.glob(os.path.join(str(tmp_path), "*", pattern)):
        time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_learner_ends_the_run_within_seconds(tmp_path):
    proc, pids = start_long_run(tmp_path, ["--save-model"])
    wait_for_file(tmp_path, "ckpt_*.pt")
    os.kill(pids["P-learner"], signal.SIGKILL)
    _, stderr = finish(proc, timeout=120)  # a guard against a hang (it takes seconds)
    assert proc.returncode == 1
    assert "the P-learner process" in stderr and "killed by signal 9" in stderr
    assert not pid_alive(pids["V-learner"])


@pytest.mark.slow
def test_killing_the_actor_leaves_no_orphans(tmp_path):
    proc, pids = start_long_run(tmp_path, ["--save-model"])
    wait_for_file(tmp_path, "ckpt_*.pt")
    proc.kill()  # SIGKILL: the Actor cannot clean up; the learners notice that their parent is gone
    proc.wait(timeout=30)
    deadline = time.time() + 120  # a bound for a loaded machine: they notice within a few polls
    while time.time() < deadline and any(pid_alive(pid) for pid in pids.values()):
        time.sleep(0.2)
    alive = [pid for pid in pids.values() if pid_alive(pid)]
    kill_group(proc)
    assert not alive


# Moments of a run to interrupt: (extra flags, what to wait for before SIGINT, seconds to wait after it)
CTRL_C_MOMENTS = {
    # the Actor's first steps, before learning starts (slow env steps: the warm-up of 100 steps lasts 10 s), once the
    # first progress line (a second after training started) says that it stepped
    "warm_up": (
        ["--toy.step-time-mean", "0.003", "--eval-freq", "1000", "--num-eval-envs", "1", "--warm-up-steps", "100"],
        "progress ",
        0.0,
    ),
    # learning, between the checkpoints of evaluations every 20 steps
    "updates": ([], "ckpt_*.pt", 1.0),
    # inside the first evaluation, which lasts about 58 s (64 eval envs of slow steps, H = 300): it must not finish
    "evaluation": (["--toy.step-time-mean", "0.003", "--toy.horizon", "300", "--num-eval-envs", "64"], None, 2.0),
    # an evaluation of five steps (H = 5) and a checkpoint at every Actor step: most of the time is spent saving
    "checkpoint_save": (["--eval-freq", "1", "--toy.horizon", "5"], "ckpt_*.pt", 0.3),
}


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(CTRL_C_MOMENTS))
def test_ctrl_c_at_any_moment_ends_the_run_with_summary_checkpoint_and_no_process_left(tmp_path, moment):
    """SIGINT to the process group (learners included) at four moments (once a file or line appeared, and a delay):
    exit code 130, summary.json marked interrupted, final_ckpt.pt of the same global step (once the run stepped), no
    temporary files, no process left (a clean stop takes 1-3 s;
    the 120 s only guard against a hang). An evaluation is interrupted, not finished: it sleeps 58 s in its env steps,
    on any machine, and SIGINT comes 2 s after it began, so no eval/return can have been written (holds under load:
    no wall-clock bound is asserted)."""
    extra, wait_for, delay = CTRL_C_MOMENTS[moment]
    proc, pids = start_long_run(tmp_path, ["--save-model", "--progress-interval", "1", *extra])
    if wait_for and wait_for.endswith(".pt"):
        wait_for_file(tmp_path, wait_for)
    elif wait_for:  # a line of its output
        line = "?"
        while line and not line.startswith(wait_for):
            line = proc.stdout.readline()
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group gets it
    stdout, stderr = finish(proc, timeout=120)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    summary = read_summary(run_dir)
    assert summary["interrupted"] is True
    if moment == "evaluation":  # the first one, before any Actor step: nothing new to checkpoint
        assert "eval/return" not in summary and summary["global_step"] == 0  # (it did not run to its end)
        assert not os.path.exists(os.path.join(run_dir, "final_ckpt.pt"))
    else:
        assert summary["pql/learning_steps"] == 0 if moment == "warm_up" else summary["pql/learning_steps"] > 0
        ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=True)
        assert ckpt["global_step"] == summary["global_step"] and "policy" in ckpt["model"]
        assert "critic" in ckpt["optimizer"] and ckpt["global_step"] > 0
    assert not glob.glob(os.path.join(run_dir, "*.tmp")) and not glob.glob(os.path.join(run_dir, "*_state.pt"))
    assert not any(pid_alive(pid) for pid in pids.values())


PROGRESS = re.compile(
    r"progress global_step=(\d+)/(\d+) \((\d+)%\) SPS=\d+ elapsed=\d+:\d\d:\d\d left=(\d+:\d\d:\d\d|\?)"
    r"( charts/episodic_return=\S+)?( charts/success_rate=\S+)? actor_steps=\d+ v_updates=\d+ p_updates=\d+"
    r" a:v=(\d+\.\d{3}|\?)/0\.125 p:v=(\d+\.\d{3}|\?)/0\.500"
)


@pytest.mark.slow
def test_progress_lines_in_a_log_file(tmp_path):
    """A long run with --progress-interval 1, its stdout a file (as `> log.txt` makes it, without PYTHONUNBUFFERED):
    each line in the file as it is printed, plain (no carriage return), in the documented format, the percentage
    rounded down, global_step increasing; Ctrl-C after the third."""
    log = tmp_path / "stdout.txt"
    with open(log, "w") as stdout:
        flags = [
            "--total-timesteps",
            str(32 * 10**5),
            "--progress-interval",
            "1",
            "--eval-freq",
            "0",
        ]  # (no other line)
        proc = start_script(TOY_SMALL + flags, tmp_path, stdout=stdout, unbuffered=False)  # (its lines are flushed)
    seen = []  # the number of progress lines in the file at each look, every 10 ms
    try:
        wait_until(lambda: seen.append(log.read_text().count("\nprogress ")) or seen[-1] >= 3, "3 lines", timeout=300)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        finish(proc, timeout=120)
    assert seen[-1] <= 4  # each line came when printed (a second apart), not with a buffer of 40 when it filled
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("progress ")]
    assert "\r" not in text and len(lines) >= 3 and proc.returncode == 130
    steps = []
    for line in lines:
        match = PROGRESS.fullmatch(line)
        assert match, line
        done, total, percent = (int(match.group(index)) for index in (1, 2, 3))
        assert total == 32 * 10**5 and percent == 100 * done // total
        steps.append(done)
    assert steps == sorted(set(steps))


def group_processes(pgid):
    """The live processes of a process group (zombies excluded)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(name))
    return found


@pytest.mark.slow
def test_ctrl_c_while_the_maniskill_env_workers_start_ends_the_run_within_10_s(tmp_path):
    """pql.py on PushCube-v1, CPU simulation (8 env worker processes per env set; its start takes about a minute on 2
    cores): SIGINT to the process group once the settings are printed and the first env workers run (the process group
    has grown by 3: the forkserver and workers; each takes seconds to build its scene). The run ends with 130 and
    summary.json marked interrupted, nothing left of the group. Measured: 1.2-3.5 s after the signal here (at any
    moment of the start, learners starting included); the bound of 10 s leaves CI's load a margin of 3x."""
    proc = start_script(["--env-id", "PushCube-v1", "--no-cuda"], tmp_path)
    try:
        lines = []
        while not lines or not lines[-1].startswith("settings:"):
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines) + proc.stderr.read()
        started = len(group_processes(proc.pid))
        wait_until(lambda: len(group_processes(proc.pid)) >= started + 3, "the env workers' start", timeout=300)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        ended = time.monotonic() - signalled
        wait_until(lambda: not group_processes(proc.pid), "the end of every process of the run", timeout=30)
    finally:
        kill_group(proc)
        proc.communicate()
    assert proc.returncode == 130 and ended < 10.0, ended
    summary = read_summary(only_run_dir(tmp_path))
    assert summary["interrupted"] is True and summary["global_step"] == 0


@pytest.mark.slow
def test_evaluate_with_capture_video_writes_a_video_beside_the_checkpoint(tmp_path):
    """--evaluate --capture-video of a checkpoint on PushCube-v1 (CPU simulation and rendering, 1 eval env, H = 5):
    the video path printed, one mp4 of the reset and 5 steps there, read back as 6 frames; the result line and
    eval_ckpt.json beside the checkpoint. On the toy chain --capture-video is refused (no renderer)."""
    import imageio.v2 as imageio

    checkpoint = tiny_checkpoint(tmp_path / "ckpt.pt", "PushCube-v1", 35, 8)
    flags = ["--env-id", "PushCube-v1", "--no-cuda", "--num-eval-envs", "1", "--horizon", "5"]
    proc = run_script([*flags, "--evaluate", "--checkpoint", checkpoint, "--capture-video"], None, timeout=900)
    assert f"videos: {tmp_path / 'videos'}" in proc.stdout
    assert EVAL_LINE.fullmatch([line for line in proc.stdout.splitlines() if line.startswith("global_step=")][0])
    videos = glob.glob(str(tmp_path / "videos" / "**" / "*.mp4"), recursive=True)
    assert [os.path.relpath(path, tmp_path) for path in videos] == [os.path.join("videos", "env0", "0.mp4")]
    assert open(videos[0], "rb").read(12)[4:8] == b"ftyp"  # an MP4 container
    reader = imageio.get_reader(videos[0], "ffmpeg")
    assert reader.count_frames() == 6 and reader.get_data(0).ndim == 3
    reader.close()
    assert json.load(open(tmp_path / "eval_ckpt.json"))["eval/episode_len"] == 5


def test_bad_flag_exits_early_with_a_message_and_writes_nothing(tmp_path):
    proc = run_script(["--env-id", "ToyChain-v0"], tmp_path, check=False)
    assert proc.returncode == 2
    assert "is not ToyChainContinuous-v0 or a registered ManiSkill3 task" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_a_replay_buffer_larger_than_memory_is_an_error_naming_the_flag(tmp_path):
    proc = run_script(
        TOY_SMALL + ["--total-timesteps", str(10**13), "--buffer-size", str(10**12)], tmp_path, check=False
    )
    assert proc.returncode == 2 and "--buffer-size" in proc.stderr and "use a smaller --buffer-size" in proc.stderr
    assert "started: pid" not in proc.stdout


def test_write_whole_leaves_the_old_file_and_no_temporary_one_when_interrupted(tmp_path):
    """Checkpoints, summary.json, config.json and eval json go through write_whole: a Ctrl-C while writing leaves the
    file as it was (or none) and no temporary file."""

    def half_then_interrupted(path):
        path.write_text("half")
        raise KeyboardInterrupt

    pql.write_whole(tmp_path / "summary.json", lambda path: path.write_text("whole"))
    with pytest.raises(KeyboardInterrupt):
        pql.write_whole(tmp_path / "summary.json", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        pql.write_whole(tmp_path / "final_ckpt.pt", half_then_interrupted)
    assert os.listdir(tmp_path) == ["summary.json"] and (tmp_path / "summary.json").read_text() == "whole"
