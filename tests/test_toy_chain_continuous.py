"""ToyChainContinuous-v0 (toy_chain_env.py): the ToyChain with actions in [-1, 1]^d, for pql.py. Rewards from the
distance to the block's target vector, the same skill gating, horizon, autoreset modes and partial resets."""

import gymnasium as gym
import pytest
import torch
from conftest import DEVICES

from toy_chain_env import ToyChainConfig, ToyChainContinuousConfig, ToyChainContinuousVectorEnv, draw_target_vectors


def make(num_envs=4, device="cpu", **overrides):
    env = ToyChainContinuousVectorEnv(num_envs, ToyChainContinuousConfig(**overrides), device=device)
    env.reset(seed=0)
    return env


def on_target(env):
    return env.target_vectors[env.block].clone()


def far_off(env):
    """An action at RMS distance > target_radius from every env's target: the mirror image through 0 (or +1)."""
    target = env.target_vectors[env.block]
    return torch.where(target.abs() < 0.5, target + 1.0, -target)


def test_registered_with_box_spaces_and_one_hot_observations():
    envs = gym.make_vec("ToyChainContinuous-v0", num_envs=6, horizon=30, block_length=3, action_dim=2)
    assert isinstance(envs, ToyChainContinuousVectorEnv)
    assert envs.single_observation_space == gym.spaces.Box(0.0, 1.0, (10,), "float32")
    assert envs.single_action_space == gym.spaces.Box(-1.0, 1.0, (2,), "float32")
    obs, _ = envs.reset(seed=1)
    assert obs.shape == (6, 10) and obs.dtype == torch.float32
    assert torch.equal(obs.sum(-1), torch.ones(6)) and torch.equal(obs.argmax(-1), envs.block)


def test_a_plain_toychain_config_keeps_its_settings_and_unknown_options_are_rejected():
    env = ToyChainContinuousVectorEnv(2, ToyChainConfig(horizon=40, block_length=4))
    assert env.config.horizon == 40 and env.num_blocks == 10 and env.config.action_dim == 4
    with pytest.raises(TypeError, match="unknown ToyChainContinuous option"):
        ToyChainContinuousVectorEnv(2, no_such_option=1)


@pytest.mark.parametrize("device", DEVICES)
def test_reward_is_half_minus_half_the_rms_distance_to_the_target_vector(device):
    env = make(num_envs=3, device=device, horizon=20, action_dim=4)
    target = env.target_vectors[env.block]
    actions = target.clone()
    actions[1] = target[1] + torch.tensor([0.2, -0.2, 0.2, -0.2], device=device)  # RMS distance exactly 0.2
    actions[2] = target[2] + torch.tensor([0.4, 0.0, 0.0, 0.0], device=device)  # RMS distance 0.4 / 2 = 0.2
    _, reward, terminated, truncated, info = env.step(actions)
    torch.testing.assert_close(reward.cpu(), torch.tensor([0.5, 0.4, 0.4]))
    assert info["correct"].tolist() == [True, True, True]  # distance <= target_radius (0.2)
    assert not terminated.any() and not truncated.any()


def test_the_far_corner_gives_minus_half_and_out_of_box_actions_are_clipped():
    env = make(num_envs=1, horizon=20, action_dim=2)
    env.target_vectors[:] = torch.tensor([0.8, -0.8])
    _, reward, _, _, info = env.step(torch.tensor([[-5.0, 5.0]]))  # clipped to (-1, 1): distance 1.8 per axis
    torch.testing.assert_close(reward, torch.tensor([0.5 - 0.5 * 1.8]))
    assert not info["correct"].any()
    env2 = make(num_envs=1, horizon=20, action_dim=2)
    env2.target_vectors[:] = torch.tensor([1.0, -1.0])
    _, reward, _, _, _ = env2.step(torch.tensor([[-1.0, 1.0]]))  # the opposite corner of [-1, 1]^2: distance 2
    torch.testing.assert_close(reward, torch.tensor([-0.5]))


def test_target_vectors_come_from_the_task_seed_and_lie_in_the_inner_box():
    a, b = make(horizon=50, task_seed=3), make(horizon=50, task_seed=3)
    b.reset(seed=999)
    assert torch.equal(a.target_vectors, b.target_vectors)
    assert not torch.equal(a.target_vectors, make(horizon=50, task_seed=4).target_vectors)
    cfg = ToyChainContinuousConfig(horizon=50, task_seed=3)
    assert torch.equal(a.target_vectors, draw_target_vectors(cfg))
    assert a.target_vectors.shape == (10, 4) and a.target_vectors.abs().max() <= 0.8


def test_correct_actions_drive_mastery_and_wrong_ones_do_not():
    # p_prog = 0: only mastery (3 correct actions in a block of L = 5 steps) moves the agent on (App. B.2.2).
    good = make(num_envs=2, horizon=50, block_length=5, progression_prob=0.0, mastery_threshold=3)
    bad = make(num_envs=2, horizon=50, block_length=5, progression_prob=0.0, mastery_threshold=3)
    for step in range(1, 21):
        good.step(on_target(good))
        bad.step(far_off(bad))
        assert good.block.tolist() == [step // 5] * 2
    assert bad.block.tolist() == [0, 0]


def test_near_misses_inside_the_radius_count_as_correct():
    env = make(num_envs=1, horizon=50, block_length=5, progression_prob=0.0, mastery_threshold=5, target_radius=0.3)
    for _ in range(5):
        env.step(on_target(env) + 0.25)  # RMS distance 0.25 <= 0.3
    assert env.block.tolist() == [1]


@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_horizon_is_a_truncation_with_the_true_final_observation(mode):
    H = 10
    env = make(num_envs=3, horizon=H, block_length=5, progression_prob=1.0, autoreset_mode=mode)
    for t in range(H):
        obs, reward, terminated, truncated, info = env.step(on_target(env))
        assert not terminated.any()
        assert truncated.all() == (t == H - 1)
    assert info["success"].all()  # in the last block (1) when the episode ended
    if mode == "same_step":
        assert torch.equal(obs.argmax(-1), torch.zeros(3, dtype=torch.long))  # already reset
        assert info["_final_obs"].all() and torch.equal(info["final_obs"].argmax(-1), torch.ones(3, dtype=torch.long))
        assert info["final_obs"].shape == (3, 2) and torch.equal(info["final_obs"].sum(-1), torch.ones(3))
    else:
        assert torch.equal(obs.argmax(-1), torch.ones(3, dtype=torch.long))  # the true last observation
        obs, reward, terminated, truncated, info = env.step(on_target(env))  # the reset step ignores the action
        assert reward.tolist() == [0.0] * 3 and not (terminated | truncated).any()
        assert torch.equal(obs.argmax(-1), torch.zeros(3, dtype=torch.long)) and not info["correct"].any()


def test_a_perfect_agent_collects_half_the_horizon():
    env = make(num_envs=4, horizon=50, autoreset_mode="same_step")
    total = torch.zeros(4)
    for _ in range(50):
        _, reward, _, truncated, info = env.step(on_target(env))
        total += reward
    assert truncated.all() and info["final_info"]["success"].all()
    torch.testing.assert_close(total, torch.full((4,), 25.0))


def test_partial_reset_only_touches_masked_envs():
    env = make(num_envs=3, horizon=50, progression_prob=1.0)
    for _ in range(6):
        env.step(on_target(env))
    obs, _ = env.reset(options={"reset_mask": torch.tensor([True, False, True])})
    assert obs.argmax(-1).tolist() == [0, 1, 0] and env.episode_step.tolist() == [0, 6, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_cpu_and_cuda_give_the_same_trajectories(mode):
    # Deterministic dynamics (p_prog in {0, 1}): both devices agree (rewards up to float rounding).
    for p_prog in (0.0, 1.0):
        envs = [
            make(num_envs=8, device=d, horizon=20, progression_prob=p_prog, autoreset_mode=mode)
            for d in ("cpu", "cuda")
        ]
        generator = torch.Generator().manual_seed(0)
        for step in range(45):
            # on target for even steps, uniform random otherwise: both correct and wrong actions occur
            actions = on_target(envs[0]) if step % 2 == 0 else torch.rand((8, 4), generator=generator) * 2 - 1
            (o1, r1, te1, tr1, i1), (o2, r2, te2, tr2, i2) = (e.step(actions.to(e.device)) for e in envs)
            assert torch.equal(o1, o2.cpu()) and torch.equal(tr1, tr2.cpu()) and torch.equal(te1, te2.cpu())
            assert torch.equal(i1["correct"], i2["correct"].cpu())
            torch.testing.assert_close(r1, r2.cpu())


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"action_dim": 0}, "--toy.action-dim"),
        ({"target_radius": 0.0}, "--toy.target-radius"),
        ({"target_radius": 2.5}, "--toy.target-radius"),
        ({"horizon": 7, "block_length": 5}, "--toy.block-length"),
    ],
)
def test_bad_settings_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        ToyChainContinuousConfig(**overrides).validate()
    with pytest.raises(ValueError, match=flag):
        ToyChainContinuousVectorEnv(2, ToyChainContinuousConfig(**overrides))
