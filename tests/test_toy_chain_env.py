"""ToyChain-v0 (App. B.2): rewards, skill gating, resets, horizon, both autoreset modes, partial resets, devices."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import DEVICES

from toy_chain_env import ToyChainConfig, ToyChainVectorEnv, draw_target_actions


def make(num_envs=4, device="cpu", **overrides):
    env = ToyChainVectorEnv(num_envs, ToyChainConfig(**overrides), device=device)
    env.reset(seed=0)
    return env


def correct_actions(env):
    return env.target_actions[env.block]


def wrong_actions(env):
    return (env.target_actions[env.block] + 1) % env.config.num_actions


@pytest.mark.parametrize("device", DEVICES)
def test_reward_is_plus_half_for_the_target_action_and_minus_half_otherwise(device):
    env = make(num_envs=3, device=device, horizon=20)
    actions = correct_actions(env)
    actions[1] = (actions[1] + 3) % env.config.num_actions
    _, reward, terminated, truncated, info = env.step(actions)
    assert reward.tolist() == [0.5, -0.5, 0.5]
    assert info["correct"].tolist() == [True, False, True]
    assert not terminated.any() and not truncated.any()


def test_registered_as_a_vector_entry_point_and_overrides_apply():
    envs = gym.make_vec("ToyChain-v0", num_envs=6, horizon=30, block_length=3)
    assert isinstance(envs, ToyChainVectorEnv)
    assert envs.num_blocks == 10 and envs.single_observation_space == gym.spaces.Discrete(10)
    assert envs.single_action_space == gym.spaces.Discrete(20)
    obs, _ = envs.reset(seed=1)
    assert obs.shape == (6,) and obs.dtype == torch.long


def test_target_actions_come_from_the_task_seed_not_the_episode_seed():
    a = make(horizon=50, task_seed=3)
    b = make(horizon=50, task_seed=3)
    b.reset(seed=12345)
    assert torch.equal(a.target_actions, b.target_actions)
    assert not torch.equal(a.target_actions, make(horizon=50, task_seed=4).target_actions)
    assert torch.equal(a.target_actions, draw_target_actions(ToyChainConfig(horizon=50, task_seed=3)))


def test_hard_gate_without_mastery_never_leaves_the_first_block():
    # p_prog = 0: only mastery moves the agent on (App. B.2.2); an agent that is always wrong stays in block 0.
    env = make(num_envs=8, horizon=50, progression_prob=0.0, mastery_threshold=3)
    for _ in range(49):
        env.step(wrong_actions(env))
        assert (env.block == 0).all()


def test_hard_gate_with_mastery_advances_every_block_length_steps():
    # Always correct: k = 3 <= L = 5 correct actions in each block, so b_t = floor(t / L) exactly.
    env = make(num_envs=2, horizon=50, block_length=5, progression_prob=0.0, mastery_threshold=3)
    blocks = []
    for _ in range(49):
        obs, *_ = env.step(correct_actions(env))
        blocks.append(obs[0].item())
    assert blocks == [(t + 1) // 5 for t in range(49)]


def test_unmet_gate_is_checked_again_after_every_further_step():
    # Our reading of App. B.2.2: after L steps without mastery the agent stays and the check repeats every step.
    # Wrong for the first 5 steps, then correct: the 3rd correct action (step 8) masters block 0 -> block 1.
    env = make(num_envs=1, horizon=50, block_length=5, progression_prob=0.0, mastery_threshold=3)
    blocks = []
    for t in range(10):
        action = wrong_actions(env) if t < 5 else correct_actions(env)
        obs, *_ = env.step(action)
        blocks.append(obs[0].item())
    assert blocks == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]


def test_progression_probability_one_moves_on_regardless_of_actions():
    env = make(num_envs=3, horizon=40, block_length=4, progression_prob=1.0, mastery_threshold=3)
    for t in range(39):
        obs, *_ = env.step(wrong_actions(env))
        assert (obs == (t + 1) // 4).all()


def test_progression_probability_is_the_chance_per_check():
    # With p_prog = 0.3 and wrong actions, the first move happens after L + G - 1 steps, G ~ Geometric(0.3).
    env = make(num_envs=4000, horizon=60, block_length=5, progression_prob=0.3, mastery_threshold=3)
    for _ in range(5):  # the first check is made after the 5th step
        env.step(wrong_actions(env))
    assert abs((env.block == 1).float().mean().item() - 0.3) < 0.03


def test_last_block_is_absorbing():
    env = make(num_envs=2, horizon=20, block_length=5, progression_prob=1.0)
    for _ in range(19):
        env.step(wrong_actions(env))
    assert (env.block == 3).all()


def test_start_block_is_poisson_clamped():
    lam, blocks = 1.5, 4  # clamped to [0, 3]: P(3) = P(X >= 3)
    env = ToyChainVectorEnv(40000, ToyChainConfig(horizon=20, block_length=5, reset_lambda=lam))
    obs, _ = env.reset(seed=7)
    pmf = [math.exp(-lam) * lam**k / math.factorial(k) for k in range(blocks - 1)]
    expected = np.array(pmf + [1 - sum(pmf)])
    observed = np.bincount(obs.numpy(), minlength=blocks) / len(obs)
    np.testing.assert_allclose(observed, expected, atol=0.01)


def test_deterministic_reset_starts_in_block_zero():
    env = ToyChainVectorEnv(100, ToyChainConfig(reset_lambda=0.0))
    obs, _ = env.reset(seed=3)
    assert (obs == 0).all()


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_horizon_is_a_truncation_and_success_means_final_block_at_the_end(mode):
    env = make(num_envs=2, horizon=10, block_length=5, progression_prob=0.0, mastery_threshold=3, autoreset_mode=mode)
    for t in range(10):
        actions = correct_actions(env)
        actions[1] = wrong_actions(env)[1]  # env 1 never masters block 0
        _, _, terminated, truncated, info = env.step(actions)
        assert not terminated.any()  # there is no terminal state
        assert truncated.tolist() == ([True, True] if t == 9 else [False, False])
    assert info["success"].tolist() == [True, False]


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_terminal_horizon_option_ends_the_episode_with_a_termination(mode):
    env = make(num_envs=2, horizon=10, block_length=5, terminal_horizon=True, autoreset_mode=mode)
    for t in range(10):
        _, _, terminated, truncated, _ = env.step(correct_actions(env))
        assert not truncated.any()
        assert terminated.tolist() == [t == 9, t == 9]


def test_next_step_autoreset_sequence():
    # H = 10, L = 5, always correct: obs 0,0,0,0,1,1,1,1,1,1(truncated) then the reset step: obs 0, reward 0.
    env = make(num_envs=1, horizon=10, block_length=5, progression_prob=0.0, autoreset_mode="next_step")
    seen = []
    for _ in range(12):
        obs, reward, terminated, truncated, info = env.step(correct_actions(env))
        seen.append((obs.item(), reward.item(), truncated.item(), info["correct"].item()))
    assert seen[:10] == [(0, 0.5, False, True)] * 4 + [(1, 0.5, False, True)] * 5 + [(1, 0.5, True, True)]
    assert seen[10] == (0, 0.0, False, False)  # the action of the reset step is ignored
    assert seen[11] == (0, 0.5, False, True)
    assert "final_obs" not in info


def test_same_step_autoreset_sequence():
    env = make(num_envs=1, horizon=10, block_length=5, progression_prob=0.0, autoreset_mode="same_step")
    seen = []
    for _ in range(11):
        obs, reward, _, truncated, info = env.step(correct_actions(env))
        seen.append((obs.item(), truncated.item(), info["final_obs"].item(), info["_final_obs"].item()))
    assert seen[8] == (1, False, 1, False)
    assert seen[9] == (0, True, 1, True)  # the reset observation now, the true last one in final_obs
    assert seen[10] == (0, False, 0, False)
    assert env.episode_step.item() == 1


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_partial_reset_only_touches_masked_envs(mode):
    env = make(num_envs=4, horizon=20, block_length=2, progression_prob=1.0, autoreset_mode=mode)
    for _ in range(5):
        env.step(correct_actions(env))
    before_block, before_step = env.block.clone(), env.episode_step.clone()
    mask = torch.tensor([True, False, True, False])
    obs, _ = env.reset(options={"reset_mask": mask})
    assert obs.tolist() == [0, before_block[1].item(), 0, before_block[3].item()]
    assert env.episode_step.tolist() == [0, before_step[1].item(), 0, before_step[3].item()]
    with pytest.raises(ValueError, match="reset_mask"):
        env.reset(options={"reset_mask": torch.tensor([1, 0, 1, 0])})


def test_partial_reset_cancels_a_pending_next_step_reset():
    env = make(num_envs=2, horizon=4, block_length=2, autoreset_mode="next_step")
    for _ in range(4):
        env.step(correct_actions(env))  # both truncated: a reset is pending
    env.reset(options={"reset_mask": torch.tensor([True, False])})
    _, reward, *_ = env.step(correct_actions(env))
    assert reward.tolist() == [0.5, 0.0]  # env 0 was reset already and acts; env 1 does its pending reset


def test_same_seed_same_trajectories_with_stochastic_settings():
    def rollout():
        env = ToyChainVectorEnv(64, ToyChainConfig(horizon=30, progression_prob=0.5, reset_lambda=2.0))
        obs, _ = env.reset(seed=11)
        out = [obs]
        for _ in range(40):
            obs, *_ = env.step(torch.zeros(64, dtype=torch.long))
            out.append(obs)
        return torch.stack(out)

    assert torch.equal(rollout(), rollout())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_cpu_and_cuda_give_the_same_trajectories(mode):
    # Deterministic dynamics (p_prog in {0, 1}, lambda_R = 0): both devices must agree exactly.
    for p_prog in (0.0, 1.0):
        outs = []
        for device in ("cpu", "cuda"):
            env = make(
                num_envs=16, device=device, horizon=20, block_length=4, progression_prob=p_prog, autoreset_mode=mode
            )
            gen = torch.Generator().manual_seed(0)
            trace = []
            for _ in range(45):
                actions = torch.randint(0, 20, (16,), generator=gen)
                obs, reward, _, truncated, info = env.step(actions.to(device))
                trace.append(
                    torch.stack([obs.cpu(), reward.cpu().long(), truncated.cpu().long(), info["correct"].cpu().long()])
                )
            outs.append(torch.stack(trace))
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(horizon=52, block_length=5), "--toy.horizon"),
        (dict(num_actions=1), "--toy.num-actions"),
        (dict(progression_prob=1.5), "--toy.progression-prob"),
        (dict(reset_lambda=-1.0), "--toy.reset-lambda"),
        (dict(autoreset_mode="disabled"), "--toy.autoreset-mode"),
    ],
)
def test_bad_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        ToyChainVectorEnv(2, ToyChainConfig(**overrides))


# ----------------------------------------------------------------------------------------------------------------------
# Simulation time (VER's heterogeneous environments) and the crash option
# ----------------------------------------------------------------------------------------------------------------------
def record_sleeps(monkeypatch):
    import toy_chain_env

    slept = []
    monkeypatch.setattr(toy_chain_env.time, "sleep", lambda seconds: slept.append(seconds))
    return slept


def test_no_delay_by_default(monkeypatch):
    slept = record_sleeps(monkeypatch)
    env = make(num_envs=3, horizon=20)
    for _ in range(25):
        env.step(correct_actions(env))
    assert slept == []


def test_step_time_without_spread_or_jitter_is_the_mean_per_chain(monkeypatch):
    slept = record_sleeps(monkeypatch)
    env = make(num_envs=3, horizon=20, step_time_mean=0.002, step_time_spread=0.0, step_time_jitter=0.0)
    for _ in range(5):
        env.step(correct_actions(env))
    np.testing.assert_allclose(slept, [3 * 0.002] * 5)  # the chains of one step() are simulated one after another


def test_episode_speed_factor_is_fixed_within_an_episode_and_lognormal_across_episodes(monkeypatch):
    slept = record_sleeps(monkeypatch)
    sigma, horizon = 0.8, 4
    env = make(
        num_envs=1,
        horizon=horizon,
        block_length=2,
        autoreset_mode="same_step",
        step_time_mean=1.0,
        step_time_spread=sigma,
        step_time_jitter=0.0,
    )
    env.reset(seed=5)
    episodes = 3000
    for _ in range(episodes * horizon):
        env.step(correct_actions(env))
    per_episode = np.array(slept).reshape(episodes, horizon)
    assert np.ptp(per_episode, axis=1).max() < 1e-12  # one factor per episode (episode-level stragglers)
    factors = per_episode[:, 0]
    assert abs(np.log(factors).std() - sigma) < 0.05
    assert abs(factors.mean() - 1.0) < 0.06  # mean-one factor: --toy.step-time-mean stays the mean step time


def test_per_step_jitter_is_lognormal_with_mean_one(monkeypatch):
    slept = record_sleeps(monkeypatch)
    sigma = 0.5
    env = make(num_envs=1, horizon=1000, step_time_mean=1.0, step_time_spread=0.0, step_time_jitter=sigma)
    for _ in range(4000):
        env.step(correct_actions(env))
    factors = np.array(slept)
    assert len(np.unique(factors)) == len(factors)  # a new factor every step (action-level stragglers)
    assert abs(np.log(factors).std() - sigma) < 0.03 and abs(factors.mean() - 1.0) < 0.03


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_delays_leave_the_dynamics_unchanged(monkeypatch, mode):
    record_sleeps(monkeypatch)

    def rollout(**timing):
        env = ToyChainVectorEnv(
            32, ToyChainConfig(horizon=20, progression_prob=0.5, reset_lambda=1.0, autoreset_mode=mode, **timing)
        )
        obs, _ = env.reset(seed=3)
        gen = torch.Generator().manual_seed(0)
        out = [obs]
        for _ in range(50):
            obs, reward, _, truncated, _ = env.step(torch.randint(0, 20, (32,), generator=gen))
            out += [obs, reward.long(), truncated.long()]
        return torch.stack(out)

    assert torch.equal(rollout(), rollout(step_time_mean=0.01, step_time_spread=1.0, step_time_jitter=0.5))


def test_step_time_is_spent_inside_step():
    env = make(num_envs=1, horizon=20, step_time_mean=0.01, step_time_jitter=0.0)
    import time

    start = time.perf_counter()
    env.step(correct_actions(env))
    assert time.perf_counter() - start >= 0.0095  # time.sleep never returns early


def test_crash_at_step_raises_in_that_call():
    env = make(num_envs=2, horizon=20, crash_at_step=3)
    env.step(correct_actions(env))
    env.step(correct_actions(env))
    with pytest.raises(RuntimeError, match="deliberate crash in step\\(\\) call 3"):
        env.step(correct_actions(env))


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(step_time_mean=-0.1), "--toy.step-time-mean"),
        (dict(step_time_spread=-1.0), "--toy.step-time-spread"),
        (dict(step_time_jitter=float("nan")), "--toy.step-time-jitter"),
        (dict(crash_at_step=-1), "toy.crash_at_step"),
    ],
)
def test_bad_timing_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        ToyChainVectorEnv(2, ToyChainConfig(**overrides))


def run_random_steps(env, num_steps: int, seed: int) -> list:
    """num_steps of random actions; every output and the time draws' per-chain speed factors, for comparison."""
    generator = torch.Generator().manual_seed(seed)
    trace = []
    for _ in range(num_steps):
        actions = torch.randint(0, env.config.num_actions, (env.num_envs,), generator=generator)
        obs, reward, terminated, truncated, info = env.step(actions)
        trace.append((obs.tolist(), reward.tolist(), terminated.tolist(), truncated.tolist(), info["success"].tolist()))
        trace.append(env._episode_speed.tolist())
    return trace


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_a_restored_state_continues_exactly_as_the_original(mode, tmp_path):
    """state_dict() through torch.save and a weights_only load, into a new env: the same future (outputs, gating
    draws, Poisson starts, episode speed factors), and none of it from the new env's own seed."""
    config = dict(horizon=20, block_length=2, progression_prob=0.5, reset_lambda=1.5, autoreset_mode=mode)
    config.update(step_time_spread=0.5)  # (speed factors are drawn without sleeping: step_time_mean stays 0)
    original = make(num_envs=6, **config)
    original.config = ToyChainConfig(**{**config, "step_time_mean": 1e-9})  # draw speed factors, sleep ~0
    run_random_steps(original, 33, seed=1)
    original.reset(options={"reset_mask": torch.tensor([True, False, True, False, False, False])})
    run_random_steps(original, 8, seed=3)  # next-step: four chains at H, their resets pending
    torch.save({"env": original.state_dict()}, tmp_path / "state.pt")
    restored = make(num_envs=6, **config)
    restored.config = original.config
    restored.reset(seed=99)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["env"])
    assert run_random_steps(restored, 50, seed=2) == run_random_steps(original, 50, seed=2)


def test_a_state_of_another_number_of_chains_is_refused():
    with pytest.raises(ValueError, match="a state of 4 chains, not of 3"):
        make(num_envs=3).load_state_dict(make(num_envs=4).state_dict())
