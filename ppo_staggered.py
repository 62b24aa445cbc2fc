"""PPO with staggered environment resets, for massively parallel simulation (ManiSkill3) and the toy chain.

Paper: "Staggered Environment Resets Improve Massively Parallel On-Policy Reinforcement Learning",
Sid Bharthulwar, Stone Tao, Hao Su (2025), arXiv:2511.21011.

With N parallel envs, rollouts of K steps and a task horizon H >> K, synchronous resets make every PPO batch
come from one K-step slice of the task, and the slice cycles through the horizon every H/K updates (Sec. 3.2).
Staggered resets split the envs into N_B = ceil(H/K) groups and advance group j by j*S steps (S = K) before
training, so every batch holds every stage of the task (Sec. 3.3, App. B.1). Each group then resets together
when its horizon ends (a "reset gate"); an env that terminates early waits for its group's next gate, its steps
masked out of the loss (or, with --partial-reset-mode immediate, resets at once). --no-stagger runs the same
code with one group: the naive synchronous baseline.

Map from the paper to this file
  Sec. 3.3, App. B.1  stagger_groups, stagger_start_steps, advance_for_stagger   (groups, offsets j*S, advance)
  Sec. 3.3 resets     reset_bookkeeping                                          (reset gates, masking)
  App. B.2, Table 2   PRESETS["ToyChain-v0"], ChainAgent                         (toy chain: toy_chain_env.py)
  App. B.3, Table 3   PRESETS[ManiSkill task ids], MANISKILL_COMMON, GaussianAgent
  App. C, Fig. 6      batch_temporal_stats, toy occupancy heatmap                 (stagger/..., toy/...)
  App. E.0.1          stagger/value_mse, stagger/policy_kl, forgetting_matrix     (value error, KL, forgetting)
Autoreset (autoreset_modes.txt): this script consumes both of Gymnasium's modes. ToyChain lets you choose
(--toy.autoreset-mode); ManiSkill envs are same-step (ManiSkillVecEnv). compute_gae bootstraps zero at a
termination and V(true last observation) at a truncation; reset_bookkeeping masks next-step's stale step.

Examples
  python ppo_staggered.py --env-id ToyChain-v0                       # App. C setting, staggered (about a minute on a CPU)
  python ppo_staggered.py --env-id ToyChain-v0 --no-stagger          # the naive synchronous baseline
  python ppo_staggered.py --env-id StackCube-v1                      # Table 3 settings, GPU simulation with 4096 envs
  python ppo_staggered.py --env-id StackCube-v1 --num-envs 2 --total-timesteps 2000   # CPU simulation, 2 processes
"""

from __future__ import annotations

import ctypes
import glob
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

from toy_chain_env import ToyChainConfig, ToyChainVectorEnv


@dataclass
class Args:
    # ---- experiment -------------------------------------------------------------------------------------------
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of python, numpy, torch and the environments"""
    torch_deterministic: bool = True
    """sets torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """use CUDA when it is available (and then ManiSkill's GPU simulation)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{env_id}__{exp_name}__{seed}__{unix_time}/"""
    track: bool = False
    """mirror the TensorBoard scalars to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "staggered-resets"
    """wandb project name"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    capture_video: bool = False
    """record videos of the evaluation episodes into the run directory (ManiSkill tasks)"""
    save_model: bool = False
    """write checkpoints (ckpt_{global_step}.pt at every evaluation, final_ckpt.pt at the end)"""
    checkpoint: Optional[str] = None
    """a checkpoint to resume training from (or to evaluate, with --evaluate)"""
    evaluate: bool = False
    """only evaluate the policy of --checkpoint, then exit"""
    progress_bar: bool = True
    """show a progress bar with SPS, return and success"""

    # ---- environment ------------------------------------------------------------------------------------------
    env_id: str = "ToyChain-v0"
    """ToyChain-v0 or a ManiSkill3 task id (StackCube-v1, PushT-v1, AnymalC-Reach-v1, ...)"""
    num_envs: Optional[int] = None
    """number of parallel training envs N (default: the task preset; 8 with CPU simulation)"""
    num_eval_envs: Optional[int] = None
    """number of parallel evaluation envs (default: 128; 2 with CPU simulation)"""
    horizon: Optional[int] = None
    """ManiSkill task horizon H, i.e. max_episode_steps (default: Table 3, else the task's own); ToyChain: --toy.horizon"""
    sim_backend: Literal["auto", "physx_cuda", "physx_cpu"] = "auto"
    """ManiSkill simulation: auto = physx_cuda (one process, thousands of envs) when CUDA is used, else physx_cpu (one process per env)"""
    control_mode: Optional[str] = None
    """ManiSkill controller (default: the task's default)"""
    reconfiguration_freq: Optional[int] = None
    """ManiSkill training-env reconfiguration frequency (must stay None/0 with partial resets)"""
    eval_reconfiguration_freq: Optional[int] = 1
    """ManiSkill evaluation-env reconfiguration frequency"""
    toy: ToyChainConfig = field(default_factory=ToyChainConfig)
    """ToyChain-v0 settings (App. B.2)"""

    # ---- PPO ------------------------------------------------------------------------------------------------------
    total_timesteps: Optional[int] = None
    """training env steps (default: Table 2/3: 150 updates on ToyChain, 2e8 on ManiSkill)"""
    learning_rate: float = 3e-4
    """Adam learning rate (Tables 2 and 3)"""
    anneal_lr: bool = False
    """linearly decay the learning rate to 0 (Table 3: off)"""
    num_steps: Optional[int] = None
    """rollout length K, steps per env per update (default: the task preset)"""
    gamma: Optional[float] = None
    """discount factor (default: the task preset)"""
    gae_lambda: Optional[float] = None
    """GAE lambda (default: the task preset)"""
    num_minibatches: Optional[int] = None
    """minibatches per epoch (default: 4 on ToyChain, 32 on ManiSkill GPU, 4 on ManiSkill CPU)"""
    update_epochs: int = 4
    """epochs over each batch"""
    norm_adv: bool = True
    """normalize advantages per minibatch (over the steps that are trained on)"""
    clip_coef: float = 0.2
    """PPO clipping coefficient"""
    clip_vloss: bool = False
    """clip the value loss as in the PPO paper's code (Table 3: off)"""
    ent_coef: Optional[float] = None
    """entropy bonus (default: 0.01 ToyChain, 0.005 ManiSkill)"""
    vf_coef: float = 0.5
    """value-loss coefficient"""
    max_grad_norm: float = 0.5
    """gradient-norm clip"""
    target_kl: Optional[float] = None
    """stop the update's epochs once approx KL exceeds this (default: 0.1 ManiSkill, off ToyChain; 0 turns it off)"""
    norm_obs: Optional[bool] = None
    """normalize observations with running mean & std (default: on for ManiSkill states, off for ToyChain's block index)"""
    reward_scale: float = 1.0
    """rewards are multiplied by this for learning (returns are logged unscaled)"""

    # ---- staggered resets (Sec. 3.3, App. B.1) -----------------------------------------------------------------
    stagger: bool = True
    """staggered resets; --no-stagger is the naive synchronous baseline (the same code with one group)"""
    num_stagger_groups: Optional[int] = None
    """N_B, the number of stagger groups (default: ceil(H / K))"""
    stagger_step: Optional[int] = None
    """S, the offset between consecutive groups in env steps (default: K)"""
    stagger_advance: Literal["random", "policy"] = "random"
    """how groups are advanced before training: random actions or the initial policy"""
    partial_reset_mode: Literal["gate", "immediate"] = "gate"
    """an env that terminates early: 'gate' waits (masked) for its group's next reset gate; 'immediate' resets at once"""

    # ---- evaluation, speed ---------------------------------------------------------------------------------------
    eval_freq: Optional[int] = None
    """evaluate every this many iterations (default: 10 ToyChain, 25 ManiSkill)"""
    num_eval_steps: Optional[int] = None
    """steps per evaluation (default: H, one full episode per eval env)"""
    compile: bool = False
    """torch.compile the policy step and the PPO update (LeanRL / ManiSkill ppo_fast.py)"""
    cudagraphs: bool = False
    """capture the policy step and the PPO update in CUDA graphs (LeanRL / ppo_fast.py); needs CUDA"""

    # ---- filled in by resolve_args ------------------------------------------------------------------------------
    batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    num_iterations: tyro.conf.Suppress[int] = 0
    resolved_horizon: tyro.conf.Suppress[int] = 0
    resolved_sim_backend: tyro.conf.Suppress[str] = ""


TOY_ENV_ID = "ToyChain-v0"
# App. B.2, Table 2: PPO on the toy chain (N = 512, K = 5, 150 updates).
PRESETS: dict[str, dict] = {
    TOY_ENV_ID: dict(
        num_envs=512, num_steps=5, gamma=0.99, gae_lambda=0.95, num_minibatches=4, ent_coef=0.01,
        target_kl=0.0, total_timesteps=150 * 512 * 5, norm_obs=False, eval_freq=10, num_eval_envs=128,
    ),
    # App. B.3, Table 3: per-task K, H, gamma, lambda and N of the ManiSkill experiments.
    "StackCube-v1": dict(num_steps=8, horizon=100, gamma=0.8, gae_lambda=0.9, num_envs=4096),
    "PushT-v1": dict(num_steps=8, horizon=100, gamma=0.99, gae_lambda=0.9, num_envs=4096),
    "AnymalC-Reach-v1": dict(num_steps=16, horizon=200, gamma=0.99, gae_lambda=0.95, num_envs=512),
    "MS-HumanoidWalk-v1": dict(num_steps=64, horizon=1000, gamma=0.97, gae_lambda=0.9, num_envs=4096),
    "TwoRobotPickCube-v1": dict(num_steps=16, horizon=100, gamma=0.8, gae_lambda=0.9, num_envs=2048),
    "UnitreeG1TransportBox-v1": dict(num_steps=32, horizon=500, gamma=0.8, gae_lambda=0.9, num_envs=1024),
}
# Table 3, common rows: 32 minibatches, entropy 0.005, target KL 0.1, 2e8 steps, 128 eval envs, running obs norm.
MANISKILL_COMMON = dict(
    num_minibatches=32, ent_coef=0.005, target_kl=0.1, total_timesteps=200_000_000, norm_obs=True,
    eval_freq=25, num_eval_envs=128,
)
# ManiSkill tasks without a Table 3 row: ManiSkill's own PPO baseline settings (H is the task's registered one).
MANISKILL_OTHER = dict(num_steps=16, gamma=0.8, gae_lambda=0.9, num_envs=4096)
# CPU simulation runs one process per env, so far fewer envs (and minibatches that still hold several samples).
MANISKILL_CPU = dict(num_envs=8, num_minibatches=4, num_eval_envs=2)


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or process starts."""


# =====================================================================================================================
# Argument resolution: presets, derived sizes, validation (all before any env starts)
# =====================================================================================================================
def is_maniskill_env(env_id: str) -> bool:
    """True for a registered ManiSkill3 task (imports mani_skill, which registers them)."""
    try:
        from mani_skill.utils.registration import REGISTERED_ENVS
    except ImportError as e:  # pragma: no cover - mani_skill is in requirements.txt
        raise ArgsError(f"--env-id {env_id}: ManiSkill3 is not installed ({e}); see README.md, Set-up") from e
    return env_id in REGISTERED_ENVS


def find_vulkan_problem() -> Optional[str]:
    """Why ManiSkill3 (SAPIEN) could not start a Vulkan device on this machine, or None if a driver is present."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        ctypes.CDLL("libvulkan.so.1")
    except OSError:
        return "the Vulkan loader (libvulkan.so.1) is not installed"
    listed = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
    if listed:
        missing = [p for p in listed.split(os.pathsep) if p and not os.path.exists(p)]
        return f"the Vulkan driver file(s) named by VK_DRIVER_FILES/VK_ICD_FILENAMES do not exist: {missing}" if missing else None
    data_dirs = ["/usr/share", "/usr/local/share", "/etc"] + os.environ.get("XDG_DATA_DIRS", "").split(os.pathsep)
    search = [os.path.join(d, "vulkan", "icd.d", "*.json") for d in data_dirs if d]
    search.append("/usr/local/nvidia/share/vulkan/icd.d/*.json")
    if not any(glob.glob(pattern) for pattern in search):
        return "no Vulkan driver (ICD) is installed"
    return None


def resolve_args(args: Args) -> Args:
    """Fills the task presets and derived sizes into a copy of `args` and validates it. Raises ArgsError."""
    a = Args(**{**asdict(args), "toy": ToyChainConfig(**asdict(args.toy))})
    is_toy = a.env_id == TOY_ENV_ID
    if not is_toy and not is_maniskill_env(a.env_id):
        raise ArgsError(
            f"--env-id {a.env_id!r} is not ToyChain-v0 or a registered ManiSkill3 task. "
            f"Tasks with paper presets: {', '.join(PRESETS)}"
        )
    use_cuda = a.cuda and torch.cuda.is_available()
    if is_toy:
        backend = "torch"
    elif a.sim_backend == "auto":
        backend = "physx_cuda" if use_cuda else "physx_cpu"
    else:
        backend = a.sim_backend
    if backend == "physx_cuda" and not torch.cuda.is_available():
        raise ArgsError("--sim-backend physx_cuda needs a CUDA GPU; use --sim-backend physx_cpu (or auto)")
    a.resolved_sim_backend = backend

    preset = dict(PRESETS[TOY_ENV_ID]) if is_toy else {**MANISKILL_COMMON, **PRESETS.get(a.env_id, MANISKILL_OTHER)}
    if backend == "physx_cpu":
        preset.update(MANISKILL_CPU)
    for name, value in preset.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.target_kl is not None and a.target_kl <= 0:
        a.target_kl = None

    if is_toy:
        if args.horizon is not None:
            raise ArgsError("--horizon is for ManiSkill tasks; set the toy chain's horizon with --toy.horizon")
        try:
            a.toy.validate()
        except ValueError as e:
            raise ArgsError(str(e)) from e
        a.resolved_horizon = a.toy.horizon
        if a.norm_obs:
            raise ArgsError("--norm-obs: ToyChain's observation is a block index (embedded), not a vector to normalize")
        if a.capture_video:
            raise ArgsError(
                "--capture-video: ToyChain has no renderer; its pictures are the block-occupancy and forgetting-matrix "
                "PNGs written to the run directory"
            )
    else:
        if a.horizon is None:
            a.horizon = gym.spec(a.env_id).max_episode_steps
        if a.horizon is None or a.horizon < 1:
            raise ArgsError(f"--horizon: {a.env_id} has no registered max_episode_steps; pass --horizon H")
        a.resolved_horizon = a.horizon
        if a.reconfiguration_freq:
            raise ArgsError("--reconfiguration-freq must be 0/None for training envs: ManiSkill cannot reconfigure "
                            "while resetting only some envs (gates and partial resets do)")
    H, K = a.resolved_horizon, a.num_steps

    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs", "num_eval_envs", "eval_freq"):
        if getattr(a, name) < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if K > H:
        raise ArgsError(f"--num-steps K={K} is longer than the task horizon H={H}; staggered resets assume K <= H")
    if a.num_stagger_groups is None:
        a.num_stagger_groups = math.ceil(H / K) if a.stagger else 1  # App. B.1: N_B = ceil(H / K)
        if a.num_stagger_groups > a.num_envs:
            print(f"note: {a.num_envs} envs are fewer than ceil(H/K) = {a.num_stagger_groups} stagger groups; "
                  f"using N_B = {a.num_envs} groups (one env each)")
            a.num_stagger_groups = a.num_envs
    if a.stagger_step is None:
        a.stagger_step = K  # Sec. 3.3: "A standard choice is S = K"
    if not a.stagger and a.num_stagger_groups != 1:
        raise ArgsError("--num-stagger-groups > 1 contradicts --no-stagger (the naive baseline has one group)")
    if a.num_stagger_groups < 1 or a.stagger_step < 1:
        raise ArgsError("--num-stagger-groups and --stagger-step must be >= 1")
    if a.num_stagger_groups > a.num_envs:
        raise ArgsError(
            f"--num-stagger-groups N_B={a.num_stagger_groups} exceeds --num-envs N={a.num_envs}: every group needs "
            f"an env; use more envs or fewer groups"
        )
    if (a.num_stagger_groups - 1) * a.stagger_step >= H:
        raise ArgsError(
            f"the last stagger group would start at step (N_B-1)*S = {(a.num_stagger_groups - 1) * a.stagger_step}, "
            f"past the horizon H={H}: lower --num-stagger-groups or --stagger-step"
        )
    a.batch_size = a.num_envs * K
    if a.batch_size % a.num_minibatches != 0:
        raise ArgsError(
            f"the batch N*K = {a.num_envs}*{K} = {a.batch_size} does not split into --num-minibatches "
            f"{a.num_minibatches} equal minibatches; pick N, K or the number of minibatches so that it divides"
        )
    a.minibatch_size = a.batch_size // a.num_minibatches
    a.num_iterations = a.total_timesteps // a.batch_size
    if a.num_iterations < 1 and not a.evaluate:
        raise ArgsError(f"--total-timesteps {a.total_timesteps} is less than one batch (N*K = {a.batch_size})")
    if a.num_eval_steps is None:
        a.num_eval_steps = H
    if a.compile and a.cudagraphs:
        raise ArgsError("use --compile or --cudagraphs, not both (ManiSkill's baselines use --cudagraphs alone)")
    if a.cudagraphs and not use_cuda:
        raise ArgsError("--cudagraphs needs CUDA (and not --no-cuda); use --compile on a CPU")
    if a.evaluate and not a.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    if a.checkpoint and not os.path.isfile(a.checkpoint):
        raise ArgsError(f"--checkpoint {a.checkpoint}: no such file")
    if not is_toy:
        problem = find_vulkan_problem()
        if problem:
            raise ArgsError(
                f"ManiSkill3 needs a Vulkan driver even for state-only simulation, and {problem}. "
                f"See README.md, 'Set-up' (on Debian/Ubuntu: bash .ci/install_system.sh)"
            )
    return a


# =====================================================================================================================
# Environments
# =====================================================================================================================
def make_maniskill_env(env_id: str, num_envs: int, backend: str, horizon: int, control_mode: Optional[str],
                       reconfiguration_freq, video_dir: Optional[str]):
    """A batched ManiSkill3 env (state observations, time limit H), with flattened multi-agent actions and, with
    `video_dir`, ManiSkill's episode recorder."""
    import mani_skill.envs  # noqa: F401  (registers the tasks in this process)
    from mani_skill.utils.wrappers.flatten import FlattenActionSpaceWrapper
    from mani_skill.utils.wrappers.record import RecordEpisode

    kwargs = dict(num_envs=num_envs, obs_mode="state", sim_backend=backend, max_episode_steps=horizon,
                  reconfiguration_freq=reconfiguration_freq, render_mode="rgb_array" if video_dir else None)
    if control_mode:
        kwargs["control_mode"] = control_mode
    env = gym.make(env_id, **kwargs)
    if isinstance(env.action_space, gym.spaces.Dict):  # e.g. TwoRobotPickCube-v1
        env = FlattenActionSpaceWrapper(env)
    if video_dir:
        env = RecordEpisode(env, video_dir, save_trajectory=False, max_steps_per_video=horizon, video_fps=30)
    return env


def make_maniskill_cpu_worker_env(env_id: str, horizon: int, control_mode: Optional[str], reconfiguration_freq,
                                  video_dir: Optional[str]):
    """One physx_cpu ManiSkill env for a worker process, with numpy outputs (ManiSkill's CPUGymWrapper)."""
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    return CPUGymWrapper(make_maniskill_env(env_id, 1, "physx_cpu", horizon, control_mode, reconfiguration_freq,
                                            video_dir))


class ManiSkillVecEnv(gym.vector.VectorEnv):
    """A ManiSkill3 task as a *same-step* autoreset vector env of torch tensors on `device`.

    physx_cuda: one batched ManiSkill env in this process (thousands of envs on the GPU).
    physx_cpu:  one ManiSkill env per worker process: gymnasium AsyncVectorEnv over CPUGymWrapper, autoreset off.
    Either way this class decides the resets: every truncated env (its horizon H ended), and every terminated env
    if `reset_on_termination` (an immediate partial reset). With reset_on_termination=False a terminated env keeps
    running until its time limit, which is how it waits for its group's reset gate (Sec. 3.3), and how evaluation
    runs without partial resets. info["final_obs"] is the true last observation where info["_final_obs"] (the envs
    reset in this step); info["success"] is the task's success flag of this step, before any reset.
    """

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
    autoreset_mode = gym.vector.AutoresetMode.SAME_STEP

    def __init__(self, env_id: str, num_envs: int, horizon: int, backend: str, device: torch.device,
                 reset_on_termination: bool, control_mode: Optional[str] = None, reconfiguration_freq=None,
                 video_dir: Optional[str] = None):
        self.num_envs, self.device, self.reset_on_termination = num_envs, device, reset_on_termination
        self.gpu = backend == "physx_cuda"
        if self.gpu:
            self.env = make_maniskill_env(env_id, num_envs, backend, horizon, control_mode, reconfiguration_freq,
                                          video_dir)
            self.single_observation_space = self.env.unwrapped.single_observation_space
            self.single_action_space = self.env.unwrapped.single_action_space
        else:
            fns = [partial(make_maniskill_cpu_worker_env, env_id, horizon, control_mode, reconfiguration_freq,
                           os.path.join(video_dir, f"env{i}") if video_dir else None) for i in range(num_envs)]
            # forkserver: the workers do not inherit this process's torch threads; autoreset is done here instead.
            self.env = gym.vector.AsyncVectorEnv(fns, context="forkserver",
                                                 autoreset_mode=gym.vector.AutoresetMode.DISABLED)
            self.single_observation_space = self.env.single_observation_space
            self.single_action_space = self.env.single_action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def _tensor(self, x, dtype=None) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x) if not torch.is_tensor(x) else x, device=self.device, dtype=dtype)

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        mask = None if options is None else options.get("reset_mask")
        if mask is None:
            obs, info = self.env.reset(seed=seed)
        elif self.gpu:
            obs, info = self.env.reset(options={"env_idx": torch.as_tensor(mask, device=self.device).nonzero()[:, 0]})
        else:
            obs, info = self.env.reset(options={"reset_mask": torch.as_tensor(mask).cpu().numpy().astype(bool)})
        return self._tensor(obs, torch.float32), {}

    def step(self, actions: torch.Tensor):
        if self.gpu:
            obs, reward, terminated, truncated, info = self.env.step(actions)
        else:
            obs, reward, terminated, truncated, info = self.env.step(actions.cpu().numpy())
        obs = self._tensor(obs, torch.float32)
        reward = self._tensor(reward, torch.float32).reshape(self.num_envs)
        terminated = self._tensor(terminated, torch.bool).reshape(self.num_envs)
        truncated = self._tensor(truncated, torch.bool).reshape(self.num_envs)
        success = self._tensor(info["success"], torch.bool).reshape(self.num_envs) if "success" in info else \
            torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        reset_now = truncated | (terminated & self.reset_on_termination)
        final_obs = obs
        if bool(reset_now.any()):
            final_obs = obs.clone()
            obs, _ = self.reset(options={"reset_mask": reset_now})
        info = {"success": success, "final_obs": final_obs, "_final_obs": reset_now}
        return obs, reward, terminated, truncated, info

    def close_extras(self, **kwargs):
        self.env.close()


def make_env(args: Args, num_envs: int, device: torch.device, evaluation: bool, video_dir: Optional[str] = None):
    """ToyChain-v0 (torch, on `device`) or a ManiSkill3 task (same-step autoreset, torch tensors on `device`)."""
    if args.env_id == TOY_ENV_ID:
        return gym.make_vec(TOY_ENV_ID, num_envs=num_envs, config=args.toy, device=device)
    # Training in gate mode and evaluation (no partial resets, Table 3) let terminated envs run to their horizon.
    reset_on_termination = (not evaluation) and args.partial_reset_mode == "immediate"
    return ManiSkillVecEnv(
        args.env_id, num_envs, args.resolved_horizon, args.resolved_sim_backend, device, reset_on_termination,
        control_mode=args.control_mode,
        reconfiguration_freq=args.eval_reconfiguration_freq if evaluation else args.reconfiguration_freq,
        video_dir=video_dir,
    )


def is_next_step(envs) -> bool:
    return envs.metadata.get("autoreset_mode") == gym.vector.AutoresetMode.NEXT_STEP


# =====================================================================================================================
# Pure functions the algorithm relies on (importable, tested in tests/test_ppo_staggered.py)
# =====================================================================================================================
def stagger_groups(num_envs: int, num_groups: int, device=None) -> torch.Tensor:
    """Group index j in [0, N_B) of every env: N_B contiguous groups of (nearly) equal size (Sec. 3.3)."""
    return torch.arange(num_envs, device=device) * num_groups // num_envs


def stagger_start_steps(num_groups: int, stagger_step: int) -> list[int]:
    """Advance step at which group j starts its first episode, so that after the (N_B - 1) * S advance steps group j
    is at episode step j * S (App. B.1: "each group j starting ... after an initial offset of j*K simulation steps")."""
    last = (num_groups - 1) * stagger_step
    return [last - j * stagger_step for j in range(num_groups)]


def reset_bookkeeping(stale, waiting, terminated, truncated, final_mask, episode_step,
                      next_step_mode: bool, gate_mode: bool):
    """Which transitions are trained on, and who waits, after one vector step (Sec. 3.3; autoreset_modes.txt).

    Inputs are (N,) tensors about step t:
      stale:       next-step mode: the env's previous step ended an episode, so step t only resets it (obs_t is the
                   old episode's last observation and the action is ignored)
      waiting:     gate mode: the env terminated earlier and waits for its group's reset gate
      terminated, truncated: the flags step t returned
      final_mask:  same-step mode: the env was reset inside step t (info["_final_obs"]); ignored in next-step mode
      episode_step: steps taken in the env's current episode when obs_t was observed
    Returns (valid, episode_end, stale_next, waiting_next, episode_step_next):
      valid:       transition t is trained on (neither a stale next-step reset step nor a waiting step)
      episode_end: transition t ends an episode (statistics; GAE uses the raw flags)
      stale_next, waiting_next, episode_step_next: the state for step t + 1
    A waiting env is not reset by the env (ManiSkillVecEnv with reset_on_termination=False); its time limit ends
    its group's horizon, and that truncation resets it together with its group: the reset gate.
    """
    valid = ~stale & ~waiting
    done = terminated | truncated
    episode_end = valid & done
    reset_now = stale if next_step_mode else final_mask
    stale_next = done if next_step_mode else torch.zeros_like(done)
    waiting_next = (waiting | (valid & terminated)) & ~reset_now if gate_mode else torch.zeros_like(done)
    episode_step_next = torch.where(reset_now, 0, episode_step + 1)
    return valid, episode_end, stale_next, waiting_next, episode_step_next


def bootstrap_values(values, last_value, final_values, final_mask):
    """V of the true next state of every transition in a (K, N) rollout.

    next_values[t] = values[t + 1] (V(obs_{t+1})), and V(obs after the rollout) for the last step; where a
    same-step env reset in step t, obs_{t+1} is the new episode's first observation, so V(final_obs) is used
    instead (final_mask[t]). In next-step mode obs_{t+1} already is the true last observation: nothing to replace.
    """
    next_values = torch.cat([values[1:], last_value.unsqueeze(0)], dim=0)
    return torch.where(final_mask, final_values, next_values)


def compute_gae(rewards, values, next_values, terminations, dones, gamma: float, gae_lambda: float):
    """Generalized advantage estimation over a (K, N) rollout, right at terminations and truncations.

    delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t)     (terminal: bootstrap 0; truncated: the
                                                                          true last state's value, next_values)
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}           (nothing flows across an episode end)
    Returns (advantages, returns = advantages + values).
    """
    not_terminal = 1.0 - terminations.to(rewards.dtype)
    not_done = 1.0 - dones.to(rewards.dtype)
    deltas = rewards + gamma * not_terminal * next_values - values
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        lastgaelam = deltas[t] + gamma * gae_lambda * not_done[t] * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the entries where mask is True (0 if there are none)."""
    w = mask.to(x.dtype)
    return (x * w).sum() / w.sum().clamp(min=1.0)


def batch_temporal_stats(episode_steps: torch.Tensor, valid: torch.Tensor, horizon: int, window: int) -> dict:
    """How temporally diverse a batch is (Sec. 3.2, Fig. 1): statistics of the episode step of its trained-on
    transitions, and how they spread over the horizon's ceil(H / window) windows of `window` steps.
    coverage = fraction of windows with data; entropy = normalized entropy over windows (1 = uniform, 0 = one)."""
    steps = episode_steps[valid].float()
    num_windows = math.ceil(horizon / window)
    if steps.numel() == 0:
        return {}
    counts = torch.bincount((steps.long() // window).clamp(max=num_windows - 1), minlength=num_windows).float()
    p = counts / counts.sum()
    entropy = -(p[p > 0] * p[p > 0].log()).sum() / math.log(num_windows) if num_windows > 1 else torch.tensor(1.0)
    return {
        "episode_step_mean": steps.mean().item(),
        "episode_step_std": steps.std(unbiased=False).item(),
        "episode_step_min": steps.min().item(),
        "episode_step_max": steps.max().item(),
        "stage_coverage": (counts > 0).float().mean().item(),
        "stage_entropy": float(entropy),
    }


def forgetting_matrix(accuracy: np.ndarray) -> np.ndarray:
    """App. E.0.1: Forgetting(t, b) = max_{t' <= t} A(t', b) - A(t, b), for an accuracy matrix A of shape (T, B)."""
    return np.maximum.accumulate(accuracy, axis=0) - accuracy


class EpisodeStats:
    """Return, length and success of every env's current episode, counted over its trained-on (valid) steps."""

    def __init__(self, num_envs: int, device):
        self.ret = torch.zeros(num_envs, device=device)
        self.len = torch.zeros(num_envs, dtype=torch.long, device=device)
        self.success_once = torch.zeros(num_envs, dtype=torch.bool, device=device)

    def step(self, reward, valid, success, episode_end) -> dict:
        """Adds one step; returns (N,) tensors of the episode statistics, meaningful where `episode_end`, and
        starts new episodes there."""
        self.ret = self.ret + reward * valid
        self.len = self.len + valid.long()
        self.success_once = self.success_once | (success & valid)
        ended = {"return": self.ret, "episode_len": self.len, "success_once": self.success_once,
                 "success_at_end": success}
        self.ret = torch.where(episode_end, 0.0, self.ret)
        self.len = torch.where(episode_end, 0, self.len)
        self.success_once = self.success_once & ~episode_end
        return ended


class RunningMeanStd:
    """Running mean and variance of observations (parallel-variance update of Chan et al.); Table 3's
    "Observation Normalization: running mean & std". Normalized observations are clipped to [-10, 10]."""

    def __init__(self, shape, device, epsilon: float = 1e-4):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(epsilon, device=device)

    def update(self, x: torch.Tensor) -> None:
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        self.var = (self.var * self.count + batch_var * n + delta.square() * self.count * n / total) / total
        self.count = total

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-10.0, 10.0)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = (state[k].to(self.mean.device) for k in ("mean", "var", "count"))


# =====================================================================================================================
# Networks
# =====================================================================================================================
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(sizes: list[int], activation: type[nn.Module], out_std: float) -> nn.Sequential:
    """Linear layers with `activation` between them; orthogonal init, the last layer with gain `out_std`."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        layers.append(layer_init(nn.Linear(n_in, n_out), std=out_std if last else math.sqrt(2)))
        if not last:
            layers.append(activation())
    return nn.Sequential(*layers)


class ChainAgent(nn.Module):
    """Table 2: block index -> 64-d embedding -> 4 x 256 ReLU -> categorical policy / scalar value (separate nets).

    The observation is one of B block indices, so each forward pass evaluates the networks once per block and
    gathers the rows of the batch: exactly the same outputs and gradients, at a cost of B rows instead of N*K.
    """

    def __init__(self, num_blocks: int, num_actions: int):
        super().__init__()
        self.register_buffer("blocks", torch.arange(num_blocks))
        self.actor = nn.Sequential(nn.Embedding(num_blocks, 64), mlp([64, 256, 256, 256, 256, num_actions], nn.ReLU, 0.01))
        self.critic = nn.Sequential(nn.Embedding(num_blocks, 64), mlp([64, 256, 256, 256, 256, 1], nn.ReLU, 1.0))

    def action_probs_per_block(self) -> torch.Tensor:
        """(B, A) policy probabilities in every block (for the per-block accuracy of App. E.0.1)."""
        return torch.softmax(self.actor(self.blocks), dim=-1)

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.blocks)[:, 0][obs]

    def get_action_and_value(self, obs: torch.Tensor, action: Optional[torch.Tensor] = None):
        logits = self.actor(self.blocks)[obs]
        log_probs = torch.log_softmax(logits, dim=-1)
        if action is None:  # Gumbel-max sampling: a categorical sample without a host sync (graph/compile friendly)
            gumbel = -torch.log(-torch.log(torch.rand_like(logits).clamp(1e-20, 1.0)))
            action = torch.argmax(logits + gumbel, dim=-1)
        logprob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, logprob, entropy, self.get_value(obs)

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self.blocks)[obs].argmax(-1)


class GaussianAgent(nn.Module):
    """Table 3: separate actor and critic MLPs, 3 x 256 tanh, orthogonal init; Gaussian policy whose log std is a
    learned, state-independent parameter (initialised at -0.5 as in ManiSkill's ppo.py)."""

    def __init__(self, obs_dim: int, act_dim: int):
        super().__init__()
        self.critic = mlp([obs_dim, 256, 256, 256, 1], nn.Tanh, 1.0)
        self.actor_mean = mlp([obs_dim, 256, 256, 256, act_dim], nn.Tanh, 0.01 * math.sqrt(2))
        self.actor_logstd = nn.Parameter(torch.full((1, act_dim), -0.5))

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs)[:, 0]

    def get_action_and_value(self, obs: torch.Tensor, action: Optional[torch.Tensor] = None):
        mean = self.actor_mean(obs)
        logstd = self.actor_logstd.expand_as(mean)
        std = logstd.exp()
        if action is None:
            action = mean + std * torch.randn_like(mean)
        # Diagonal Gaussian log-density and entropy, written out (no torch.distributions: graph/compile friendly).
        logprob = (-0.5 * ((action - mean) / std).square() - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + logstd).sum(-1)
        return action, logprob, entropy, self.get_value(obs)

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor_mean(obs)


def make_agent(envs) -> nn.Module:
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    if isinstance(obs_space, gym.spaces.Discrete):
        return ChainAgent(int(obs_space.n), int(act_space.n))
    return GaussianAgent(int(np.prod(obs_space.shape)), int(np.prod(act_space.shape)))


class CudaGraphed:
    """Replays a CUDA graph of `fn` (the --cudagraphs option, as LeanRL / ppo_fast.py do with tensordict's
    CudaGraphModule). The first `warmup` calls run eagerly on a side stream (lazy allocations, optimizer state);
    the next call captures the graph; every later call copies its tensor arguments into the graph's static inputs
    and replays it. The returned tensors are the graph's static outputs: read or clone them before the next call."""

    def __init__(self, fn: Callable, warmup: int = 3):
        self.fn, self.warmup, self.calls, self.graph = fn, warmup, 0, None

    def __call__(self, *args: torch.Tensor):
        if self.graph is None and self.calls < self.warmup:
            self.calls += 1
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = self.fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            return out
        if self.graph is None:
            self.static_args = [a.clone() for a in args]
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = self.fn(*self.static_args)
        for static, a in zip(self.static_args, args):
            static.copy_(a)
        self.graph.replay()
        return self.static_out


# =====================================================================================================================
# Logging, checkpoints, figures
# =====================================================================================================================
class Logger:
    """TensorBoard scalars (mirrored to wandb with --track); keeps the last value of each for summary.json."""

    def __init__(self, run_dir: Path, args: Args, run_name: str):
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=asdict(args), name=run_name, save_code=True)
        self.writer = SummaryWriter(str(run_dir))
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in asdict(args).items()))
        self.last: dict[str, float] = {}

    def scalar(self, name: str, value, step: int) -> None:
        value = float(value)
        self.writer.add_scalar(name, value, step)
        self.last[name] = value

    def close(self) -> None:
        self.writer.close()


def save_checkpoint(path: Path, agent, optimizer, obs_rms, global_step: int, iteration: int, args: Args) -> None:
    """Everything needed to resume: model, optimizer, normalizer, global step, iteration and RNG states.
    Written to a temporary file and renamed, so a crash never leaves a half-written checkpoint."""
    state = {
        "agent": agent.state_dict(),
        "optimizer": optimizer.state_dict(),
        "obs_rms": obs_rms.state_dict() if obs_rms is not None else None,
        "global_step": global_step,
        "iteration": iteration,
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        "args": asdict(args),
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:  # also on Ctrl-C during the write
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(path: str, agent, optimizer, obs_rms) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own file: holds numpy RNG state
    try:
        agent.load_state_dict(state["agent"])
    except RuntimeError as e:
        saved = state.get("args", {})
        raise ArgsError(f"--checkpoint {path} does not fit this network (it was trained on "
                        f"{saved.get('env_id')}); {e}") from e
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if obs_rms is not None and state["obs_rms"] is not None:
        obs_rms.load_state_dict(state["obs_rms"])
    return state


def restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_toy_figures(run_dir: Path, occupancy: np.ndarray, accuracy: np.ndarray, title: str, writer) -> None:
    """App. C Fig. 6c/d (mean number of envs in each block at each update) and App. E Fig. 12/13 (forgetting),
    as PNGs in the run directory and as TensorBoard images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, matrix, label, cmap in (
        ("toy_block_occupancy.png", occupancy, "mean envs in block", "viridis"),
        ("toy_forgetting_matrix.png", forgetting_matrix(accuracy), "forgetting (best - current accuracy)", "inferno"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        image = ax.imshow(matrix.T, aspect="auto", origin="lower", cmap=cmap, interpolation="nearest",
                          vmin=0.0, vmax=None if name.endswith("occupancy.png") else 1.0)
        ax.set_xlabel("PPO update")
        ax.set_ylabel("block index")
        ax.set_title(f"{title}: {label}")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        writer.add_figure(f"toy/{name[len('toy_'):-len('.png')]}", fig, close=True)


# =====================================================================================================================
# Evaluation
# =====================================================================================================================
@torch.no_grad()
def evaluate(agent, eval_envs, normalize: Callable, num_steps: int, seed: int, device) -> dict:
    """Deterministic policy, no partial resets (terminations do not end evaluation episodes: Table 3, ManiSkill's
    evaluation protocol). Returns the means of eval/return, success_once, success_at_end and episode_len over
    the episodes that ended (each eval env runs one full H-step episode with the default --num-eval-steps)."""
    obs, _ = eval_envs.reset(seed=seed)
    n = eval_envs.num_envs
    zeros = lambda dtype: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
    stats = EpisodeStats(n, device)
    stale, waiting, episode_step = zeros(torch.bool), zeros(torch.bool), zeros(torch.long)
    ended: dict[str, list[torch.Tensor]] = {"return": [], "success_once": [], "success_at_end": [], "episode_len": []}
    next_step_mode = is_next_step(eval_envs)
    for _ in range(num_steps):
        action = agent.deterministic_action(normalize(obs))
        if isinstance(eval_envs.single_action_space, gym.spaces.Box):
            low, high = eval_envs.single_action_space.low, eval_envs.single_action_space.high
            action = action.clamp(torch.as_tensor(low, device=device), torch.as_tensor(high, device=device))
        obs, reward, terminated, truncated, info = eval_envs.step(action)
        final_mask = info.get("_final_obs", zeros(torch.bool))
        # A termination ends an evaluation episode only where the env resets there (ToyChain); ManiSkill's
        # evaluation envs keep running after a success (no partial resets), so their episodes last H steps.
        ending_termination = terminated & (final_mask | next_step_mode)
        valid, episode_end, stale, waiting, episode_step = reset_bookkeeping(
            stale, waiting, ending_termination, truncated, final_mask, episode_step, next_step_mode, gate_mode=True)
        for key, value in stats.step(reward, valid, info["success"], episode_end).items():
            ended[key].append(value[episode_end].float())
    ended_all = {k: torch.cat(v) for k, v in ended.items()}
    return {k: v.mean().item() for k, v in ended_all.items() if v.numel() > 0}


# =====================================================================================================================
# Training
# =====================================================================================================================
def advance_for_stagger(envs, obs, state: dict, groups: torch.Tensor, args: Args, act: Callable, observe: Callable):
    """App. B.1: before training, advance group j by j * S env steps (random actions or the initial policy), so its
    first trained-on episode is already at step j * S. All envs step together; group j's first episode is started
    (a partial reset of the group) at advance step (N_B - 1 - j) * S. Nothing of the advance is trained on.
    Returns the observation after the advance; `state` (stale/waiting/episode_step) is updated in place."""
    starts = stagger_start_steps(args.num_stagger_groups, args.stagger_step)
    last = starts[0]
    next_step_mode = is_next_step(envs)
    for t in range(last + 1):
        starting = [j for j, s in enumerate(starts) if s == t and t > 0]  # the last group started at the reset
        if starting:
            mask = torch.isin(groups, torch.tensor(starting, device=groups.device))
            raw_obs, _ = envs.reset(options={"reset_mask": mask})
            obs = torch.where(mask.view(-1, *[1] * (obs.dim() - 1)), observe(raw_obs, update=True), obs)
            for key in ("stale", "waiting"):
                state[key] = state[key] & ~mask
            state["episode_step"] = torch.where(mask, 0, state["episode_step"])
        if t == last:
            break
        raw_next, _, terminated, truncated, info = envs.step(act(obs))
        _, _, state["stale"], state["waiting"], state["episode_step"] = reset_bookkeeping(
            state["stale"], state["waiting"], terminated, truncated, info.get("_final_obs", torch.zeros_like(terminated)),
            state["episode_step"], next_step_mode, args.partial_reset_mode == "gate")
        obs = observe(raw_next, update=True)
    return obs


def make_run_dir(args: Args) -> tuple[str, Path]:
    """{output_dir}/{env_id}__{exp_name}__{seed}__{unix_time}, created here; a suffix keeps concurrent runs apart."""
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    for attempt in range(1000):
        name = run_name if attempt == 0 else f"{run_name}_{attempt}"
        try:
            (Path(args.output_dir) / name).mkdir()
            return name, Path(args.output_dir) / name
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run directory under {args.output_dir}")


def main(args: Args) -> dict:
    args = resolve_args(args)
    is_toy = args.env_id == TOY_ENV_ID
    run_name, run_dir = make_run_dir(args)
    (run_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")

    logger = Logger(run_dir, args, run_name)
    video_dir = str(run_dir / "videos") if args.capture_video else None
    envs = None if args.evaluate else make_env(args, args.num_envs, device, evaluation=False)
    eval_envs = make_env(args, args.num_eval_envs, device, evaluation=True, video_dir=video_dir)
    agent = make_agent(eval_envs).to(device)
    lr = torch.tensor(args.learning_rate, device=device) if args.cudagraphs else args.learning_rate
    # Table 3: Adam, eps 1e-5. The fused kernel is fastest; CUDA-graph capture needs the capturable variant.
    optimizer = torch.optim.Adam(agent.parameters(), lr=lr, eps=1e-5, fused=not args.cudagraphs,
                                 capturable=args.cudagraphs)
    obs_space = eval_envs.single_observation_space
    obs_rms = RunningMeanStd(obs_space.shape, device) if args.norm_obs else None

    def observe(raw_obs: torch.Tensor, update: bool) -> torch.Tensor:
        """Observations as the agent sees them (running normalization, Table 3; stats updated during collection)."""
        if obs_rms is None:
            return raw_obs
        if update:
            obs_rms.update(raw_obs)
        return obs_rms.normalize(raw_obs)

    start_iteration, global_step = 1, 0
    if args.checkpoint:
        ckpt = load_checkpoint(args.checkpoint, agent, None if args.evaluate else optimizer, obs_rms)
        start_iteration, global_step = ckpt["iteration"] + 1, ckpt["global_step"]
        if not args.evaluate:
            restore_rng(ckpt["rng"])
            print(f"resuming from {args.checkpoint} at iteration {start_iteration}, global step {global_step}")

    summary: dict = {"run_dir": str(run_dir), "global_step": global_step, "interrupted": False}
    start_time = time.time()
    start_global_step = global_step
    try:
        if args.evaluate:
            metrics = evaluate(agent, eval_envs, lambda o: observe(o, update=False), args.num_eval_steps,
                               args.seed, device)
            for k, v in metrics.items():
                logger.scalar(f"eval/{k}", v, global_step)
            print(" ".join(f"eval/{k}={v:.4f}" for k, v in metrics.items()))
            return summary
        train(args, envs, eval_envs, agent, optimizer, observe, obs_rms, logger, run_dir, device,
              start_iteration, global_step, summary, is_toy)
    except KeyboardInterrupt:
        summary["interrupted"] = True
        print("interrupted: writing summary.json" + (" and a checkpoint" if args.save_model else ""))
        if args.save_model and "iteration" in summary:
            save_checkpoint(run_dir / "final_ckpt.pt", agent, optimizer, obs_rms, summary["global_step"],
                            summary["iteration"], args)
        raise
    finally:
        wall = time.time() - start_time
        summary.update(wall_time_s=wall, sps=(summary["global_step"] - start_global_step) / max(wall, 1e-9))
        summary.update(logger.last)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.close()
        for e in (envs, eval_envs):
            if e is not None:
                e.close()
    return summary


def train(args: Args, envs, eval_envs, agent, optimizer, observe, obs_rms, logger: Logger, run_dir: Path, device,
          start_iteration: int, global_step: int, summary: dict, is_toy: bool) -> None:
    N, K, H = args.num_envs, args.num_steps, args.resolved_horizon
    next_step_mode, gate_mode = is_next_step(envs), args.partial_reset_mode == "gate"
    act_space = envs.single_action_space
    continuous = isinstance(act_space, gym.spaces.Box)
    if continuous:
        act_low = torch.as_tensor(act_space.low, device=device)
        act_high = torch.as_tensor(act_space.high, device=device)

    # ---- rollout storage (K, N, ...) --------------------------------------------------------------------------------
    obs_shape, obs_dtype = (() if is_toy else envs.single_observation_space.shape), (torch.long if is_toy else torch.float32)
    act_shape, act_dtype = (act_space.shape if continuous else ()), (torch.float32 if continuous else torch.long)
    obs_buf = torch.zeros((K, N, *obs_shape), dtype=obs_dtype, device=device)
    actions_buf = torch.zeros((K, N, *act_shape), dtype=act_dtype, device=device)
    f32 = lambda: torch.zeros((K, N), device=device)  # noqa: E731
    b8 = lambda: torch.zeros((K, N), dtype=torch.bool, device=device)  # noqa: E731
    logprobs_buf, rewards_buf, values_buf, final_values_buf = f32(), f32(), f32(), f32()
    terms_buf, dones_buf, valid_buf, final_mask_buf, correct_buf = b8(), b8(), b8(), b8(), b8()
    episode_step_buf = torch.zeros((K, N), dtype=torch.long, device=device)

    # ---- the policy step and the PPO minibatch step (eager by default; --compile / --cudagraphs wrap them) --------
    def policy_step(obs):
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(obs)
        return action, logprob, value

    def minibatch_grads(obs, actions, old_logprobs, advantages, returns, old_values, valid):
        """Clipped-surrogate PPO loss on one minibatch, masked to the trained-on steps; gradients left in .grad.
        Returns [pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac, grad_norm]."""
        optimizer.zero_grad(set_to_none=False)
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
        logratio = newlogprob - old_logprobs
        ratio = logratio.exp()
        with torch.no_grad():
            old_approx_kl = masked_mean(-logratio, valid)
            approx_kl = masked_mean((ratio - 1) - logratio, valid)
            clipfrac = masked_mean(((ratio - 1.0).abs() > args.clip_coef).float(), valid)
        if args.norm_adv:  # per-minibatch advantage normalization (Table 3), over the trained-on steps only
            mean = masked_mean(advantages, valid)
            n = valid.float().sum()
            std = torch.sqrt(((advantages - mean).square() * valid).sum() / (n - 1).clamp(min=1.0))
            advantages = (advantages - mean) / (std + 1e-8)
        pg_loss = masked_mean(torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)), valid)
        if args.clip_vloss:
            clipped_value = old_values + (newvalue - old_values).clamp(-args.clip_coef, args.clip_coef)
            v_loss = 0.5 * masked_mean(torch.max((newvalue - returns).square(), (clipped_value - returns).square()), valid)
        else:
            v_loss = 0.5 * masked_mean((newvalue - returns).square(), valid)
        entropy_loss = masked_mean(entropy, valid)
        loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        return torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, grad_norm]).detach()

    optimizer_step = optimizer.step
    if args.compile:
        policy_step = torch.compile(policy_step)
        minibatch_grads = torch.compile(minibatch_grads)
    if args.cudagraphs:
        policy_step = CudaGraphed(policy_step)
        minibatch_grads = CudaGraphed(minibatch_grads)
        optimizer_step = CudaGraphed(optimizer.step)

    def act_for_advance(obs):
        if args.stagger_advance == "policy":
            return clamp_action(policy_step(obs)[0])
        if continuous:
            return torch.rand((N, *act_space.shape), device=device) * (act_high - act_low) + act_low
        return torch.randint(0, int(act_space.n), (N,), device=device)

    def clamp_action(action):
        return action.clamp(act_low, act_high) if continuous else action

    # ---- start: reset, then the stagger advance (App. B.1) -----------------------------------------------------------
    groups = stagger_groups(N, args.num_stagger_groups, device)
    raw_obs, _ = envs.reset(seed=args.seed + global_step)
    obs = observe(raw_obs, update=True)
    state = {k: torch.zeros(N, dtype=torch.bool, device=device) for k in ("stale", "waiting")}
    state["episode_step"] = torch.zeros(N, dtype=torch.long, device=device)
    obs = advance_for_stagger(envs, obs, state, groups, args, act_for_advance, observe)
    advance_steps = stagger_start_steps(args.num_stagger_groups, args.stagger_step)[0] * N
    logger.scalar("stagger/advance_env_steps", advance_steps, global_step)
    summary["advance_env_steps"] = advance_steps
    episode_stats = EpisodeStats(N, device)
    # Episode statistics count only episodes that started during training (not the advanced first episodes).
    tracked = state["episode_step"] == 0

    toy_occupancy, toy_accuracy = [], []
    train_start = time.time()
    start_step = global_step
    iterations = range(start_iteration, args.num_iterations + 1)
    progress = None
    if args.progress_bar:
        from tqdm import tqdm

        progress = tqdm(iterations, desc=args.env_id, dynamic_ncols=True)
    summary["iteration"] = start_iteration - 1
    for iteration in iterations:
        if (iteration - 1) % args.eval_freq == 0:
            run_evaluation(args, agent, eval_envs, observe, logger, global_step, device, run_dir, optimizer,
                           obs_rms, iteration - 1, summary)
        if args.anneal_lr:
            new_lr = (1.0 - (iteration - 1.0) / args.num_iterations) * args.learning_rate
            if torch.is_tensor(optimizer.param_groups[0]["lr"]):
                optimizer.param_groups[0]["lr"].fill_(new_lr)
            else:
                optimizer.param_groups[0]["lr"] = new_lr

        # ---- rollout: K steps of every env ---------------------------------------------------------------------------
        rollout_start = time.time()
        env_time = inference_time = 0.0
        final_mask_buf.zero_()
        n_episodes = torch.zeros((), device=device)
        episode_sums = {k: torch.zeros((), device=device) for k in ("return", "episode_len", "success_once",
                                                                     "success_at_end")}
        for step in range(K):
            obs_buf[step] = obs
            episode_step_buf[step] = state["episode_step"]
            t0 = time.time()
            action, logprob, value = policy_step(obs)
            actions_buf[step], logprobs_buf[step], values_buf[step] = action, logprob, value
            inference_time += time.time() - t0
            t0 = time.time()
            raw_next, reward, terminated, truncated, info = envs.step(clamp_action(action))
            env_time += time.time() - t0
            rewards_buf[step] = reward * args.reward_scale
            terms_buf[step], dones_buf[step] = terminated, terminated | truncated
            final_mask = info.get("_final_obs", torch.zeros_like(terminated))
            if not next_step_mode:
                # Same-step autoreset: a truncated env's next observation is already the new episode's first one;
                # bootstrap from V(final_obs), the true last observation (autoreset_modes.txt).
                boot = final_mask & truncated
                if bool(boot.any()):
                    with torch.no_grad():
                        final_values = agent.get_value(observe(info["final_obs"], update=False))
                    final_values_buf[step] = torch.where(boot, final_values, 0.0)
                    final_mask_buf[step] = boot
            valid, episode_end, state["stale"], state["waiting"], state["episode_step"] = reset_bookkeeping(
                state["stale"], state["waiting"], terminated, truncated, final_mask, state["episode_step"],
                next_step_mode, gate_mode)
            valid_buf[step] = valid
            if is_toy:
                correct_buf[step] = info["correct"]
            # episode statistics (unscaled reward), over the trained-on steps of each episode
            recorded = episode_end & tracked
            tracked = tracked | (state["episode_step"] == 0)
            n_episodes += recorded.sum()
            for key, value in episode_stats.step(reward, valid, info["success"], episode_end).items():
                episode_sums[key] += (value * recorded).sum()
            obs = observe(raw_next, update=True)
        global_step += N * K

        # ---- advantages: GAE with the right bootstrap under either autoreset mode ----------------------------------
        with torch.no_grad():
            last_value = agent.get_value(obs)
            next_values = bootstrap_values(values_buf, last_value, final_values_buf, final_mask_buf)
            advantages, returns = compute_gae(rewards_buf, values_buf, next_values, terms_buf, dones_buf,
                                              args.gamma, args.gae_lambda)
            value_mse = masked_mean((values_buf - returns).square(), valid_buf)  # App. E.0.1 value error
        rollout_time = time.time() - rollout_start

        # ---- PPO update ---------------------------------------------------------------------------------------------
        update_start = time.time()
        b_obs = obs_buf.reshape(-1, *obs_shape)
        b_actions = actions_buf.reshape(-1, *act_shape)
        b_logprobs, b_advantages = logprobs_buf.reshape(-1), advantages.reshape(-1)
        b_returns, b_values, b_valid = returns.reshape(-1), values_buf.reshape(-1), valid_buf.reshape(-1)
        stats = torch.zeros(7, device=device)
        num_updates = 0
        agent.train()
        for epoch in range(args.update_epochs):
            permutation = torch.randperm(args.batch_size, device=device)
            stop = False
            for start in range(0, args.batch_size, args.minibatch_size):
                mb = permutation[start:start + args.minibatch_size]
                mb_stats = minibatch_grads(b_obs[mb], b_actions[mb], b_logprobs[mb], b_advantages[mb],
                                           b_returns[mb], b_values[mb], b_valid[mb])
                if args.target_kl is not None and mb_stats[4].item() > args.target_kl:
                    stop = True  # target-KL early stop (Table 3): skip this step and the rest of the update
                    break
                optimizer_step()
                stats += mb_stats
                num_updates += 1
            if stop:
                break
        agent.eval()
        stats = (stats / max(num_updates, 1)).tolist()
        with torch.no_grad():
            # App. E.0.1 policy oscillation: 0.5 E[(log pi_new(a|s) - log pi_old(a|s))^2] over the batch.
            _, newlogprob, _, _ = agent.get_action_and_value(b_obs, b_actions)
            policy_kl = 0.5 * masked_mean((newlogprob - b_logprobs).square(), b_valid)
            explained_var = 1 - masked_mean((b_returns - b_values).square(), b_valid) / \
                masked_mean((b_returns - masked_mean(b_returns, b_valid)).square(), b_valid).clamp(min=1e-8)
        update_time = time.time() - update_start

        # ---- logging -------------------------------------------------------------------------------------------------
        sps = (global_step - start_step) / (time.time() - train_start)
        log = logger.scalar
        log("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
        log("charts/SPS", sps, global_step)
        for name, value in zip(("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac"), stats):
            log(f"losses/{name}", value, global_step)
        log("losses/explained_variance", explained_var.item(), global_step)
        log("losses/grad_norm", stats[6], global_step)
        log("losses/minibatch_updates", num_updates, global_step)
        if n_episodes.item() > 0:
            n = n_episodes.item()
            for key, name in (("return", "charts/episodic_return"), ("episode_len", "charts/episodic_length"),
                              ("success_once", "charts/success_rate"), ("success_at_end", "train/success_at_end")):
                log(name, episode_sums[key].item() / n, global_step)
        log("stagger/value_mse", value_mse.item(), global_step)
        log("stagger/policy_kl", policy_kl.item(), global_step)
        log("stagger/valid_fraction", valid_buf.float().mean().item(), global_step)
        for name, value in batch_temporal_stats(episode_step_buf, valid_buf, H, K).items():
            log(f"stagger/{name}", value, global_step)
        logger.writer.add_histogram("stagger/episode_step", episode_step_buf[valid_buf].float(), global_step)
        log("time/rollout", rollout_time, global_step)
        log("time/env_step", env_time, global_step)
        log("time/inference", inference_time, global_step)
        log("time/update", update_time, global_step)
        if is_toy:
            log_toy_diagnostics(agent, envs, obs_buf, valid_buf, correct_buf, logger, global_step,
                                toy_occupancy, toy_accuracy)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(sps=f"{sps:.0f}", ret=f"{logger.last.get('charts/episodic_return', float('nan')):.2f}",
                                 success=f"{logger.last.get('charts/success_rate', float('nan')):.2f}")
        summary["iteration"], summary["global_step"] = iteration, global_step  # completed iterations only

    if progress is not None:
        progress.close()
    run_evaluation(args, agent, eval_envs, observe, logger, global_step, device, run_dir, optimizer, obs_rms,
                   args.num_iterations, summary, final=True)
    if is_toy and toy_accuracy:
        occupancy, accuracy = np.stack(toy_occupancy), np.stack(toy_accuracy)
        np.savez(run_dir / "toy_diagnostics.npz", occupancy=occupancy, accuracy=accuracy,
                 forgetting=forgetting_matrix(accuracy))
        summary["toy/forgetting_mean_overall"] = float(forgetting_matrix(accuracy).mean())
        save_toy_figures(run_dir, occupancy, accuracy, "staggered" if args.stagger else "naive (synchronous)",
                         logger.writer)


def run_evaluation(args, agent, eval_envs, observe, logger, global_step, device, run_dir, optimizer, obs_rms,
                   iteration, summary, final: bool = False) -> None:
    eval_start = time.time()
    metrics = evaluate(agent, eval_envs, lambda o: observe(o, update=False), args.num_eval_steps,
                       args.seed + 10_000 + iteration, device)
    for k, v in metrics.items():
        logger.scalar(f"eval/{k}", v, global_step)
    logger.scalar("time/eval", time.time() - eval_start, global_step)
    if args.save_model:
        name = "final_ckpt.pt" if final else f"ckpt_{global_step}.pt"
        save_checkpoint(run_dir / name, agent, optimizer, obs_rms, global_step, iteration, args)


def log_toy_diagnostics(agent, envs, obs_buf, valid_buf, correct_buf, logger, global_step, occupancy_log,
                        accuracy_log) -> None:
    """App. C / E diagnostics on ToyChain: batch accuracy, block occupancy and per-block accuracy / forgetting.

    Per-block accuracy A(t, b) is the probability the policy gives the target action of block b, measured after
    update t for every block (also those absent from the batch: that is where forgetting shows)."""
    num_blocks = envs.num_blocks
    accuracy = masked_mean(correct_buf.float(), valid_buf).item()
    occupancy = torch.bincount(obs_buf.reshape(-1), minlength=num_blocks).float() / obs_buf.shape[0]
    with torch.no_grad():
        probs = agent.action_probs_per_block()
        block_accuracy = probs.gather(-1, envs.target_actions.view(-1, 1)).squeeze(-1)
    occupancy_log.append(occupancy.cpu().numpy())
    accuracy_log.append(block_accuracy.cpu().numpy())
    forgetting = forgetting_matrix(np.stack(accuracy_log))[-1]
    logger.scalar("toy/accuracy", accuracy, global_step)
    logger.scalar("toy/block_accuracy_mean", float(block_accuracy.mean()), global_step)
    logger.scalar("toy/block_accuracy_min", float(block_accuracy.min()), global_step)
    logger.scalar("toy/forgetting_mean", float(forgetting.mean()), global_step)
    logger.writer.add_histogram("toy/block_occupancy", obs_buf.reshape(-1).float(), global_step)


if __name__ == "__main__":
    cli_args = tyro.cli(Args)
    try:
        main(cli_args)
    except ArgsError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
