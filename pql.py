"""Parallel Q-Learning (PQL): an Actor, a V-learner and a P-learner running concurrently, for massively parallel
simulation (ManiSkill3) and a continuous-action toy chain.

Paper: "Parallel Q-Learning: Scaling Off-policy Reinforcement Learning under Massively Parallel Simulation",
Zechu Li, Tao Chen, Zhang-Wei Hong, Anurag Ajay, Pulkit Agrawal (ICML 2023), arXiv:2307.12983.

DDPG with two Q functions (the min of both in the target), n-step returns and mixed exploration noise, split into
three processes that run at the same time (Sec. 3.1, Fig. 1, Alg. 1-3):
  Actor      (this, the main process) steps N parallel envs with its copy of the policy pi^a plus mixed exploration
             noise (Sec. 3.3), keeps the running observation normalizer, builds n-step transitions and sends the
             full transitions to the V-learner and the states to the P-learner;
  V-learner  (a torch.multiprocessing process) keeps its own replay buffer of transitions on its device and updates
             Q1, Q2 (and their target networks, tau) against a lagged copy of the policy, which plays the target
             policy (Sec. 3.2, third point);
  P-learner  (a process) keeps its own replay buffer of states and updates the policy to maximize min(Q1, Q2) of its
             copy of the Q functions.
Data moves through preallocated shared-memory (CPU) or CUDA IPC (GPU) slots, never pickled per batch. Networks move
once per Actor step: the policy P-learner -> Actor and V-learner, the Q functions V-learner -> P-learner. Speed
ratios beta_a:v (Actor steps per V-update, default 1:8) and beta_p:v (P-updates per V-update, default 1:2) are
enforced by making whichever process is ahead wait (Sec. 3.2). --sequential runs the same updates one after another
in one process: the DDPG(n) baseline of Sec. 4.1, for side-by-side comparisons.

Map from the paper to this file
  Sec. 3.1, Fig. 1, Alg. 1   train (the Actor loop), NStepAssembler, Mailbox (data transfer), ParamBoard (networks)
  Sec. 3.1, Alg. 3           VLearner (double Q, n-step target, target nets), ReplayBuffer
  Sec. 3.1, Alg. 2           PLearner (maximize min Q over its state buffer)
  Sec. 3.2                   actor_may_step, v_may_update, p_may_update (ratio control), pql/ratio_* metrics
  Sec. 3.3                   mixed_exploration_sigmas (sigma_i spread over [0.05, 0.8] across envs)
  Sec. 4.1 DDPG(n)           --sequential (SequentialLearners)
  App. B.1, Table B.1/B.2    Args defaults (batch 8192, buffer 5M, lr 5e-4, tau 0.05, clip 0.5, n = 3, warm-up 32)
  App. C, PQL-D              --distributional: categorical critic (51 atoms on [-10, 10]), categorical_projection
n-step returns (nstep_targets) keep termination and truncation apart: a termination bootstraps zero, a truncation
(time limit) bootstraps the true final observation (info["final_obs"] in same-step mode). The original code treats
time-outs as terminal; this script does not. Autoreset (autoreset_modes.txt): ToyChainContinuous-v0 runs in either
Gymnasium mode (--toy.autoreset-mode; next-step's stale reset step is never stored), ManiSkill envs are same-step.

Examples
  python pql.py --env-id ToyChainContinuous-v0                     # toy chain on the CPU, about a minute
  python pql.py --env-id ToyChainContinuous-v0 --sequential        # the DDPG(n) baseline, same updates, one process
  python pql.py --env-id PickCube-v1                               # GPU: 4096 envs (physx_cuda), all three on one GPU
  python pql.py --env-id PushCube-v1 --v-learner-device cuda:1 --p-learner-device cuda:1 --distributional
  python pql.py --env-id PickCube-v1 --num-envs 2 --total-timesteps 2000 --no-cuda   # CPU simulation, 2 processes
"""

from __future__ import annotations

import copy
import ctypes
import glob
import json
import math
import os
import queue
import random
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.tensorboard import SummaryWriter

from toy_chain_env import ToyChainContinuousConfig


@dataclass
class Args:
    # ---- experiment -------------------------------------------------------------------------------------------
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of python, numpy, torch and the environments (the learners use seed + 1 and seed + 2)"""
    torch_deterministic: bool = True
    """sets torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """use CUDA when it is available: the default device of all three processes (and ManiSkill's GPU simulation)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{env_id}__{exp_name}__{seed}__{unix_time}/"""
    track: bool = False
    """mirror the TensorBoard scalars to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "pql"
    """wandb project name"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    capture_video: bool = False
    """record videos of the evaluation episodes into the run directory (ManiSkill tasks)"""
    save_model: bool = False
    """write checkpoints (ckpt_{global_step}.pt at every evaluation, final_ckpt.pt at the end and on Ctrl-C)"""
    checkpoint: Optional[str] = None
    """a checkpoint to resume training from (or to evaluate, with --evaluate)"""
    evaluate: bool = False
    """only evaluate the deterministic policy of --checkpoint, then exit"""
    progress_bar: bool = True
    """show a progress bar with SPS, return and success"""

    # ---- environment ------------------------------------------------------------------------------------------
    env_id: str = "PickCube-v1"
    """a ManiSkill3 task id (PickCube-v1, PushCube-v1, StackCube-v1, ...) or ToyChainContinuous-v0"""
    num_envs: Optional[int] = None
    """number of parallel training envs N (default: 4096 with GPU simulation (Table B.1), 8 with CPU simulation, 64 on the toy chain)"""
    num_eval_envs: Optional[int] = None
    """number of parallel evaluation envs (default: 16 ManiSkill GPU, 2 ManiSkill CPU, 64 toy chain)"""
    horizon: Optional[int] = None
    """ManiSkill task horizon H (max_episode_steps; default: the task's own); ToyChain: --toy.horizon"""
    sim_backend: Literal["auto", "physx_cuda", "physx_cpu"] = "auto"
    """ManiSkill simulation: auto = physx_cuda (one process, thousands of envs) when the Actor is on a GPU, else physx_cpu (one worker process per env)"""
    control_mode: Optional[str] = None
    """ManiSkill controller (default: the task's default)"""
    toy: ToyChainContinuousConfig = field(default_factory=ToyChainContinuousConfig)
    """ToyChainContinuous-v0 settings"""

    # ---- the three processes (Sec. 3.1, 3.2) -------------------------------------------------------------------
    sequential: bool = False
    """run the Actor, V-learner and P-learner updates one after another in one process: DDPG(n), Sec. 4.1"""
    actor_device: Optional[str] = None
    """device of the Actor: simulation, exploration policy, n-step assembly (default: cuda if used, else cpu)"""
    v_learner_device: Optional[str] = None
    """device of the V-learner: its replay buffer and the Q functions (default: as --actor-device)"""
    p_learner_device: Optional[str] = None
    """device of the P-learner: its state buffer and the policy (default: as --actor-device)"""
    beta_a_v: float = 1 / 8
    """beta_a:v = f_a / f_v, Actor steps (of all N envs) per V-learner update (Sec. 3.2; default 1:8)"""
    beta_p_v: float = 1 / 2
    """beta_p:v = f_p / f_v, P-learner updates per V-learner update (Sec. 3.2; default 1:2)"""
    num_threads: Optional[int] = None
    """torch CPU threads per process (default: the cores split among the three processes; all of them with --sequential)"""

    # ---- algorithm (App. B.1, Table B.1) ---------------------------------------------------------------------------
    total_timesteps: Optional[int] = None
    """training env steps, warm-up included (default: 30M ManiSkill GPU, 200k ManiSkill CPU, 64 * 600 toy chain)"""
    max_time: Optional[float] = None
    """also stop after this many seconds of training (the original code's time budget)"""
    gamma: float = 0.99
    """discount factor (Table B.1)"""
    nstep: int = 3
    """n of the n-step returns (Table B.1, App. C: n = 3 works best)"""
    tau: float = 0.05
    """target-network update rate, after every V-update (Table B.1)"""
    batch_size: Optional[int] = None
    """batch size of both learners (default: 8192 (Table B.1); 1024 with CPU learners on ManiSkill CPU simulation or the toy chain)"""
    buffer_size: int = 5_000_000
    """replay buffer capacity of each learner (Table B.1); the default shrinks, with a message, to what the run can fill or the device memory holds"""
    learning_rate: float = 5e-4
    """Adam learning rate of the policy and the Q functions (Table B.1)"""
    max_grad_norm: float = 0.5
    """gradient-norm clip of both learners (Table B.1)"""
    warm_up_steps: int = 32
    """Actor steps with uniform random actions before learning starts (Table B.1)"""
    reward_scale: float = 0.1
    """rewards are multiplied by this for learning (Table B.2: 0.01-1; 0.1 keeps ManiSkill's normalized dense rewards and the toy chain inside PQL-D's [-10, 10]); returns are logged unscaled"""
    norm_obs: Optional[bool] = None
    """running mean/std observation normalization shared by all processes (Table B.1; default: on, off for the toy chain's one-hot)"""
    sigma_min: float = 0.05
    """mixed exploration: smallest noise std, of env 1 (Sec. 3.3)"""
    sigma_max: float = 0.8
    """mixed exploration: largest noise std, of env N (Sec. 3.3)"""
    target_noise_std: float = 0.8
    """std of the noise added to the target policy's action (the original code's value; not in the paper)"""
    target_noise_clip: float = 0.2
    """the target policy noise is clipped to +-this (the original code's value)"""
    actor_hidden_dims: Optional[tuple[int, ...]] = None
    """hidden layers of the policy MLP (default: 512 256 128, ELU, as the original code; 256 256 on the toy chain)"""
    critic_hidden_dims: Optional[tuple[int, ...]] = None
    """hidden layers of each Q MLP (default: 512 256 128, ELU; 256 256 on the toy chain)"""
    distributional: bool = False
    """PQL-D: categorical Q distributions with the C51 projection (App. C)"""
    num_atoms: int = 51
    """PQL-D: atoms of the support (App. C)"""
    v_min: float = -10.0
    """PQL-D: lowest atom (App. C)"""
    v_max: float = 10.0
    """PQL-D: highest atom (App. C)"""

    # ---- evaluation, logging ---------------------------------------------------------------------------------------
    eval_freq: Optional[int] = None
    """evaluate every this many Actor steps (default: 200 ManiSkill GPU, 50 CPU simulation, 25 toy chain)"""
    num_eval_steps: Optional[int] = None
    """steps per evaluation (default: H, one full episode per eval env)"""
    log_freq: int = 5
    """write training scalars every this many Actor steps"""
    debug_crash: Optional[Literal["v_learner", "p_learner"]] = None
    """make this learner process raise an error after 20 of its updates (to check that a failing process ends the run)"""

    # ---- filled in by resolve_args ------------------------------------------------------------------------------
    num_actor_steps: tyro.conf.Suppress[int] = 0
    resolved_horizon: tyro.conf.Suppress[int] = 0
    resolved_sim_backend: tyro.conf.Suppress[str] = ""


TOY_ENV_ID = "ToyChainContinuous-v0"
# ToyChainContinuous-v0: small networks and batches, so that a run takes about a minute on two CPU cores.
TOY_PRESET = dict(num_envs=64, num_eval_envs=64, batch_size=1024, total_timesteps=64 * 600, eval_freq=25,
                  norm_obs=False, actor_hidden_dims=(256, 256), critic_hidden_dims=(256, 256))
# ManiSkill3 with GPU simulation: Table B.1 (4096 envs, batch 8192) and the original code's networks.
MANISKILL_GPU = dict(num_envs=4096, num_eval_envs=16, batch_size=8192, total_timesteps=30_000_000, eval_freq=200,
                     norm_obs=True, actor_hidden_dims=(512, 256, 128), critic_hidden_dims=(512, 256, 128))
# ManiSkill3 with CPU simulation (one worker process per env): for trying things out.
MANISKILL_CPU = dict(num_envs=8, num_eval_envs=2, batch_size=1024, total_timesteps=200_000, eval_freq=50,
                     norm_obs=True, actor_hidden_dims=(512, 256, 128), critic_hidden_dims=(512, 256, 128))
PAPER_BATCH_SIZE = 8192
CRASH_AFTER_UPDATES = 20  # --debug-crash


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or process starts."""


class ProcessFailed(RuntimeError):
    """A learner process failed or died; the message holds its traceback (or its exit code)."""


# =====================================================================================================================
# Argument resolution: presets, devices, validation (all before any env or process starts)
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


def resolve_device(flag: str, value: Optional[str], default: str) -> str:
    """A device string checked against this machine ('cuda' becomes 'cuda:0'); raises ArgsError naming the flag."""
    try:
        device = torch.device(value if value is not None else default)
    except RuntimeError as e:
        raise ArgsError(f"{flag} {value!r} is not a device (use cpu, cuda or cuda:N): {e}") from e
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ArgsError(f"{flag} {value!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise ArgsError(f"{flag} {device}: CUDA is not available on this machine; use cpu")
    index = device.index if device.index is not None else 0
    if index >= torch.cuda.device_count():
        raise ArgsError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


def resolve_args(args: Args) -> Args:
    """Fills presets, devices and derived sizes into a copy of `args` and validates it. Raises ArgsError."""
    a = Args(**{**asdict(args), "toy": ToyChainContinuousConfig(**asdict(args.toy))})
    if a.env_id == "ToyChain-v0":
        raise ArgsError("--env-id ToyChain-v0 has discrete actions; PQL (DDPG) needs continuous ones: use "
                        "--env-id ToyChainContinuous-v0, the same chain with actions in [-1, 1]^d")
    is_toy = a.env_id == TOY_ENV_ID
    if not is_toy and not is_maniskill_env(a.env_id):
        raise ArgsError(f"--env-id {a.env_id!r} is not {TOY_ENV_ID} or a registered ManiSkill3 task "
                        f"(e.g. PickCube-v1, PushCube-v1, StackCube-v1)")

    default_device = "cuda" if a.cuda and torch.cuda.is_available() else "cpu"
    a.actor_device = resolve_device("--actor-device", a.actor_device, default_device)
    a.v_learner_device = resolve_device("--v-learner-device", a.v_learner_device, a.actor_device)
    a.p_learner_device = resolve_device("--p-learner-device", a.p_learner_device, a.actor_device)
    if is_toy:
        backend = "torch"
    elif a.sim_backend == "auto":
        backend = "physx_cuda" if a.actor_device.startswith("cuda") else "physx_cpu"
    else:
        backend = a.sim_backend
    if backend == "physx_cuda" and not a.actor_device.startswith("cuda"):
        raise ArgsError("--sim-backend physx_cuda simulates on the Actor's GPU: it needs --actor-device cuda[:N] "
                        "(or use --sim-backend physx_cpu)")
    a.resolved_sim_backend = backend

    preset = TOY_PRESET if is_toy else (MANISKILL_GPU if backend == "physx_cuda" else MANISKILL_CPU)
    for name, value in preset.items():
        if getattr(a, name) is None:
            setattr(a, name, value)

    if is_toy:
        if a.horizon is not None:
            raise ArgsError("--horizon is for ManiSkill tasks; set the toy chain's horizon with --toy.horizon")
        try:
            a.toy.validate()
        except ValueError as e:
            raise ArgsError(str(e)) from e
        a.resolved_horizon = a.toy.horizon
        if a.capture_video:
            raise ArgsError("--capture-video: ToyChainContinuous-v0 has no renderer")
    else:
        if a.horizon is None:
            a.horizon = gym.spec(a.env_id).max_episode_steps
        if a.horizon is None or a.horizon < 1:
            raise ArgsError(f"--horizon: {a.env_id} has no registered max_episode_steps; pass --horizon H")
        a.resolved_horizon = a.horizon

    for name in ("num_envs", "num_eval_envs", "batch_size", "buffer_size", "nstep", "eval_freq", "log_freq"):
        if getattr(a, name) < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.num_threads is not None and a.num_threads < 1:
        raise ArgsError(f"--num-threads must be >= 1, got {a.num_threads}")
    if a.warm_up_steps < 0:
        raise ArgsError(f"--warm-up-steps must be >= 0, got {a.warm_up_steps}")
    if not 0.0 < a.gamma <= 1.0:
        raise ArgsError(f"--gamma must be in (0, 1], got {a.gamma}")
    if not 0.0 < a.tau <= 1.0:
        raise ArgsError(f"--tau must be in (0, 1], got {a.tau}")
    for name in ("beta_a_v", "beta_p_v", "learning_rate", "max_grad_norm", "reward_scale"):
        if not getattr(a, name) > 0.0:
            raise ArgsError(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if not 0.0 <= a.sigma_min <= a.sigma_max:
        raise ArgsError(f"need 0 <= --sigma-min <= --sigma-max, got {a.sigma_min} and {a.sigma_max}")
    if a.target_noise_std < 0.0 or a.target_noise_clip < 0.0:
        raise ArgsError("--target-noise-std and --target-noise-clip must be >= 0")
    if not a.actor_hidden_dims or not a.critic_hidden_dims or min(a.actor_hidden_dims + a.critic_hidden_dims) < 1:
        raise ArgsError("--actor-hidden-dims and --critic-hidden-dims need at least one layer, each of size >= 1")
    if a.distributional:
        if a.num_atoms < 2:
            raise ArgsError(f"--num-atoms must be >= 2 with --distributional, got {a.num_atoms}")
        if not a.v_min < a.v_max:
            raise ArgsError(f"--v-min ({a.v_min}) must be below --v-max ({a.v_max})")
    if a.max_time is not None and a.max_time <= 0:
        raise ArgsError(f"--max-time must be > 0 seconds, got {a.max_time}")
    if a.num_eval_steps is None:
        a.num_eval_steps = a.resolved_horizon
    if a.num_eval_steps < 1:
        raise ArgsError(f"--num-eval-steps must be >= 1, got {a.num_eval_steps}")
    a.num_actor_steps = a.total_timesteps // a.num_envs
    if not a.evaluate and a.num_actor_steps <= a.warm_up_steps + a.nstep:
        raise ArgsError(
            f"--total-timesteps {a.total_timesteps} gives {a.num_actor_steps} Actor steps of {a.num_envs} envs, "
            f"not more than --warm-up-steps ({a.warm_up_steps}) + --nstep ({a.nstep}): nothing would be learned"
        )
    if a.debug_crash is not None and a.sequential:
        raise ArgsError("--debug-crash makes a learner *process* fail; --sequential has none")
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
def _make_maniskill_env(env_id: str, num_envs: int, backend: str, horizon: int, control_mode: Optional[str],
                        video_dir: Optional[str]):
    """A state-observation ManiSkill env (flat action space; episode videos into video_dir when given)."""
    import mani_skill.envs  # noqa: F401  (registers the tasks in this process)
    from mani_skill.utils.wrappers.record import RecordEpisode

    kwargs = dict(num_envs=num_envs, obs_mode="state", sim_backend=backend, max_episode_steps=horizon,
                  render_mode="rgb_array" if video_dir else None)
    if control_mode:
        kwargs["control_mode"] = control_mode
    env = gym.make(env_id, **kwargs)
    if isinstance(env.action_space, gym.spaces.Dict):
        from mani_skill.utils.wrappers.flatten import FlattenActionSpaceWrapper
        env = FlattenActionSpaceWrapper(env)
    if video_dir:
        env = RecordEpisode(env, video_dir, save_trajectory=False, max_steps_per_video=horizon, video_fps=30)
    return env


def _make_maniskill_cpu_env(env_id: str, horizon: int, control_mode: Optional[str], video_dir: Optional[str]):
    """One physx_cpu ManiSkill env for a worker process, with numpy outputs (ManiSkill's CPUGymWrapper)."""
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    return CPUGymWrapper(_make_maniskill_env(env_id, 1, "physx_cpu", horizon, control_mode, video_dir))


class ManiSkillVecEnv(gym.vector.VectorEnv):
    """A ManiSkill3 task as a *same-step* autoreset vector env of torch tensors on `device`.

    physx_cuda: one batched ManiSkill env in this process (thousands of envs on the GPU).
    physx_cpu:  one ManiSkill env per worker process: Gymnasium AsyncVectorEnv over CPUGymWrapper, autoreset off.
    This class decides the resets: every truncated env (its horizon ended) and, with reset_on_termination, every
    terminated one (training). Evaluation envs keep running after a termination (success), so each evaluation
    episode lasts H steps (ManiSkill's evaluation protocol). info["final_obs"] holds the true last observation
    where info["_final_obs"] (the envs reset in this step); info["success"] is the task's success flag of this
    step, before any reset.
    """

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, env_id: str, num_envs: int, horizon: int, backend: str, device: torch.device,
                 reset_on_termination: bool, control_mode: Optional[str] = None, video_dir: Optional[str] = None):
        self.num_envs, self.device, self.reset_on_termination = num_envs, device, reset_on_termination
        self.gpu = backend == "physx_cuda"
        if self.gpu:
            env = _make_maniskill_env(env_id, num_envs, "physx_cuda", horizon, control_mode, video_dir)
            self.env = env
            self.single_observation_space = env.unwrapped.single_observation_space
            self.single_action_space = env.unwrapped.single_action_space
        else:
            fns = [partial(_make_maniskill_cpu_env, env_id, horizon, control_mode,
                           os.path.join(video_dir, f"env{i}") if video_dir else None) for i in range(num_envs)]
            # forkserver: the workers do not inherit this process's torch threads; autoreset is done here instead.
            self.env = gym.vector.AsyncVectorEnv(fns, context="forkserver",
                                                 autoreset_mode=gym.vector.AutoresetMode.DISABLED)
            self.single_observation_space = self.env.single_observation_space
            self.single_action_space = self.env.single_action_space
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def _tensor(self, x, dtype) -> torch.Tensor:
        return torch.as_tensor(x if torch.is_tensor(x) else np.asarray(x), device=self.device, dtype=dtype)

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        mask = None if options is None else options.get("reset_mask")
        if mask is None:
            obs, _ = self.env.reset(seed=seed)
        elif self.gpu:
            obs, _ = self.env.reset(options={"env_idx": torch.as_tensor(mask, device=self.device).nonzero()[:, 0]})
        else:
            obs, _ = self.env.reset(options={"reset_mask": torch.as_tensor(mask).cpu().numpy().astype(bool)})
        return self._tensor(obs, torch.float32).reshape(self.num_envs, -1), {}

    def step(self, actions: torch.Tensor):
        if self.gpu:
            obs, reward, terminated, truncated, info = self.env.step(actions)
        else:
            obs, reward, terminated, truncated, info = self.env.step(actions.cpu().numpy())
        obs = self._tensor(obs, torch.float32).reshape(self.num_envs, -1)
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
        return obs, reward, terminated, truncated, {"success": success, "final_obs": final_obs, "_final_obs": reset_now}

    def close_extras(self, **kwargs):
        self.env.close()


def make_env(args: Args, num_envs: int, device: torch.device, evaluation: bool, video_dir: Optional[str] = None):
    """ToyChainContinuous-v0 (torch, on `device`) or a ManiSkill3 task (same-step autoreset, tensors on `device`)."""
    if args.env_id == TOY_ENV_ID:
        return gym.make_vec(TOY_ENV_ID, num_envs=num_envs, config=args.toy, device=device)
    return ManiSkillVecEnv(args.env_id, num_envs, args.resolved_horizon, args.resolved_sim_backend, device,
                           reset_on_termination=not evaluation, control_mode=args.control_mode, video_dir=video_dir)


def is_next_step(envs) -> bool:
    return envs.metadata.get("autoreset_mode") == gym.vector.AutoresetMode.NEXT_STEP


# =====================================================================================================================
# Pure functions the algorithm relies on (importable, tested in tests/test_pql.py)
# =====================================================================================================================
def mixed_exploration_sigmas(num_envs: int, sigma_min: float, sigma_max: float, device=None) -> torch.Tensor:
    """Sec. 3.3, mixed exploration: env i of N explores with noise std
    sigma_i = sigma_min + (i - 1) / (N - 1) * (sigma_max - sigma_min), i = 1..N (sigma_min when N = 1)."""
    return torch.linspace(sigma_min, sigma_max, num_envs, device=device)


def explore(action: torch.Tensor, sigmas: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sec. 3.3: a_t = clip(pi(s_t) + N(0, sigma_i^2), -1, 1), env i's noise std sigma_i (sigmas: (N,))."""
    noise = torch.randn(action.shape, device=action.device, generator=generator) * sigmas[:, None]
    return (action + noise).clamp(-1.0, 1.0)


def nstep_targets(rewards: torch.Tensor, terminations: torch.Tensor, dones: torch.Tensor, gamma: float):
    """n-step return of a window of n consecutive steps t..t+n-1 of N envs (tensors of shape (n, N)).

    The window is cut at the first episode end (dones = terminated | truncated): with m = 1 + the index of the first
    end (m = n if none),
        return   = sum_{k < m} gamma^k r_{t+k}
        discount = 0 if step t+m-1 terminated, else gamma^m   (a truncation bootstraps: it is a time limit)
        last     = m - 1, the step whose true next observation is bootstrapped from:
    target = return + discount * Q'(s_{t+m}, pi(s_{t+m})). Returns (returns, discounts, last), each of shape (N,).
    """
    n = rewards.shape[0]
    done = dones.to(rewards.dtype)
    ended_before = (torch.cumsum(done, 0) - done) > 0  # an episode end happened at an earlier step of the window
    alive = (~ended_before).to(rewards.dtype)
    powers = gamma ** torch.arange(n, device=rewards.device, dtype=rewards.dtype)
    returns = (rewards * alive * powers[:, None]).sum(0)
    m = alive.sum(0).long()
    last = m - 1
    terminated_last = terminations.gather(0, last[None])[0]
    discounts = torch.where(terminated_last, torch.zeros_like(returns), gamma ** m.to(rewards.dtype))
    return returns, discounts, last


class NStepAssembler:
    """Builds n-step transitions of N parallel envs from a sliding window of their last n steps (Sec. 3, n-step
    returns; Table B.1: n = 3), as the Actor does before it sends them (Alg. 1).

    push() takes one vector step: the observation s_t, action a_t, (scaled) reward r_t, the terminated / truncated
    flags, the *true* next observation (info["final_obs"] where a same-step env reset) and `valid` (False for
    next-step mode's stale reset step, whose action the env ignores). Once the window holds n steps it returns the
    transitions that start n - 1 steps earlier: dict(obs, action, reward (the n-step return), next_obs, discount,
    valid), each with a leading dimension N; before that it returns None.
    """

    def __init__(self, nstep: int, gamma: float):
        self.nstep, self.gamma = nstep, gamma
        self.window: deque = deque()

    def push(self, obs, action, reward, terminated, truncated, next_obs, valid) -> Optional[dict]:
        self.window.append((obs, action, reward, terminated, terminated | truncated, next_obs, valid))
        if len(self.window) < self.nstep:
            return None
        obs0, action0, *_, valid0 = self.window[0]
        rewards, terminations, dones, next_obs_all = (torch.stack([w[k] for w in self.window]) for k in (2, 3, 4, 5))
        returns, discounts, last = nstep_targets(rewards, terminations, dones, self.gamma)
        bootstrap_obs = next_obs_all[last, torch.arange(last.shape[0], device=last.device)]
        self.window.popleft()
        return dict(obs=obs0, action=action0, reward=returns, next_obs=bootstrap_obs, discount=discounts, valid=valid0)


def categorical_projection(probs: torch.Tensor, returns: torch.Tensor, discounts: torch.Tensor,
                           support: torch.Tensor) -> torch.Tensor:
    """C51 projection (Bellemare et al. 2017, Alg. 1; PQL-D, App. C): the distribution of returns + discount * Z, with
    Z ~ `probs` (B, K) on the fixed `support` (K,), projected back onto the support. Atoms shifted past the ends are
    clamped to them; each shifted atom's mass is split between its two neighbouring atoms in proportion to closeness."""
    v_min, v_max, num_atoms = support[0], support[-1], support.shape[0]
    delta = (v_max - v_min) / (num_atoms - 1)
    shifted = (returns[:, None] + discounts[:, None] * support[None, :]).clamp(v_min, v_max)
    position = (shifted - v_min) / delta  # fractional atom index in [0, K - 1]
    lower, upper = position.floor(), position.ceil()
    upper_weight = position - lower
    lower_weight = 1.0 - upper_weight  # 1 where position is an exact atom (lower == upper)
    projected = torch.zeros_like(probs)
    projected.scatter_add_(1, lower.long().clamp(0, num_atoms - 1), probs * lower_weight)
    projected.scatter_add_(1, upper.long().clamp(0, num_atoms - 1), probs * upper_weight)
    return projected


@torch.no_grad()
def soft_update_(target: nn.Module, source: nn.Module, tau: float) -> None:
    """target <- (1 - tau) * target + tau * source, parameter-wise (Table B.1: tau = 0.05 after every V-update)."""
    target_params, source_params = list(target.parameters()), list(source.parameters())
    torch._foreach_mul_(target_params, 1.0 - tau)
    torch._foreach_add_(target_params, source_params, alpha=tau)


# Speed-ratio control (Sec. 3.2). With k_v = 1 / beta_a:v V-updates per Actor step and k_p = 1 / beta_p:v V-updates
# per P-update, the process that is ahead waits: the Actor may be up to two steps ahead of the V-learner's updates (so
# that it simulates step A + 1 while the V-learner trains on step A), the V-learner may use only the data's update
# budget k_v * A and be at most two P-updates ahead of the P-learner, and the P-learner never gets ahead of the
# V-learner. Together this can never deadlock, and the measured ratios stay within a few updates of the targets.
RATIO_EPS = 1e-9


def actor_may_step(actor_steps: int, v_updates: int, beta_a_v: float) -> bool:
    """May the Actor take learning step A + 1 (A = actor_steps taken since learning started)?"""
    k_v = 1.0 / beta_a_v
    return k_v * (actor_steps + 1) <= v_updates + 2.0 * max(k_v, 1.0) + RATIO_EPS


def v_may_update(v_updates: int, actor_steps: int, p_updates: int, beta_a_v: float, beta_p_v: float) -> bool:
    """May the V-learner do update V + 1: within the data's budget k_v * A, and not too far ahead of the P-learner?"""
    k_v, k_p = 1.0 / beta_a_v, 1.0 / beta_p_v
    return (v_updates + 1 <= k_v * actor_steps + RATIO_EPS
            and v_updates + 1 <= k_p * p_updates + 2.0 * max(k_p, 1.0) + RATIO_EPS)


def p_may_update(p_updates: int, v_updates: int, beta_p_v: float) -> bool:
    """May the P-learner do update P + 1 (it needs k_p * (P + 1) V-updates done)?"""
    return (p_updates + 1) / beta_p_v <= v_updates + RATIO_EPS


def scale_action(action: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Maps the policy's action in [-1, 1] to the env's box [low, high]."""
    return low + (action + 1.0) * 0.5 * (high - low)


class RunningMeanStd:
    """Running mean and variance of observations (parallel-variance update of Chan et al.); Table B.1's
    "Normalized Observations", kept by the Actor and shared with both learners."""

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

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = (state[k].to(self.mean.device) for k in ("mean", "var", "count"))


def normalize_obs(obs: torch.Tensor, mean: Optional[torch.Tensor], var: Optional[torch.Tensor]) -> torch.Tensor:
    """(obs - mean) / sqrt(var + 1e-8), clipped to [-5, 5]; the same in all three processes (None: unnormalized)."""
    if mean is None:
        return obs
    return ((obs - mean) / torch.sqrt(var + 1e-8)).clamp(-5.0, 5.0)


class ReplayBuffer:
    """A ring buffer of preallocated tensors on one device, sampled uniformly (Sec. 3.1: each learner keeps its own,
    on its GPU when it fits). `spec` maps field names to (shape, dtype) of one entry."""

    def __init__(self, capacity: int, spec: dict, device: torch.device):
        self.capacity, self.device, self.pos, self.size = capacity, device, 0, 0
        self.data = {k: torch.empty((capacity, *shape), dtype=dtype, device=device) for k, (shape, dtype) in spec.items()}

    def add(self, batch: dict) -> None:
        n = next(iter(batch.values())).shape[0]
        if n > self.capacity:  # keep the newest `capacity` entries
            batch, n = {k: v[-self.capacity:] for k, v in batch.items()}, self.capacity
        first = min(n, self.capacity - self.pos)
        for k, buf in self.data.items():
            buf[self.pos:self.pos + first] = batch[k][:first]
            if first < n:
                buf[:n - first] = batch[k][first:]
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict:
        index = torch.randint(self.size, (batch_size,), device=self.device, generator=generator)
        return {k: v[index] for k, v in self.data.items()}


# =====================================================================================================================
# Networks
# =====================================================================================================================
def mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers with ELU between them (the original code's MLPNet: no normalization, PyTorch's default init)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ELU())
    return nn.Sequential(*layers)


class Policy(nn.Module):
    """Deterministic policy pi(s) = tanh(MLP(s)) in [-1, 1]^d (DDPG)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        self.net = mlp([obs_dim, *hidden, act_dim])

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(obs))


class Critic(nn.Module):
    """Two Q functions Q1, Q2 (double Q), MLPs on [s, a]. With num_atoms > 1 (PQL-D, App. C) each outputs the logits
    of a categorical distribution over the fixed support linspace(v_min, v_max, num_atoms)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...], num_atoms: int = 1,
                 v_min: float = -10.0, v_max: float = 10.0):
        super().__init__()
        self.distributional = num_atoms > 1
        self.q1 = mlp([obs_dim + act_dim, *hidden, num_atoms])
        self.q2 = mlp([obs_dim + act_dim, *hidden, num_atoms])
        self.register_buffer("support", torch.linspace(v_min, v_max, num_atoms) if self.distributional else torch.zeros(1))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw outputs of both heads: Q values (B, 1), or logits (B, num_atoms) with PQL-D."""
        x = torch.cat([obs, action], dim=-1)
        return self.q1(x), self.q2(x)

    def q_values(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q1(s, a), Q2(s, a) of shape (B,) (the means of the distributions with PQL-D)."""
        out1, out2 = self(obs, action)
        if self.distributional:
            return (out1.softmax(-1) * self.support).sum(-1), (out2.softmax(-1) * self.support).sum(-1)
        return out1[:, 0], out2[:, 0]


def build_networks(args: Args, obs_dim: int, act_dim: int) -> tuple[Policy, Critic]:
    policy = Policy(obs_dim, act_dim, args.actor_hidden_dims)
    critic = Critic(obs_dim, act_dim, args.critic_hidden_dims, args.num_atoms if args.distributional else 1,
                    args.v_min, args.v_max)
    return policy, critic


# =====================================================================================================================
# The learners (Alg. 2, Alg. 3): the same classes run in their own processes or, with --sequential, in this one
# =====================================================================================================================
class VLearner:
    """Sec. 3.1 V-learner: a local replay buffer of n-step transitions, Q1, Q2 with target networks, and a lagged copy
    of the policy that plays the target policy (Sec. 3.2, third point: no separate target policy)."""

    def __init__(self, args: Args, obs_dim: int, act_dim: int, capacity: int, device: torch.device, seed: int,
                 state: dict):
        self.args, self.device = args, device
        self.policy, self.critic = (net.to(device) for net in build_networks(args, obs_dim, act_dim))
        self.policy.load_state_dict(state["policy"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target = copy.deepcopy(self.critic)
        if state.get("critic_target") is not None:
            self.critic_target.load_state_dict(state["critic_target"])
        for p in list(self.policy.parameters()) + list(self.critic_target.parameters()):
            p.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.critic.parameters(), lr=args.learning_rate)
        if state.get("critic_optimizer") is not None:
            self.optimizer.load_state_dict(state["critic_optimizer"])
        f32 = torch.float32
        self.buffer = ReplayBuffer(capacity, {"obs": ((obs_dim,), f32), "action": ((act_dim,), f32),
                                              "reward": ((), f32), "next_obs": ((obs_dim,), f32),
                                              "discount": ((), f32)}, device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.obs_mean = self.obs_var = None

    def ingest(self, batch: dict) -> None:
        """Stores the valid transitions of one Actor step (Alg. 3: "B = B u {s_t, a_t, r_t, s_t+1}")."""
        valid = batch["valid"]
        self.buffer.add({k: batch[k][valid] for k in self.buffer.data})

    def set_policy(self, flat: torch.Tensor) -> None:
        vector_to_parameters(flat.to(self.device), self.policy.parameters())

    def set_obs_stats(self, flat: Optional[torch.Tensor]) -> None:
        if flat is not None:
            self.obs_mean, self.obs_var = flat.to(self.device).chunk(2)

    def critic_vector(self) -> torch.Tensor:
        return parameters_to_vector(self.critic.parameters()).detach()

    @torch.no_grad()
    def target(self, returns: torch.Tensor, discounts: torch.Tensor, next_obs: torch.Tensor) -> torch.Tensor:
        """The n-step double-Q target y = R + discount * min(Q1', Q2')(s', pi^v(s') + clip(noise)) (target networks
        Q', the lagged policy pi^v); with PQL-D the projected target distribution (B, num_atoms)."""
        a = self.args
        next_action = self.policy(next_obs)  # the lagged policy pi^v, synced from the P-learner once per step
        noise = (torch.randn(next_action.shape, device=self.device, generator=self.generator)
                 * a.target_noise_std).clamp(-a.target_noise_clip, a.target_noise_clip)
        next_action = (next_action + noise).clamp(-1.0, 1.0)
        if self.critic.distributional:
            logits1, logits2 = self.critic_target(next_obs, next_action)
            probs1, probs2 = logits1.softmax(-1), logits2.softmax(-1)
            support = self.critic.support
            lower_is_1 = (probs1 * support).sum(-1) <= (probs2 * support).sum(-1)
            # double Q for distributions: the whole distribution of the head with the lower mean (as FastTD3; the
            # original code's elementwise min of the two probability vectors does not sum to 1)
            next_probs = torch.where(lower_is_1[:, None], probs1, probs2)
            return categorical_projection(next_probs, returns, discounts, support)
        q1_next, q2_next = self.critic_target.q_values(next_obs, next_action)
        return returns + discounts * torch.min(q1_next, q2_next)

    def update(self) -> torch.Tensor:
        """One update of Q1, Q2 on a sampled batch (Alg. 3), then the soft update of their targets. Returns the loss."""
        a = self.args
        batch = self.buffer.sample(a.batch_size, self.generator)
        obs = normalize_obs(batch["obs"], self.obs_mean, self.obs_var)
        target = self.target(batch["reward"], batch["discount"], normalize_obs(batch["next_obs"], self.obs_mean, self.obs_var))
        out1, out2 = self.critic(obs, batch["action"])
        if self.critic.distributional:  # cross-entropy to the projected target distribution, for both heads
            loss = -(target * out1.log_softmax(-1)).sum(-1).mean() - (target * out2.log_softmax(-1)).sum(-1).mean()
        else:
            loss = F.mse_loss(out1[:, 0], target) + F.mse_loss(out2[:, 0], target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.critic.parameters(), a.max_grad_norm)
        self.optimizer.step()
        soft_update_(self.critic_target, self.critic, a.tau)
        return loss.detach()

    def state_dict(self) -> dict:
        cpu = lambda sd: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in sd.items()}  # noqa: E731
        return {"critic": cpu(self.critic.state_dict()), "critic_target": cpu(self.critic_target.state_dict()),
                "critic_optimizer": optimizer_state_to_cpu(self.optimizer)}


class PLearner:
    """Sec. 3.1 P-learner: a local buffer of states, the policy, and a copy of Q1, Q2 synced from the V-learner;
    updates the policy to maximize min(Q1, Q2)(s, pi(s)) (Alg. 2)."""

    def __init__(self, args: Args, obs_dim: int, act_dim: int, capacity: int, device: torch.device, seed: int,
                 state: dict):
        self.args, self.device = args, device
        self.policy, self.critic = (net.to(device) for net in build_networks(args, obs_dim, act_dim))
        self.policy.load_state_dict(state["policy"])
        self.critic.load_state_dict(state["critic"])
        for p in self.critic.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=args.learning_rate)
        if state.get("policy_optimizer") is not None:
            self.optimizer.load_state_dict(state["policy_optimizer"])
        self.buffer = ReplayBuffer(capacity, {"obs": ((obs_dim,), torch.float32)}, device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.obs_mean = self.obs_var = None

    def ingest(self, batch: dict) -> None:
        """Stores the valid states of one Actor step (Alg. 2: "B = B u {s_t}")."""
        self.buffer.add({"obs": batch["obs"][batch["valid"]]})

    def set_critic(self, flat: torch.Tensor) -> None:
        vector_to_parameters(flat.to(self.device), self.critic.parameters())

    def set_obs_stats(self, flat: Optional[torch.Tensor]) -> None:
        if flat is not None:
            self.obs_mean, self.obs_var = flat.to(self.device).chunk(2)

    def policy_vector(self) -> torch.Tensor:
        return parameters_to_vector(self.policy.parameters()).detach()

    def update(self) -> torch.Tensor:
        """One policy update: maximize min_i Q_i(s, pi(s)) over a batch of states (Alg. 2). Returns the loss."""
        obs = normalize_obs(self.buffer.sample(self.args.batch_size, self.generator)["obs"], self.obs_mean, self.obs_var)
        q1, q2 = self.critic.q_values(obs, self.policy(obs))
        loss = -torch.min(q1, q2).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.policy.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        return loss.detach()

    def state_dict(self) -> dict:
        return {"policy": {k: v.detach().cpu() for k, v in self.policy.state_dict().items()},
                "policy_optimizer": optimizer_state_to_cpu(self.optimizer)}


def optimizer_state_to_cpu(optimizer: torch.optim.Optimizer) -> dict:
    state = optimizer.state_dict()
    state["state"] = {k: {n: v.detach().cpu() if torch.is_tensor(v) else v for n, v in s.items()}
                      for k, s in state["state"].items()}
    return state


# =====================================================================================================================
# Moving data and networks between the processes (Sec. 3.1: "Data Transfer", "Network Transfer")
# =====================================================================================================================
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_shared(shape, dtype, device: torch.device) -> torch.Tensor:
    """A tensor other processes can use: shared memory on the CPU; CUDA memory (shared through CUDA IPC) on a GPU."""
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    return tensor.share_memory_() if device.type == "cpu" else tensor


class Mailbox:
    """Batches from the Actor to one learner, through a ring of `num_slots` preallocated slots in shared memory (CPU)
    or CUDA IPC memory on the learner's device: the Actor copies each batch into a free slot and counts it as
    written; the learner copies new slots into its replay buffer and counts them as read. Nothing is pickled.
    The Actor waits (a full ring) only when the learner falls `num_slots` batches behind."""

    def __init__(self, ctx, spec: dict, batch: int, num_slots: int, device: torch.device):
        self.device, self.num_slots = device, num_slots
        self.slots = {k: make_shared((num_slots, batch, *shape), dtype, device) for k, (shape, dtype) in spec.items()}
        self.written = ctx.Value("q", 0)
        self.read = ctx.Value("q", 0)

    def has_room(self) -> bool:
        return self.written.value - self.read.value < self.num_slots

    def put(self, batch: dict) -> None:
        """Producer side (call only when has_room())."""
        index = self.written.value % self.num_slots
        for k, slot in self.slots.items():
            slot[index].copy_(batch[k])
        synchronize(self.device)  # the data is in place before the learner can see the slot
        for source in {v.device for v in batch.values()}:
            synchronize(source)
        self.written.value += 1

    def take(self, consume: Callable[[dict], None]) -> int:
        """Consumer side: passes every new slot to `consume` (which must copy what it keeps), then frees them."""
        read, written = self.read.value, self.written.value
        for i in range(read, written):
            consume({k: slot[i % self.num_slots] for k, slot in self.slots.items()})
        if written > read:
            synchronize(self.device)  # finished reading before the Actor may overwrite the slots
            self.read.value = written
        return written - read


class ParamBoard:
    """The latest published version of a flat vector (a network's parameters, or the normalizer's statistics): one
    process publishes, others fetch when the version changed. A lock makes every fetch see one whole version.
    `on_wait` (the Actor's liveness check) is called every second while the lock is busy: a process killed while it
    held the lock must not hang the Actor."""

    def __init__(self, ctx, numel: int, device: torch.device):
        self.device = device
        self.flat = make_shared((numel,), torch.float32, device)
        self.version = ctx.Value("q", 0)  # its lock (recursive) guards `flat` too

    def _acquire(self, on_wait: Optional[Callable[[], None]]) -> None:
        lock = self.version.get_lock()
        while not lock.acquire(timeout=1.0):
            if on_wait is not None:
                on_wait()

    def publish(self, vector: torch.Tensor, on_wait: Optional[Callable[[], None]] = None) -> None:
        self._acquire(on_wait)
        try:
            self.flat.copy_(vector)
            synchronize(self.device)
            synchronize(vector.device)
            self.version.value += 1
        finally:
            self.version.get_lock().release()

    def fetch(self, since: int, device: torch.device, on_wait: Optional[Callable[[], None]] = None
              ) -> tuple[int, Optional[torch.Tensor]]:
        """(version, a copy on `device`) if a version newer than `since` was published, else (since, None)."""
        if self.version.value == since:
            return since, None
        self._acquire(on_wait)
        try:
            out = self.flat.to(device, copy=True)
            synchronize(device)
            synchronize(self.device)
            return self.version.value, out
        finally:
            self.version.get_lock().release()


# Per-learner statistics, written by the learner into a shared float64 CPU tensor and read by the Actor for logging.
STAT_LOSS_SUM, STAT_LOSS_COUNT, STAT_WAIT_S, STAT_UPDATE_S, STAT_SYNCS = range(5)
POLL_MIN_S, POLL_MAX_S = 5e-5, 2e-3  # a waiting process sleeps between looks at the counters, longer as it waits


def poll_sleep(polls: int) -> None:
    """Sleep before look number `polls` of one wait: 50 us, doubling up to 2 ms (quick hand-over, little CPU)."""
    time.sleep(min(POLL_MAX_S, POLL_MIN_S * 2 ** min(polls, 10)))


class SharedState:
    """Everything the three processes share, created by the Actor before it starts the learners: the update counters
    of the ratio control (Sec. 3.2), the stop flag and error queue, the mailboxes (data) and boards (networks)."""

    def __init__(self, ctx, args: Args, obs_dim: int, act_dim: int, policy_numel: int, critic_numel: int):
        v_dev, p_dev, a_dev = (torch.device(d) for d in (args.v_learner_device, args.p_learner_device, args.actor_device))
        n, f32 = args.num_envs, torch.float32
        self.actor_steps = ctx.Value("q", 0)  # A: learning steps the Actor has sent
        self.v_updates = ctx.Value("q", 0)  # V
        self.p_updates = ctx.Value("q", 0)  # P
        self.stop = ctx.Event()
        self.errors = ctx.Queue()
        self.ckpt_request = ctx.Value("q", 0)
        self.ckpt_queue = ctx.Queue()
        self.v_mailbox = Mailbox(ctx, {"obs": ((obs_dim,), f32), "action": ((act_dim,), f32), "reward": ((), f32),
                                       "next_obs": ((obs_dim,), f32), "discount": ((), f32),
                                       "valid": ((), torch.bool)}, n, 4, v_dev)
        self.p_mailbox = Mailbox(ctx, {"obs": ((obs_dim,), f32), "valid": ((), torch.bool)}, n, 4, p_dev)
        self.policy_board = ParamBoard(ctx, policy_numel, p_dev)  # P-learner -> Actor, V-learner
        self.critic_board = ParamBoard(ctx, critic_numel, v_dev)  # V-learner -> P-learner
        self.obs_board = ParamBoard(ctx, 2 * obs_dim, a_dev)  # Actor's normalizer -> both learners
        self.v_stats = make_shared((5,), torch.float64, torch.device("cpu"))
        self.p_stats = make_shared((5,), torch.float64, torch.device("cpu"))


def learner_process(role: str, args: Args, obs_dim: int, act_dim: int, capacity: int, state: dict,
                    shared: SharedState, threads: int) -> None:
    """Entry point of the V-learner and P-learner processes. Any error is sent to the Actor with its traceback,
    and stops all three processes."""
    try:
        torch.set_num_threads(threads)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        device = torch.device(args.v_learner_device if role == "v_learner" else args.p_learner_device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        seed = args.seed + (1 if role == "v_learner" else 2)
        torch.manual_seed(seed)
        learner_cls = VLearner if role == "v_learner" else PLearner
        learner = learner_cls(args, obs_dim, act_dim, capacity, device, seed, state)
        run_learner_loop(role, learner, shared, args)
    except BaseException:  # noqa: B036 - report everything, including a KeyboardInterrupt during start-up
        shared.errors.put((role, traceback.format_exc()))
        shared.stop.set()
        sys.exit(1)


def run_learner_loop(role: str, learner, shared: SharedState, args: Args) -> None:
    """Alg. 2 / Alg. 3: take new data (and, with it, the newest networks), serve checkpoint requests, and update
    whenever the speed ratios allow it; otherwise wait. Ends when the Actor sets the stop flag or disappears."""
    is_v = role == "v_learner"
    mailbox = shared.v_mailbox if is_v else shared.p_mailbox
    stats = shared.v_stats if is_v else shared.p_stats
    parent = mp.parent_process()
    versions = {"net": 0, "obs": 0}
    loss_sum, loss_count, wait_s, update_s, syncs = torch.zeros((), device=learner.device), 0, 0.0, 0.0, 0
    flushed_count, served_requests, last_parent_check, polls = 0, 0, time.time(), 0

    def flush_stats() -> None:
        nonlocal flushed_count
        stats[STAT_LOSS_SUM] = loss_sum.item()
        stats[STAT_LOSS_COUNT], stats[STAT_WAIT_S], stats[STAT_UPDATE_S], stats[STAT_SYNCS] = \
            loss_count, wait_s, update_s, syncs
        flushed_count = loss_count

    while not shared.stop.is_set():
        now = time.time()
        if now - last_parent_check > 0.5:  # the Actor died without stopping us (e.g. SIGKILL): no orphans
            if parent is not None and not parent.is_alive():
                return
            last_parent_check = now
        # New data from the Actor (one batch per Actor step), then the newest networks (Alg. 2-3, "if new data
        # received"): the V-learner takes the policy and publishes its Q functions, the P-learner the other way round.
        if mailbox.take(learner.ingest):
            if is_v:
                versions["net"], flat = shared.policy_board.fetch(versions["net"], learner.device)
                if flat is not None:
                    learner.set_policy(flat)
                    syncs += 1
                shared.critic_board.publish(learner.critic_vector())
            else:
                versions["net"], flat = shared.critic_board.fetch(versions["net"], learner.device)
                if flat is not None:
                    learner.set_critic(flat)
                    syncs += 1
                shared.policy_board.publish(learner.policy_vector())
            if args.norm_obs:
                versions["obs"], flat = shared.obs_board.fetch(versions["obs"], learner.device)
                learner.set_obs_stats(flat)
            flush_stats()
        if shared.ckpt_request.value > served_requests:
            served_requests = shared.ckpt_request.value
            shared.ckpt_queue.put((role, learner.state_dict()))
        # An update if the speed ratios allow it (Sec. 3.2), else wait.
        A, V, P = shared.actor_steps.value, shared.v_updates.value, shared.p_updates.value
        allowed = v_may_update(V, A, P, args.beta_a_v, args.beta_p_v) if is_v else p_may_update(P, V, args.beta_p_v)
        if allowed and learner.buffer.size > 0:
            polls = 0
            start = time.time()
            loss_sum += learner.update()
            loss_count += 1
            update_s += time.time() - start
            (shared.v_updates if is_v else shared.p_updates).value += 1
            if args.debug_crash == role and loss_count >= CRASH_AFTER_UPDATES:
                raise RuntimeError(f"--debug-crash {role}: the {role} fails on purpose after {loss_count} updates")
        else:
            if loss_count > flushed_count:
                flush_stats()
            poll_sleep(polls)
            polls += 1
            wait_s += time.time() - now


class ParallelLearners:
    """The V-learner and the P-learner as two torch.multiprocessing (spawn) processes, seen from the Actor."""

    def __init__(self, args: Args, obs_dim: int, act_dim: int, capacity: int, state: dict, threads: int,
                 policy: Policy, critic: Critic):
        self.args = args
        ctx = mp.get_context("spawn")
        self.shared = SharedState(ctx, args, obs_dim, act_dim, parameters_to_vector(policy.parameters()).numel(),
                                  parameters_to_vector(critic.parameters()).numel())
        self.policy_version = 0
        self.processes = {}
        # The learners ignore Ctrl-C (SIGINT reaches the whole process group): the Actor shuts them down in order.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for role in ("v_learner", "p_learner"):
                process = ctx.Process(target=learner_process, name=f"pql-{role}", daemon=True,
                                      args=(role, args, obs_dim, act_dim, capacity, state, self.shared, threads))
                process.start()
                self.processes[role] = process
        finally:
            signal.signal(signal.SIGINT, previous)
        for role, process in self.processes.items():
            device = args.v_learner_device if role == "v_learner" else args.p_learner_device
            print(f"{ROLE_NAMES[role]} started: pid {process.pid}, device {device}", flush=True)

    def check(self) -> None:
        """Raises ProcessFailed if a learner failed (its traceback) or died (its exit code)."""
        dead = [role for role, p in self.processes.items() if not p.is_alive()]
        if not self.shared.stop.is_set() and not dead:
            return
        self.shared.stop.set()
        try:
            role, trace = self.shared.errors.get(timeout=2.0)
        except queue.Empty:  # no traceback: the process was killed
            role, trace = (dead[0] if dead else "v_learner"), None
        if trace is not None:
            raise ProcessFailed(f"the {ROLE_NAMES[role]} process failed:\n{trace.rstrip()}")
        code = self.processes[role].exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        raise ProcessFailed(f"the {ROLE_NAMES[role]} process (pid {self.processes[role].pid}) died ({how}) "
                            f"without reporting an error")

    def wait_until(self, condition: Callable[[], bool], timeout: Optional[float] = None) -> float:
        """Sleeps until condition() holds, checking the learners; returns the seconds waited."""
        start = time.time()
        polls = 0
        while not condition():
            if polls % 20 == 19:
                self.check()
            if timeout is not None and time.time() - start > timeout:
                raise TimeoutError(f"the learners did not respond within {timeout:.0f} s")
            poll_sleep(polls)
            polls += 1
        return time.time() - start

    def wait_turn(self) -> float:
        """Sec. 3.2: the Actor waits while it is ahead of the V-learner by more than beta_a:v allows."""
        s = self.shared
        return self.wait_until(lambda: actor_may_step(s.actor_steps.value, s.v_updates.value, self.args.beta_a_v))

    def send(self, transitions: dict, obs_stats: Optional[torch.Tensor]) -> float:
        """Alg. 1: full transitions to the V-learner, states to the P-learner; the normalizer's statistics to both.
        Returns the seconds waited for a free slot."""
        if obs_stats is not None:
            self.shared.obs_board.publish(obs_stats, on_wait=self.check)
        waited = 0.0
        for box, fields in ((self.shared.v_mailbox, None), (self.shared.p_mailbox, ("obs", "valid"))):
            waited += self.wait_until(box.has_room)
            box.put(transitions if fields is None else {k: transitions[k] for k in fields})
        return waited

    def step_done(self) -> None:
        self.shared.actor_steps.value += 1

    def fetch_policy(self, policy: Policy) -> None:
        """Alg. 1: pi^a <- the P-learner's newest published policy."""
        self.policy_version, flat = self.shared.policy_board.fetch(self.policy_version, next(policy.parameters()).device,
                                                                  on_wait=self.check)
        if flat is not None:
            vector_to_parameters(flat, policy.parameters())

    def counts(self) -> tuple[int, int, int]:
        s = self.shared
        return s.actor_steps.value, s.v_updates.value, s.p_updates.value

    def stats(self) -> dict:
        return {"v_learner": self.shared.v_stats.tolist(), "p_learner": self.shared.p_stats.tolist()}

    def state_dicts(self, timeout: float = 120.0) -> dict:
        """Networks and optimizers of both learners, for a checkpoint (each learner answers between two updates)."""
        self.shared.ckpt_request.value += 1
        states: dict = {}
        start = time.time()
        while len(states) < 2:
            self.check()
            if time.time() - start > timeout:
                raise TimeoutError(f"the learners did not send their state for the checkpoint within {timeout:.0f} s")
            try:
                role, state = self.shared.ckpt_queue.get(timeout=0.2)
                states[role] = state
            except queue.Empty:
                continue
        return {**states["v_learner"], **states["p_learner"]}

    def drain(self, timeout: float = 600.0) -> None:
        """After the last Actor step: let the learners finish the updates that step paid for, so that the run does
        exactly 1/beta_a:v V-updates per Actor step (as --sequential does)."""
        a = self.args

        def finished() -> bool:
            A, V, P = self.counts()
            return not v_may_update(V, A, P, a.beta_a_v, a.beta_p_v) and not p_may_update(P, V, a.beta_p_v)

        self.wait_until(finished, timeout)

    def close(self) -> None:
        """Stops both learners: the stop flag, then terminate / kill whatever did not exit in time."""
        self.shared.stop.set()
        for process in self.processes.values():
            process.join(timeout=10.0)
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(timeout=3.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=3.0)
        for channel in (self.shared.errors, self.shared.ckpt_queue):
            channel.cancel_join_thread()
            channel.close()


class SequentialLearners:
    """--sequential, the DDPG(n) baseline (Sec. 4.1): the same V- and P-learner updates, in this process, one after
    another after every Actor step, in the same numbers (1/beta_a:v V-updates per step, beta_p:v P-updates per
    V-update) and with the same once-per-step network copies as the parallel scheme."""

    def __init__(self, args: Args, obs_dim: int, act_dim: int, capacity: int, state: dict):
        self.args = args
        v_device, p_device = torch.device(args.v_learner_device), torch.device(args.p_learner_device)
        self.v = VLearner(args, obs_dim, act_dim, capacity, v_device, args.seed + 1, state)
        self.p = PLearner(args, obs_dim, act_dim, capacity, p_device, args.seed + 2, state)
        self.A = self.V = self.P = 0
        self.loss = {"v_learner": [torch.zeros((), device=v_device), 0], "p_learner": [torch.zeros((), device=p_device), 0]}
        self.update_s = {"v_learner": 0.0, "p_learner": 0.0}

    def check(self) -> None:
        pass

    def wait_turn(self) -> float:
        return 0.0

    def send(self, transitions: dict, obs_stats: Optional[torch.Tensor]) -> float:
        self.v.ingest({k: v.to(self.v.device) for k, v in transitions.items()})
        self.p.ingest({k: transitions[k].to(self.p.device) for k in ("obs", "valid")})
        self.v.set_policy(self.p.policy_vector())  # the same once-per-step network copies as the parallel scheme
        self.p.set_critic(self.v.critic_vector())
        if obs_stats is not None:
            self.v.set_obs_stats(obs_stats)
            self.p.set_obs_stats(obs_stats)
        return 0.0

    def step_done(self) -> None:
        """One Actor step paid for k_v V-updates; P-updates follow the V-updates they depend on (Sec. 3.2 ratios)."""
        a = self.args
        self.A += 1
        while True:
            if p_may_update(self.P, self.V, a.beta_p_v):
                role, learner = "p_learner", self.p
                self.P += 1
            elif v_may_update(self.V, self.A, self.P, a.beta_a_v, a.beta_p_v):
                role, learner = "v_learner", self.v
                self.V += 1
            else:
                break
            start = time.time()
            self.loss[role][0] += learner.update()
            self.loss[role][1] += 1
            self.update_s[role] += time.time() - start

    def fetch_policy(self, policy: Policy) -> None:
        vector_to_parameters(self.p.policy_vector().to(next(policy.parameters()).device), policy.parameters())

    def counts(self) -> tuple[int, int, int]:
        return self.A, self.V, self.P

    def stats(self) -> dict:
        return {role: [self.loss[role][0].item(), self.loss[role][1], 0.0, self.update_s[role], self.A]
                for role in self.loss}

    def state_dicts(self, timeout: float = 0.0) -> dict:
        return {**self.v.state_dict(), **self.p.state_dict()}

    def drain(self, timeout: float = 0.0) -> None:
        pass

    def close(self) -> None:
        pass


ROLE_NAMES = {"v_learner": "V-learner", "p_learner": "P-learner"}


# =====================================================================================================================
# Logging, checkpoints, memory
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


def save_checkpoint(path: Path, learner_states: dict, obs_rms: Optional[RunningMeanStd], global_step: int,
                    actor_step: int, args: Args) -> None:
    """All networks and optimizers (policy and its optimizer from the P-learner; Q functions, their targets and
    optimizer from the V-learner), the normalizer, the step counters and RNG states. The replay buffers are not
    saved (up to 2 x 5M entries): a resumed run refills them. Written to a temporary file and renamed."""
    state = {
        **learner_states,
        "obs_rms": {k: v.cpu() for k, v in obs_rms.state_dict().items()} if obs_rms is not None else None,
        "global_step": global_step,
        "actor_step": actor_step,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "args": asdict(args),
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:  # also on Ctrl-C during the write
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(path: str, policy: Policy, critic: Critic, obs_rms: Optional[RunningMeanStd]) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own file: holds numpy RNG state
    try:
        policy.load_state_dict(state["policy"])
        critic.load_state_dict(state["critic"])
    except RuntimeError as e:
        saved = state.get("args", {})
        raise ArgsError(f"--checkpoint {path} does not fit these networks (it was trained on {saved.get('env_id')}"
                        f"{' with --distributional' if saved.get('distributional') else ''}); {e}") from e
    if obs_rms is not None and state["obs_rms"] is not None:
        obs_rms.load_state_dict(state["obs_rms"])
    return state


def restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def replay_capacity(args: Args, obs_dim: int, act_dim: int, buffer_size_given: bool) -> int:
    """Entries of each learner's replay buffer: --buffer-size (5M, Table B.1), but no more than the run can fill and
    no more than half of the free memory of each learner's device holds (both buffers counted where they share one).
    A default that does not fit shrinks with a message; an explicit --buffer-size that does not fit is an error."""
    fillable = args.num_actor_steps * args.num_envs
    capacity = min(args.buffer_size, fillable)
    bytes_v = 4 * (2 * obs_dim + act_dim + 2)  # obs, next_obs, action, reward, discount
    bytes_p = 4 * obs_dim
    need: dict[str, int] = {}
    need[args.v_learner_device] = need.get(args.v_learner_device, 0) + bytes_v
    need[args.p_learner_device] = need.get(args.p_learner_device, 0) + bytes_p
    for device, per_entry in need.items():
        budget = free_memory_bytes(torch.device(device)) // 2
        if capacity * per_entry > budget:
            fits = max(budget // per_entry, args.batch_size)
            if buffer_size_given:
                raise ArgsError(f"--buffer-size {args.buffer_size}: the replay buffer(s) on {device} need "
                                f"{capacity * per_entry / 2**30:.1f} GiB but half of its free memory is "
                                f"{budget / 2**30:.1f} GiB; use --buffer-size {fits} or less")
            print(f"note: the replay buffer(s) on {device} would need {capacity * per_entry / 2**30:.1f} GiB for "
                  f"{capacity:,} entries; half of its free memory holds {fits:,}, so the buffers are reduced to that "
                  f"(choose with --buffer-size)", flush=True)
            capacity = fits
    return capacity


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


# =====================================================================================================================
# Evaluation
# =====================================================================================================================
@torch.no_grad()
def evaluate(policy: Policy, eval_envs, normalize: Callable, num_steps: int, seed: int, device,
             act_low: torch.Tensor, act_high: torch.Tensor) -> dict:
    """The deterministic policy (no exploration noise), one episode per eval env: eval/return (unscaled),
    success_once (success at any step), success_at_end (at the last step) and episode_len, averaged over the
    episodes that ended within num_steps. ManiSkill eval envs keep running after a termination (H-step episodes)."""
    obs, _ = eval_envs.reset(seed=seed)
    n = eval_envs.num_envs
    zeros = lambda dtype: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
    ep_return, ep_len, success_once, finished = zeros(torch.float32), zeros(torch.long), zeros(torch.bool), zeros(torch.bool)
    ended: dict[str, list[torch.Tensor]] = {"return": [], "success_once": [], "success_at_end": [], "episode_len": []}
    next_step_mode = is_next_step(eval_envs)
    for _ in range(num_steps):
        action = scale_action(policy(normalize(obs)), act_low, act_high)
        obs, reward, terminated, truncated, info = eval_envs.step(action)
        reset_here = (terminated | truncated) if next_step_mode else info.get("_final_obs", zeros(torch.bool))
        live = ~finished
        ep_return += reward * live
        ep_len += live.long()
        success_once |= info["success"] & live
        end = live & (truncated | (terminated & reset_here))
        for key, value in (("return", ep_return), ("success_once", success_once),
                           ("success_at_end", info["success"]), ("episode_len", ep_len)):
            ended[key].append(value[end].float())
        finished |= end
        if bool(finished.all()):
            break
    ended_all = {k: torch.cat(v) for k, v in ended.items()}
    return {k: v.mean().item() for k, v in ended_all.items() if v.numel() > 0}


# =====================================================================================================================
# Main: the Actor process (Alg. 1)
# =====================================================================================================================
def default_threads(args: Args) -> int:
    if args.num_threads is not None:
        return args.num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores if args.sequential else max(1, cores // 3)


def raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(args: Args) -> dict:
    args = resolve_args(args)
    buffer_size_given = args.buffer_size != Args.buffer_size
    run_name, run_dir = make_run_dir(args)
    (run_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    threads = default_threads(args)
    torch.set_num_threads(threads)
    device = torch.device(args.actor_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threading_main():
        signal.signal(signal.SIGTERM, raise_keyboard_interrupt)  # `kill` shuts down as cleanly as Ctrl-C

    logger = Logger(run_dir, args, run_name)
    summary: dict = {"run_dir": str(run_dir), "global_step": 0, "interrupted": False,
                     "mode": "sequential" if args.sequential else "parallel"}
    envs = eval_envs = learners = None
    progress: dict = {"actor_step": 0, "global_step": 0}
    start_time = time.time()
    start_global_step = 0
    obs_rms = None
    try:
        video_dir = str(run_dir / "videos") if args.capture_video else None
        eval_envs = make_env(args, args.num_eval_envs, device, evaluation=True, video_dir=video_dir)
        obs_space, act_space = eval_envs.single_observation_space, eval_envs.single_action_space
        if not isinstance(act_space, gym.spaces.Box) or not np.all(np.isfinite(act_space.low)) \
                or not np.all(np.isfinite(act_space.high)):
            raise ArgsError(f"--env-id {args.env_id}: PQL (DDPG) needs a bounded continuous action space, got {act_space}")
        obs_dim, act_dim = int(np.prod(obs_space.shape)), int(np.prod(act_space.shape))
        policy, critic = build_networks(args, obs_dim, act_dim)  # the initial networks of all three processes
        obs_rms = RunningMeanStd((obs_dim,), device) if args.norm_obs else None
        ckpt = load_checkpoint(args.checkpoint, policy, critic, obs_rms) if args.checkpoint else None
        policy = policy.to(device)
        act_low = torch.as_tensor(act_space.low, dtype=torch.float32, device=device)
        act_high = torch.as_tensor(act_space.high, dtype=torch.float32, device=device)

        def normalize(raw: torch.Tensor) -> torch.Tensor:
            return normalize_obs(raw, obs_rms.mean, obs_rms.var) if obs_rms is not None else raw

        if ckpt is not None:
            progress.update(actor_step=ckpt["actor_step"], global_step=ckpt["global_step"])
            summary["global_step"] = start_global_step = ckpt["global_step"]
        if args.evaluate:
            metrics = evaluate(policy, eval_envs, normalize, args.num_eval_steps, args.seed, device, act_low, act_high)
            for k, v in metrics.items():
                logger.scalar(f"eval/{k}", v, progress["global_step"])
            print(" ".join(f"eval/{k}={v:.4f}" for k, v in metrics.items()))
            return summary

        envs = make_env(args, args.num_envs, device, evaluation=False)
        capacity = replay_capacity(args, obs_dim, act_dim, buffer_size_given)
        summary["buffer_size"] = capacity
        state = {"policy": policy.state_dict(), "critic": critic.state_dict()}
        if ckpt is not None:
            state = {k: ckpt.get(k) for k in ("policy", "critic", "critic_target", "critic_optimizer", "policy_optimizer")}
            restore_rng(ckpt["rng"])
            print(f"resuming from {args.checkpoint} at global step {progress['global_step']} (the replay buffers "
                  f"start empty: {args.warm_up_steps} warm-up steps with the loaded policy refill them)")
        state = {k: ({n: t.cpu() for n, t in v.items()} if k in ("policy", "critic") else v) for k, v in state.items()}
        if args.sequential:
            learners = SequentialLearners(args, obs_dim, act_dim, capacity, state)
        else:
            learners = ParallelLearners(args, obs_dim, act_dim, capacity, state, threads, policy, critic)
        start_time = time.time()
        train(args, envs, eval_envs, policy, obs_rms, normalize, learners, logger, run_dir, summary, progress,
              act_low, act_high, resumed=ckpt is not None)
    except KeyboardInterrupt:
        summary["interrupted"] = True
        print("interrupted: writing summary.json" + (" and a checkpoint" if args.save_model else ""), flush=True)
        if args.save_model and learners is not None and progress["actor_step"] > 0:
            try:
                save_checkpoint(run_dir / "final_ckpt.pt", learners.state_dicts(timeout=30.0), obs_rms,
                                progress["global_step"], progress["actor_step"], args)
            except (ProcessFailed, TimeoutError) as e:
                print(f"could not write the checkpoint: {e}", file=sys.stderr)
        raise
    except ProcessFailed as e:
        summary["failed"] = str(e).splitlines()[0]
        raise
    finally:
        wall = time.time() - start_time
        summary.update(global_step=progress["global_step"], actor_steps=progress["actor_step"], wall_time_s=wall,
                       sps=(progress["global_step"] - start_global_step) / max(wall, 1e-9))
        if learners is not None:
            summary.update(ratio_summary(args, learners))
        summary.update(logger.last)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        logger.close()
        if learners is not None:
            learners.close()
        for e in (envs, eval_envs):
            if e is not None:
                e.close()
    return summary


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def ratio_summary(args: Args, learners) -> dict:
    """Measured speed ratios over the whole run (Sec. 3.2): beta_a:v = A / V and beta_p:v = P / V."""
    A, V, P = learners.counts()
    out = {"pql/learning_steps": A, "pql/v_updates": V, "pql/p_updates": P,
           "pql/target_ratio_a_v": args.beta_a_v, "pql/target_ratio_p_v": args.beta_p_v}
    if V > 0:
        out.update({"pql/ratio_a_v": A / V, "pql/ratio_p_v": P / V})
    return out


def train(args: Args, envs, eval_envs, policy: Policy, obs_rms: Optional[RunningMeanStd], normalize: Callable,
          learners, logger: Logger, run_dir: Path, summary: dict, progress: dict, act_low: torch.Tensor,
          act_high: torch.Tensor, resumed: bool) -> None:
    """Alg. 1, the Actor: step the envs, send the data, keep the learners in ratio, log and evaluate."""
    device = torch.device(args.actor_device)
    N = args.num_envs
    sigmas = mixed_exploration_sigmas(N, args.sigma_min, args.sigma_max, device)  # Sec. 3.3
    assembler = NStepAssembler(args.nstep, args.gamma)
    next_step_mode = is_next_step(envs)
    raw_obs, _ = envs.reset(seed=args.seed + progress["actor_step"])
    raw_obs = raw_obs.float()
    if obs_rms is not None:
        obs_rms.update(raw_obs)
    stale = torch.zeros(N, dtype=torch.bool, device=device)  # next-step mode: this step only resets the env
    ep_return = torch.zeros(N, device=device)
    ep_len = torch.zeros(N, dtype=torch.long, device=device)
    success_once = torch.zeros(N, dtype=torch.bool, device=device)
    episodes = torch.zeros(4, device=device)  # count, return, length, success_once of episodes ended since the last log
    timers = {k: 0.0 for k in ("env_step", "inference", "actor_wait", "send", "sequential_updates")}
    first_step = progress["actor_step"]
    # Learning starts after the warm-up, and not before the first n-step transitions exist.
    warm_up_end = first_step + max(args.warm_up_steps, args.nstep - 1)
    train_start = time.time()
    last_log = {"time": train_start, "global_step": progress["global_step"], "counts": (0, 0, 0),
                "stats": learners.stats()}
    bar = None
    if args.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=args.num_actor_steps * N, initial=progress["global_step"], desc=args.env_id,
                   dynamic_ncols=True, unit="step")

    def run_eval(final: bool = False) -> None:
        start = time.time()
        metrics = evaluate(policy, eval_envs, normalize, args.num_eval_steps,
                           args.seed + 10_000 + progress["actor_step"], device, act_low, act_high)
        for k, v in metrics.items():
            logger.scalar(f"eval/{k}", v, progress["global_step"])
        logger.scalar("time/eval", time.time() - start, progress["global_step"])
        logger.scalar("time/train_wall", time.time() - train_start, progress["global_step"])
        if args.save_model and progress["actor_step"] > first_step:
            name = "final_ckpt.pt" if final else f"ckpt_{progress['global_step']}.pt"
            save_checkpoint(run_dir / name, learners.state_dicts(), obs_rms, progress["global_step"],
                            progress["actor_step"], args)

    for actor_step in range(first_step, args.num_actor_steps):
        if (actor_step - first_step) % args.eval_freq == 0:
            learners.fetch_policy(policy)
            run_eval()
        if args.max_time is not None and time.time() - train_start > args.max_time:
            print(f"--max-time {args.max_time} s reached after {progress['global_step']} env steps", flush=True)
            break
        learners.check()
        learning = actor_step >= warm_up_end
        if learning:
            timers["actor_wait"] += learners.wait_turn()  # Sec. 3.2: wait while ahead of the V-learner
        learners.fetch_policy(policy)  # pi^a <- pi^p (Alg. 1)

        start = time.time()
        with torch.no_grad():
            if actor_step < warm_up_end and not resumed:  # Table B.1 warm-up: uniform random actions
                action = torch.rand((N, act_low.shape[0]), device=device) * 2.0 - 1.0
            else:  # Sec. 3.3: pi(s) + N(0, sigma_i^2), sigma_i fixed per env
                action = explore(policy(normalize(raw_obs)), sigmas)
        timers["inference"] += time.time() - start
        start = time.time()
        next_raw, reward, terminated, truncated, info = envs.step(scale_action(action, act_low, act_high))
        timers["env_step"] += time.time() - start
        next_raw, reward = next_raw.float(), reward.float()

        # The true next observation: where a same-step env reset in this step, it is info["final_obs"].
        if next_step_mode:
            true_next = next_raw
        else:
            reset_mask = info.get("_final_obs", torch.zeros_like(terminated))
            true_next = torch.where(reset_mask[:, None], info["final_obs"].float().reshape(N, -1), next_raw)
        valid = ~stale
        transitions = assembler.push(raw_obs, action, reward * args.reward_scale, terminated, truncated, true_next,
                                     valid)
        done = terminated | truncated
        stale = done & next_step_mode
        if obs_rms is not None:
            obs_rms.update(next_raw)
        if transitions is not None:
            start = time.time()
            stats_vector = torch.cat([obs_rms.mean, obs_rms.var]) if obs_rms is not None else None
            waited = learners.send(transitions, stats_vector)
            timers["actor_wait"] += waited
            timers["send"] += time.time() - start - waited
        if learning:
            start = time.time()
            learners.step_done()  # --sequential: the V- and P-updates of this step happen here
            timers["sequential_updates"] += time.time() - start
        raw_obs = next_raw

        # episode statistics (unscaled rewards) of the training episodes
        ep_return += reward * valid
        ep_len += valid.long()
        success_once |= info["success"] & valid
        ended = done & valid
        episodes += torch.stack([ended.sum(), (ep_return * ended).sum(), (ep_len * ended).sum(),
                                 (success_once & ended).sum()]).float()
        ep_return = torch.where(ended, 0.0, ep_return)
        ep_len = torch.where(ended, 0, ep_len)
        success_once = success_once & ~ended

        progress["actor_step"] = actor_step + 1
        progress["global_step"] += N
        if bar is not None:
            bar.update(N)
        if progress["actor_step"] % args.log_freq == 0:
            log_training(args, logger, learners, progress, episodes, timers, last_log, train_start, bar)
            episodes.zero_()
            timers = {k: 0.0 for k in timers}

    if bar is not None:
        bar.close()
    learners.drain()
    log_training(args, logger, learners, progress, episodes, timers, last_log, train_start, None)
    learners.fetch_policy(policy)
    run_eval(final=True)


def log_training(args: Args, logger: Logger, learners, progress: dict, episodes: torch.Tensor, timers: dict,
                 last_log: dict, train_start: float, bar) -> None:
    step = progress["global_step"]
    now = time.time()
    log = logger.scalar
    new_window = step > last_log["global_step"]  # False for the last log after the learners' drain
    if new_window:
        log("charts/SPS", (step - last_log["global_step"]) / max(now - last_log["time"], 1e-9), step)
    count = episodes[0].item()
    if count > 0:
        log("charts/episodic_return", episodes[1].item() / count, step)
        log("charts/episodic_length", episodes[2].item() / count, step)
        log("charts/success_rate", episodes[3].item() / count, step)
    A, V, P = learners.counts()
    if V > 0:  # Sec. 3.2: the measured ratios f_a / f_v and f_p / f_v since learning started, and over this window
        log("pql/ratio_a_v", A / V, step)
        log("pql/ratio_p_v", P / V, step)
        dA, dV, dP = (x - y for x, y in zip((A, V, P), last_log["counts"]))
        if dV > 0 and new_window:
            log("pql/ratio_a_v_window", dA / dV, step)
            log("pql/ratio_p_v_window", dP / dV, step)
    log("pql/learning_steps", A, step)
    log("pql/v_updates", V, step)
    log("pql/p_updates", P, step)
    elapsed = max(now - last_log["time"], 1e-9)
    stats, previous = learners.stats(), last_log["stats"]
    for role, loss_name in (("v_learner", "losses/qf_loss"), ("p_learner", "losses/actor_loss")):
        new, old = stats[role], previous[role]
        n = new[STAT_LOSS_COUNT] - old[STAT_LOSS_COUNT]
        if n > 0:
            log(loss_name, (new[STAT_LOSS_SUM] - old[STAT_LOSS_SUM]) / n, step)
        if new_window:  # fractions of the wall-clock time since the last log
            log(f"time/{role}_wait_frac", (new[STAT_WAIT_S] - old[STAT_WAIT_S]) / elapsed, step)
            log(f"time/{role}_update_frac", (new[STAT_UPDATE_S] - old[STAT_UPDATE_S]) / elapsed, step)
        log(f"pql/{role}_network_syncs", new[STAT_SYNCS], step)
    if new_window:
        for name, seconds in timers.items():
            log(f"time/{name}_frac", seconds / elapsed, step)
    log("charts/learning_rate", args.learning_rate, step)
    last_log.update(time=now, global_step=step, counts=(A, V, P), stats=stats)
    if bar is not None:
        bar.set_postfix(ret=f"{logger.last.get('charts/episodic_return', float('nan')):.2f}",
                        eval=f"{logger.last.get('eval/return', float('nan')):.2f}", V=V, P=P)


if __name__ == "__main__":
    cli_args = tyro.cli(Args)
    try:
        main(cli_args)
    except ArgsError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except ProcessFailed as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
