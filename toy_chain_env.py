"""ToyChain: the skill-gated chain environment of App. B.2 of

    "Staggered Environment Resets Improve Massively Parallel On-Policy Reinforcement Learning"
    Sid Bharthulwar, Stone Tao, Hao Su (2025), arXiv:2511.21011

batched in torch, so that thousands of chains step at once on the CPU or on a CUDA device.

The task (App. B.2.1, Sec. 4.1)
-------------------------------
An episode lasts H steps and the chain has B = H / L blocks ("levels") of L steps each. The observation is the
index b of the block the agent is in. Every block has a fixed target action a*_b in {0, ..., A_c - 1}; choosing it
gives +0.5, any other action -0.5. A perfect agent therefore collects 0.5 * H per episode.

Skill gating (App. B.2.2). After the agent has spent L steps in block b it moves on to b + 1 if either
  1. it has mastered b: at least k_mastery correct actions in b during the current episode, or
  2. a random check with probability p_prog succeeds.
The paper does not say what happens when neither is true. Our reading, the simplest one consistent with the text:
the agent stays in b, and the same check is made again after every further step it spends there (its count of
correct actions in b keeps growing, so an agent that keeps choosing a*_b eventually masters b and moves on).
The last block has no successor: the agent stays in it until the episode ends.

Start state (App. B.2.2): the start block is b_0 ~ Poisson(lambda_R), clamped to [0, B - 1]; lambda_R = 0 always
starts in block 0. The episode still lasts H steps from wherever it starts.

Episode end: after H steps the episode is *truncated* (a time limit: the observation carries no time, so the
value of the last state is bootstrapped, not zeroed). There is no termination. The paper calls the end
"terminates"; for learning it is a time limit, which is what we model. Success = the agent is in the final block
when the episode ends.

Vector-env API (Gymnasium 1.x VectorEnv)
----------------------------------------
Observations, rewards and flags are torch tensors on the env's device (as ManiSkill3 returns them):
  obs (N,) int64 block index, reward (N,) float32, terminated / truncated (N,) bool.
Both of Gymnasium's autoreset modes are implemented (Gymnasium's documentation: "Vector Environments", autoreset modes):
  * "next_step": the step that ends an episode returns the true last observation; the *next* call to step()
    resets that env, ignores its action and returns the reset observation with reward 0 and no flags.
  * "same_step": the step that ends an episode resets at once and returns the reset observation; the true last
    observation is in info["final_obs"] (a dense (N,) tensor, valid where info["_final_obs"] is True) and the
    last step's info in info["final_info"].
reset(options={"reset_mask": mask}) resets only the envs where mask is True and returns the observation of all.

Diagnostics for the scripts: `block` (N,) and `episode_step` (N,) are the current block index and the number of
steps taken in the current episode; info["correct"] says whether each env's action was its block's target (False
on the ignored action of a next-step reset); `target_actions` (B,) holds a*_b. ToyChainDiagnostics records a policy's
block occupancy and per-block accuracy over training (App. C), and forgetting_matrix its forgetting (App. E.0.1).
ChainAgent and TABLE2_PPO are Table 2's PPO network and settings for the chain (ppo_staggered.py's).
state_dict() and load_state_dict() save and restore the chains and their random streams, so that a run
resumed from a checkpoint continues as if it had not stopped (each wrapper below has them too).

Simulation time (for VER, Wijmans et al. 2022, Sec. 2: heterogeneous environments). With step_time_mean > 0 every
step() spends time.sleep() inside the call, as a CPU simulator would spend simulation time in the process that steps
it: each chain's step takes step_time_mean * episode_factor * step_factor seconds, where episode_factor (drawn at each
episode start, lognormal with sigma step_time_spread and mean 1) makes some episodes slow throughout (episode-level
stragglers) and step_factor (drawn every step, lognormal with sigma step_time_jitter and mean 1) makes single actions
slow (action-level stragglers); a step of N chains sleeps for the sum of their times (simulated one after another).
These draws use their own random stream, so the task's dynamics are the same with or without delays.
crash_at_step > 0 raises an error in that step() call: a hook for the tests of the scripts' crash handling, set in code,
not a command-line flag (tyro.conf.Suppress keeps it out of every script's --help).

Registered with Gymnasium as "ToyChain-v0" (vector entry point):
    envs = gymnasium.make_vec("ToyChain-v0", num_envs=512, config=ToyChainConfig(horizon=200), device="cpu")
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from gymnasium.vector import AutoresetMode, VectorEnv


@dataclass
class ToyChainConfig:
    """Settings of the ToyChain task (App. B.2, Table 2). Scripts nest this as `toy`: --toy.horizon, ..."""

    horizon: int = 200
    """H: episode length in steps; reaching it is a time-limit truncation (App. B.2.1)"""
    block_length: int = 5
    """L: steps the agent spends in a block before it may move on; B = H / L blocks (App. B.2.1)"""
    num_actions: int = 20
    """A_c: number of action categories (Table 2)"""
    progression_prob: float = 0.5
    """p_prog: chance that each gating check lets an unmastered agent move on (App. B.2.2)"""
    mastery_threshold: int = 3
    """k_mastery: correct actions in a block that guarantee moving on from it (App. B.2.2)"""
    reset_lambda: float = 0.0
    """lambda_R: start block ~ Poisson(lambda_R) clamped to [0, B-1]; 0 always starts in block 0 (App. B.2.2)"""
    autoreset_mode: Literal["next_step", "same_step"] = "next_step"
    """Gymnasium autoreset mode of the vector env (next_step masks one stale step; same_step fills final_obs)"""
    task_seed: int = 0
    """seed that draws the target action of each block: the task itself, the same whatever --seed is"""
    terminal_horizon: bool = False
    """end episodes at H with a termination, as App. B.2.1's wording has it (default: a time-limit truncation)"""
    step_time_mean: float = 0.0
    """mean simulation time of one chain's step in seconds, slept inside step() (0 = no delay); VER Sec. 2"""
    step_time_spread: float = 0.0
    """lognormal sigma of a per-episode speed factor (mean 1): episode-level stragglers (with --toy.step-time-mean)"""
    step_time_jitter: float = 0.3
    """lognormal sigma of a per-step speed factor (mean 1): action-level stragglers (with --toy.step-time-mean)"""
    crash_at_step: tyro.conf.Suppress[int] = 0
    """raise an error in this step() call of the env (0 = never): a hook for tests of crash handling, not a flag"""

    @property
    def num_blocks(self) -> int:
        return self.horizon // self.block_length

    def validate(self) -> None:
        """Raises ValueError naming the flag to fix."""
        if self.horizon < 1:
            raise ValueError(f"--toy.horizon {self.horizon}: must be >= 1")
        if self.block_length < 1:
            raise ValueError(f"--toy.block-length {self.block_length}: must be >= 1")
        if self.horizon % self.block_length != 0:
            raise ValueError(
                f"--toy.horizon ({self.horizon}) must be a multiple of --toy.block-length ({self.block_length}): "
                f"the chain has B = H / L blocks (App. B.2.1)"
            )
        if self.num_actions < 2:
            raise ValueError(f"--toy.num-actions {self.num_actions}: must be >= 2")
        if not 0.0 <= self.progression_prob <= 1.0:
            raise ValueError(f"--toy.progression-prob {self.progression_prob}: must be in [0, 1]")
        if self.mastery_threshold < 0:
            raise ValueError(f"--toy.mastery-threshold {self.mastery_threshold}: must be >= 0")
        if self.reset_lambda < 0.0:
            raise ValueError(f"--toy.reset-lambda {self.reset_lambda}: must be >= 0")
        if self.autoreset_mode not in ("next_step", "same_step"):
            raise ValueError(f"--toy.autoreset-mode {self.autoreset_mode!r}: must be 'next_step' or 'same_step'")
        for name in ("step_time_mean", "step_time_spread", "step_time_jitter"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"--toy.{name.replace('_', '-')} {getattr(self, name)}: must be >= 0")
        if self.crash_at_step < 0:
            raise ValueError(f"toy.crash_at_step {self.crash_at_step}: must be >= 0 (0 = never; a test hook)")


def draw_target_actions(config: ToyChainConfig) -> torch.Tensor:
    """The fixed target action a*_b of every block, drawn from `config.task_seed` (a CPU generator: any device)."""
    generator = torch.Generator().manual_seed(config.task_seed)
    return torch.randint(0, config.num_actions, (config.num_blocks,), generator=generator)


class ToyChainVectorEnv(VectorEnv):
    """N independent ToyChain episodes stepped together as torch tensors (see the module docstring)."""

    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int,
        config: ToyChainConfig | None = None,
        device: str | torch.device = "cpu",
        **overrides: Any,
    ):
        """`overrides` replace single fields of `config`, e.g. make_vec("ToyChain-v0", num_envs=8, horizon=50)."""
        config = config if config is not None else ToyChainConfig()
        unknown = set(overrides) - {f.name for f in fields(ToyChainConfig)}
        if unknown:
            raise TypeError(f"unknown ToyChain option(s) {sorted(unknown)}; see ToyChainConfig")
        self.config = replace(config, **overrides)
        self.config.validate()
        if num_envs < 1:
            raise ValueError(f"num_envs {num_envs}: must be >= 1")

        self.num_envs = num_envs
        self.device = torch.device(device)
        self.num_blocks = self.config.num_blocks
        self.autoreset_mode = (
            AutoresetMode.NEXT_STEP if self.config.autoreset_mode == "next_step" else AutoresetMode.SAME_STEP
        )
        self.metadata = {"autoreset_mode": self.autoreset_mode}

        self.single_observation_space = gym.spaces.Discrete(self.num_blocks)
        self.single_action_space = gym.spaces.Discrete(self.config.num_actions)
        self.observation_space = gym.spaces.MultiDiscrete(np.full(num_envs, self.num_blocks))
        self.action_space = gym.spaces.MultiDiscrete(np.full(num_envs, self.config.num_actions))

        self.target_actions = draw_target_actions(self.config).to(self.device)
        self._generator = torch.Generator(device=self.device)
        self._generator.seed()

        zeros = lambda dtype: torch.zeros(num_envs, dtype=dtype, device=self.device)  # noqa: E731
        self.block = zeros(torch.long)  # current block index b (the observation)
        self.episode_step = zeros(torch.long)  # steps taken in the current episode
        self.steps_in_block = zeros(torch.long)  # steps spent in the current block
        self.correct_in_block = zeros(torch.long)  # correct actions in the current block (for mastery)
        self._pending_reset = zeros(torch.bool)  # next_step mode: episode ended, reset on the next step()
        # Simulation time (module docstring): per-chain episode speed factors, drawn from their own stream (CPU).
        self._time_rng = np.random.default_rng()
        self._episode_speed = np.ones(num_envs)
        self._num_step_calls = 0

    # ----------------------------------------------------------------------------------------------------------
    def _start_episodes(self, mask: torch.Tensor) -> None:
        """Starts a new episode in every env where `mask` is True: b_0 ~ Poisson(lambda_R) clamped (App. B.2.2)."""
        if self.config.reset_lambda > 0.0:
            rate = torch.full((self.num_envs,), self.config.reset_lambda, device=self.device)
            start = torch.poisson(rate, generator=self._generator).long().clamp_(0, self.num_blocks - 1)
        else:
            start = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
        self.block = torch.where(mask, start, self.block)
        self.episode_step = torch.where(mask, 0, self.episode_step)
        self.steps_in_block = torch.where(mask, 0, self.steps_in_block)
        self.correct_in_block = torch.where(mask, 0, self.correct_in_block)
        self._pending_reset = self._pending_reset & ~mask
        if self.config.step_time_mean > 0.0:  # episode-level stragglers: a new speed factor per episode
            starting = mask.cpu().numpy()
            self._episode_speed[starting] = self._lognormal_mean_one(self.config.step_time_spread, int(starting.sum()))

    def _lognormal_mean_one(self, sigma: float, n: int) -> np.ndarray:
        return np.exp(sigma * self._time_rng.standard_normal(n) - 0.5 * sigma**2)

    def _simulation_time(self) -> float:
        """Seconds this step() spends: the sum over chains of mean * episode factor * per-step factor."""
        step_factor = self._lognormal_mean_one(self.config.step_time_jitter, self.num_envs)
        return float(self.config.step_time_mean * (self._episode_speed * step_factor).sum())

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Resets all envs, or only those in options["reset_mask"] (bool, shape (N,)); returns (obs, info)."""
        if seed is not None:
            self._generator.manual_seed(int(seed))
            self._time_rng = np.random.default_rng([int(seed), 1])
        mask = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        if options is not None and "reset_mask" in options:
            mask = torch.as_tensor(options["reset_mask"], device=self.device)
            if mask.dtype != torch.bool or mask.shape != (self.num_envs,):
                raise ValueError(
                    f"options['reset_mask'] must be a bool tensor/array of shape ({self.num_envs},), "
                    f"got dtype={mask.dtype} shape={tuple(mask.shape)}"
                )
        self._start_episodes(mask)
        return self.block.clone(), {}

    def step(self, actions):
        """One step of every env; returns (obs, reward, terminated, truncated, info) as torch tensors."""
        self._num_step_calls += 1
        if self.config.crash_at_step and self._num_step_calls == self.config.crash_at_step:
            raise RuntimeError(
                f"ToyChain: deliberate crash in step() call {self._num_step_calls} "
                f"(toy.crash_at_step {self.config.crash_at_step}, a test hook)"
            )
        if self.config.step_time_mean > 0.0:
            time.sleep(self._simulation_time())  # simulation time, spent in the process that steps the env
        actions = torch.as_tensor(actions, device=self.device).long().reshape(self.num_envs)
        # Next-step autoreset: envs whose episode ended on the previous call are reset now; their action is ignored.
        # (Masked updates instead of `if mask.any()`: no host synchronisation when the env lives on a GPU.)
        resetting = self._pending_reset.clone()
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            self._start_episodes(resetting)
        active = ~resetting

        # Reward: +0.5 for the block's target action, -0.5 otherwise (App. B.2.1).
        correct = (actions == self.target_actions[self.block]) & active
        reward = torch.where(correct, 0.5, -0.5) * active
        self.correct_in_block += correct.long()
        self.steps_in_block += active.long()
        self.episode_step += active.long()

        # Skill gating (App. B.2.2): after L steps in b, move on if b is mastered or a p_prog check succeeds;
        # otherwise stay and check again after the next step.
        at_check = active & (self.steps_in_block >= self.config.block_length) & (self.block < self.num_blocks - 1)
        mastered = self.correct_in_block >= self.config.mastery_threshold
        lucky = torch.rand(self.num_envs, device=self.device, generator=self._generator) < self.config.progression_prob
        advance = at_check & (mastered | lucky)
        self.block = self.block + advance.long()
        self.steps_in_block = torch.where(advance, 0, self.steps_in_block)
        self.correct_in_block = torch.where(advance, 0, self.correct_in_block)

        horizon_end = active & (self.episode_step >= self.config.horizon)
        if self.config.terminal_horizon:  # the paper's wording; the value of a block then depends on unseen time
            terminated, truncated = horizon_end, torch.zeros_like(horizon_end)
        else:  # default: a time limit (the observation carries no time), so the last state is bootstrapped
            terminated, truncated = torch.zeros_like(horizon_end), horizon_end
        success = self.block == self.num_blocks - 1
        info: dict[str, Any] = {"correct": correct, "success": success}
        done = terminated | truncated

        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            self._pending_reset = done
            obs = self.block.clone()
        else:  # SAME_STEP: return the reset observation now, the true last one in info["final_obs"]
            final_obs = self.block.clone()
            self._start_episodes(done)
            obs = self.block.clone()
            info.update(
                final_obs=final_obs,
                _final_obs=done,
                final_info={"success": success, "correct": correct},
                _final_info=done,
            )
        return obs, reward.float(), terminated, truncated, info

    def state_dict(self) -> dict:
        """Everything the chains' future depends on (their state and both random streams), for a checkpoint that
        resumes a run as if it had not stopped; torch.load(..., weights_only=True) reads it back."""
        return {
            "block": self.block.clone(),
            "episode_step": self.episode_step.clone(),
            "steps_in_block": self.steps_in_block.clone(),
            "correct_in_block": self.correct_in_block.clone(),
            "pending_reset": self._pending_reset.clone(),
            "generator": self._generator.get_state(),
            "time_rng": self._time_rng.bit_generator.state,
            "episode_speed": torch.from_numpy(self._episode_speed.copy()),
            "num_step_calls": self._num_step_calls,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict returned (of chains with the same config and number of envs)."""
        if state["block"].shape != (self.num_envs,):
            raise ValueError(f"a state of {state['block'].shape[0]} chains, not of {self.num_envs}")
        self.block = state["block"].to(self.device)
        self.episode_step = state["episode_step"].to(self.device)
        self.steps_in_block = state["steps_in_block"].to(self.device)
        self.correct_in_block = state["correct_in_block"].to(self.device)
        self._pending_reset = state["pending_reset"].to(self.device)
        self._generator.set_state(state["generator"])
        self._time_rng.bit_generator.state = state["time_rng"]
        self._episode_speed = state["episode_speed"].numpy().copy()
        self._num_step_calls = state["num_step_calls"]

    def close_extras(self, **kwargs: Any) -> None:
        pass


def forgetting_matrix(accuracy: np.ndarray) -> np.ndarray:
    """App. E.0.1: Forgetting(t, b) = max_{t' <= t} A(t', b) - A(t, b), for an accuracy matrix A of shape (T, B)."""
    return np.maximum.accumulate(accuracy, axis=0) - accuracy


class ToyChainDiagnostics:
    """App. C and E.0.1 of a policy training on the chain, one row per update: the batch's share of steps in each block
    (occupancy) and the policy's probability of each block's target action (accuracy), whose drops are forgetting."""

    def __init__(self, envs: ToyChainVectorEnv):
        self.num_blocks, self.target_actions = envs.num_blocks, envs.target_actions
        self.occupancy: list[np.ndarray] = []
        self.accuracy: list[np.ndarray] = []

    def record(self, obs: torch.Tensor, action_probs: torch.Tensor) -> float:
        """Adds a (K, N) batch of observations and the policy's (B, A) action probabilities after the update; returns
        the forgetting now, averaged over the blocks."""
        self.occupancy.append(torch.bincount(obs.flatten(), minlength=self.num_blocks).cpu().numpy() / obs.shape[0])
        self.accuracy.append(action_probs.gather(-1, self.target_actions.view(-1, 1))[:, 0].cpu().numpy())
        return forgetting_matrix(np.stack(self.accuracy))[-1].mean()

    def save(self, path) -> float:
        """Writes occupancy and accuracy, (updates, B) each, to an .npz; returns the mean forgetting of the run."""
        accuracy = np.stack(self.accuracy)
        tmp = Path(f"{path}.tmp")  # written whole, then renamed: a Ctrl-C leaves no half-written file at `path`
        try:
            with open(tmp, "wb") as file:  # (a file: np.savez would add .npz to the name)
                np.savez(file, occupancy=np.stack(self.occupancy), accuracy=accuracy)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return float(forgetting_matrix(accuracy).mean())


def chain_network(num_blocks: int, num_outputs: int, out_std: float) -> nn.Sequential:
    """Table 2's network: block index -> 64-d embedding -> 4 x 256 ReLU -> linear output. Orthogonal init (gain sqrt 2,
    the output layer out_std), zero biases, as CleanRL's layer_init."""
    embedding = nn.Embedding(num_blocks, 64)
    sizes = [64, 256, 256, 256, 256, num_outputs]
    layers: list[nn.Module] = []
    for index, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(n_in, n_out)
        is_output = index == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, out_std if is_output else math.sqrt(2))
        nn.init.constant_(linear.bias, 0.0)
        layers.append(linear)
        if not is_output:
            layers.append(nn.ReLU())
    return nn.Sequential(embedding, nn.Sequential(*layers))


class ChainAgent(nn.Module):
    """Table 2's PPO agent for the chain (ppo_staggered.py): a categorical policy and a scalar value, separate networks.
    They run once per block and the batch gathers its rows: the same outputs and gradients, B rows of work."""

    def __init__(self, num_blocks: int, num_actions: int):
        super().__init__()
        self.register_buffer("blocks", torch.arange(num_blocks))
        self.actor = chain_network(num_blocks, num_actions, out_std=0.01)
        self.critic = chain_network(num_blocks, 1, out_std=1.0)

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.blocks)[:, 0][obs]

    def get_action_and_value(self, obs: torch.Tensor, action: torch.Tensor | None = None):
        log_probs = torch.log_softmax(self.actor(self.blocks)[obs], dim=-1)
        if action is None:  # Gumbel-max sampling: a categorical sample without a host sync (CUDA-graph friendly)
            gumbel = -torch.log(-torch.log(torch.rand_like(log_probs).clamp(1e-20, 1.0)))
            action = torch.argmax(log_probs + gumbel, dim=-1)
        logprob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, logprob, entropy, self.get_value(obs)

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self.blocks)[obs].argmax(-1)

    @torch.no_grad()
    def action_probs(self) -> torch.Tensor:
        """(B, A): the policy's action probabilities in every block (for ToyChainDiagnostics.record)."""
        return torch.softmax(self.actor(self.blocks), dim=-1)


# Table 2's PPO settings for the chain (N = 512, K = 5, 150 updates): ppo_staggered.py's ToyChain-v0 preset.
TABLE2_PPO = {
    "num_envs": 512,
    "num_steps": 5,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "num_minibatches": 4,
    "ent_coef": 0.01,
    "target_kl": 0.0,
    "total_timesteps": 150 * 512 * 5,
    "eval_freq": 10,
    "num_eval_envs": 128,
}


class ToyChainPool:
    """ToyChain-v0 behind EnvPool's async_reset/send/recv API, in EnvPool's next-step autoreset mode (the Cleanba
    scripts' adapter): recv returns numpy (obs, reward, terminated, truncated, info), info["reward"] being the raw
    reward as in EnvPool Atari, info["success"] ToyChain's success flag."""

    def __init__(self, config: ToyChainConfig, num_envs: int, seed: int):
        self.env = ToyChainVectorEnv(num_envs, config, device="cpu")
        self.seed = seed
        self.actions = None

    def async_reset(self) -> None:
        self.actions = None

    def send(self, actions: np.ndarray, env_ids=None) -> None:
        self.actions = actions

    def recv(self):
        if self.actions is None:
            obs, _ = self.env.reset(seed=self.seed)
            no = torch.zeros(self.env.num_envs, dtype=torch.bool)
            reward, terminated, truncated, info = torch.zeros(self.env.num_envs), no, no, {"success": no}
        else:
            obs, reward, terminated, truncated, info = self.env.step(torch.as_tensor(self.actions))
        info = {"reward": reward.numpy(), "success": info["success"].numpy()}
        return obs.numpy(), reward.numpy(), terminated.numpy(), truncated.numpy(), info

    def state_dict(self) -> dict:
        """The chains' state (ToyChainVectorEnv.state_dict) and whether the next recv() resets them."""
        return {"env": self.env.state_dict(), "reset_pending": self.actions is None}

    def load_state_dict(self, state: dict) -> None:
        self.env.load_state_dict(state["env"])
        self.actions = None if state["reset_pending"] else np.zeros(self.env.num_envs, dtype=np.int64)

    def close(self) -> None:
        self.env.close()


if "ToyChain-v0" not in gym.registry:
    gym.register(id="ToyChain-v0", vector_entry_point=ToyChainVectorEnv)


# =====================================================================================================================
# ToyChainContinuous-v0: the same chain with continuous actions (for DDPG-style scripts: pql.py)
# =====================================================================================================================
@dataclass
class ToyChainContinuousConfig(ToyChainConfig):
    """ToyChain settings plus those of the continuous-action variant (--toy.action-dim, --toy.target-radius)."""

    action_dim: int = 4
    """d: actions are vectors in [-1, 1]^d; every block b has a fixed target vector a*_b in [-0.8, 0.8]^d"""
    target_radius: float = 0.2
    """an action is "correct" (counts towards mastery, App. B.2.2) when its RMS distance to a*_b is at most this"""

    def validate(self) -> None:
        super().validate()
        if self.action_dim < 1:
            raise ValueError(f"--toy.action-dim {self.action_dim}: must be >= 1")
        if not 0.0 < self.target_radius <= 2.0:
            raise ValueError(f"--toy.target-radius {self.target_radius}: must be in (0, 2] (RMS distance in [-1, 1]^d)")


def draw_target_vectors(config: ToyChainContinuousConfig) -> torch.Tensor:
    """The fixed target vector a*_b in [-0.8, 0.8]^d of every block, drawn from `config.task_seed` (CPU generator)."""
    generator = torch.Generator().manual_seed(config.task_seed)
    return torch.rand((config.num_blocks, config.action_dim), generator=generator) * 1.6 - 0.8


class ToyChainContinuousVectorEnv(ToyChainVectorEnv):
    """ToyChain with continuous actions: the same blocks, skill gating, start states, horizon, autoreset modes and
    partial resets as ToyChain-v0 (this class reuses its step and reset), with

      observation  one-hot of the block index b, float32 (B,)
      action       a in [-1, 1]^d (clipped to the box)
      reward       0.5 - 0.5 * dist(a, a*_b), dist = RMS distance ||a - a*_b||_2 / sqrt(d) in [0, 2]: +0.5 on the
                   target, -0.5 at the far corner, so a perfect agent collects 0.5 * H like on ToyChain-v0
      correct      dist <= target_radius; correct actions drive mastery exactly as the target action does on
                   ToyChain-v0 (the step is delegated to ToyChain-v0 with the target action for a correct action and
                   a wrong one otherwise).
    info["final_obs"] (same-step mode) is one-hot too. Registered as "ToyChainContinuous-v0":
        gymnasium.make_vec("ToyChainContinuous-v0", num_envs=64, config=ToyChainContinuousConfig(), device="cpu")
    """

    def __init__(
        self,
        num_envs: int,
        config: ToyChainContinuousConfig | None = None,
        device: str | torch.device = "cpu",
        **overrides: Any,
    ):
        config = config if config is not None else ToyChainContinuousConfig()
        if not isinstance(config, ToyChainContinuousConfig):  # a plain ToyChainConfig: keep its settings
            config = ToyChainContinuousConfig(**{f.name: getattr(config, f.name) for f in fields(config)})
        unknown = set(overrides) - {f.name for f in fields(ToyChainContinuousConfig)}
        if unknown:
            raise TypeError(f"unknown ToyChainContinuous option(s) {sorted(unknown)}; see ToyChainContinuousConfig")
        super().__init__(num_envs, replace(config, **overrides), device)
        d, num_blocks = self.config.action_dim, self.num_blocks
        self.single_observation_space = gym.spaces.Box(0.0, 1.0, (num_blocks,), np.float32)
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (d,), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.target_vectors = draw_target_vectors(self.config).to(self.device)

    def _one_hot(self, block: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(block, self.num_blocks).float()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        block, info = super().reset(seed=seed, options=options)
        return self._one_hot(block), info

    def step(self, actions):
        actions = torch.as_tensor(actions, device=self.device, dtype=torch.float32)
        actions = actions.reshape(self.num_envs, self.config.action_dim).clamp(-1.0, 1.0)
        # Score the action against the block it was taken in (before the step moves the agent on).
        distance = (actions - self.target_vectors[self.block]).square().mean(-1).sqrt()
        correct = distance <= self.config.target_radius
        target = self.target_actions[self.block]
        discrete = torch.where(correct, target, (target + 1) % self.config.num_actions)
        # Envs that reset in this step (next-step mode) ignore their action: reward 0, as on ToyChain-v0.
        acting = ~self._pending_reset if self.autoreset_mode == AutoresetMode.NEXT_STEP else torch.ones_like(correct)
        block, _, terminated, truncated, info = super().step(discrete)
        reward = (0.5 - 0.5 * distance) * acting
        if "final_obs" in info:
            info["final_obs"] = self._one_hot(info["final_obs"])
        return self._one_hot(block), reward, terminated, truncated, info


if "ToyChainContinuous-v0" not in gym.registry:
    gym.register(id="ToyChainContinuous-v0", vector_entry_point=ToyChainContinuousVectorEnv)


# =====================================================================================================================
# ToyChain for env worker processes that step one chain each (ppo_ver.py), with deliberate stragglers
# =====================================================================================================================
@dataclass
class ToyChainWorkerConfig(ToyChainConfig):
    """ToyChain settings plus deliberate stragglers, for studying VER (Wijmans et al. 2022) with one chain per env
    worker: --toy.slow-rank-factor (a straggling machine, Sec. 2.3) and --toy.slow-env-factor (a straggling env)."""

    autoreset_mode: Literal["same_step"] = "same_step"
    """same_step only: a worker resets its chain in the step that ends an episode, and reports the last observation"""
    slow_rank_factor: float = 1.0
    """with >= 2 ranks (torchrun), every chain of rank 0 steps this many times slower (with --toy.step-time-mean)"""
    slow_env_factor: float = 1.0
    """env 0 of every rank steps this many times slower than the others (with --toy.step-time-mean)"""

    def validate(self) -> None:
        super().validate()
        if self.autoreset_mode != "same_step":
            raise ValueError(
                f"--toy.autoreset-mode {self.autoreset_mode}: env workers run their chain in same_step mode"
            )
        for name in ("slow_rank_factor", "slow_env_factor"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"--toy.{name.replace('_', '-')} {getattr(self, name)}: must be > 0")

    def step_time_of(self, rank: int, world_size: int, env_index: int) -> float:
        """The mean step time of env `env_index` of rank `rank`: step_time_mean times the straggler factors."""
        rank_factor = self.slow_rank_factor if rank == 0 and world_size > 1 else 1.0
        env_factor = self.slow_env_factor if env_index == 0 else 1.0
        return self.step_time_mean * rank_factor * env_factor


class ToyChainWorkerEnv:
    """One chain with numpy in and out, for an env worker process that steps one env (ppo_ver.py, VER Sec. 2.1). The
    chain runs in same_step mode, so step() resets an ended episode itself.

    step(action) returns (obs, reward, terminated, truncated, final_obs, success): final_obs is the true last
    observation of an episode that ended in this step (obs is then the first of the next one), else None; success is
    this step's success flag (in the final block)."""

    def __init__(self, config: ToyChainConfig):
        self.env = ToyChainVectorEnv(1, replace(config, autoreset_mode="same_step"), device="cpu")
        self.observation_space = self.env.single_observation_space
        self.action_space = self.env.single_action_space

    def reset(self, seed: int | None = None) -> np.ndarray:
        obs, _ = self.env.reset(seed=seed)
        return obs.numpy()[0]

    def step(self, action: np.ndarray):
        obs, reward, terminated, truncated, info = self.env.step(torch.as_tensor(action).reshape(1))
        final_obs = info["final_obs"].numpy()[0] if bool(info["_final_obs"][0]) else None
        success = bool(info["success"][0])
        return obs.numpy()[0], float(reward[0]), bool(terminated[0]), bool(truncated[0]), final_obs, success

    def state_dict(self) -> dict:
        return self.env.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.env.load_state_dict(state)

    def close(self) -> None:
        self.env.close()
