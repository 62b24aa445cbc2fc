"""PPO with Variable Experience Rollout (VER): env worker processes, dynamic batching, DD-PPO.

Paper: "VER: Scaling On-Policy RL Leads to the Emergence of Navigation in Embodied Rearrangement",
Erik Wijmans, Irfan Essa, Dhruv Batra (NeurIPS 2022), arXiv:2210.05064.

Batched on-policy RL waits for the slowest environment twice: at every step (action-level stragglers) and at the
end of every rollout of T steps per env (episode-level stragglers). VER removes both waits while staying on-policy:
env workers (processes) step their envs independently and write results into shared memory; the main process
batches whatever observations are waiting (dynamic batching) and sends actions back; a rollout ends as soon as
T x N steps have been collected in total, however many each env contributed (fast envs contribute more), and
actions still being simulated then are carried into the next rollout. Learning is PPO on sequences of variable
length, corrected for the biased sampling by truncated importance weights. With torchrun, every process (rank)
collects and learns (DD-PPO), gradients are all-reduced, and stragglers among the ranks are preempted.

Map from the paper to this file
  Sec. 2.1, Fig. 2   env_worker, SharedSlots, EnvWorkers (processes, shared CPU memory, pipes);
                     Collector (the main process is the inference worker: dynamic batching, min/max batch size);
                     --num-inference-workers K > 1: inference_worker, InferenceWorkers, SharedPolicy (K processes,
                     each acting for its share of the env workers, writing into RolloutStorage in shared memory)
  Sec. 2.2 VER       Collector.collect (T x N steps per rollout, no per-env quota), Collector.start_next_rollout
                     (inflight actions carried over); --no-variable-experience (NoVER) and --sync (SyncOnRL)
  Sec. 2.2, Fig. 3B  build_sequences, make_minibatches (shuffle sequences, cut into equal-size minibatches)
  Sec. 2.2, Fig. 3C  pack_layout, Agent.evaluate (LSTM over a torch PackedSequence, each piece from its stored state)
  GAE                compute_gae_packed (over sequences split at rollout and episode boundaries)
  Sec. 4 "Training"  importance_weights (truncated at 1.0), ppo_update (weighted losses, learned entropy coef.)
  Sec. 2.3           World, allreduce_gradients (DD-PPO), optimal_preemption_time (argmax_S S/(Time(S)+LT)),
                     fill_from_previous (preempted rollouts filled with the previous rollout's experience)
Autoreset (autoreset_modes.txt): the workers reset Gymnasium and ManiSkill envs themselves in the step that ends an
episode (same-step) and send the true last observation, whose value bootstraps a truncation; ToyChain keeps its
--toy.autoreset-mode, and in next_step mode the reset step (its action ignored) is left out of learning, the
truncated step bootstrapping from the true last observation it returned. A termination bootstraps zero.

Examples
  python ppo_ver.py                                                      # ToyChain-v0, 16 env workers, VER
  python ppo_ver.py --toy.step-time-mean 0.004 --toy.step-time-spread 1  # heterogeneous simulation time
  python ppo_ver.py --toy.step-time-mean 0.004 --toy.step-time-spread 1 --no-variable-experience   # NoVER
  python ppo_ver.py --num-envs 32 --num-inference-workers 2              # 2 inference worker processes, 16 envs each
  python ppo_ver.py --env-id CartPole-v1 --recurrent                     # any Gymnasium env id, LSTM policy
  python ppo_ver.py --env-id PickCube-v1 --num-envs 8                    # ManiSkill3, one physx_cpu env per worker
  torchrun --standalone --nproc_per_node 2 ppo_ver.py --num-envs 8       # DD-PPO: 2 ranks (gloo on CPU, NCCL on GPUs)
"""

from __future__ import annotations

import copy
import ctypes
import glob
import json
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import wait as wait_for_connections
from pathlib import Path
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import tyro
from torch.nn.utils.rnn import PackedSequence
from torch.utils.tensorboard import SummaryWriter

from toy_chain_env import ToyChainConfig, ToyChainVectorEnv, draw_target_actions


@dataclass
class Args:
    # ---- experiment -------------------------------------------------------------------------------------------
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of python, numpy, torch and the environments (env e of rank r is seeded seed + r * N + e)"""
    torch_deterministic: bool = True
    """sets torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """use CUDA for inference and learning when it is available (the envs are always CPU-simulated, in workers)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{env_id}__{exp_name}__{seed}__{unix_time}/"""
    track: bool = False
    """mirror the TensorBoard scalars to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "ver"
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
    """only evaluate the policy of --checkpoint, then exit"""
    progress_bar: bool = True
    """show a progress bar with SPS, return and success"""
    torch_threads: Optional[int] = None
    """torch threads of the main process (default: 1 when it runs on the CPU, leaving the cores to the env workers)"""

    # ---- environment ------------------------------------------------------------------------------------------
    env_id: str = "ToyChain-v0"
    """ToyChain-v0, a ManiSkill3 task id (PickCube-v1, StackCube-v1, ...) or any Gymnasium env id (CartPole-v1, ...)"""
    num_envs: Optional[int] = None
    """N: environments per rank, each stepped in an env worker process (default: 16 ToyChain, 8 otherwise)"""
    envs_per_worker: int = 1
    """environments per env worker process, stepped one after another (num_envs / envs_per_worker workers)"""
    horizon: Optional[int] = None
    """max_episode_steps of a ManiSkill or Gymnasium env (default: its registered one); ToyChain: --toy.horizon"""
    control_mode: Optional[str] = None
    """ManiSkill controller (default: the task's default)"""
    toy: ToyChainConfig = field(default_factory=ToyChainConfig)
    """ToyChain-v0 settings (the step-time options make its simulation time heterogeneous, as in VER Sec. 2)"""

    # ---- PPO ------------------------------------------------------------------------------------------------------
    total_timesteps: Optional[int] = None
    """env steps to train for, all ranks together (default: 300k ToyChain, 200k Gymnasium, 2M ManiSkill)"""
    learning_rate: Optional[float] = None
    """Adam learning rate (default: 2.5e-4, Sec. 4; 3e-4 ManiSkill)"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """learning-rate schedule over training (the paper decays it to zero with a cosine schedule, Sec. 4)"""
    num_steps: Optional[int] = None
    """T: rollout length; a rollout collects T x N steps per rank (per env on average with VER) (default: 32 ToyChain, 128 Gymnasium, 50 ManiSkill)"""
    gamma: Optional[float] = None
    """discount factor (default: 0.99; 0.8 ManiSkill)"""
    gae_lambda: Optional[float] = None
    """GAE lambda (default: 0.95; 0.9 ManiSkill)"""
    num_minibatches: int = 4
    """minibatches per epoch, each of T x N / num_minibatches steps (Sec. 2.2)"""
    update_epochs: int = 4
    """PPO epochs over each rollout"""
    norm_adv: bool = True
    """normalize advantages per minibatch"""
    clip_coef: float = 0.2
    """PPO clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss as in the PPO paper's code"""
    ent_coef: Optional[float] = None
    """entropy bonus coefficient; with --learned-ent-coef its initial value (default: 0.01; 0 ManiSkill)"""
    learned_ent_coef: bool = False
    """learn the entropy coefficient alpha towards --target-entropy (Sec. 4: alpha([H]_sg - lambda) - [alpha]_sg H)"""
    target_entropy: float = 0.0
    """lambda: the minimum policy entropy that the learned coefficient enforces (Sec. 4 sets 0)"""
    vf_coef: float = 0.5
    """value-loss coefficient"""
    max_grad_norm: float = 0.5
    """gradient-norm clip"""
    target_kl: Optional[float] = None
    """stop an update's epochs once the approximate KL exceeds this (default: off; 0.1 ManiSkill)"""
    norm_obs: Optional[bool] = None
    """normalize Box observations with a running mean and std (default: on for ManiSkill, off otherwise)"""
    reward_scale: float = 1.0
    """rewards are multiplied by this for learning (returns are logged unscaled)"""
    hidden_sizes: tuple[int, ...] = (256, 256)
    """hidden layers of the MLP actor and critic (recurrent: the first is the LSTM's input layer)"""
    recurrent: bool = False
    """an LSTM policy trained on packed sequences (Sec. 2.2, Fig. 3C); default: an MLP"""
    lstm_hidden_size: int = 128
    """LSTM hidden size (--recurrent)"""
    lstm_layers: int = 1
    """LSTM layers (--recurrent)"""

    # ---- VER (Sec. 2) ----------------------------------------------------------------------------------------------
    variable_experience: bool = True
    """variable experience rollout: T x N steps per rollout from any envs (Sec. 2.2); --no-variable-experience is NoVER: the same workers and dynamic batching, but exactly T steps from every env"""
    sync: bool = False
    """SyncOnRL (DD-PPO's collection): step all envs, wait for all of them, then act; implies NoVER"""
    inference_min_batch: Optional[int] = None
    """dynamic batching: act once this many envs are waiting... (default: N / 1.5, as habitat-lab)"""
    inference_max_batch: Optional[int] = None
    """...or no more than this many at once (default: N)"""
    inference_max_wait_ms: Optional[float] = None
    """...or once the first waiting env has waited this long (default: half the mean policy step time, adaptive)"""
    is_clip_max: float = 1.0
    """truncation of the importance weights T / n_e that correct VER's biased sampling (Sec. 4: 1.0)"""
    importance_weights: bool = True
    """weight the losses by the truncated importance weights (--no-importance-weights to ablate)"""
    overlap_learning: bool = False
    """collect the next rollout while learning on this one (its experience is then one policy version old), as habitat-lab's overlap_rollouts_and_learn; off by default, as in the paper (Sec. 2.1)"""
    worker_timeout: float = 300.0
    """seconds without any env worker answering before the run is stopped as hung"""
    num_inference_workers: int = 1
    """K inference workers (Sec. 2.1, Fig. 2): 1 = the main process acts for all envs; K > 1 = K inference worker processes, each acting for its own share of the env workers (dynamic batching over its envs, a CPU copy of the policy refreshed after every update) while the main process only learns"""

    # ---- DD-PPO (Sec. 2.3), launched with torchrun ----------------------------------------------------------------
    straggler_preemption: bool = True
    """with torchrun (world size > 1): end each rollout at the S that maximizes S / (Time(S) + LT) (Sec. 2.3) and fill preempted ranks' batches with experience from the previous rollout"""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend (auto: NCCL with CUDA, gloo on CPU)"""

    # ---- evaluation -------------------------------------------------------------------------------------------------
    eval_freq: int = 10
    """evaluate every this many iterations (and at the end); 0 = only at the end"""
    num_eval_episodes: int = 16
    """evaluation episodes (deterministic policy, in the main process, envs without step delays)"""
    num_eval_envs: Optional[int] = None
    """evaluation envs stepped together (default: num_eval_episodes; 2 for ManiSkill)"""

    # ---- filled in by resolve_args ------------------------------------------------------------------------------
    batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    num_iterations: tyro.conf.Suppress[int] = 0  # nominal: total_timesteps / (T * N * world_size)
    world_size: tyro.conf.Suppress[int] = 1
    env_kind: tyro.conf.Suppress[str] = ""


TOY_ENV_ID = "ToyChain-v0"
# Defaults per kind of env (any flag overrides them).
PRESETS: dict[str, dict] = {
    "toy": dict(num_envs=16, num_steps=32, total_timesteps=300_000, learning_rate=2.5e-4, gamma=0.99,
                gae_lambda=0.95, norm_obs=False),
    "gym": dict(num_envs=8, num_steps=128, total_timesteps=200_000, learning_rate=2.5e-4, gamma=0.99,
                gae_lambda=0.95, norm_obs=False),
    # ManiSkill's own PPO baseline settings (gamma 0.8, lambda 0.9, target KL 0.1, obs normalization).
    "maniskill": dict(num_envs=8, num_steps=50, total_timesteps=2_000_000, learning_rate=3e-4, gamma=0.8,
                      gae_lambda=0.9, norm_obs=True, target_kl=0.1, num_eval_envs=2, ent_coef=0.0),
}


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or process starts."""


class WorkerError(RuntimeError):
    """An env (or inference) worker raised, died or stopped answering: the run ends with its message."""

    def __init__(self, message: str, who: str = "an env worker"):
        super().__init__(message)
        self.who = who


# =====================================================================================================================
# Argument resolution: presets, derived sizes, validation (all before any env or process starts)
# =====================================================================================================================
def is_maniskill_env(env_id: str) -> bool:
    """True for a registered ManiSkill3 task (imports mani_skill, which registers them)."""
    try:
        from mani_skill.utils.registration import REGISTERED_ENVS
    except ImportError:  # pragma: no cover - mani_skill is in requirements.txt
        return False
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


def env_kind(env_id: str) -> str:
    """'toy', 'maniskill' or 'gym'; raises ArgsError for an id nobody registered."""
    if env_id == TOY_ENV_ID:
        return "toy"
    if is_maniskill_env(env_id):
        return "maniskill"
    try:
        gym.spec(env_id)
    except gym.error.Error as e:
        raise ArgsError(f"--env-id {env_id!r}: not ToyChain-v0, a ManiSkill3 task or a registered Gymnasium env ({e})") from e
    return "gym"


def resolve_args(args: Args, world_size: Optional[int] = None) -> Args:
    """Fills the presets and derived sizes into a copy of `args` and validates it. Raises ArgsError."""
    a = replace(args, toy=replace(args.toy))
    a.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    kind = a.env_kind = env_kind(a.env_id)
    for name, value in PRESETS[kind].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.target_kl is not None and a.target_kl <= 0:
        a.target_kl = None

    if kind == "toy":
        if a.horizon is not None:
            raise ArgsError("--horizon is for ManiSkill and Gymnasium envs; set the toy chain's horizon with --toy.horizon")
        try:
            a.toy.validate()
        except ValueError as e:
            raise ArgsError(str(e)) from e
        if a.norm_obs:
            raise ArgsError("--norm-obs: ToyChain's observation is a block index (embedded), not a vector to normalize")
        if a.capture_video:
            raise ArgsError("--capture-video: ToyChain has no renderer")
    else:
        if a.horizon is not None and a.horizon < 1:
            raise ArgsError(f"--horizon must be >= 1, got {a.horizon}")
        if a.capture_video and kind != "maniskill":
            raise ArgsError("--capture-video records ManiSkill tasks' evaluation episodes; Gymnasium envs are not recorded")
        if a.control_mode is not None and kind != "maniskill":
            raise ArgsError("--control-mode is for ManiSkill tasks")

    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs", "envs_per_worker", "num_eval_episodes",
                 "lstm_hidden_size", "lstm_layers"):
        if getattr(a, name) < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.eval_freq < 0:
        raise ArgsError(f"--eval-freq must be >= 0 (0 = only at the end), got {a.eval_freq}")
    if not a.hidden_sizes or min(a.hidden_sizes) < 1:
        raise ArgsError(f"--hidden-sizes needs at least one positive layer size, got {a.hidden_sizes}")
    if a.num_envs % a.envs_per_worker != 0:
        raise ArgsError(f"--num-envs {a.num_envs} is not a multiple of --envs-per-worker {a.envs_per_worker}")
    if a.num_eval_envs is None:
        a.num_eval_envs = a.num_eval_episodes
    a.num_eval_envs = max(1, min(a.num_eval_envs, a.num_eval_episodes))

    N = a.num_envs
    if a.sync:
        if a.inference_min_batch is not None or a.inference_max_batch is not None or a.inference_max_wait_ms is not None:
            raise ArgsError("--sync steps all N envs and waits for all of them: it sets the inference batch to N; "
                            "drop --inference-min-batch/--inference-max-batch/--inference-max-wait-ms")
        a.variable_experience = False
        a.inference_min_batch = a.inference_max_batch = N
    if a.inference_max_batch is None:
        a.inference_max_batch = N
    if a.inference_min_batch is None:
        a.inference_min_batch = max(1, min(int(N / 1.5), a.inference_max_batch))  # habitat-lab's default
    if not 1 <= a.inference_min_batch <= a.inference_max_batch <= N:
        raise ArgsError(f"need 1 <= --inference-min-batch ({a.inference_min_batch}) <= --inference-max-batch "
                        f"({a.inference_max_batch}) <= --num-envs ({N})")
    if a.inference_max_wait_ms is not None and a.inference_max_wait_ms < 0:
        raise ArgsError(f"--inference-max-wait-ms must be >= 0, got {a.inference_max_wait_ms}")
    if a.is_clip_max <= 0:
        raise ArgsError(f"--is-clip-max must be > 0 (the paper uses 1.0), got {a.is_clip_max}")
    if a.overlap_learning and a.world_size > 1 and a.straggler_preemption:
        raise ArgsError("--overlap-learning collects while learning, so the straggler preemption of Sec. 2.3 "
                        "(which ends collection to start learning) does not apply: add --no-straggler-preemption")
    if a.worker_timeout <= 0:
        raise ArgsError(f"--worker-timeout must be > 0 seconds, got {a.worker_timeout}")
    num_env_workers = N // a.envs_per_worker
    if not 1 <= a.num_inference_workers <= num_env_workers:
        raise ArgsError(f"--num-inference-workers must be between 1 and the number of env workers, --num-envs / "
                        f"--envs-per-worker = {num_env_workers}, got {a.num_inference_workers}")
    if a.num_inference_workers > 1 and a.sync:
        raise ArgsError("--num-inference-workers > 1 is not supported with --sync (SyncOnRL acts on all N envs at "
                        "once, in one process); drop one of them")
    if a.num_inference_workers > 1 and a.overlap_learning:
        raise ArgsError("--num-inference-workers > 1 is not supported with --overlap-learning (the inference workers "
                        "refresh their weights between rollouts); drop one of them")
    if a.ent_coef is None:
        a.ent_coef = 0.01
    if a.ent_coef < 0:
        raise ArgsError(f"--ent-coef must be >= 0, got {a.ent_coef}")
    if a.learned_ent_coef and a.ent_coef <= 0:
        raise ArgsError("--learned-ent-coef learns alpha = exp(log alpha) starting from --ent-coef, which must be > 0")
    if a.torch_threads is not None and a.torch_threads < 1:
        raise ArgsError(f"--torch-threads must be >= 1, got {a.torch_threads}")
    if a.learning_rate <= 0:
        raise ArgsError(f"--learning-rate must be > 0, got {a.learning_rate}")

    a.batch_size = N * a.num_steps
    if a.batch_size % a.num_minibatches != 0:
        raise ArgsError(f"the batch T*N = {a.num_steps}*{N} = {a.batch_size} does not split into --num-minibatches "
                        f"{a.num_minibatches} equal minibatches (Sec. 2.2); pick T, N or the number of minibatches so "
                        f"that it divides")
    a.minibatch_size = a.batch_size // a.num_minibatches
    a.num_iterations = a.total_timesteps // (a.batch_size * a.world_size)
    if a.num_iterations < 1 and not a.evaluate:
        raise ArgsError(f"--total-timesteps {a.total_timesteps} is less than one rollout of all ranks "
                        f"(T*N*world_size = {a.batch_size * a.world_size})")
    if a.evaluate and not a.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    if a.checkpoint and not os.path.isfile(a.checkpoint):
        raise ArgsError(f"--checkpoint {a.checkpoint}: no such file")
    if a.evaluate and a.world_size > 1:
        raise ArgsError("--evaluate runs in one process; start it without torchrun")
    use_cuda = a.cuda and torch.cuda.is_available()
    if a.dist_backend == "nccl" and not use_cuda:
        raise ArgsError("--dist-backend nccl needs CUDA GPUs; use gloo (or auto) on a CPU")
    if use_cuda and a.world_size > 1 and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
        raise ArgsError(f"torchrun started {os.environ.get('LOCAL_WORLD_SIZE')} processes per node but this machine has "
                        f"{torch.cuda.device_count()} GPU(s); use --nproc_per_node <= the GPU count, or --no-cuda")
    if kind == "maniskill":
        problem = find_vulkan_problem()
        if problem:
            raise ArgsError(f"ManiSkill3 needs a Vulkan driver even for state-only simulation, and {problem}. "
                            f"See README.md, 'Set-up' (on Debian/Ubuntu: bash .ci/install_system.sh)")
    return a


# =====================================================================================================================
# Environments: one env as a worker (or the evaluation loop) steps it
# =====================================================================================================================
class EnvAdapter:
    """One environment with numpy in and out and the autoreset inside step() (see the module docstring).

    step(action) returns (obs, reward, terminated, truncated, final_obs, success): final_obs is the true last
    observation of an episode that ended in this step and was reset at once (same-step), else None; success is the
    task's success flag of this step (False where the env has none)."""

    def __init__(self, env, kind: str):
        self.env, self.kind = env, kind
        self.next_step_mode = kind == "toy" and env.config.autoreset_mode == "next_step"
        if kind == "toy":
            self.observation_space, self.action_space = env.single_observation_space, env.single_action_space
        else:
            self.observation_space, self.action_space = env.observation_space, env.action_space
        self.continuous = isinstance(self.action_space, gym.spaces.Box)
        if self.continuous:
            self.low, self.high = self.action_space.low, self.action_space.high

    def reset(self, seed: Optional[int] = None) -> np.ndarray:
        obs, _ = self.env.reset(seed=seed)
        return obs.numpy()[0] if self.kind == "toy" else np.asarray(obs)

    def step(self, action: np.ndarray):
        if self.kind == "toy":  # a 1-chain ToyChain vector env: it does its own autoreset, in either mode
            obs, reward, terminated, truncated, info = self.env.step(torch.as_tensor(action).reshape(1))
            final = info["final_obs"].numpy()[0] if info.get("_final_obs", torch.zeros(1, dtype=torch.bool))[0] else None
            return (obs.numpy()[0], float(reward[0]), bool(terminated[0]), bool(truncated[0]), final,
                    bool(info["success"][0]))
        if self.continuous:
            action = np.clip(action, self.low, self.high)
        else:
            action = int(action)
        obs, reward, terminated, truncated, info = self.env.step(action)
        success = bool(np.asarray(info.get("success", info.get("is_success", False))).any())
        final = None
        if terminated or truncated:  # same-step autoreset: reset now, send the true last observation along
            final = np.asarray(obs)
            obs, _ = self.env.reset()
        return np.asarray(obs), float(reward), bool(terminated), bool(truncated), final, success

    def close(self) -> None:
        self.env.close()


def make_env(args: Args, evaluation: bool = False, video_dir: Optional[str] = None) -> EnvAdapter:
    """ToyChain-v0 (one chain), a ManiSkill3 task on CPU simulation (physx_cpu) or a Gymnasium env.
    Evaluation envs of ToyChain simulate without delays or crashes; ManiSkill evaluation ignores terminations
    (its success_once/success_at_end protocol)."""
    kind = args.env_kind or env_kind(args.env_id)
    if kind == "toy":
        config = replace(args.toy, step_time_mean=0.0, crash_at_step=0) if evaluation else args.toy
        return EnvAdapter(ToyChainVectorEnv(1, config, device="cpu"), kind)
    if kind == "maniskill":
        import mani_skill.envs  # noqa: F401  (registers the tasks in this process)
        from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

        kwargs = dict(num_envs=1, obs_mode="state", sim_backend="physx_cpu",
                      render_mode="rgb_array" if video_dir else None)
        if args.horizon:
            kwargs["max_episode_steps"] = args.horizon
        if args.control_mode:
            kwargs["control_mode"] = args.control_mode
        env = gym.make(args.env_id, **kwargs)
        if isinstance(env.action_space, gym.spaces.Dict):
            from mani_skill.utils.wrappers.flatten import FlattenActionSpaceWrapper

            env = FlattenActionSpaceWrapper(env)
        if video_dir:
            from mani_skill.utils.wrappers.record import RecordEpisode

            env = RecordEpisode(env, video_dir, save_trajectory=False, video_fps=30)
        return EnvAdapter(CPUGymWrapper(env, ignore_terminations=evaluation), kind)
    env = gym.make(args.env_id, max_episode_steps=args.horizon) if args.horizon else gym.make(args.env_id)
    return EnvAdapter(env, kind)


@dataclass
class EnvSpec:
    """What the main process needs to know about the envs before it starts the workers."""

    obs_shape: tuple
    obs_dtype: torch.dtype
    act_shape: tuple
    act_dtype: torch.dtype
    observation_space: gym.Space
    action_space: gym.Space
    next_step_mode: bool

    @staticmethod
    def of(env: EnvAdapter) -> "EnvSpec":
        obs_space, act_space = env.observation_space, env.action_space
        if isinstance(obs_space, gym.spaces.Discrete):
            obs_shape, obs_dtype = (), torch.int64
        elif isinstance(obs_space, gym.spaces.Box):
            obs_shape, obs_dtype = tuple(obs_space.shape), torch.float32
        else:
            raise ArgsError(f"--env-id: observation space {obs_space} is not supported (a Box or a Discrete one is)")
        if isinstance(act_space, gym.spaces.Discrete):
            act_shape, act_dtype = (), torch.int64
        elif isinstance(act_space, gym.spaces.Box):
            act_shape, act_dtype = tuple(act_space.shape), torch.float32
        else:
            raise ArgsError(f"--env-id: action space {act_space} is not supported (a Box or a Discrete one is)")
        return EnvSpec(obs_shape, obs_dtype, act_shape, act_dtype, obs_space, act_space, env.next_step_mode)


# =====================================================================================================================
# Env workers (Sec. 2.1, Fig. 2): processes that write into preallocated shared CPU memory
# =====================================================================================================================
@dataclass
class SharedSlots:
    """Preallocated shared CPU memory with one slot per env (Sec. 2.1): a worker writes the result of a step into
    its env's slot and the main process writes the next action there. A pipe message only says which env is ready.
    torch's shared memory lives as long as a process holds it: it is released when the last process exits."""

    obs: torch.Tensor  # (N, *obs_shape): the observation to act on
    final_obs: torch.Tensor  # (N, *obs_shape): the true last observation of an episode reset in this step
    has_final_obs: torch.Tensor  # (N,) bool
    action: torch.Tensor  # (N, *act_shape)
    reward: torch.Tensor  # (N,) float64
    terminated: torch.Tensor  # (N,) bool
    truncated: torch.Tensor  # (N,) bool
    success: torch.Tensor  # (N,) bool
    busy_time: torch.Tensor  # (N,) float64: seconds the env's last step took in its worker (simulation time)

    @staticmethod
    def allocate(num_envs: int, spec: EnvSpec) -> "SharedSlots":
        def shared(shape, dtype):
            return torch.zeros((num_envs, *shape), dtype=dtype).share_memory_()

        return SharedSlots(
            obs=shared(spec.obs_shape, spec.obs_dtype), final_obs=shared(spec.obs_shape, spec.obs_dtype),
            has_final_obs=shared((), torch.bool), action=shared(spec.act_shape, spec.act_dtype),
            reward=shared((), torch.float64), terminated=shared((), torch.bool), truncated=shared((), torch.bool),
            success=shared((), torch.bool), busy_time=shared((), torch.float64),
        )


def env_worker(worker_index: int, env_ids: list[int], args: Args, slots: SharedSlots, conn, base_seed: int) -> None:
    """An env worker process (Sec. 2.1): steps its envs one action at a time, as the main process asks, and
    writes each result into the env's slot of shared memory. It never waits for other workers. It exits when told
    to, when the main process is gone (its pipe closes), or after reporting an error with its traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle: it shuts the workers down
    torch.set_num_threads(1)
    view = {name: getattr(slots, name).numpy() for name in SharedSlots.__dataclass_fields__}
    envs: dict[int, EnvAdapter] = {}
    current = env_ids[0]
    try:
        for e in env_ids:
            current = e
            envs[e] = make_env(args)
            view["obs"][e] = envs[e].reset(seed=base_seed + e)
            conn.send(("obs", e))
        while True:
            command, e = conn.recv()
            if command == "close":
                break
            current = e
            start = time.perf_counter()
            obs, reward, terminated, truncated, final_obs, success = envs[e].step(view["action"][e].copy())
            view["busy_time"][e] = time.perf_counter() - start
            view["obs"][e], view["reward"][e] = obs, reward
            view["terminated"][e], view["truncated"][e], view["success"][e] = terminated, truncated, success
            view["has_final_obs"][e] = final_obs is not None
            if final_obs is not None:
                view["final_obs"][e] = final_obs
            conn.send(("obs", e))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the main process is gone: nobody to report to, just exit (no orphans)
    except BaseException:
        try:
            conn.send(("error", current, f"env worker {worker_index} (env {current}, pid {os.getpid()}):\n"
                       f"{traceback.format_exc()}"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        for env in envs.values():
            try:
                env.close()
            except Exception:
                pass


def shutdown_processes(processes, conns, close_message: tuple, timeout: float, terminate_grace: float) -> None:
    """Sends `close_message` down every pipe, waits up to `timeout` seconds in all for the processes to exit, then
    terminates (and, after `terminate_grace` seconds, kills) what is left, and closes the pipes: no orphans."""
    for conn in conns:
        try:
            conn.send(close_message)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(timeout=terminate_grace)
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)
    for conn in conns:
        conn.close()


def start_process(ctx, target, args_before_conn: tuple, args_after_conn: tuple, name: str, daemon: bool,
                  processes: list, conns: list) -> None:
    """Starts `target(*args_before_conn, conn, *args_after_conn)` in a new process with its end of a duplex pipe and
    appends the process and this side's end to `processes` and `conns`."""
    parent, child = ctx.Pipe(duplex=True)
    p = ctx.Process(target=target, args=(*args_before_conn, child, *args_after_conn), name=name, daemon=daemon)
    p.start()
    child.close()
    processes.append(p)
    conns.append(parent)


def forkserver_context(args: Args):
    """The start method of every worker process: a forkserver (fast: torch and gymnasium are imported once, and no CUDA
    or thread state is inherited), with the env's modules preloaded."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gymnasium", "numpy", "toy_chain_env"]
                               + (["mani_skill.envs"] if args.env_kind == "maniskill" else []))
    return ctx


class EnvWorkers:
    """The env worker processes of this rank (or of one inference worker: those of `env_ids`), a duplex pipe to each,
    and the shared slots.

    Processes start from a forkserver (fast: torch and gymnasium are imported once, and no CUDA or thread state is
    inherited). A worker's pipe doubles as its liveness signal: if a worker dies its pipe closes and poll() raises
    WorkerError; if the main process dies, the workers' pipes close and they exit."""

    def __init__(self, args: Args, slots: SharedSlots, base_seed: int, env_ids: Optional[np.ndarray] = None):
        ctx = forkserver_context(args)
        k = args.envs_per_worker
        env_ids = np.arange(args.num_envs) if env_ids is None else np.asarray(env_ids)  # this (inference) worker's envs
        self.num_envs = args.num_envs
        self.processes, self.conns = [], []
        self.global_index = [int(e) // k for e in env_ids[::k]]  # the workers' numbers among all of the rank's
        self.worker_of_env = np.full(args.num_envs, -1)
        self.worker_of_env[env_ids] = np.repeat(np.arange(len(env_ids) // k), k)
        try:
            for w in range(len(env_ids) // k):
                own = [int(e) for e in env_ids[w * k:(w + 1) * k]]
                start_process(ctx, env_worker, (self.global_index[w], own, args, slots), (base_seed,),
                              f"ver-env-worker-{self.global_index[w]}", True, self.processes, self.conns)
        except BaseException:
            self.close()
            raise
        self.worker_of_conn = {c: w for w, c in enumerate(self.conns)}
        self.worker_of_sentinel = {p.sentinel: w for w, p in enumerate(self.processes)}

    def send_step(self, env_ids) -> None:
        for e in env_ids:
            try:
                self.conns[self.worker_of_env[e]].send(("step", int(e)))
            except (BrokenPipeError, ConnectionResetError):
                self._raise_dead(self.worker_of_env[e])

    def poll(self, timeout: float) -> list[int]:
        """Env ids whose step result arrived within `timeout` seconds (all that are ready, without waiting longer
        once one is). Raises WorkerError if a worker reported an error or died."""
        ready = wait_for_connections(self.conns + list(self.worker_of_sentinel), timeout=max(timeout, 0.0))
        arrived = []
        for obj in ready:
            if obj in self.worker_of_sentinel:  # a worker process ended: report its error message if it sent one
                w = self.worker_of_sentinel[obj]
                while self.conns[w].poll():
                    self._handle(self.conns[w], w, arrived)
                self._raise_dead(w)
            else:
                w = self.worker_of_conn[obj]
                while obj.poll():
                    self._handle(obj, w, arrived)
        return arrived

    def _handle(self, conn, w: int, arrived: list) -> None:
        try:
            kind, e, *rest = conn.recv()
        except (EOFError, ConnectionResetError):
            self._raise_dead(w)
        if kind == "error":
            raise WorkerError(rest[0])
        arrived.append(e)

    def _raise_dead(self, w: int):
        p = self.processes[w]
        p.join(timeout=1.0)
        raise WorkerError(f"env worker {self.global_index[w]} (pid {p.pid}) died with exit code {p.exitcode} without a "
                          f"message (killed, or crashed inside native code)")

    def close(self, timeout: float = 3.0) -> None:
        """Asks every worker to exit, waits up to `timeout` seconds, then terminates (and kills) what is left."""
        shutdown_processes(self.processes, self.conns, ("close", -1), timeout, terminate_grace=1.0)
        self.processes, self.conns = [], []


# =====================================================================================================================
# Pure functions the algorithm relies on (importable, tested in tests/test_ppo_ver.py)
# =====================================================================================================================
def build_sequences(env_ids: np.ndarray, episode_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups the steps of one rollout into sequences: the steps of one env's one episode, in time order (Sec. 2.2:
    a sequence starts at a rollout start or at an episode start). The input steps are in time order per env (the
    order they were collected in). Returns (order, lengths): `order` lists the step indices sequence after
    sequence, `lengths` the length of each sequence."""
    if len(env_ids) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.lexsort((episode_ids, env_ids))  # stable: time order is kept inside each (env, episode)
    env_sorted, episode_sorted = env_ids[order], episode_ids[order]
    new_sequence = np.ones(len(order), dtype=bool)
    new_sequence[1:] = (env_sorted[1:] != env_sorted[:-1]) | (episode_sorted[1:] != episode_sorted[:-1])
    starts = np.flatnonzero(new_sequence)
    lengths = np.diff(np.append(starts, len(order)))
    return order.astype(np.int64), lengths.astype(np.int64)


def pack_layout(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The PackedSequence layout of sequences stored one after another (Sec. 2.2, Fig. 3C: the elements of all
    sequences at a time step are next to one another). Returns (select, batch_sizes, sorted_sequences):
      packed[j] = flat[select[j]]      (flat: the sequences concatenated in their given order)
      batch_sizes[t]                   number of sequences longer than t (PackedSequence.batch_sizes)
      sorted_sequences                 the sequences by decreasing length: the batch order of the packed data
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    sorted_sequences = np.argsort(-lengths, kind="stable")
    rank = np.empty_like(sorted_sequences)
    rank[sorted_sequences] = np.arange(len(lengths))
    max_len = int(lengths.max())
    batch_sizes = len(lengths) - np.cumsum(np.bincount(lengths, minlength=max_len + 1))[:max_len]
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)[:-1]])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    t_of_flat = np.arange(lengths.sum()) - np.repeat(starts, lengths)
    packed_of_flat = offsets[t_of_flat] + np.repeat(rank, lengths)
    select = np.empty_like(packed_of_flat)
    select[packed_of_flat] = np.arange(len(packed_of_flat))
    return select, batch_sizes.astype(np.int64), sorted_sequences


def compute_gae_packed(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
                       terminated: torch.Tensor, batch_sizes: np.ndarray, gamma: float, gae_lambda: float) -> torch.Tensor:
    """GAE over variable-length sequences in PackedSequence layout (inputs in packed order, see pack_layout).

    delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * A_{t+1}       inside a sequence; A = delta at a sequence's last step
    Sequences end at episode ends (a termination bootstraps 0; a truncation bootstraps next_values = V(true last
    observation)) and at the rollout's end (next_values = V(next observation), the bootstrap). Time runs backwards
    over the packed steps; the sequences present at step t+1 are a prefix of those present at t."""
    deltas = rewards + gamma * (1.0 - terminated.to(rewards.dtype)) * next_values - values
    advantages = torch.zeros_like(rewards)
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)])
    following = torch.zeros(0, dtype=rewards.dtype, device=rewards.device)  # A_{t+1} of the sequences still running
    for t in reversed(range(len(batch_sizes))):
        n = int(batch_sizes[t])
        carried = torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
        carried[: following.numel()] = following
        following = deltas[offsets[t]:offsets[t] + n] + gamma * gae_lambda * carried
        advantages[offsets[t]:offsets[t] + n] = following
    return advantages


def make_minibatches(lengths: np.ndarray, num_minibatches: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """VER's minibatches (Sec. 2.2, Fig. 3B): shuffle the sequences, concatenate their steps and cut the result into
    `num_minibatches` chunks of equal size. A sequence is split only where a cut falls inside it; each piece is
    then its own sequence (starting from the stored recurrent state of its first step).
    Returns, per minibatch, (indices of its steps in the flat batch, lengths of its pieces in that order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total % num_minibatches != 0:
        raise ValueError(f"{total} steps do not split into {num_minibatches} equal minibatches")
    size = total // num_minibatches
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    permutation = rng.permutation(len(lengths))
    perm_lengths = lengths[permutation]
    perm_starts = np.concatenate([[0], np.cumsum(perm_lengths)[:-1]])
    flat = np.repeat(starts[permutation] - perm_starts, perm_lengths) + np.arange(total)
    boundaries = np.union1d(np.cumsum(perm_lengths), np.arange(size, total + 1, size))  # sequence ends and cuts
    boundaries = np.concatenate([[0], boundaries])
    minibatches = []
    for b in range(num_minibatches):
        inside = boundaries[(boundaries >= b * size) & (boundaries <= (b + 1) * size)]
        minibatches.append((flat[b * size:(b + 1) * size], np.diff(inside)))
    return minibatches


def importance_weights(env_ids: torch.Tensor, num_envs: int, num_steps: int, clip_max: float = 1.0) -> torch.Tensor:
    """Truncated importance weights of VER's biased sampling (Sec. 4 "Training", truncated as in IMPALA).

    Uniform sampling would give every env T steps of the rollout; VER gives env e n_e steps, so each of its steps is
    weighted w_e = min(clip_max, T / n_e): fast envs, over-represented, are down-weighted, and slow envs are not
    up-weighted beyond clip_max (1.0 in the paper). With T steps from every env (NoVER, sync) all weights are 1."""
    counts = torch.bincount(env_ids, minlength=num_envs).to(torch.float32)
    return (num_steps / counts[env_ids]).clamp(max=clip_max)


def optimal_preemption_time(step_times: np.ndarray, rank_cap: int, env_cap: Optional[int], learn_time: float,
                            resolution: float = 1e-3) -> tuple[float, int, float]:
    """The straggler preemption rule of Sec. 2.3: collect the S steps that maximize S / (Time(S) + LT).

    step_times[r, e] is the mean time env e of rank r took per step in the previous rollout (simulation plus
    inference); in a rollout of length t it collects floor(t / step_times[r, e]) steps, at most env_cap (T with
    NoVER and sync; None with VER), and rank r at most rank_cap = T x N, so S(t) <= T x N x world size.
    Candidate rollout times are the times at which some env finishes a step (rounded up to `resolution`).
    Returns (t*, S(t*), t_full): the best rollout time, its steps, and the time at which every rank has its full
    batch (no preemption is needed when t* == t_full)."""
    tau = np.asarray(step_times, dtype=np.float64)
    if env_cap is None:  # VER: a rank reaches its cap by (cap + N) / (its step rate) at the latest
        bound = ((rank_cap + tau.shape[1]) / (1.0 / tau).sum(axis=1)).max()
    else:
        bound = (tau.max(axis=1) * env_cap).max()
    candidates = [np.arange(1, int(math.ceil(bound / t)) + 1) * t for t in tau.ravel()]
    times = np.unique(np.ceil(np.concatenate(candidates) / resolution - 1e-9) * resolution)
    counts = np.floor(times[:, None, None] / tau[None] + 1e-9)
    if env_cap is not None:
        counts = np.minimum(counts, env_cap)
    steps = np.minimum(counts.sum(axis=2), rank_cap).sum(axis=1)
    full = np.flatnonzero(steps >= rank_cap * tau.shape[0])
    last = full[0] if len(full) else len(times) - 1
    times, steps = times[: last + 1], steps[: last + 1]
    best = int(np.argmax(steps / (times + learn_time)))
    return float(times[best]), int(steps[best]), float(times[-1])


class RunningMeanStd:
    """Running mean and variance of observations (parallel-variance update of Chan et al.); normalized observations
    are clipped to [-10, 10]. With DD-PPO the statistics are merged across ranks after every rollout."""

    def __init__(self, shape, device, epsilon: float = 1e-4):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(epsilon, device=device)

    def update(self, x: torch.Tensor) -> None:
        self.merge(x.mean(0), x.var(0, unbiased=False), torch.tensor(float(x.shape[0]), device=x.device))

    def merge(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        delta, total = mean - self.mean, self.count + count
        self.mean = self.mean + delta * count / total
        self.var = (self.var * self.count + var * count + delta.square() * self.count * count / total) / total
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


def mlp(sizes: list[int], out_std: Optional[float]) -> nn.Sequential:
    """Tanh MLP with orthogonal init; the last layer has gain `out_std` and no activation, or, with out_std None,
    every layer is followed by a Tanh (a feature extractor)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        layers.append(layer_init(nn.Linear(n_in, n_out), std=out_std if (last and out_std is not None) else math.sqrt(2)))
        if not last or out_std is None:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class Agent(nn.Module):
    """Actor-critic for Box or Discrete observations and actions.

    MLP (default): separate actor and critic MLPs. Recurrent (--recurrent): an input layer, an LSTM shared by the
    actor and critic heads (the paper's policy is an LSTM, Sec. 4), trained over packed sequences. A Discrete
    observation (ToyChain's block index) is embedded first. Continuous actions: a Gaussian with a learned,
    state-independent log std. The (learned) entropy coefficient alpha lives here as log_ent_coef."""

    def __init__(self, obs_space: gym.Space, act_space: gym.Space, hidden_sizes: tuple[int, ...], recurrent: bool,
                 lstm_hidden_size: int, lstm_layers: int, ent_coef: float, learned_ent_coef: bool):
        super().__init__()
        if isinstance(obs_space, gym.spaces.Discrete):
            self.embed = nn.Embedding(int(obs_space.n), 64)
            in_dim = 64
        else:
            self.embed = nn.Flatten()
            in_dim = int(np.prod(obs_space.shape))
        self.continuous = isinstance(act_space, gym.spaces.Box)
        out_dim = int(np.prod(act_space.shape)) if self.continuous else int(act_space.n)
        self.recurrent = recurrent
        if recurrent:
            self.input_layer = mlp([in_dim, hidden_sizes[0]], out_std=None)
            self.lstm = nn.LSTM(hidden_sizes[0], lstm_hidden_size, num_layers=lstm_layers)
            for name, param in self.lstm.named_parameters():
                if "bias" in name:
                    nn.init.constant_(param, 0.0)
                else:
                    nn.init.orthogonal_(param, 1.0)
            self.actor = layer_init(nn.Linear(lstm_hidden_size, out_dim), std=0.01)
            self.critic = layer_init(nn.Linear(lstm_hidden_size, 1), std=1.0)
        else:
            self.actor = mlp([in_dim, *hidden_sizes, out_dim], out_std=0.01)
            self.critic = mlp([in_dim, *hidden_sizes, 1], out_std=1.0)
        if self.continuous:
            self.actor_logstd = nn.Parameter(torch.zeros(1, out_dim))
        log_alpha = torch.tensor(math.log(ent_coef) if ent_coef > 0 else -math.inf)
        if learned_ent_coef:
            self.log_ent_coef = nn.Parameter(log_alpha)
        else:
            self.register_buffer("log_ent_coef", log_alpha)
        self.lstm_shape = (lstm_layers, lstm_hidden_size)

    # ---- recurrent state: (h, c), each (layers, batch, hidden); None for the MLP ------------------------------------
    def initial_state(self, n: int, device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if not self.recurrent:
            return None
        return tuple(torch.zeros(self.lstm_shape[0], n, self.lstm_shape[1], device=device) for _ in range(2))

    def _heads(self, features_actor, features_critic):
        out = self.actor(features_actor)
        if self.continuous:
            dist = torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
        else:
            dist = torch.distributions.Categorical(logits=out, validate_args=False)
        return dist, self.critic(features_critic).squeeze(-1)

    def _log_prob_entropy(self, dist, action):
        if self.continuous:
            return dist.log_prob(action).sum(-1), dist.entropy().sum(-1)
        return dist.log_prob(action), dist.entropy()

    def _step(self, obs, state):
        """One step of every env in the batch (inference): returns (dist, value, next_state)."""
        x = self.embed(obs)
        if not self.recurrent:
            return (*self._heads(x, x), None)
        out, next_state = self.lstm(self.input_layer(x).unsqueeze(0), state)
        return (*self._heads(out[0], out[0]), next_state)

    def act(self, obs, state):
        """Samples actions: returns (action, logprob, value, next_state). `state` must already be reset (zeros)
        where an episode starts."""
        dist, value, next_state = self._step(obs, state)
        action = dist.sample()
        logprob, _ = self._log_prob_entropy(dist, action)
        return action, logprob, value, next_state

    def get_value(self, obs, state):
        return self._step(obs, state)[1]

    def deterministic_action(self, obs, state):
        dist, _, next_state = self._step(obs, state)
        return (dist.mean if self.continuous else dist.probs.argmax(-1)), next_state

    def evaluate(self, obs, actions, state0=None, piece_lengths: Optional[np.ndarray] = None):
        """Log-probabilities, entropies and values of a minibatch of stored steps (learning).

        Recurrent: the minibatch is a set of pieces of sequences stored one after another (make_minibatches); they
        are run through the LSTM as one PackedSequence (Sec. 2.2, Fig. 3C), each piece starting from its own stored
        state `state0` ((layers, pieces, hidden) each; zeros where the piece starts an episode)."""
        x = self.embed(obs)
        if self.recurrent:
            select, batch_sizes, sorted_pieces = pack_layout(piece_lengths)
            select_t = torch.as_tensor(select, device=x.device)
            order = torch.as_tensor(sorted_pieces, device=x.device)
            packed = PackedSequence(self.input_layer(x)[select_t], torch.as_tensor(batch_sizes))
            out, _ = self.lstm(packed, (state0[0][:, order].contiguous(), state0[1][:, order].contiguous()))
            x = torch.empty_like(out.data)
            x[select_t] = out.data  # back from packed order to the minibatch's order
        dist, value = self._heads(x, x)
        logprob, entropy = self._log_prob_entropy(dist, actions)
        return logprob, entropy, value

    def action_probs(self, obs):
        """Action probabilities from a zero recurrent state (ToyChain's per-block accuracy)."""
        dist, _, _ = self._step(obs, self.initial_state(obs.shape[0], obs.device))
        return dist.probs


def make_agent(args: Args, spec: EnvSpec) -> Agent:
    return Agent(spec.observation_space, spec.action_space, args.hidden_sizes, args.recurrent, args.lstm_hidden_size,
                 args.lstm_layers, args.ent_coef, args.learned_ent_coef)


# =====================================================================================================================
# Rollout storage and collection (Sec. 2.1, 2.2)
# =====================================================================================================================
class RolloutStorage:
    """The steps of one rollout, one row per (env, step) in the order they were collected: a linear buffer, since
    VER has no (T, N) shape (Sec. 2.2). Tensors live on the training device; bookkeeping in numpy on the host.
    A row is written when the policy acts on an observation and completed when the env's next result (its reward
    and flags) arrives; rows still waiting for that (actions in flight) are carried into the next rollout.
    shared=True (inference worker processes): everything in shared CPU memory, written by an inference worker and read
    by the learner in the main process; its capacity is then fixed (shared_storage_capacity bounds a rollout)."""

    def __init__(self, capacity: int, spec: EnvSpec, lstm_shape: Optional[tuple], device, shared: bool = False):
        self.device, self.spec, self.lstm_shape, self.shared = device, spec, lstm_shape, shared
        self.size = 0
        self._allocate(capacity)

    def __getstate__(self) -> dict:  # pickled into an inference worker: the numpy arrays travel as shared tensors
        state = {k: v for k, v in self.__dict__.items() if k not in self.ARRAYS}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name, tensor in self.array_tensors.items():
            setattr(self, name, tensor.numpy())

    def _allocate(self, capacity: int) -> None:
        d, s = self.device, self.spec
        if self.shared and hasattr(self, "obs"):
            raise RuntimeError(f"internal error: a rollout needed more than the {self.capacity} rows of its shared "
                               f"storage")
        self.capacity = capacity
        self.obs = torch.zeros((capacity, *s.obs_shape), dtype=s.obs_dtype, device=d)
        self.actions = torch.zeros((capacity, *s.act_shape), dtype=s.act_dtype, device=d)
        self.logprobs = torch.zeros(capacity, device=d)
        self.values = torch.zeros(capacity, device=d)
        self.next_values = torch.full((capacity,), math.nan, device=d)  # V(s_{t+1}) for GAE, once known
        self.hidden_h = self.hidden_c = None
        if self.lstm_shape is not None:  # the recurrent state the policy acted from (zeros at an episode start)
            self.hidden_h = torch.zeros((capacity, *self.lstm_shape), device=d)
            self.hidden_c = torch.zeros((capacity, *self.lstm_shape), device=d)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.terminated = np.zeros(capacity, dtype=bool)
        self.complete = np.zeros(capacity, dtype=bool)  # its reward has arrived
        self.trainable = np.zeros(capacity, dtype=bool)  # not the ignored action of a next-step reset
        self.env_ids = np.zeros(capacity, dtype=np.int64)
        self.episode_ids = np.zeros(capacity, dtype=np.int64)
        self.versions = np.zeros(capacity, dtype=np.int64)  # policy version that acted
        if self.shared:
            for name in self.TENSORS:
                if getattr(self, name) is not None:
                    getattr(self, name).share_memory_()
            self.array_tensors = {name: torch.from_numpy(getattr(self, name)).share_memory_() for name in self.ARRAYS}
            for name, tensor in self.array_tensors.items():
                setattr(self, name, tensor.numpy())

    TENSORS = ("obs", "actions", "logprobs", "values", "next_values", "hidden_h", "hidden_c")
    ARRAYS = ("rewards", "terminated", "complete", "trainable", "env_ids", "episode_ids", "versions")

    def allocate(self, n: int) -> np.ndarray:
        """Rows for n new steps (the buffer grows if a rollout needs more, e.g. next-step reset steps)."""
        if self.size + n > self.capacity:
            old = {name: getattr(self, name) for name in self.TENSORS + self.ARRAYS}
            self._allocate(max(2 * self.capacity, self.size + n))
            for name, value in old.items():
                if value is not None:
                    getattr(self, name)[: self.size] = value[: self.size]
        rows = np.arange(self.size, self.size + n)
        self.size += n
        return rows

    def keep(self, rows: np.ndarray) -> None:
        """Starts a new rollout that holds only `rows` (moved to the front, in order): the carried-over steps."""
        k = len(rows)
        rows_t = torch.as_tensor(rows, device=self.device, dtype=torch.long)
        for name in self.TENSORS:
            value = getattr(self, name)
            if value is not None:
                value[:k] = value[rows_t]
        for name in self.ARRAYS:
            value = getattr(self, name)
            value[:k] = value[rows]
        self.next_values[k:] = math.nan
        self.complete[k:] = False
        self.trainable[k:] = False
        self.size = k


@dataclass
class Batch:
    """The steps learned from, sequence after sequence (flat order), as tensors on the training device."""

    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    weights: torch.Tensor  # truncated importance weights
    hidden_h: Optional[torch.Tensor]  # (steps, layers, hidden): the recurrent state each step was acted from
    hidden_c: Optional[torch.Tensor]
    lengths: np.ndarray  # sequence lengths
    versions: np.ndarray  # policy version that collected each step
    env_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        return Batch(**{k: v.to(device) if torch.is_tensor(v) else v
                        for k, v in ((k, getattr(self, k)) for k in Batch.__dataclass_fields__)})

    @staticmethod
    def concatenate(a: "Batch", b: "Batch") -> "Batch":
        def cat(x, y):
            if x is None:
                return None
            return torch.cat([x, y]) if torch.is_tensor(x) else np.concatenate([x, y])

        return Batch(**{k: cat(getattr(a, k), getattr(b, k)) for k in Batch.__dataclass_fields__})

    def take_sequences(self, sequence_ids: np.ndarray, total: int) -> "Batch":
        """The given sequences, in that order, cut to `total` steps (the last one may be cut short)."""
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        idx = np.concatenate([np.arange(starts[s], starts[s] + self.lengths[s]) for s in sequence_ids])[:total]
        lengths = self.lengths[sequence_ids]
        keep = np.searchsorted(np.cumsum(lengths), total, side="left") + 1
        lengths = lengths[:keep].copy()
        lengths[-1] -= lengths.sum() - total
        idx_t = torch.as_tensor(idx, device=self.obs.device)
        out = {"lengths": lengths}
        for k in Batch.__dataclass_fields__:
            v = getattr(self, k)
            if k != "lengths":
                out[k] = None if v is None else (v[idx_t] if torch.is_tensor(v) else v[idx])
        return Batch(**out)


def fill_from_previous(batch: Batch, previous: Batch, size: int, rng: np.random.Generator) -> Batch:
    """Sec. 2.3: a preempted rank fills its batch up to `size` steps with experience from the previous rollout
    (whole sequences in random order, the last one cut), on which PPO then runs extra epochs without correcting for
    its staleness. The filled steps keep their old advantages, returns and behaviour log-probabilities."""
    missing = size - len(batch)
    if missing <= 0:
        return batch
    filler = previous.take_sequences(rng.permutation(len(previous.lengths)), missing)
    return Batch.concatenate(batch, filler)


def batch_from_storage(st: RolloutStorage, num_envs: int, num_steps: int, gamma: float, gae_lambda: float,
                       is_clip_max: float) -> Batch:
    """The completed, trainable steps of a rollout storage as sequences, with GAE advantages and importance weights
    (computed on the storage's device). GAE and the weights are per env, so storages holding disjoint sets of envs
    (one per inference worker) give the batch of their union when their batches are concatenated."""
    rows = np.flatnonzero(st.complete[: st.size] & st.trainable[: st.size])
    order, lengths = build_sequences(st.env_ids[rows], st.episode_ids[rows])
    rows = rows[order]
    rows_t = torch.as_tensor(rows, device=st.device)
    values, next_values = st.values[rows_t], st.next_values[rows_t]
    if not bool(torch.isfinite(next_values).all()):
        raise RuntimeError("internal error: a step of the rollout has no bootstrap value")
    select, batch_sizes, _ = pack_layout(lengths)
    sel = torch.as_tensor(select, device=st.device)
    rewards = torch.as_tensor(st.rewards[rows], device=st.device)
    terminated = torch.as_tensor(st.terminated[rows], device=st.device)
    packed_adv = compute_gae_packed(rewards[sel], values[sel], next_values[sel], terminated[sel], batch_sizes,
                                    gamma, gae_lambda)
    advantages = torch.empty_like(packed_adv)
    advantages[sel] = packed_adv
    env_ids = st.env_ids[rows]
    weights = importance_weights(torch.as_tensor(env_ids, device=st.device), num_envs, num_steps, is_clip_max)
    return Batch(
        obs=st.obs[rows_t], actions=st.actions[rows_t], logprobs=st.logprobs[rows_t], values=values,
        advantages=advantages, returns=advantages + values, weights=weights,
        hidden_h=None if st.hidden_h is None else st.hidden_h[rows_t],
        hidden_c=None if st.hidden_c is None else st.hidden_c[rows_t],
        lengths=lengths, versions=st.versions[rows], env_ids=env_ids,
    )


@dataclass
class RolloutStats:
    env_steps: int = 0  # env steps completed (learned from or not)
    collected: int = 0  # steps learned from
    env_busy: float = 0.0  # seconds of simulation, summed over envs
    inference_time: float = 0.0
    wait_time: float = 0.0
    batch_sizes: list = field(default_factory=list)
    episodes: list = field(default_factory=list)  # (return, length, success_once, success_at_end)
    preempted: bool = False
    carried: int = 0  # steps in flight carried into the next rollout
    pending: int = 0  # envs waiting for an action at the end
    duration: float = 0.0  # seconds from the start to the end of the rollout


class Collector:
    """Experience collection of one rank (Sec. 2.1, 2.2). The main process (by default) is the inference worker: it
    waits for env results (dynamic batching with a minimum and a maximum batch size, footnote 2), runs the policy on
    all of the waiting observations at once, writes the experience into the rollout storage on the training device
    and sends the actions back through shared memory.

    VER: a rollout ends once T x N steps have been collected, from whichever envs delivered them. At that point
    every env is in one of two states: its action is in flight (or its result has arrived but was not processed
    yet): that step is carried into the next rollout ("Inflight actions", Sec. 2.2); or its observation waits for
    an action: it gets one from the next policy, and its value under the current policy bootstraps the rollout.
    NoVER: the same, but an env stops (is held) once it has T steps, and the rollout ends when all have.
    Sync (SyncOnRL): NoVER that acts on all envs at once and waits for all of them.

    In an inference worker process (--num-inference-workers > 1) a Collector serves only `env_ids` (its batch sizes
    capped at their number), writes into a `storage` in shared memory, and VER's T x N stop rule counts the steps of
    all inference workers in `shared_steps` (NoVER: T steps from each of its envs, as before)."""

    def __init__(self, args: Args, workers: EnvWorkers, slots: SharedSlots, agent: Agent, spec: EnvSpec,
                 obs_rms: Optional[RunningMeanStd], device, env_ids: Optional[np.ndarray] = None,
                 storage: Optional[RolloutStorage] = None, shared_steps=None):
        self.args, self.workers, self.slots, self.agent, self.spec = args, workers, slots, agent, spec
        self.obs_rms, self.device = obs_rms, device
        N = self.N = args.num_envs
        self.T = args.num_steps
        self.env_ids = np.arange(N) if env_ids is None else np.asarray(env_ids)
        self.quota = None if args.variable_experience else self.T  # NoVER and sync: T steps from every env
        self.shared_steps = shared_steps if self.quota is None else None
        self.budget = self.T * (N if self.shared_steps is not None else len(self.env_ids))
        self.min_batch = min(args.inference_min_batch, len(self.env_ids))
        self.max_batch = min(args.inference_max_batch, len(self.env_ids))
        self.fixed_wait = None if args.inference_max_wait_ms is None else args.inference_max_wait_ms / 1000.0
        self.policy_step_time = 0.02  # running mean of one inference, for the adaptive wait (starts at 10 ms)
        lstm_shape = agent.lstm_shape if agent.recurrent else None
        self.storage = storage if storage is not None else RolloutStorage((self.T + 2) * N, spec, lstm_shape, device)
        self.state = agent.initial_state(N, device)  # recurrent state after each env's last observation
        self.policy_version = 0
        self.inflight = np.full(N, -1)  # row of the env's step whose result has not been processed yet
        self.awaiting = np.full(N, -1)  # row of the env's last completed step that still needs V(next observation)
        self.episode_id = np.zeros(N, dtype=np.int64)
        self.episode_start = np.ones(N, dtype=bool)  # the env's current observation starts an episode
        self.next_is_stale = np.zeros(N, dtype=bool)  # next-step mode: the current obs ended an episode (reset step next)
        self.steps_in_rollout = np.zeros(N, dtype=np.int64)
        self.arrived: deque = deque()  # envs whose result arrived, not processed yet
        self.pending: deque = deque()  # envs whose observation waits for an action
        self.held: list = []  # NoVER/sync: envs that have their T steps
        self.num_stepping = len(self.env_ids)  # envs simulating now (the workers start by resetting every env)
        self.ep_return, self.ep_len = np.zeros(N), np.zeros(N, dtype=np.int64)
        self.ep_success = np.zeros(N, dtype=bool)
        self.last_arrival = np.full(N, -math.inf)
        self.interval_sum, self.interval_count = np.zeros(N), np.zeros(N)
        self.scale = args.reward_scale
        self.view = {name: getattr(slots, name).numpy() for name in ("reward", "terminated", "truncated",
                                                                    "has_final_obs", "success", "busy_time")}

    def wait_until_ready(self) -> None:
        """Waits for every env's first observation (the workers build and reset their envs), so that start-up is
        not counted as collection time."""
        self.rollout_start = time.perf_counter()
        deadline = time.perf_counter() + self.args.worker_timeout
        while self.num_stepping > 0:
            if time.perf_counter() > deadline:
                raise WorkerError(f"the env workers did not start within {self.args.worker_timeout:.0f} s (--worker-timeout)")
            self._poll(deadline - time.perf_counter())

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _observe(self, raw: torch.Tensor, update: bool) -> torch.Tensor:
        obs = raw.to(self.device, non_blocking=True)
        if self.obs_rms is None:
            return obs
        if update:
            self.obs_rms.update(obs)
        return self.obs_rms.normalize(obs)

    def _state_of(self, envs: np.ndarray, reset: Optional[np.ndarray] = None):
        """The recurrent state of `envs` (zeros where `reset`), or None for the MLP."""
        if self.state is None:
            return None
        idx = torch.as_tensor(envs, device=self.device)
        h, c = self.state[0][:, idx], self.state[1][:, idx]
        if reset is not None and reset.any():
            keep = torch.as_tensor(~reset, device=self.device, dtype=h.dtype).view(1, -1, 1)
            h, c = h * keep, c * keep
        return h, c

    def _poll(self, timeout: float) -> int:
        arrived = self.workers.poll(timeout)
        now = time.perf_counter()
        for e in arrived:
            if self.last_arrival[e] >= self.rollout_start:  # Sec. 2.3: mean time per step of each env
                self.interval_sum[e] += now - self.last_arrival[e]
                self.interval_count[e] += 1
            self.last_arrival[e] = now
            self.arrived.append(e)
        self.num_stepping -= len(arrived)
        return len(arrived)

    # ---- one rollout --------------------------------------------------------------------------------------------------
    def collect(self, deadline: float = math.inf) -> RolloutStats:
        """Collects T x N steps (fewer if preempted at `deadline`, a time.perf_counter() value)."""
        self.stats = RolloutStats()
        self.steps_in_rollout[:] = 0
        self.interval_sum[:] = 0.0
        self.interval_count[:] = 0
        self.rollout_start = time.perf_counter()
        self.pending.extend(self.held)
        self.held = []
        while not self._rollout_full():
            if time.perf_counter() >= deadline:
                self.stats.preempted = True
                break
            self._wait_for_requests(deadline)
            if time.perf_counter() >= deadline:
                self.stats.preempted = True
                break
            self._step_batch()
        self._bootstrap_waiting()
        self.stats.pending = len(self.pending) + len(self.held)
        self.stats.duration = time.perf_counter() - self.rollout_start
        return self.stats

    def _rollout_full(self) -> bool:
        """The rollout has its steps: T x N (VER, counted over all inference workers), or T from each env (NoVER)."""
        if self.shared_steps is None:
            return self.stats.collected >= self.budget
        return self.shared_steps.value >= self.budget

    def _claim_step(self, e: int) -> bool:
        """Whether env e's arrived result may be processed now: a step that counts towards the rollout is claimed
        from the budget shared by all inference workers (atomically, so that together they collect exactly T x N)."""
        row = self.inflight[e]
        if self.shared_steps is None or row < 0 or not self.storage.trainable[row]:
            return True
        with self.shared_steps.get_lock():
            if self.shared_steps.value >= self.budget:
                return False
            self.shared_steps.value += 1
            return True

    def _wait_for_requests(self, deadline: float) -> None:
        """Dynamic batching (Sec. 2.1, footnote 2): returns once min_batch envs wait for an action, or every
        stepping env has answered, or the first waiting env has waited max_wait (or at the deadline). With other
        inference workers it also returns within a few milliseconds of their filling the rollout."""
        first_wait = None
        max_wait = self.fixed_wait if self.fixed_wait is not None else 0.5 * self.policy_step_time
        if self.quota is not None and self.min_batch >= self.N:
            max_wait = math.inf  # sync: wait for every env
        last_progress = time.perf_counter()
        while True:
            ready = len(self.pending) + len(self.arrived)
            if ready >= self.min_batch or (ready > 0 and self.num_stepping == 0) or self._rollout_full():
                return
            if self.num_stepping == 0:
                raise RuntimeError("internal error: no env is stepping and none waits for an action")
            now = time.perf_counter()
            timeout = deadline - now
            if ready > 0:
                first_wait = now if first_wait is None else first_wait
                timeout = min(timeout, max_wait - (now - first_wait))
            if timeout <= 0:
                return
            if self.shared_steps is not None:
                timeout = min(timeout, 0.002)  # look at the shared step count now and then
            hang_timeout = self.args.worker_timeout - (now - last_progress)
            if hang_timeout <= 0:
                stepping = sorted(set(self.env_ids.tolist()) - set(self.arrived) - set(self.pending) - set(self.held))
                raise WorkerError(f"no env worker answered for {self.args.worker_timeout:.0f} s (--worker-timeout); "
                                  f"envs {stepping[:16]} were stepping")
            if self._poll(min(timeout, hang_timeout)):
                last_progress = time.perf_counter()
            self.stats.wait_time += time.perf_counter() - now

    def _step_batch(self) -> None:
        """Processes the results that arrived and acts on up to max_batch waiting envs."""
        batch, final_rows, final_envs = [], [], []
        while len(batch) < self.max_batch and not self._rollout_full() and (self.pending or self.arrived):
            if self.pending:
                batch.append(self.pending.popleft())
                continue
            if not self._claim_step(self.arrived[0]):
                break  # the other inference workers filled the rollout: this result is carried over
            e = self.arrived.popleft()
            self._complete(e, final_rows, final_envs)
            if self.quota is not None and self.steps_in_rollout[e] >= self.quota:
                self.held.append(e)  # NoVER/sync: this env has its T steps
            else:
                batch.append(e)
        if final_rows:  # same-step truncation: bootstrap from V(true last observation)
            with torch.no_grad():
                envs = np.array(final_envs)
                raw = self.slots.final_obs[torch.as_tensor(envs)]
                values = self.agent.get_value(self._observe(raw, update=False), self._state_of(envs))
            self.storage.next_values[torch.as_tensor(final_rows, device=self.device)] = values
        if self._rollout_full():
            self.pending.extendleft(reversed(batch))  # the rollout is complete: these act with the next policy
            return
        if batch:
            self._act(np.array(batch))

    def _complete(self, e: int, final_rows: list, final_envs: list) -> None:
        """The result of env e's last action arrived (its slot holds reward, flags and the next observation)."""
        row = self.inflight[e]
        self.inflight[e] = -1
        if row < 0:  # the first observation after the worker reset the env
            self.episode_start[e] = True
            return
        view, st = self.view, self.storage
        reward = float(view["reward"][e])
        terminated, truncated = bool(view["terminated"][e]), bool(view["truncated"][e])
        st.rewards[row] = reward * self.scale
        st.terminated[row] = terminated
        st.complete[row] = True
        self.stats.env_steps += 1
        self.stats.env_busy += float(view["busy_time"][e])
        if not st.trainable[row]:  # the ignored action of a next-step reset: the observation now starts an episode
            self.episode_start[e] = True
            return
        self.stats.collected += 1
        self.steps_in_rollout[e] += 1
        if terminated:
            st.next_values[row] = 0.0  # a termination bootstraps zero
        elif truncated and bool(view["has_final_obs"][e]):
            final_rows.append(row)  # same-step: V(final_obs), computed for the whole batch at once
            final_envs.append(e)
        else:
            self.awaiting[e] = row  # V(next observation): when the policy acts on it, or the bootstrap at the end
        success = bool(view["success"][e])
        self.ep_return[e] += reward
        self.ep_len[e] += 1
        self.ep_success[e] |= success
        if terminated or truncated:
            self.stats.episodes.append((self.ep_return[e], self.ep_len[e], self.ep_success[e], success))
            self.ep_return[e], self.ep_len[e], self.ep_success[e] = 0.0, 0, False
            self.episode_id[e] += 1
            if self.spec.next_step_mode:
                self.next_is_stale[e] = True  # the observation is the true last one; the next step is a reset step
            else:
                self.episode_start[e] = True

    def _act(self, envs: np.ndarray) -> None:
        """Runs the policy on the batch, stores the steps and sends the actions to the workers."""
        start = time.perf_counter()
        n = len(envs)
        idx = torch.as_tensor(envs)
        with torch.no_grad():
            obs = self._observe(self.slots.obs[idx], update=True)
            state = self._state_of(envs, reset=self.episode_start[envs])
            action, logprob, value, next_state = self.agent.act(obs, state)
        st = self.storage
        rows = st.allocate(n)
        rows_t = torch.as_tensor(rows, device=self.device)
        st.obs[rows_t], st.actions[rows_t], st.logprobs[rows_t], st.values[rows_t] = obs, action, logprob, value
        if state is not None:
            st.hidden_h[rows_t], st.hidden_c[rows_t] = state[0].transpose(0, 1), state[1].transpose(0, 1)
            dev_idx = idx.to(self.device)
            self.state[0][:, dev_idx], self.state[1][:, dev_idx] = next_state
        st.env_ids[rows] = envs
        st.episode_ids[rows] = self.episode_id[envs]
        st.versions[rows] = self.policy_version
        st.trainable[rows] = ~self.next_is_stale[envs]
        waiting = self.awaiting[envs] >= 0  # V of this observation bootstraps the env's previous step
        if waiting.any():
            st.next_values[torch.as_tensor(self.awaiting[envs][waiting], device=self.device)] = \
                value[torch.as_tensor(waiting, device=self.device)]
        self.awaiting[envs] = -1
        self.inflight[envs] = rows
        self.next_is_stale[envs] = False
        self.episode_start[envs] = False
        self.slots.action[idx] = action.to("cpu")
        self.workers.send_step(envs)
        self.num_stepping += n
        elapsed = time.perf_counter() - start
        self.policy_step_time = 0.9 * self.policy_step_time + 0.1 * elapsed
        self.stats.inference_time += elapsed
        self.stats.batch_sizes.append(n)

    def _bootstrap_waiting(self) -> None:
        """At the end of a rollout, V (current policy) of the observations that wait for an action bootstraps the
        envs' last steps. (Envs with an action in flight already have it: the value of that step's observation.)"""
        envs = np.flatnonzero(self.awaiting >= 0)
        if len(envs) == 0:
            return
        with torch.no_grad():
            obs = self._observe(self.slots.obs[torch.as_tensor(envs)], update=False)
            values = self.agent.get_value(obs, self._state_of(envs, reset=self.episode_start[envs]))
        self.storage.next_values[torch.as_tensor(self.awaiting[envs], device=self.device)] = values
        self.awaiting[envs] = -1

    # ---- from the rollout to the learner's batch ---------------------------------------------------------------------
    def build_batch(self, gamma: float, gae_lambda: float, is_clip_max: float) -> Batch:
        """The completed, trainable steps of the rollout as sequences, with GAE advantages and importance weights."""
        return batch_from_storage(self.storage, self.N, self.T, gamma, gae_lambda, is_clip_max)

    def policy_updated(self, version: int) -> None:
        """The learner made update number `version` (this collector acts with the learner's own network)."""
        self.policy_version = version

    def start_next_rollout(self) -> None:
        """Carries the steps still in flight into the next rollout's storage ("Inflight actions", Sec. 2.2)."""
        envs = np.flatnonzero(self.inflight >= 0)
        self.stats.carried = len(envs)
        self.storage.keep(self.inflight[envs])
        self.inflight[envs] = np.arange(len(envs))

    def mean_step_times(self) -> np.ndarray:
        """Sec. 2.3's Time(S) estimate: each env's mean time per step in the last rollout (inference and
        simulation); an env that delivered no two steps counts as taking the whole rollout."""
        duration = max(time.perf_counter() - self.rollout_start, 1e-3)
        with np.errstate(invalid="ignore", divide="ignore"):
            tau = self.interval_sum / self.interval_count
        return np.where(self.interval_count > 0, tau, duration)


class BackgroundRollout:
    """--overlap-learning: the next rollout is collected in a thread while the main thread learns (habitat-lab's
    overlap_rollouts_and_learn; the paper's default does not overlap, Sec. 2.1 / App. A). Torch releases the GIL in
    its kernels, so collection and learning proceed together; all of the rollout is then one policy version old."""

    def __init__(self, collector: Collector):
        self.error: Optional[BaseException] = None
        self.stats: Optional[RolloutStats] = None
        self.thread = threading.Thread(target=self._run, args=(collector,), name="ver-collector", daemon=True)
        self.thread.start()

    def _run(self, collector: Collector) -> None:
        try:
            self.stats = collector.collect()
        except BaseException as error:  # handed to the main thread by result()
            self.error = error

    def result(self) -> RolloutStats:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.stats


# =====================================================================================================================
# Inference workers (Sec. 2.1, Fig. 2, --num-inference-workers K > 1): processes that each serve a share of the envs
# =====================================================================================================================
@dataclass
class SharedPolicy:
    """The learner's weights in shared CPU memory, and the policy version (updates made) that they are. The learner
    publishes them after every update; an inference worker copies them into its own network before a rollout."""

    network: nn.Module
    version: torch.Tensor

    @staticmethod
    def of(agent: Agent) -> "SharedPolicy":
        network = copy.deepcopy(agent).cpu().requires_grad_(False).share_memory()
        return SharedPolicy(network, torch.zeros((), dtype=torch.int64).share_memory_())

    def publish(self, agent: Agent, version: int) -> None:
        self.network.load_state_dict(agent.state_dict())  # copies into the shared tensors in place
        self.version.fill_(version)

    def load_into(self, agent: Agent, version: int) -> None:
        if int(self.version) != version:
            raise RuntimeError(f"internal error: the shared policy is version {int(self.version)} but the learner "
                               f"announced version {version}")
        agent.load_state_dict(self.network.state_dict())


def shared_storage_capacity(args: Args, num_envs: int, spec: EnvSpec) -> int:
    """Rows an inference worker's shared rollout storage needs (it cannot grow): the steps carried in (one per env),
    the counted steps (all T x N of the rollout with VER, T per env with NoVER), one action per env still to
    complete, and in next-step autoreset mode one ignored reset step per finished episode (at most one per counted
    or carried step)."""
    counted = args.num_steps * (args.num_envs if args.variable_experience else num_envs)
    rows = counted + 2 * num_envs
    return 2 * rows if spec.next_step_mode else rows


def combine_obs_rms(base: dict, results: list[dict]) -> dict:
    """Observation statistics of K inference workers that all started a rollout from `base` and each merged its own
    observations in: the statistics of `base` merged with all of their observations (exact: the K copies of `base`
    are taken out of the summed counts and second moments)."""
    extra = len(results) - 1
    count = sum(r["count"] for r in results) - extra * base["count"]
    mean = (sum(r["count"] * r["mean"] for r in results) - extra * base["count"] * base["mean"]) / count
    second = (sum(r["count"] * (r["var"] + r["mean"].square()) for r in results)
              - extra * base["count"] * (base["var"] + base["mean"].square())) / count
    return {"mean": mean, "var": (second - mean.square()).clamp(min=0.0), "count": count}


def merge_rollout_stats(parts: list[RolloutStats]) -> RolloutStats:
    """One rank's rollout statistics from those of its inference workers (which collected at the same time)."""
    return RolloutStats(
        env_steps=sum(p.env_steps for p in parts), collected=sum(p.collected for p in parts),
        env_busy=sum(p.env_busy for p in parts), inference_time=sum(p.inference_time for p in parts),
        wait_time=sum(p.wait_time for p in parts), batch_sizes=[n for p in parts for n in p.batch_sizes],
        episodes=[ep for p in parts for ep in p.episodes], preempted=any(p.preempted for p in parts),
        pending=sum(p.pending for p in parts), duration=max(p.duration for p in parts),
    )


def inference_worker(index: int, env_ids: np.ndarray, args: Args, spec: EnvSpec, slots: SharedSlots,
                     storage: RolloutStorage, policy: SharedPolicy, shared_steps, conn, base_seed: int,
                     seed: int) -> None:
    """An inference worker process (Sec. 2.1, Fig. 2): starts and owns the env workers of `env_ids`, and runs a
    Collector over them with its own CPU copy of the policy, writing experience into `storage` (shared memory).
    Per rollout the learner sends ("collect", seconds left, policy version, observation statistics); the worker
    loads the published weights (checking their version), collects, and answers with its statistics; ("next",)
    carries its inflight steps over. An error, its own or an env worker's, is sent with its traceback before it
    exits; it exits as well when the main process is gone, closing its env workers either way."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    signal.signal(signal.SIGTERM, _terminate)  # terminate(): unwind, so that the env workers are closed
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    workers = None
    try:
        agent = make_agent(args, spec).requires_grad_(False)
        policy.load_into(agent, int(policy.version))
        obs_rms = RunningMeanStd(spec.obs_shape, "cpu") if args.norm_obs and spec.obs_dtype == torch.float32 else None
        workers = EnvWorkers(args, slots, base_seed, env_ids)
        collector = Collector(args, workers, slots, agent, spec, obs_rms, torch.device("cpu"), env_ids=env_ids,
                              storage=storage, shared_steps=shared_steps)
        collector.wait_until_ready()
        conn.send(("ready",))
        while True:
            command, *payload = conn.recv()
            if command == "close":
                break
            if command == "next":
                collector.start_next_rollout()
                conn.send(("carried", collector.stats.carried))
                continue
            time_left, version, obs_stats = payload
            policy.load_into(agent, version)
            collector.policy_version = version
            if obs_rms is not None:
                obs_rms.load_state_dict(obs_stats)
            stats = collector.collect(time.perf_counter() + time_left)
            conn.send(("collected", stats, storage.size, collector.steps_in_rollout, collector.mean_step_times(),
                       None if obs_rms is None else obs_rms.state_dict()))
    except (EOFError, BrokenPipeError, ConnectionResetError, SystemExit):
        pass  # the main process is gone or ends this worker: close the env workers and exit
    except BaseException as error:
        who, message = "an inference worker", f"inference worker {index} (pid {os.getpid()}):\n{traceback.format_exc()}"
        if isinstance(error, WorkerError):  # one of its env workers failed: pass that on
            who, message = error.who, str(error)
        try:
            conn.send(("error", who, message))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if workers is not None:
            workers.close()


class InferenceWorkers:
    """--num-inference-workers K > 1: the K inference worker processes of this rank, seen by the learner through the
    Collector's interface (collect, build_batch, start_next_rollout, ...). The env workers are split into K
    contiguous groups; each inference worker batches the requests of its group with the same min/max batch sizes
    (capped at the group's size), and together they collect exactly T x N steps per rollout (VER: a step counter in
    shared memory; NoVER: T from every env), each carrying its own inflight steps over. The main process only learns:
    it reads the K shared rollout storages into one batch and publishes the new weights after every update."""

    def __init__(self, args: Args, spec: EnvSpec, agent: Agent, obs_rms: Optional[RunningMeanStd], device,
                 base_seed: int, seed: int):
        self.args, self.agent, self.obs_rms, self.device = args, agent, obs_rms, device
        self.N, self.T = args.num_envs, args.num_steps
        self.quota = None if args.variable_experience else self.T
        k, K = args.envs_per_worker, args.num_inference_workers
        self.env_ids = [np.concatenate([np.arange(w * k, (w + 1) * k) for w in group])
                        for group in np.array_split(np.arange(self.N // k), K)]
        ctx = forkserver_context(args)
        self.slots = SharedSlots.allocate(self.N, spec)
        self.policy = SharedPolicy.of(agent)
        self.policy_version = 0
        self.shared_steps = ctx.Value("q", 0)
        lstm_shape = agent.lstm_shape if agent.recurrent else None
        self.storages = [RolloutStorage(shared_storage_capacity(args, len(ids), spec), spec, lstm_shape,
                                        torch.device("cpu"), shared=True) for ids in self.env_ids]
        self.steps_in_rollout = np.zeros(self.N, dtype=np.int64)
        self.step_times = np.zeros(self.N)
        self.stats = RolloutStats()
        self.processes, self.conns = [], []
        try:
            for i, ids in enumerate(self.env_ids):
                # not a daemon: an inference worker starts its own env workers
                start_process(ctx, inference_worker, (i, ids, args, spec, self.slots, self.storages[i], self.policy,
                                                      self.shared_steps), (base_seed, seed + i + 1),
                              f"ver-inference-worker-{i}", False, self.processes, self.conns)
        except BaseException:
            self.close()
            raise

    def _send_all(self, message: tuple) -> None:
        for i, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError):
                self._raise_dead(i)

    def _receive_all(self, kind: str) -> list[tuple]:
        """One `kind` answer from every inference worker (in worker order). Raises WorkerError if one reports an
        error or dies. (An inference worker detects hung env workers itself, --worker-timeout.)"""
        answers: dict[int, tuple] = {}
        sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
        while len(answers) < len(self.conns):
            waiting = [c for i, c in enumerate(self.conns) if i not in answers]
            for obj in wait_for_connections(waiting + [s for s, i in sentinels.items() if i not in answers]):
                i = sentinels[obj] if obj in sentinels else self.conns.index(obj)
                if i in answers:
                    continue
                if not self.conns[i].poll():
                    self._raise_dead(i)
                try:
                    message = self.conns[i].recv()
                except (EOFError, ConnectionResetError):
                    self._raise_dead(i)
                if message[0] == "error":
                    raise WorkerError(message[2], who=message[1])
                if message[0] != kind:
                    raise RuntimeError(f"internal error: inference worker {i} answered {message[0]!r}, not {kind!r}")
                answers[i] = message[1:]
        return [answers[i] for i in range(len(self.conns))]

    def _raise_dead(self, i: int):
        p = self.processes[i]
        p.join(timeout=1.0)
        raise WorkerError(f"inference worker {i} (pid {p.pid}) died with exit code {p.exitcode} without a message "
                          f"(killed, or crashed inside native code)", who="an inference worker")

    def wait_until_ready(self) -> None:
        self._receive_all("ready")

    def policy_updated(self, version: int) -> None:
        """Publishes the learner's weights after update number `version` for the next rollout."""
        self.policy.publish(self.agent, version)
        self.policy_version = version

    def collect(self, deadline: float = math.inf) -> RolloutStats:
        self.shared_steps.value = 0
        base = None if self.obs_rms is None else {k: v.cpu() for k, v in self.obs_rms.state_dict().items()}
        self._send_all(("collect", deadline - time.perf_counter(), self.policy_version, base))
        answers = self._receive_all("collected")
        self.stats = merge_rollout_stats([a[0] for a in answers])
        self.steps_in_rollout = sum(a[2] for a in answers)
        for ids, (_, size, _, step_times, _) in zip(self.env_ids, answers):
            self.step_times[ids] = step_times[ids]
        for storage, answer in zip(self.storages, answers):
            storage.size = answer[1]
        if self.obs_rms is not None:
            self.obs_rms.load_state_dict(combine_obs_rms(base, [a[4] for a in answers]))
        return self.stats

    def build_batch(self, gamma: float, gae_lambda: float, is_clip_max: float) -> Batch:
        """The K storages' batches (disjoint envs) concatenated, on the training device."""
        parts = [batch_from_storage(st, self.N, self.T, gamma, gae_lambda, is_clip_max) for st in self.storages]
        batch = parts[0]
        for part in parts[1:]:
            batch = Batch.concatenate(batch, part)
        return batch.to(self.device)

    def start_next_rollout(self) -> None:
        self._send_all(("next",))
        self.stats.carried = sum(a[0] for a in self._receive_all("carried"))

    def mean_step_times(self) -> np.ndarray:
        return self.step_times

    def close(self, timeout: float = 10.0) -> None:
        """Asks every inference worker to exit (each closes its env workers), then terminates what is left."""
        shutdown_processes(self.processes, self.conns, ("close",), timeout, terminate_grace=5.0)
        self.processes, self.conns = [], []


# =====================================================================================================================
# DD-PPO (Sec. 2.3): every rank collects and learns; gradients are all-reduced
# =====================================================================================================================
@dataclass
class World:
    """This process's place in a torchrun launch (world size 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        y = x.to(self.comm_device).clone()
        dist.all_reduce(y)
        return y.to(x.device)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world_size, *x.shape): every rank's x, in rank order."""
        if self.world_size == 1:
            return x.unsqueeze(0)
        y = x.to(self.comm_device)
        out = [torch.empty_like(y) for _ in range(self.world_size)]
        dist.all_gather(out, y)
        return torch.stack(out).to(x.device)

    def broadcast_object(self, obj):
        if self.world_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, device=self.comm_device)
        return holder[0]


def init_world(args: Args) -> World:
    """Joins the torchrun process group (NCCL on GPUs, gloo on CPU); one GPU per local rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = None
    if world_size > 1:
        backend = args.dist_backend if args.dist_backend != "auto" else ("nccl" if use_cuda else "gloo")
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    return World(rank, world_size, local_rank, device, backend)


def allreduce_gradients(parameters: list[torch.nn.Parameter], world: World) -> None:
    """DD-PPO: average the gradients of all ranks, flattened into one tensor (one collective per minibatch)."""
    if world.world_size == 1:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    flat = world.all_reduce_sum(torch.cat([g.reshape(-1) for g in grads])) / world.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_obs_rms(obs_rms: Optional[RunningMeanStd], world: World) -> None:
    """Every rank normalizes with the same statistics: the ranks' running mean and variance are averaged."""
    if obs_rms is None or world.world_size == 1:
        return
    stacked = torch.stack([obs_rms.mean, obs_rms.var + obs_rms.mean.square()])
    mean, second = world.all_reduce_sum(stacked) / world.world_size
    obs_rms.mean, obs_rms.var = mean, (second - mean.square()).clamp(min=0.0)
    obs_rms.count = world.all_reduce_sum(obs_rms.count.reshape(1))[0] / world.world_size


def preemption_deadline(collector: Collector, world: World, args: Args, learn_time: float) -> tuple[float, float]:
    """Sec. 2.3: the rollout time t* maximizing S / (Time(S) + LT) over all ranks' envs, from each env's mean step
    time in the previous rollout and the mean learning time LT. Every rank computes the same t* from the gathered
    numbers. Returns (t* or inf when no rank needs preempting, t*)."""
    local = torch.tensor([*collector.mean_step_times(), learn_time], dtype=torch.float64)
    gathered = world.all_gather(local).numpy()
    N = args.num_envs
    t_star, _, t_full = optimal_preemption_time(gathered[:, :N], args.batch_size, collector.quota,
                                                float(gathered[:, N].mean()))
    return (t_star if t_star < t_full else math.inf), t_star


# =====================================================================================================================
# PPO update
# =====================================================================================================================
def ppo_update(args: Args, agent: Agent, optimizer: torch.optim.Optimizer, batch: Batch, world: World,
               rng: np.random.Generator) -> dict:
    """PPO epochs over VER minibatches (Sec. 2.2), losses weighted by the truncated importance weights (Sec. 4):
    mean(w * clipped surrogate), mean(w * value loss), mean(w * entropy). With --learned-ent-coef the entropy
    coefficient alpha minimizes alpha * ([H]_sg - target) while the policy maximizes [alpha]_sg * H (Sec. 4)."""
    device = batch.obs.device
    trained = [p for p in agent.parameters() if p.requires_grad]
    policy_params = [p for name, p in agent.named_parameters() if name != "log_ent_coef"]
    totals = torch.zeros(8, device=device)
    updates = 0
    stop = False
    for _ in range(args.update_epochs):
        for mb_idx, piece_lengths in make_minibatches(batch.lengths, args.num_minibatches, rng):
            idx = torch.as_tensor(mb_idx, device=device)
            state0 = None
            if agent.recurrent:  # each piece starts from the stored state of its first step
                first = torch.as_tensor(mb_idx[np.concatenate([[0], np.cumsum(piece_lengths)[:-1]])], device=device)
                state0 = (batch.hidden_h[first].transpose(0, 1), batch.hidden_c[first].transpose(0, 1))
            newlogprob, entropy, newvalue = agent.evaluate(batch.obs[idx], batch.actions[idx], state0, piece_lengths)
            logratio = newlogprob - batch.logprobs[idx]
            ratio = logratio.exp()
            with torch.no_grad():
                old_approx_kl = (-logratio).mean()
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
            if args.target_kl is not None:
                mean_kl = world.all_reduce_sum(approx_kl.reshape(1))[0] / world.world_size  # same decision on every rank
                if mean_kl.item() > args.target_kl:
                    stop = True
                    break
            advantages = batch.advantages[idx]
            if args.norm_adv:
                advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
            w = batch.weights[idx] if args.importance_weights else torch.ones_like(advantages)
            pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef))
            returns, old_values = batch.returns[idx], batch.values[idx]
            v = (newvalue - returns).square()
            if args.clip_vloss:
                clipped = old_values + (newvalue - old_values).clamp(-args.clip_coef, args.clip_coef)
                v = torch.max(v, (clipped - returns).square())
            pg_loss, v_loss, ent = (w * pg).mean(), 0.5 * (w * v).mean(), (w * entropy).mean()
            alpha = agent.log_ent_coef.exp()
            loss = pg_loss + args.vf_coef * v_loss - alpha.detach() * ent
            if args.learned_ent_coef:
                loss = loss + alpha * (ent.detach() - args.target_entropy)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_gradients(trained, world)
            grad_norm = nn.utils.clip_grad_norm_(policy_params, args.max_grad_norm)
            optimizer.step()
            totals += torch.stack([pg_loss.detach(), v_loss.detach(), entropy.detach().mean(), old_approx_kl,
                                   approx_kl, clipfrac, grad_norm.detach(), alpha.detach()])
            updates += 1
        if stop:
            break
    names = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm", "ent_coef")
    out = dict(zip(names, (totals / max(updates, 1)).tolist()))
    out["ent_coef"] = float(agent.log_ent_coef.detach().exp())
    out["minibatch_updates"] = updates
    with torch.no_grad():
        var_returns = batch.returns.var()
        out["explained_variance"] = float(1 - (batch.returns - batch.values).var() / var_returns) if var_returns > 0 else math.nan
    return out


def learning_rate_at(args: Args, global_step: int) -> float:
    """--lr-schedule: constant, or decayed to zero over --total-timesteps linearly or with a cosine (Sec. 4)."""
    frac = min(global_step / args.total_timesteps, 1.0)
    if args.lr_schedule == "linear":
        return args.learning_rate * (1.0 - frac)
    if args.lr_schedule == "cosine":
        return args.learning_rate * 0.5 * (1.0 + math.cos(math.pi * frac))
    return args.learning_rate


# =====================================================================================================================
# Logging, checkpoints, evaluation
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


def save_checkpoint(path: Path, agent, optimizer, obs_rms, global_step: int, iteration: int, policy_version: int,
                    args: Args) -> None:
    """Everything needed to resume: model, optimizer, normalizer, global step, iteration, policy version and RNG
    states. Written to a temporary file and renamed, so a crash never leaves a half-written checkpoint."""
    state = {
        "agent": agent.state_dict(), "optimizer": optimizer.state_dict(),
        "obs_rms": obs_rms.state_dict() if obs_rms is not None else None,
        "global_step": global_step, "iteration": iteration, "policy_version": policy_version,
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


def load_checkpoint(path: str, agent, optimizer, obs_rms) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own file: holds numpy RNG state
    try:
        agent.load_state_dict(state["agent"])
    except RuntimeError as e:
        saved = state.get("args", {})
        raise ArgsError(f"--checkpoint {path} does not fit this network (it was trained on {saved.get('env_id')}, "
                        f"recurrent={saved.get('recurrent')}); {e}") from e
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


@torch.no_grad()
def evaluate(agent: Agent, envs: list[EnvAdapter], obs_rms: Optional[RunningMeanStd], num_episodes: int, seed: int,
             device) -> dict:
    """Deterministic policy in the main process: rounds of one episode per eval env, stepped together, until
    `num_episodes` have ended. Returns the means of eval/return, episode_len, success_once, success_at_end."""
    results = []
    for round_index in range(math.ceil(num_episodes / len(envs))):
        k = len(envs)
        obs = np.stack([env.reset(seed=seed + round_index * k + i) for i, env in enumerate(envs)])
        state = agent.initial_state(k, device)
        active = np.ones(k, dtype=bool)
        ret, length = np.zeros(k), np.zeros(k, dtype=np.int64)
        success_once, success_end = np.zeros(k, dtype=bool), np.zeros(k, dtype=bool)
        while active.any():
            x = torch.as_tensor(obs, device=device)
            x = x.float() if x.is_floating_point() else x
            if obs_rms is not None:
                x = obs_rms.normalize(x)
            action, state = agent.deterministic_action(x, state)
            action = action.cpu().numpy()
            for i in np.flatnonzero(active):
                o, r, terminated, truncated, _, success = envs[i].step(action[i])
                obs[i] = o
                ret[i] += r
                length[i] += 1
                success_once[i] |= success
                success_end[i] = success
                if terminated or truncated:
                    active[i] = False
        results += [(ret[i], length[i], success_once[i], success_end[i]) for i in range(k)]
    r = np.array(results[:num_episodes], dtype=np.float64)
    return {"return": r[:, 0].mean(), "episode_len": r[:, 1].mean(), "success_once": r[:, 2].mean(),
            "success_at_end": r[:, 3].mean()}


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


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # SIGTERM (e.g. from torchrun): unwind, so that summary and workers are handled


# =====================================================================================================================
# Main
# =====================================================================================================================
def main(args: Args) -> dict:
    args = resolve_args(args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    world = init_world(args)
    try:
        return run(args, world)
    finally:
        if world.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run(args: Args, world: World) -> dict:
    device = world.device
    if args.torch_threads is not None or device.type == "cpu":
        torch.set_num_threads(args.torch_threads or 1)
    random.seed(args.seed + world.rank)
    np.random.seed(args.seed + world.rank)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (broadcast below as well)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # One env tells the spaces (rank 0 keeps it as its first evaluation env); then the network and the checkpoint.
    # Anything wrong so far is reported before a file is written or a process is started.
    probe = make_env(args, evaluation=True)
    spec = EnvSpec.of(probe)
    agent = make_agent(args, spec).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    obs_rms = RunningMeanStd(spec.obs_shape, device) if args.norm_obs and spec.obs_dtype == torch.float32 else None
    start_iteration, global_step, policy_version = 1, 0, 0
    if args.checkpoint:
        ckpt = load_checkpoint(args.checkpoint, agent, None if args.evaluate else optimizer, obs_rms)
        start_iteration, global_step = ckpt["iteration"] + 1, ckpt["global_step"]
        policy_version = ckpt.get("policy_version", 0)
        if not args.evaluate:
            restore_rng(ckpt["rng"])
            if world.is_main:
                print(f"resuming from {args.checkpoint} at iteration {start_iteration}, global step {global_step}")

    run_name = run_dir = logger = None
    if world.is_main:
        run_name, run_dir = make_run_dir(args)
        (run_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))
        logger = Logger(run_dir, args, run_name)
    run_name = world.broadcast_object(run_name)
    if world.world_size > 1:
        for tensor in agent.state_dict().values():
            if tensor.is_floating_point():
                synced = tensor.to(world.comm_device)
                dist.broadcast(synced, src=0)
                tensor.copy_(synced)
    torch.manual_seed(args.seed + 1000 * world.rank + start_iteration)  # per-rank action sampling

    summary: dict = {"run_dir": str(run_dir), "global_step": global_step, "interrupted": False}
    totals = {"collect_time_s": 0.0, "learn_time_s": 0.0, "env_busy_time_s": 0.0, "inference_time_s": 0.0}
    start_time = time.time()
    start_global_step = global_step
    workers = None
    context = dict(args=args, world=world, agent=agent, optimizer=optimizer, obs_rms=obs_rms, logger=logger,
                   run_dir=run_dir, eval_envs=[], summary=summary, totals=totals, spec=spec, device=device,
                   policy_version=policy_version)
    eval_envs: list[EnvAdapter] = [probe]
    try:
        if world.is_main:
            if args.capture_video:
                eval_envs = []
                probe.close()
                eval_envs = [make_env(args, evaluation=True, video_dir=str(run_dir / "videos"))]
            eval_envs += [make_env(args, evaluation=True) for _ in range(args.num_eval_envs - 1)]
            context["eval_envs"] = eval_envs
        else:
            eval_envs = []
            probe.close()
        if args.evaluate:
            metrics = evaluate(agent, eval_envs, obs_rms, args.num_eval_episodes, args.seed + 10_000, device)
            for k, v in metrics.items():
                logger.scalar(f"eval/{k}", v, global_step)
            print(" ".join(f"eval/{k}={v:.4f}" for k, v in metrics.items()))
            return summary
        base_seed = args.seed + world.rank * args.num_envs
        if args.num_inference_workers > 1:
            workers = collector = InferenceWorkers(args, spec, agent, obs_rms, device, base_seed,
                                                   seed=args.seed + 1000 * world.rank + start_iteration)
        else:
            slots = SharedSlots.allocate(args.num_envs, spec)
            workers = EnvWorkers(args, slots, base_seed)
            collector = Collector(args, workers, slots, agent, spec, obs_rms, device)
        collector.policy_updated(policy_version)
        collector.wait_until_ready()
        context["collector"] = collector
        train(context, start_iteration, global_step)
    except WorkerError as error:
        summary["error"] = str(error)
        raise
    except (KeyboardInterrupt, SystemExit):
        summary["interrupted"] = True
        if world.is_main:
            print("interrupted: writing summary.json" + (" and a checkpoint" if args.save_model else ""), file=sys.stderr)
            if args.save_model and "iteration" in summary and "collector" in context:
                save_checkpoint(run_dir / "final_ckpt.pt", agent, optimizer, obs_rms, summary["global_step"],
                                summary["iteration"], context["policy_version"], args)
        raise
    finally:
        if workers is not None:
            workers.close()
        if world.is_main:
            wall = time.time() - start_time
            summary.update(wall_time_s=wall, sps=(summary["global_step"] - start_global_step) / max(wall, 1e-9))
            summary.update(totals)
            if totals["env_busy_time_s"] > 0:  # the limit: every env simulating all the time, never waiting
                summary["ideal_sps"] = (summary["global_step"] - start_global_step) / (
                    totals["env_busy_time_s"] / (args.num_envs * world.world_size))
            summary.update(logger.last)
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            logger.close()
        for env in eval_envs:
            env.close()
    return summary


def train(ctx: dict, start_iteration: int, global_step: int) -> None:
    args, world, agent, optimizer = ctx["args"], ctx["world"], ctx["agent"], ctx["optimizer"]
    collector, obs_rms, logger, summary, totals = ctx["collector"], ctx["obs_rms"], ctx["logger"], ctx["summary"], ctx["totals"]
    device = ctx["device"]
    rng = np.random.default_rng(args.seed + 7919 * world.rank + start_iteration)
    is_toy = args.env_kind == "toy"
    if is_toy:
        targets = draw_target_actions(args.toy).to(device)
        blocks = torch.arange(args.toy.num_blocks, device=device)
        block_accuracy_history: list[np.ndarray] = []
    previous: Optional[Batch] = None
    learn_time = 0.0
    version = ctx["policy_version"]  # updates made so far (the learner's policy version)
    overlap = args.overlap_learning
    background: Optional[BackgroundRollout] = None
    if overlap:  # the collector acts with its own copy of the weights, refreshed after every update
        collector.agent = copy.deepcopy(agent).requires_grad_(False)
    train_start = time.time()
    start_step = global_step
    progress = None
    if args.progress_bar and world.is_main:
        from tqdm import tqdm

        mode = "VER" if args.variable_experience else ("sync" if args.sync else "NoVER")
        progress = tqdm(total=args.total_timesteps, initial=global_step, desc=f"{args.env_id} {mode}", unit="step",
                        dynamic_ncols=True)
    iteration = summary["iteration"] = start_iteration - 1
    # Until --total-timesteps env steps (all ranks): one rollout of T x N steps per rank per iteration, fewer when a
    # rank is preempted (its batch is then filled with old experience, so learning still sees T x N steps).
    while global_step < args.total_timesteps:
        iteration += 1
        lr = learning_rate_at(args, global_step)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # ---- collection (Sec. 2.1, 2.2), preempting stragglers among the ranks (Sec. 2.3) -----------------------
        deadline, t_star = math.inf, math.nan
        if world.world_size > 1 and args.straggler_preemption and previous is not None:
            deadline, t_star = preemption_deadline(collector, world, args, learn_time)
        collect_start = time.perf_counter()
        if background is not None:  # --overlap-learning: the rollout collected while the last update ran
            stats = background.result()
            background = None
            collector.agent.load_state_dict(agent.state_dict())
            collector.policy_version = version
        else:
            stats = collector.collect(collect_start + deadline)
        collect_time = time.perf_counter() - collect_start  # the time the learner waited for experience
        sync_obs_rms(obs_rms, world)

        # ---- learning (Sec. 2.2, 4): returns over sequences, importance weights, PPO ------------------------------
        learn_start = time.perf_counter()
        batch = collector.build_batch(args.gamma, args.gae_lambda, args.is_clip_max)
        returns_time = time.perf_counter() - learn_start
        steps_per_env = collector.steps_in_rollout.copy()
        collector.start_next_rollout()
        fresh = len(batch)
        if fresh < args.batch_size:  # preempted (Sec. 2.3): fill up with the previous rollout's experience
            batch = fill_from_previous(batch, previous, args.batch_size, rng)
        previous = batch
        version_gap = version - batch.versions

        # ---- counters of all ranks ---------------------------------------------------------------------------------
        episodes = np.array(stats.episodes, dtype=np.float64).reshape(-1, 4)
        local = torch.tensor([stats.env_steps, stats.collected, stats.env_busy, len(episodes), *episodes.sum(0),
                              float(stats.preempted), args.batch_size - fresh], dtype=torch.float64)
        total = world.all_reduce_sum(local).tolist()
        global_step += int(total[0])

        if overlap and global_step < args.total_timesteps:
            background = BackgroundRollout(collector)  # collects the next rollout during this update
        update_start = time.perf_counter()
        losses = ppo_update(args, agent, optimizer, batch, world, rng)
        update_time = time.perf_counter() - update_start
        version += 1
        ctx["policy_version"] = version
        if not overlap:
            collector.policy_updated(version)
        learn_time = time.perf_counter() - learn_start

        if progress is not None:
            progress.update(int(total[0]))
        totals["collect_time_s"] += collect_time
        totals["learn_time_s"] += learn_time
        totals["env_busy_time_s"] += total[2]
        totals["inference_time_s"] += stats.inference_time
        summary["iteration"], summary["global_step"] = iteration, global_step  # completed iterations only
        if not world.is_main:
            continue

        # ---- logging (rank 0) ---------------------------------------------------------------------------------------
        log = logger.scalar
        sps = (global_step - start_step) / (time.time() - train_start)
        log("charts/SPS", sps, global_step)
        log("charts/learning_rate", lr, global_step)
        n_episodes = total[3]
        if n_episodes > 0:
            log("charts/episodic_return", total[4] / n_episodes, global_step)
            log("charts/episodic_length", total[5] / n_episodes, global_step)
            log("charts/success_rate", total[6] / n_episodes, global_step)
            log("train/success_at_end", total[7] / n_episodes, global_step)
        for name, value in losses.items():
            log(f"losses/{name}", value, global_step)
        weights = batch.weights
        log("ver/steps_per_env_min", steps_per_env.min(), global_step)
        log("ver/steps_per_env_mean", steps_per_env.mean(), global_step)
        log("ver/steps_per_env_max", steps_per_env.max(), global_step)
        log("ver/importance_weight_min", weights.min(), global_step)
        log("ver/importance_weight_mean", weights.mean(), global_step)
        log("ver/importance_weight_max", weights.max(), global_step)
        log("ver/stale_fraction", (version_gap > 0).mean(), global_step)
        log("ver/policy_version_gap", version_gap.mean(), global_step)
        log("ver/policy_version_gap_max", version_gap.max(), global_step)
        sizes = np.array(stats.batch_sizes if stats.batch_sizes else [0])
        log("ver/inference_batch_size_min", sizes.min(), global_step)
        log("ver/inference_batch_size_mean", sizes.mean(), global_step)
        log("ver/inference_batch_size_max", sizes.max(), global_step)
        log("ver/inference_batches", len(stats.batch_sizes), global_step)
        logger.writer.add_histogram("ver/inference_batch_size", sizes, global_step)
        log("ver/inflight_carried", stats.carried, global_step)
        log("ver/waiting_at_end", stats.pending, global_step)
        log("ver/num_sequences", len(batch.lengths), global_step)
        log("ver/env_utilization", stats.env_busy / (args.num_envs * max(stats.duration, 1e-9)), global_step)
        log("ver/preempted_ranks", total[8], global_step)
        log("ver/filled_fraction", total[9] / (args.batch_size * world.world_size), global_step)
        if not math.isnan(t_star):
            log("ver/preemption_time", t_star, global_step)
        log("time/collect", collect_time, global_step)
        log("time/learn", learn_time, global_step)
        log("time/compute_returns", returns_time, global_step)
        log("time/update", update_time, global_step)
        log("time/inference", stats.inference_time, global_step)
        log("time/wait", stats.wait_time, global_step)
        log("time/env_step", stats.env_busy / max(stats.env_steps, 1), global_step)
        if is_toy:
            with torch.no_grad():
                fresh_obs, fresh_actions = batch.obs[:fresh], batch.actions[:fresh]
                log("toy/accuracy", (fresh_actions == targets[fresh_obs]).float().mean(), global_step)
                block_accuracy = agent.action_probs(blocks).gather(-1, targets.view(-1, 1)).squeeze(-1).cpu().numpy()
            block_accuracy_history.append(block_accuracy)
            history = np.stack(block_accuracy_history)
            log("toy/block_accuracy_mean", block_accuracy.mean(), global_step)
            log("toy/block_accuracy_min", block_accuracy.min(), global_step)
            log("toy/forgetting_mean", (history.max(0) - history[-1]).mean(), global_step)
        if progress is not None:
            progress.set_postfix(sps=f"{sps:.0f}", ret=f"{logger.last.get('charts/episodic_return', math.nan):.2f}",
                                 success=f"{logger.last.get('charts/success_rate', math.nan):.2f}")
        if args.eval_freq and iteration % args.eval_freq == 0 and global_step < args.total_timesteps:
            run_evaluation(ctx, global_step, iteration, final=False)
    if progress is not None:
        progress.close()
    if world.world_size > 1:  # DD-PPO keeps the ranks' weights identical: check it (summary.json)
        flat = torch.cat([p.detach().reshape(-1).float() for p in agent.parameters()])
        gathered = world.all_gather(flat)
        summary["ddp/max_weight_difference"] = float((gathered - gathered[0]).abs().max())
    if world.is_main:
        run_evaluation(ctx, global_step, iteration, final=True)


def run_evaluation(ctx: dict, global_step: int, iteration: int, final: bool) -> None:
    args, logger = ctx["args"], ctx["logger"]
    start = time.time()
    metrics = evaluate(ctx["agent"], ctx["eval_envs"], ctx["obs_rms"], args.num_eval_episodes,
                       args.seed + 10_000 + iteration, ctx["device"])
    for k, v in metrics.items():
        logger.scalar(f"eval/{k}", v, global_step)
    logger.scalar("time/eval", time.time() - start, global_step)
    if args.save_model:
        name = "final_ckpt.pt" if final else f"ckpt_{global_step}.pt"
        save_checkpoint(ctx["run_dir"] / name, ctx["agent"], ctx["optimizer"], ctx["obs_rms"], global_step, iteration,
                        ctx["policy_version"], args)


if __name__ == "__main__":
    cli_args = tyro.cli(Args)
    try:
        main(cli_args)
    except ArgsError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except WorkerError as error:
        print(f"error: {error.who} failed; the run was stopped.\n{error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
