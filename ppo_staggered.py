"""PPO with staggered environment resets, for massively parallel simulation (ManiSkill3, MuJoCo) and the toy chain.

Paper: "Staggered Environment Resets Improve Massively Parallel On-Policy Reinforcement Learning",
Sid Bharthulwar, Stone Tao, Hao Su (2025), arXiv:2511.21011.

With N envs, rollouts of K steps and a horizon H >> K, synchronous resets make every batch one K-step slice of the task,
cycling through the horizon every H/K updates (Sec. 3.2). Staggered resets advance group j of N_B = ceil(H/K) groups by
j*S steps (S = K) before training, so that every batch holds every stage (Sec. 3.3, App. B.1). A group resets at its
"reset gate", when its horizon ends; an env that terminates early waits, masked out of the loss, for the next gate of
any group. --no-stagger is Tables 1/3's naive baseline (immediate partial resets); --reset-scheme random-start
(legged_gym's init_at_random_ep_len, Sec. 5.3) cuts first episodes to U[1, H] steps.

This is ManiSkill's PPO baseline (examples/baselines/ppo/ppo.py) with the paper's changes, each marked "STAGGER", and
the departures in the map. Under torchrun, G ranks of N envs (each stepping and staggering its own) train as G x N envs.

Map from the paper to this file
  Sec. 3.3, App. B.1  stagger_groups, stagger_start_steps, stagger_advance         (groups, offsets j*S, their actions)
  Sec. 3.3 resets     ResetState, is_reset_gate, PartialResetVecEnv                (gates, loss masks, autoreset modes)
  Sec. 2, 5.3 [21]    random_start_lengths, "RANDOM START"                         (--reset-scheme random-start)
  App. B.2, Table 2   toy_chain_env.TABLE2_PPO, toy_chain_env.ChainAgent           (PPO's settings and network)
  App. B.3, Table 3   PRESETS[ManiSkill task ids], MANISKILL_COMMON, GaussianAgent, RunningMeanStd (obs. normalized)
  (not in the paper)  MUJOCO_PRESET, RunningMeanStd.scale                          (MuJoCo: CPU envs, reward scaling)
  (not in ppo.py)     PartialResetVecEnv, ppo_update (target KL), evaluate          (Gymnasium envs, protocol)
  (not in ppo.py)     resume_problem, "RESUME", main's save (a checkpoint)  (the run continues; ToyChain: bit-identical)
  App. C, Fig. 6      batch_temporal_stats, toy_diagnostics.npz                    (figures: benchmarks/toy_sweeps.py)
  App. E.0.1          stagger/value_mse, stagger/policy_kl, toy/forgetting_mean    (toy_chain_env.ToyChainDiagnostics)
  Sec. 5.4 (large N)  all_reduce_sum, RunningMeanStd.merge_ranks, "DDP"            (torchrun: ranks x N envs)

  python ppo_staggered.py                                      # ToyChain-v0 (Table 2 PPO), ~30 s on a CPU
  python ppo_staggered.py --env-id StackCube-v1 --no-stagger   # Table 3's naive baseline on a CUDA GPU
  torchrun --nproc_per_node 2 ppo_staggered.py --env-id StackCube-v1   # 2 GPUs (NCCL; gloo with --no-cuda)
  python ppo_staggered.py --env-id HalfCheetah-v5 --reset-scheme random-start   # 256 MuJoCo envs on a CPU
"""

from __future__ import annotations

import glob
import json
import math
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal, Optional

import gymnasium as gym
import imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter

from toy_chain_env import TABLE2_PPO, ChainAgent, ToyChainConfig, ToyChainDiagnostics


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of python, numpy, torch and the environments, >= 0 (rank r of torchrun: seed + r * N)"""
    torch_deterministic: bool = True
    """sets torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """use CUDA when it is available (then ManiSkill's GPU simulation; without it, "CPU" presets: a short trial)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{env_id}__{exp_name}__{seed}__{unix_time}/"""
    track: bool = False
    """mirror the TensorBoard scalars to Weights & Biases"""
    wandb_project_name: str = "staggered-resets"
    """wandb project name"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    capture_video: bool = False
    """film the first 8 evaluation envs at every evaluation into videos/ (ManiSkill, Gymnasium tasks; not ToyChain)"""
    save_model: bool = False
    """write checkpoints (ckpt_{global_step}.pt at every evaluation, final_ckpt.pt at the end and on Ctrl-C)"""
    checkpoint: Optional[str] = None
    """continue the run of this checkpoint, in its folder (not --output-dir), or evaluate it (--evaluate)"""
    evaluate: bool = False
    """only evaluate the policy of --checkpoint: one result line and eval_<name>.json (and videos) beside it"""
    progress_interval: float = 15.0
    """seconds between two progress lines, >= 1"""
    quiet: bool = False
    """no progress lines (settings, evaluations and errors still print)"""

    env_id: str = "ToyChain-v0"
    """ToyChain-v0, a ManiSkill3 task (StackCube-v1, ...), MuJoCo (HalfCheetah-v5, ...) or another Gymnasium Box task"""
    num_envs: Optional[int] = None
    """envs per rank >= 1 (ToyChain 512; Table 3 4096, AnymalC 512, TwoRobot 2048, G1 1024; CPU 8; MuJoCo, Gym 256)"""
    num_eval_envs: Optional[int] = None
    """evaluation envs, >= 1 (ToyChain, ManiSkill 128; CPU, MuJoCo, Gym 8)"""
    horizon: Optional[int] = None
    """horizon H >= 1 (Table 3 100, AnymalC 200, Humanoid 1000, G1 500; else the time limit; ToyChain --toy.horizon)"""
    toy: ToyChainConfig = field(default_factory=ToyChainConfig)
    """ToyChain-v0 settings (App. B.2)"""

    total_timesteps: Optional[int] = None
    """env steps of all ranks, >= 1 (ToyChain 384000: 150 updates; ManiSkill 2e8, CPU 3e4; MuJoCo, Gym 3e6)"""
    learning_rate: float = 3e-4
    """Adam learning rate, > 0 (Tables 2 and 3)"""
    num_steps: Optional[int] = None
    """rollout length K >= 1 (ToyChain 5; StackCube, PushT 8, Humanoid 64, G1 32, others 16; MuJoCo, Gym 8)"""
    gamma: Optional[float] = None
    """discount in [0, 1] (Table 3 0.8, PushT, AnymalC 0.99, Humanoid 0.97; ToyChain, MuJoCo, Gym 0.99)"""
    gae_lambda: Optional[float] = None
    """GAE lambda in [0, 1] (Table 3 0.9, AnymalC 0.95; ToyChain, MuJoCo, Gym 0.95)"""
    num_minibatches: Optional[int] = None
    """minibatches per epoch, >= 1 (Table 3 32; ToyChain, CPU 4; MuJoCo, Gym 8)"""
    update_epochs: int = 4
    """epochs over each batch, >= 1"""
    clip_coef: float = 0.2
    """PPO clipping coefficient, > 0"""
    ent_coef: Optional[float] = None
    """entropy bonus, >= 0 (ToyChain 0.01; ManiSkill 0.005; MuJoCo, Gym 0)"""
    vf_coef: float = 0.5
    """value-loss coefficient, >= 0"""
    max_grad_norm: float = 0.5
    """gradient-norm clip, > 0"""
    target_kl: Optional[float] = None
    """stop the update once approx KL exceeds this, >= 0, 0 = off (ManiSkill 0.1; others 0)"""
    normalize_reward: Optional[bool] = None
    """divide rewards by a running std of the discounted return, clip to +-10, as CleanRL's MuJoCo PPO (MuJoCo, Gym)"""
    bootstrap_at_done: Optional[Literal["always", "truncated"]] = None
    """bootstrap V(final obs) at every episode end ('always', default for ManiSkill) or only at truncations (others)"""

    reset_scheme: Literal["staggered", "naive", "random-start"] = "staggered"
    """staggered (Sec. 3.3), naive (synchronous: Tables 1/3's baseline) or random-start (first episodes U[1, H] long)"""
    stagger: bool = True
    """--no-stagger: the naive synchronous baseline (alias of --reset-scheme naive)"""
    advance_actions: Literal["policy", "random"] = "policy"
    """the stagger advance's actions (App. B.1): the initial policy's mean action, or uniform random in the bounds"""

    eval_freq: Optional[int] = None
    """evaluate every this many iterations, 0 = only at the end (ToyChain 10; ManiSkill 25, CPU 50; MuJoCo, Gym 50)"""
    cudagraphs: bool = False
    """replay the policy step and the PPO update as CUDA graphs (tensordict's CudaGraphModule, as ppo_fast.py)"""

    batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    num_iterations: tyro.conf.Suppress[int] = 0
    resolved_sim_backend: tyro.conf.Suppress[str] = ""
    num_stagger_groups: tyro.conf.Suppress[int] = 0
    stagger_step: tyro.conf.Suppress[int] = 0
    world_size: tyro.conf.Suppress[int] = 1


TOY_ENV_ID = "ToyChain-v0"
SCRIPT = os.path.basename(__file__)  # "ppo_staggered.py": every checkpoint names it
VIDEO_ENVS = 8  # --capture-video records this many evaluation envs at most, as ManiSkill's baselines
PRESETS: dict[str, dict] = {
    TOY_ENV_ID: TABLE2_PPO,  # App. B.2, Table 2: PPO on the toy chain (N = 512, K = 5, 150 updates)
    # App. B.3, Table 3: per-task K, H, gamma, lambda and N of the ManiSkill experiments.
    "StackCube-v1": dict(num_steps=8, horizon=100, gamma=0.8, gae_lambda=0.9, num_envs=4096),
    "PushT-v1": dict(num_steps=8, horizon=100, gamma=0.99, gae_lambda=0.9, num_envs=4096),
    "AnymalC-Reach-v1": dict(num_steps=16, horizon=200, gamma=0.99, gae_lambda=0.95, num_envs=512),
    "MS-HumanoidWalk-v1": dict(num_steps=64, horizon=1000, gamma=0.97, gae_lambda=0.9, num_envs=4096),
    "TwoRobotPickCube-v1": dict(num_steps=16, horizon=100, gamma=0.8, gae_lambda=0.9, num_envs=2048),
    "UnitreeG1TransportBox-v1": dict(num_steps=32, horizon=500, gamma=0.8, gae_lambda=0.9, num_envs=1024),
}
# Table 3, common rows: 32 minibatches, entropy 0.005, target KL 0.1, 2e8 steps, 128 eval envs.
MANISKILL_COMMON = dict(
    num_minibatches=32, ent_coef=0.005, target_kl=0.1, total_timesteps=200_000_000, eval_freq=25, num_eval_envs=128
)
# ManiSkill tasks without a Table 3 row: ManiSkill's own PPO baseline settings (H is the task's registered one).
MANISKILL_OTHER = dict(num_steps=16, gamma=0.8, gae_lambda=0.9, num_envs=4096)
# Without CUDA: a short trial on CPU simulation (one process per env), about 3 minutes (StackCube) on 2 cores.
MANISKILL_CPU_TRIAL = dict(num_envs=8, num_minibatches=4, num_eval_envs=8, total_timesteps=30_000, eval_freq=50)
MUJOCO_PRESET = {  # Gymnasium Box tasks, set for MuJoCo locomotion (HalfCheetah-v5, ...): H = the time limit, 1000
    "num_envs": 256,
    "num_steps": 8,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "num_minibatches": 8,
    "ent_coef": 0.0,
    "target_kl": 0.0,
    "normalize_reward": True,
    "total_timesteps": 3_000_000,
    "eval_freq": 50,
    "num_eval_envs": 8,
}


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or process starts."""


def resolve_args(args: Args) -> Args:
    """Fills the task presets and derived sizes into a copy of `args` and checks it. Raises ArgsError."""
    args = replace(args, toy=replace(args.toy))
    headless = not (os.environ.get("MUJOCO_GL") or os.environ.get("DISPLAY"))
    if args.capture_video and headless and args.env_id in gym.registry and args.env_id != TOY_ENV_ID:  # Gymnasium's
        # MUJOCO_GL before MuJoCo is imported (ManiSkill's import below does): the first that renders the task here
        probe = f"import gymnasium as gym; env = gym.make({args.env_id!r}, render_mode='rgb_array'); env.reset(); "
        for backend in ("egl", "osmesa"):
            env = {**os.environ, "MUJOCO_GL": backend}
            probed = subprocess.run([sys.executable, "-c", probe + "env.render()[0]"], env=env, capture_output=True)
            if probed.returncode == 0:
                os.environ["MUJOCO_GL"] = backend
                break
        else:
            reason = (probed.stderr.decode().strip() or "no output").splitlines()[-1]
            raise ArgsError(f"--capture-video: {args.env_id} renders no frame here (MUJOCO_GL egl, osmesa: {reason})")
    from mani_skill.utils.assets.data import is_data_source_downloaded
    from mani_skill.utils.registration import REGISTERED_ENVS

    kind = "toy" if args.env_id == TOY_ENV_ID else "maniskill" if args.env_id in REGISTERED_ENVS else "gym"
    if kind == "gym" and args.env_id not in gym.registry:
        raise ArgsError(f"--env-id {args.env_id!r} is not ToyChain-v0, a ManiSkill3 task or a Gymnasium id")
    if kind == "toy":
        args.resolved_sim_backend = "torch"
        preset = PRESETS[TOY_ENV_ID]
    elif kind == "gym":
        args.resolved_sim_backend = "cpu"
        preset = MUJOCO_PRESET
    else:
        gpu = f"physx_cuda:{os.environ.get('LOCAL_RANK', '0')}"  # DDP: torchrun's rank on this machine, its GPU
        args.resolved_sim_backend = gpu if args.cuda and torch.cuda.is_available() else "physx_cpu"
        preset = {**MANISKILL_COMMON, **PRESETS.get(args.env_id, MANISKILL_OTHER)}
        if args.resolved_sim_backend == "physx_cpu":
            print(f"note: no CUDA GPU, so {args.env_id} runs a short CPU trial {MANISKILL_CPU_TRIAL} (flags override).")
            print(f"  Table 3 needs a CUDA GPU: {preset['num_envs']} envs, {preset['total_timesteps']:.0e} steps.")
            preset = {**preset, **MANISKILL_CPU_TRIAL}
    args = replace(args, **{name: value for name, value in preset.items() if getattr(args, name) is None})
    args.normalize_reward = bool(args.normalize_reward)  # (on in the MuJoCo preset only)
    domains = [  # (flag, value, whether it is in the flag's domain, the domain); presets filled in (--toy.*: below)
        ("--seed", args.seed, args.seed >= 0, ">= 0"),
        ("--num-envs", args.num_envs, args.num_envs >= 1, ">= 1"),
        ("--num-eval-envs", args.num_eval_envs, args.num_eval_envs >= 1, ">= 1"),
        ("--horizon", args.horizon, args.horizon is None or args.horizon >= 1, ">= 1"),
        ("--total-timesteps", args.total_timesteps, args.total_timesteps >= 1, ">= 1"),
        ("--learning-rate", args.learning_rate, args.learning_rate > 0, "> 0"),
        ("--num-steps", args.num_steps, args.num_steps >= 1, ">= 1"),
        ("--gamma", args.gamma, 0 <= args.gamma <= 1, "in [0, 1]"),
        ("--gae-lambda", args.gae_lambda, 0 <= args.gae_lambda <= 1, "in [0, 1]"),
        ("--num-minibatches", args.num_minibatches, args.num_minibatches >= 1, ">= 1"),
        ("--update-epochs", args.update_epochs, args.update_epochs >= 1, ">= 1"),
        ("--clip-coef", args.clip_coef, args.clip_coef > 0, "> 0"),
        ("--ent-coef", args.ent_coef, args.ent_coef >= 0, ">= 0"),
        ("--vf-coef", args.vf_coef, args.vf_coef >= 0, ">= 0"),
        ("--max-grad-norm", args.max_grad_norm, args.max_grad_norm > 0, "> 0"),
        ("--target-kl", args.target_kl, args.target_kl >= 0, ">= 0 (0 = off)"),
        ("--eval-freq", args.eval_freq, args.eval_freq >= 0, ">= 0 (0 = only at the end)"),
        ("--progress-interval", args.progress_interval, args.progress_interval >= 1, ">= 1"),
    ]
    for flag, value, in_domain, domain in domains:
        if not in_domain:
            raise ArgsError(f"{flag} {value}: must be {domain}")
    stored = read_checkpoint(args.checkpoint) if args.checkpoint else None  # (its shapes: at the build)
    if stored and stored["env_id"] != args.env_id:
        raise ArgsError(f"--checkpoint {args.checkpoint}: a checkpoint of {stored['env_id']}, not of {args.env_id}")
    toy_flags = [name for name, value in asdict(args.toy).items() if value != getattr(ToyChainConfig, name)]
    if kind != "toy" and toy_flags:
        raise ArgsError(f"--toy.{toy_flags[0].replace('_', '-')}: an option of ToyChain-v0, not of {args.env_id}")
    if kind == "toy" and args.horizon is not None:
        raise ArgsError(f"--horizon {args.horizon}: ToyChain-v0's horizon is --toy.horizon")
    if kind == "toy" and args.capture_video:
        raise ArgsError("--capture-video: ToyChain-v0 renders nothing (its observations are block indices)")
    if args.evaluate and (args.save_model or args.track):
        raise ArgsError("--save-model, --track: --evaluate writes no run, only eval_<name>.json beside the checkpoint")
    if not args.track and (args.wandb_entity or args.wandb_project_name != Args.wandb_project_name):
        raise ArgsError("--wandb-project-name, --wandb-entity: only with --track")
    if args.quiet and args.progress_interval != Args.progress_interval:
        raise ArgsError("--progress-interval: --quiet prints no progress lines")
    if kind == "toy":
        try:
            args.toy.validate()  # its numeric flags' domains, H a multiple of the block length L, ...
        except ValueError as error:
            raise ArgsError(str(error)) from error
    if args.bootstrap_at_done is None:
        args.bootstrap_at_done = "always" if kind == "maniskill" else "truncated"
    if not args.stagger and args.reset_scheme == "random-start":
        raise ArgsError("--no-stagger means --reset-scheme naive: pass --no-stagger or --reset-scheme random-start")
    args.reset_scheme = "naive" if not args.stagger else args.reset_scheme
    args.stagger = args.reset_scheme == "staggered"  # (config.json then records both consistently)
    args.horizon = args.toy.horizon if kind == "toy" else (args.horizon or gym.spec(args.env_id).max_episode_steps or 0)
    if args.horizon < 1:
        raise ArgsError(f"--horizon: {args.env_id} has no registered max_episode_steps; pass --horizon H")
    H, K = args.horizon, args.num_steps
    if K > H:
        raise ArgsError(f"--num-steps K={K} is longer than the task horizon H={H} (staggering needs K <= H)")
    # App. B.1: N_B = ceil(H / K), at most N. Sec. 3.3: "A standard choice is S = K"; with N_B = N < H / K groups,
    # S = floor(H / N_B) >= K spreads them over the horizon, the last starting before H.
    args.num_stagger_groups = min(math.ceil(H / K), args.num_envs) if args.stagger else 1
    args.stagger_step = max(K, H // args.num_stagger_groups) if args.num_stagger_groups > 1 else K
    if args.advance_actions == "random" and args.num_stagger_groups == 1:
        raise ArgsError(f"--advance-actions random: no stagger advance runs ({args.reset_scheme} resets, N_B = 1)")
    args.batch_size = args.num_envs * K
    if args.batch_size % args.num_minibatches != 0:
        raise ArgsError(f"batch N*K = {args.batch_size} does not split into --num-minibatches {args.num_minibatches}")
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))  # DDP: torchrun's number of ranks
    steps = args.batch_size * args.world_size
    args.num_iterations = args.total_timesteps // steps
    if args.num_iterations < 1 and not args.evaluate:
        raise ArgsError(f"--total-timesteps {args.total_timesteps} is less than one batch (N*K*ranks = {steps})")
    stored_steps = stored.get("steps_per_iteration", steps) if stored else steps  # (RESUME: iterations of its size)
    if not args.evaluate and stored_steps != steps:
        shape = f"--num-envs {args.num_envs}, --num-steps {K}, {args.world_size} ranks: {steps} env steps an iteration"
        raise ArgsError(f"{shape}, the checkpoint's {stored_steps}: pass ones whose N*K*ranks is {stored_steps}")
    if stored and not args.evaluate and stored["global_step"] >= args.num_iterations * steps:
        at = f"the checkpoint is at global step {stored['global_step']} already"
        raise ArgsError(f"--total-timesteps {args.total_timesteps}: {at}; pass a larger value")
    if args.evaluate and not args.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    if args.cudagraphs and (args.world_size > 1 or not (args.cuda and torch.cuda.is_available())):
        raise ArgsError("--cudagraphs: one process on a CUDA GPU only (no torchrun all-reduces or CPU work in graphs)")
    # DDP: every rank would prompt for AnymalC's robot download at once
    if args.env_id == "AnymalC-Reach-v1" and args.world_size > 1 and not is_data_source_downloaded("anymal_c"):
        raise ArgsError("--env-id AnymalC-Reach-v1: python -m mani_skill.utils.download_asset anymal_c first")
    icd_files = glob.glob("/usr/share/vulkan/icd.d/*.json") + glob.glob("/etc/vulkan/icd.d/*.json")
    if kind == "maniskill" and sys.platform.startswith("linux") and not (icd_files or os.getenv("VK_ICD_FILENAMES")):
        raise ArgsError("ManiSkill3 needs a Vulkan driver, even for state-only simulation: bash .ci/install_system.sh")
    return args


def read_checkpoint(path: str) -> dict:
    """A checkpoint of this script, loaded on the CPU (before any env starts); else ArgsError, naming what it found."""
    if not os.path.isfile(path):
        raise ArgsError(f"--checkpoint {path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise ArgsError(f"--checkpoint {path}: not a checkpoint of {SCRIPT} ({str(error).splitlines()[0]})") from error
    script = checkpoint.get("script") if isinstance(checkpoint, dict) else None
    if script != SCRIPT:
        found = f"a checkpoint of {script}, not" if script else "not a checkpoint"
        raise ArgsError(f"--checkpoint {path}: {found} of {SCRIPT}")
    return checkpoint


def format_settings(args: Args, device: torch.device) -> str:
    """The resolved settings as `name=value` pairs (toy.horizon=200 on the toy chain only) and the device in use."""
    pairs = [f"{name}={value}" for name, value in asdict(args).items() if name not in ("toy", "cuda")]
    if args.env_id == TOY_ENV_ID:  # (not the test hook toy.crash_at_step)
        pairs += [f"toy.{name}={value}" for name, value in asdict(args.toy).items() if name != "crash_at_step"]
    pairs.append(f"device={device}")
    return "settings:\n" + textwrap.fill(" ".join(pairs), 120, initial_indent="  ", subsequent_indent="  ")


# ---- Environments ----------------------------------------------------------------------------------------------------
def make_maniskill_env(args: Args, num_envs: int, evaluation: bool, video_dir: Optional[str]):
    """A ManiSkill3 task: state observations, time limit H, multi-agent actions flattened (it clips actions itself)."""
    import mani_skill.envs  # noqa: F401  (registers the tasks in this process)
    from mani_skill.utils.wrappers.flatten import FlattenActionSpaceWrapper
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper
    from mani_skill.utils.wrappers.record import RecordEpisode

    # physx_cuda:i renders on GPU i, not ManiSkill's GPU 0 (not "none": PushT-v1 reads render shapes as it builds);
    # without CUDA, on the CPU (asked for the GPU, every env process would warn that it falls back to the CPU)
    gpu_simulation = args.resolved_sim_backend.startswith("physx_cuda")
    cpu_render = "gpu" if torch.cuda.is_available() else "cpu"
    render_backend = args.resolved_sim_backend.replace("physx_", "") if gpu_simulation else cpu_render
    env = gym.make(
        args.env_id,
        num_envs=num_envs,
        obs_mode="state",
        sim_backend=args.resolved_sim_backend,
        render_backend=render_backend,
        max_episode_steps=args.horizon,
        reconfiguration_freq=1 if evaluation else None,  # evaluation: new object poses every episode
        render_mode="rgb_array" if video_dir else None,
    )
    if video_dir:  # the first VIDEO_ENVS sub-envs, tiled (RecordEpisode tiles all the frames the env renders)
        env = RecordEpisode(
            FirstFrames(env),
            video_dir,
            save_trajectory=False,
            max_steps_per_video=args.horizon,
            avoid_overwriting_video=True,  # numbered on past the videos there: a resume and --evaluate overwrite none
        )
        env.video_nrows = int(math.sqrt(min(num_envs, VIDEO_ENVS)))
    if args.resolved_sim_backend == "physx_cpu":  # one env with numpy outputs, for a Gymnasium vector env
        env = CPUGymWrapper(env)
    if isinstance(env.unwrapped.single_action_space, gym.spaces.Dict):  # e.g. TwoRobotPickCube-v1 (one per robot)
        env = FlattenActionSpaceWrapper(env)
    return env


class FirstFrames(gym.Wrapper):
    """The frames of the first VIDEO_ENVS sub-envs only (on a GPU, a tile of 128 would take ~10 GB of host memory)."""

    def render(self):
        return self.env.render()[:VIDEO_ENVS]


class SingleEnvAdapter(gym.Wrapper):
    """Actions clipped to the (bounded) action space; a termination moved to info: PartialResetVecEnv resets."""

    def step(self, action):
        action = np.clip(action, self.action_space.low, self.action_space.high)  # (ClipAction would unbound the space)
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, False, truncated, {**info, "terminated": terminated}


def make_single_env(args: Args, evaluation: bool, video_dir: Optional[str], index: int):
    """Env `index` of a vector env: a physx_cpu ManiSkill task or a Gymnasium env, filmed if index < VIDEO_ENVS."""
    filmed = video_dir is not None and index < VIDEO_ENVS  # (by RecordEpisode on ManiSkill, else by evaluate)
    if args.resolved_sim_backend == "physx_cpu":
        return SingleEnvAdapter(make_maniskill_env(args, 1, evaluation, f"{video_dir}/env{index}" if filmed else None))
    render = {"render_mode": "rgb_array"} if filmed else {}  # (a user's env may take no render_mode)
    return SingleEnvAdapter(gym.make(args.env_id, max_episode_steps=args.horizon, **render))


class PartialResetVecEnv(gym.vector.VectorEnv):
    """A batched env without autoreset (ManiSkill on the GPU, a Gymnasium vector env) as a same-step autoreset vector
    env of torch tensors: it resets truncated envs, and terminated ones if `reset_on_termination` (else the loop resets
    them at a reset gate, Sec. 3.3). info holds "final_obs" only when some env reset: the loop reads that, no sync."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, env, num_envs: int, device: torch.device, reset_on_termination: bool):
        self.env, self.num_envs, self.device = env, num_envs, device
        self.reset_on_termination = reset_on_termination
        self.batched_maniskill = not isinstance(env, gym.vector.VectorEnv)  # physx_cuda: resets by env_idx
        source = env.unwrapped if self.batched_maniskill else env
        self.single_observation_space = source.single_observation_space
        self.single_action_space = getattr(env, "single_action_space", None) or source.single_action_space  # flattened
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def tensor(self, data, dtype) -> torch.Tensor:
        """A copy (a reset may write into the simulator's outputs), on the device, one row per env."""
        data = torch.as_tensor(data if torch.is_tensor(data) else np.asarray(data), device=self.device, dtype=dtype)
        return data.reshape(self.num_envs, -1).squeeze(-1).clone()

    def reset(self, *, seed=None, options=None):
        mask = None if options is None else options.get("reset_mask")
        if mask is None:
            obs, _ = self.env.reset(seed=seed)
        elif self.batched_maniskill:
            obs, _ = self.env.reset(options={"env_idx": mask.nonzero()[:, 0].to(self.env.unwrapped.device)})
        else:
            obs, _ = self.env.reset(options={"reset_mask": mask.cpu().numpy()})
        return torch.as_tensor(obs, device=self.device, dtype=torch.float32), {}

    def step(self, actions: torch.Tensor):
        actions = actions if self.batched_maniskill else actions.cpu().numpy()
        obs, reward, terminated, truncated, info = self.env.step(actions)
        obs = torch.as_tensor(obs, device=self.device, dtype=torch.float32)
        reward, truncated = self.tensor(reward, torch.float32), self.tensor(truncated, torch.bool)
        terminated = self.tensor(terminated if self.batched_maniskill else info["terminated"], torch.bool)
        success = self.tensor(info.get("success", np.zeros(self.num_envs)), torch.bool)
        reset_now = truncated | (terminated & self.reset_on_termination)
        info = {"success": success}
        if bool(reset_now.any()):  # the one host sync of a step: whether to call the simulator's reset at all
            info["final_obs"] = obs.clone()  # (a reset may write into the simulator's observations: GPU simulation)
            info["_final_obs"] = reset_now
            obs, _ = self.reset(options={"reset_mask": reset_now})
        return obs, reward, terminated, truncated, info

    def close_extras(self, **kwargs):
        self.env.close()


def drop_mujoco_settotalmass_warning() -> None:
    """MuJoCo's warnings as it prints them, less the one that Gymnasium's models use 'settotalmass' (one per model)."""
    import mujoco

    def print_warning(message: str) -> None:
        if "settotalmass" not in message:
            print(f"WARNING: {message}", file=sys.stderr)

    mujoco.set_mju_user_warning(print_warning)


def make_env(args: Args, num_envs: int, device: torch.device, evaluation: bool, video_dir: Optional[str] = None):
    """ToyChain-v0 (torch, on `device`), or a ManiSkill3 / Gymnasium task behind PartialResetVecEnv."""
    if args.env_id == TOY_ENV_ID:
        return gym.make_vec(TOY_ENV_ID, num_envs=num_envs, config=args.toy, device=device)
    if args.resolved_sim_backend == "cpu":  # a Gymnasium task (MuJoCo's come with gymnasium[mujoco])
        drop_mujoco_settotalmass_warning()
    if args.resolved_sim_backend.startswith("physx_cuda"):
        env = make_maniskill_env(args, num_envs, evaluation, video_dir)
    else:
        fns = [partial(make_single_env, args, evaluation, video_dir, index) for index in range(num_envs)]
        vector_env = gym.vector.SyncVectorEnv
        if args.resolved_sim_backend == "physx_cpu" and num_envs > 1:  # one ManiSkill process per env
            vector_env = partial(gym.vector.AsyncVectorEnv, context="forkserver")
        env = vector_env(fns, autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    return PartialResetVecEnv(env, num_envs, device, reset_on_termination=not (evaluation or args.stagger))


# ---- Pure functions the algorithm relies on (tested in tests/test_ppo_staggered.py) ----------------------------------
def stagger_groups(num_envs: int, num_groups: int, device=None) -> torch.Tensor:
    """Group index j in [0, N_B) of every env: N_B contiguous groups of (nearly) equal size (Sec. 3.3)."""
    return torch.arange(num_envs, device=device) * num_groups // num_envs


def stagger_start_steps(num_groups: int, stagger_step: int) -> list[int]:
    """Advance step at which group j starts, so that it is at step j * S when training starts (App. B.1)."""
    return [(num_groups - 1 - j) * stagger_step for j in range(num_groups)]


class ResetState:
    """The reset bookkeeping of N envs (Sec. 3.3): which transitions are trained on, which envs wait for a gate."""

    def __init__(self, num_envs: int, device, next_step_mode: bool):
        self.stale = torch.zeros(num_envs, dtype=torch.bool, device=device)  # next-step mode: the next step only resets
        self.waiting = torch.zeros(num_envs, dtype=torch.bool, device=device)  # terminated, not reset: waits (masked)
        self.episode_step = torch.zeros(num_envs, dtype=torch.long, device=device)  # at the current observation
        self.next_step_mode = next_step_mode  # an env resets in the step after its episode ends (else in the same)

    def trained_on(self) -> torch.Tensor:
        """The envs whose next transition is trained on: not waiting for a reset gate, not a stale reset step."""
        return ~self.stale & ~self.waiting

    def step(self, terminated, truncated, reset_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Advances one vector step (reset_mask: the envs reset inside it, by a same-step env or by the loop). Returns
        (valid, episode_end): the steps trained on, and those that end an episode."""
        valid = self.trained_on()
        done = terminated | truncated
        reset_now = self.stale | reset_mask  # (stale: next-step mode only)
        if self.next_step_mode:  # an end that the step did not reset is reset by the next step: a stale step
            self.stale = done & ~reset_mask
        # STAGGER: a terminated env that nobody resets waits, masked, for the next reset gate (naive: never waits)
        self.waiting = (self.waiting | (valid & terminated)) & ~reset_now & ~self.stale
        self.episode_step = torch.where(reset_now, 0, self.episode_step + 1)
        return valid, valid & done

    def gated(self, terminated, reset_mask) -> torch.Tensor:
        """STAGGER (Sec. 3.3): the envs a reset gate resets, with the group that reaches H there: those waiting since a
        termination, and those that terminate in this step (reset_mask: the envs the step reset already)."""
        return (self.waiting | terminated) & ~reset_mask


def is_reset_gate(clock: int, starts: list[int], horizon: int) -> bool:
    """STAGGER (Sec. 3.3): whether some group reaches its reset gate `clock` env steps after the reset that begins the
    advance. Group j starts at starts[j] and then every H steps, when its time limit resets it: a gate every S steps."""
    return clock % horizon in starts


def reset_inside_step(envs, mask: torch.Tensor, raw_obs: torch.Tensor, final_obs, final_mask: torch.Tensor):
    """Resets the envs in `mask` after a step, as a same-step env resets an episode's end: their true last observation
    goes into final_obs (for V(final obs)) and their reset one into the observations. Returns all three."""
    last_obs = raw_obs if final_obs is None else final_obs
    final_obs = torch.where(mask.view(-1, *[1] * (raw_obs.dim() - 1)), raw_obs, last_obs)
    raw_obs, _ = envs.reset(options={"reset_mask": mask})  # (the observations of all envs)
    return raw_obs, final_obs, final_mask | mask


def random_start_lengths(num_envs: int, horizon: int, seed: int) -> torch.Tensor:
    """Each env's first-episode length, U[1, H] (init_at_random_ep_len: episode counters start at U{0, ..., H-1})."""
    return torch.randint(1, horizon + 1, (num_envs,), generator=torch.Generator().manual_seed(seed))


def compute_gae(rewards, values, next_values, no_bootstrap, dones, gamma: float, gae_lambda: float):
    """GAE over a (K, N) rollout; next_values[t]: V(true next state of step t), V(final obs) where the env reset.
    delta_t = r_t + gamma * (1 - no_bootstrap_t) * next_values_t - V(s_t)     (no_bootstrap: --bootstrap-at-done)
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}         (nothing flows across an episode end)
    Returns (advantages, returns = advantages + values)."""
    deltas = rewards + gamma * (~no_bootstrap) * next_values - values
    advantages = torch.zeros_like(rewards)
    lastgaelam = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        lastgaelam = deltas[t] + gamma * gae_lambda * (~dones[t]) * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def discounted_returns(rewards, valid, dones, gamma: float, carried: torch.Tensor):
    """Reward scaling's discounted returns (CleanRL's NormalizeReward) over a (K, N) rollout: G_t = gamma G_{t-1} + r_t
    of the trained-on rewards, restarted after an episode end. carried: G before the rollout. Returns (G, G after)."""
    returns = torch.zeros_like(rewards)
    for step in range(rewards.shape[0]):
        carried = carried * gamma + rewards[step] * valid[step]
        returns[step] = carried
        carried = carried * ~(valid[step] & dones[step])
    return returns, carried


def normalize_advantages(advantages: torch.Tensor, valid: torch.Tensor):
    """(A - mean) / (std + 1e-8) over the valid entries, and their number. DDP: of all ranks, from their count, sum and
    sum of squares in one all-reduce (float64: E[A^2] - E[A]^2 keeps its digits)."""
    masked = torch.where(valid, advantages, 0.0).double()
    shares = torch.stack([valid.sum().double(), masked.sum(), masked.square().sum()])
    count, total, total_sq = all_reduce_sum(shares)
    mean = total / count.clamp(min=1)
    std = (total_sq / count.clamp(min=1) - mean.square()).clamp(min=0).sqrt()
    return (advantages - mean.float()) / (std.float() + 1e-8), count.float()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean of values over the entries where mask is True (0 if there are none). DDP: with `count`, the number of those
    entries on all ranks, it is this rank's share of the mean over all ranks (all_reduce_sum adds the shares)."""
    return torch.where(mask, values, 0.0).sum() / (mask.sum() if count is None else count).clamp(min=1)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """DDP: the sum over all ranks (in place; NCCL on GPUs, gloo on CPU); the tensor itself in a single process."""
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def batch_temporal_stats(episode_steps: torch.Tensor, valid: torch.Tensor, horizon: int, window: int) -> dict:
    """How much of the horizon a batch covers (Sec. 3.2, Fig. 1): the share of its ceil(H / window) windows of
    `window` steps that hold trained-on transitions (stage_coverage), and their min and max episode step."""
    steps = episode_steps[valid]
    if steps.numel() == 0:
        return {}
    num_windows = math.ceil(horizon / window)
    counts = torch.bincount((steps // window).clamp(max=num_windows - 1), minlength=num_windows)
    return {
        "stagger/episode_step_min": steps.min().item(),
        "stagger/episode_step_max": steps.max().item(),
        "stagger/stage_coverage": (counts > 0).float().mean().item(),
    }


class RunningMeanStd:
    """Table 3's observation normalization (running mean & std, Chan et al.'s parallel update), clipped to +-10."""

    def __init__(self, shape, device, enabled: bool = True):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(1e-4, device=device)
        self.enabled = enabled  # off for ToyChain, whose block index is embedded
        self.merged = self.totals()  # DDP: the totals that all ranks share (the last merge's)

    def update(self, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
        """Adds the rows of `values` where `mask` is True (all of them without a mask); none: no change. (Selecting
        the rows waits for the device: on a GPU, PartialResetVecEnv waits at every env step already.)"""
        if not self.enabled:
            return
        if mask is not None:
            values = values[mask]
        if values.shape[0] == 0:  # (an empty batch's mean and variance are NaN)
            return
        batch_mean, batch_var, batch_n = values.mean(0), values.var(0, unbiased=False), values.shape[0]
        delta, total = batch_mean - self.mean, self.count + batch_n
        self.mean = self.mean + delta * batch_n / total
        between_batches = delta.square() * self.count * batch_n / total
        self.var = (self.var * self.count + batch_var * batch_n + between_batches) / total
        self.count = total

    def totals(self) -> torch.Tensor:
        """Count, sum and sum of squares of the observations so far (they add up over observations), in float64."""
        count = self.count.double().expand(self.mean.shape)
        return torch.stack([count, count * self.mean, count * (self.var + self.mean.square())])

    def merge_ranks(self) -> None:
        """DDP, at every update: the observations of every rank since the last merge join the shared statistics."""
        if self.enabled and dist.is_initialized():
            count, total, total_sq = all_reduce_sum(self.totals() - self.merged) + self.merged
            self.mean, self.count = (total / count).float(), count.max().float()
            self.var = (total_sq / count - (total / count).square()).clamp(min=0).float()
            self.merged = self.totals()

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        return ((obs - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-10.0, 10.0) if self.enabled else obs

    def scale(self, rewards: torch.Tensor) -> torch.Tensor:
        """Reward scaling (of discounted returns' statistics): divided by the std, not centred, clipped to +-10."""
        return (rewards / torch.sqrt(self.var + 1e-8)).clamp(-10.0, 10.0) if self.enabled else rewards


# ---- Networks --------------------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(sizes: list[int], activation: type[nn.Module], out_std: float) -> nn.Sequential:
    """Linear layers with `activation` between them; orthogonal init, the last layer with gain `out_std`."""
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes[:-2], sizes[1:-1]):
        layers += [layer_init(nn.Linear(n_in, n_out)), activation()]
    return nn.Sequential(*layers, layer_init(nn.Linear(sizes[-2], sizes[-1]), std=out_std))


class GaussianAgent(nn.Module):
    """Table 3: actor and critic MLPs, 3 x 256 tanh; Gaussian policy, learned log std from -0.5 (ManiSkill's ppo.py)."""

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
        # Diagonal Gaussian log-density and entropy, written out (no torch.distributions: CUDA-graph friendly).
        logprob = (-0.5 * ((action - mean) / std).square() - logstd - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + logstd).sum(-1)
        return action, logprob, entropy, self.get_value(obs)

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor_mean(obs)


def make_agent(envs) -> nn.Module:
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    if isinstance(obs_space, gym.spaces.Discrete):
        return ChainAgent(int(obs_space.n), int(act_space.n))
    if not isinstance(act_space, gym.spaces.Box):
        raise ArgsError(f"--env-id: this script's Gaussian policy needs a Box action space, not {act_space}")
    return GaussianAgent(int(np.prod(obs_space.shape)), int(np.prod(act_space.shape)))


class StopSignals:
    """DDP: Ctrl-C or SIGTERM (torchrun forwards both) raises KeyboardInterrupt before training; in training it is
    noted and all ranks stop together at the next iteration, as they do when the launcher is gone (torchrun killed)."""

    def __init__(self):
        self.requested = self.training = False
        self.launcher = os.getppid()
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        first, self.requested = not self.requested, True
        if first and not self.training:
            raise KeyboardInterrupt


def clock(device: torch.device) -> float:
    """Wall-clock time after the queued GPU work: a host sync on CUDA, so read once per phase, never per env step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


# ---- Checkpoints -----------------------------------------------------------------------------------------------------
def load_checkpoint(checkpoint: dict, agent, optimizer, normalizers: dict, device: torch.device) -> None:
    """Restores the weights, Adam and the normalizers of a checkpoint (read_checkpoint's) onto `device`."""
    try:
        agent.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, KeyError, ValueError) as error:  # networks of other sizes (other --toy.* settings)
        raise ArgsError(
            f"--checkpoint: its networks do not fit these settings ({str(error).splitlines()[0]})"
        ) from error
    for name, rms in normalizers.items():  # obs_rms, reward_rms
        rms.mean = checkpoint[name]["mean"].to(device)
        rms.var = checkpoint[name]["var"].to(device)
        rms.count = checkpoint[name]["count"].to(device)
        rms.merged = rms.totals()  # (every rank loads the same)


def resume_problem(checkpoint: dict, args: Args, layout: list) -> Optional[str]:
    """Why a resumed run cannot continue the checkpoint's envs and loop where they were (None: it can)."""
    if args.env_id != TOY_ENV_ID:  # (the toy chain's state alone is torch tensors)
        return "the simulator's state is not in the checkpoint"
    if args.world_size > 1:
        return f"{args.world_size} torchrun ranks run their own envs"
    if checkpoint["loop"] is None:
        return "the checkpoint holds no loop state (written within an iteration, or by several ranks)"
    return "the envs' settings differ from the checkpoint's" if checkpoint["loop"]["layout"] != layout else None


def write_whole(path: Path, write) -> None:
    """write(a temporary file), then renamed to `path`: never half-written (a Ctrl-C leaves the old file, or none)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def hms(seconds: float) -> str:
    return f"{int(seconds) // 3600}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"


# ---- The policy step, the PPO loss and the evaluation (module level: --cudagraphs replays the first two) -------------
@torch.no_grad()
def policy_step(agent: nn.Module, obs: torch.Tensor):
    action, logprob, _, value = agent.get_action_and_value(obs)
    return action, logprob, value


def ppo_loss(agent: nn.Module, minibatch: dict, args: Args) -> tuple[torch.Tensor, dict]:
    """The clipped PPO loss of a minibatch (ManiSkill's ppo.py: advantages normalized per minibatch, value unclipped)
    and its statistics. STAGGER: means over the trained-on steps only. DDP: this rank's shares of all ranks' means."""
    valid = minibatch["valid"]
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(minibatch["obs"], minibatch["actions"])
    logratio = newlogprob - minibatch["logprobs"]
    ratio = logratio.exp()
    advantages, count = normalize_advantages(minibatch["advantages"], valid)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
    pg_loss = masked_mean(torch.max(pg_loss1, pg_loss2), valid, count)
    v_loss = 0.5 * masked_mean((newvalue - minibatch["returns"]).square(), valid, count)
    entropy_loss = masked_mean(entropy, valid, count)
    loss = pg_loss - args.ent_coef * entropy_loss + args.vf_coef * v_loss
    with torch.no_grad():
        stats = {
            "losses/policy_loss": pg_loss.detach(),
            "losses/value_loss": v_loss.detach(),
            "losses/entropy": entropy_loss.detach(),
            "losses/old_approx_kl": masked_mean(-logratio, valid, count),
            "losses/approx_kl": masked_mean((ratio - 1) - logratio, valid, count),
            "losses/clipfrac": masked_mean(((ratio - 1.0).abs() > args.clip_coef).float(), valid, count),
        }
    return loss, stats


def minibatch_gradients(agent: nn.Module, optimizer, args: Args, minibatch: dict) -> dict:
    """ppo_loss's gradients, norm-clipped, left in .grad (the caller steps the optimizer); returns its statistics."""
    optimizer.zero_grad(set_to_none=False)
    loss, stats = ppo_loss(agent, minibatch, args)
    loss.backward()
    if dist.is_initialized():  # DDP: summed in one flat all-reduce (the losses are shares): one rank's gradient
        grads = [parameter.grad for parameter in agent.parameters()]
        flat = all_reduce_sum(torch.cat([grad.flatten() for grad in grads]))
        for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(summed.view_as(grad))
    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    return stats


def ppo_update(compute_gradients, optimizer, batch: dict, args: Args) -> dict:
    """Epochs of shuffled minibatches, an Adam step each; the mean of each statistic, on the device (of all ranks)."""
    totals = {}  # sums of the minibatch statistics
    for epoch in range(args.update_epochs):
        permutation = torch.randperm(args.batch_size, device=batch["obs"].device)
        for start in range(0, args.batch_size, args.minibatch_size):
            indices = permutation[start : start + args.minibatch_size]
            stats = compute_gradients({key: values[indices] for key, values in batch.items()})
            optimizer.step()
            totals = {name: totals.get(name, 0.0) + value for name, value in stats.items()}
        # Table 3's target-KL stop, once per epoch as CleanRL (ManiSkill's ppo.py: every minibatch). DDP: all ranks'.
        if args.target_kl > 0 and bool(all_reduce_sum(stats["losses/approx_kl"]) > args.target_kl):
            break
    num_steps_taken = (epoch + 1) * args.num_minibatches  # (epoch: the last one run)
    means = all_reduce_sum(torch.stack(list(totals.values()))) / num_steps_taken  # DDP: one all-reduce for all
    return dict(zip(totals, means))


@torch.no_grad()
def stagger_advance(envs, resets: ResetState, agent: nn.Module, obs_rms: RunningMeanStd, args: Args, seed: int):
    """STAGGER (App. B.1): from a reset of every env, advances group j by j * S steps with --advance-actions (N_B, S:
    resolve_args); group j starts (a partial reset) at step (N_B - 1 - j) * S, a reset gate where the envs waiting
    since a termination start too (Sec. 3.3). Returns the observations that training starts from."""
    starts = stagger_start_steps(args.num_stagger_groups, args.stagger_step)
    raw_obs, _ = envs.reset(seed=seed)
    groups = stagger_groups(args.num_envs, args.num_stagger_groups, raw_obs.device)
    env_starts = torch.tensor(starts, device=raw_obs.device)[groups]
    envs.action_space.seed(seed)  # (random advance actions: reproducible)
    for advance_step in range(starts[0]):  # (group 0 starts last, at (N_B - 1) * S)
        if args.advance_actions == "random":  # uniform in the action bounds
            actions = torch.as_tensor(envs.action_space.sample(), device=raw_obs.device)
        else:  # the initial policy's mean action
            actions = agent.deterministic_action(obs_rms.normalize(raw_obs))
        raw_obs, _, terminated, truncated, info = envs.step(actions)
        final_mask = info.get("_final_obs", torch.zeros_like(terminated, dtype=torch.bool))
        if advance_step + 1 in starts:  # (the schedule is known on the host: no device sync)
            starting = (env_starts == advance_step + 1) | resets.gated(terminated, final_mask)
            raw_obs, _ = envs.reset(options={"reset_mask": starting})  # (the observations of all envs)
            final_mask = final_mask | starting  # (reset inside this step, by the loop)
        resets.step(terminated, truncated, final_mask)
    return raw_obs


@torch.no_grad()
def evaluate(agent, eval_envs, obs_rms: RunningMeanStd, horizon: int, seed: int, absorbing: bool, video=None) -> dict:
    """One episode of every eval env, deterministic policy, no partial resets: H steps, or to an absorbing termination
    (a fallen Hopper). ManiSkill's protocol: a success does not end it. eval/return: its sum of rewards, env mean.
    video: a Gymnasium task's first VIDEO_ENVS envs filmed to its episode's end, {video}_env{i}.mp4 each (imageio)."""
    obs, _ = eval_envs.reset(seed=seed)
    running = torch.ones(eval_envs.num_envs, dtype=torch.bool, device=obs.device)  # not yet terminated
    ret = torch.zeros(eval_envs.num_envs, device=obs.device)
    length = torch.zeros(eval_envs.num_envs, device=obs.device)
    success_once = torch.zeros_like(running)
    filmed = eval_envs.env.envs[:VIDEO_ENVS] if video else []  # (the sub-envs of a SyncVectorEnv)
    names = [f"{video}_env{index}" for index in range(len(filmed))]  # written as {name}.part.mp4, renamed when whole
    writers = [
        imageio.get_writer(f"{name}.part.mp4", fps=env.metadata.get("render_fps", 30))
        for name, env in zip(names, filmed)
    ]
    try:
        for _ in range(horizon):  # (the next-step ToyChain's first reset step comes only after H steps)
            for writer, env, filming in zip(writers, filmed, running.tolist() if writers else []):
                if filming:  # (a frame before each step)
                    writer.append_data(env.render())
            obs, reward, terminated, _, info = eval_envs.step(agent.deterministic_action(obs_rms.normalize(obs)))
            ret = ret + reward * running
            length = length + running
            success_once = success_once | (info["success"] & running)
            running = running & ~(terminated & absorbing)
    finally:
        for writer in writers:
            writer.close()
    for name in names:
        os.replace(f"{name}.part.mp4", f"{name}.mp4")
    return {
        "eval/return": ret.mean(),
        "eval/success_once": success_once.float().mean(),
        "eval/success_at_end": info["success"].float().mean(),
        "eval/episode_len": length.mean(),
    }


# ---- Training --------------------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    args = resolve_args(args)
    # DDP: torchrun starts one process (rank) per GPU, with LOCAL_RANK its GPU; rank 0 alone writes, logs, evaluates
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if args.cuda and torch.cuda.is_available() else "cpu")
    stop = StopSignals() if args.world_size > 1 else None
    if args.world_size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    resumed = read_checkpoint(args.checkpoint) if args.checkpoint else None
    resuming = resumed is not None and not args.evaluate  # the run continues in its own directory (--evaluate: none)
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.checkpoint).parent if resuming else Path(args.output_dir) / run_name
    if rank == 0:
        print(format_settings(args, device), flush=True)
    wandb_id = resumed["wandb_id"] if resuming else None
    writer = None

    def open_run() -> None:
        """Rank 0's config.json, W&B run and TensorBoard writer (RESUME: once the checkpoint fits, else none of them)."""
        nonlocal wandb_id, writer
        if rank > 0 or args.evaluate:
            return
        run_dir.mkdir(parents=True, exist_ok=resuming)
        write_whole(run_dir / "config.json", lambda tmp: tmp.write_text(json.dumps(asdict(args), indent=2)))
        if args.track:
            import wandb

            wandb_id = wandb.init(  # RESUME: the checkpoint's W&B run (its id stored), else a new one
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=asdict(args),
                name=run_dir.name,
                save_code=True,
                id=wandb_id,
                resume="allow",
            ).id
        purge_step = resumed["global_step"] + 1 if resuming else None  # RESUME: TensorBoard drops the events after it
        writer = SummaryWriter(str(run_dir), purge_step=purge_step)

    if not resuming:
        open_run()
    last: dict[str, float] = {}  # the last value of every scalar, for summary.json

    def log(name: str, value, step: int) -> None:
        if writer is not None:
            writer.add_scalar(name, float(value), step)
        last[name] = float(value)

    N, K, H = args.num_envs, args.num_steps, args.horizon
    seed = args.seed + rank * N  # DDP: rank r's envs and actions (the weights are rank 0's, broadcast below)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    is_toy = args.env_id == TOY_ENV_ID
    is_gym = args.resolved_sim_backend == "cpu"  # a Gymnasium task (MuJoCo, ...): they have no success
    summary: dict = {"run_dir": str(run_dir), "interrupted": False}
    envs = eval_envs = None  # made inside the try, so that a Ctrl-C while they start still writes summary.json
    global_step = start_step = resumed["global_step"] if resumed else 0
    start_time = time.time()
    advance_env_steps = resumed["advance_env_steps"] if resuming else 0  # of all the run's advances
    within_iteration = False  # (a checkpoint written then holds no loop state)
    evaluated_step = None  # the global step of the last evaluation logged
    try:
        # ---- build: envs, agent, optimizer, observation normalizer (and the checkpoint to resume or evaluate) ------
        envs = None if args.evaluate else make_env(args, N, device, evaluation=False)
        video_root = Path(args.checkpoint).parent if args.evaluate else run_dir  # --evaluate: beside the checkpoint
        video_dir = str(video_root / "videos") if args.capture_video and rank == 0 else None
        if video_dir:
            os.makedirs(video_dir, exist_ok=True)
        if rank == 0 or envs is None:  # DDP: rank 0 alone evaluates
            eval_envs = make_env(args, args.num_eval_envs, device, evaluation=True, video_dir=video_dir)
        spaces = envs if envs is not None else eval_envs
        agent = make_agent(spaces).to(device)
        # Table 3: Adam, eps 1e-5; on CUDA one fused kernel per step (the step is outside --cudagraphs' graph)
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=device.type == "cuda")
        obs_rms = RunningMeanStd(spaces.single_observation_space.shape, device, enabled=not is_toy)  # Table 3
        reward_rms = RunningMeanStd((), device, enabled=args.normalize_reward)  # of the discounted returns
        normalizers = {"obs_rms": obs_rms, "reward_rms": reward_rms}
        if resumed:
            load_checkpoint(resumed, agent, optimizer, normalizers, device)
        if resuming:
            open_run()
        if resuming and rank == 0:
            print(f"resuming {run_dir} at global step {global_step} (iteration {resumed['iteration']})", flush=True)
        if args.world_size > 1:  # DDP: every rank starts from rank 0's weights
            for tensor in agent.state_dict().values():
                dist.broadcast(tensor, src=0)
        absorbing = args.bootstrap_at_done == "truncated"  # a termination ends an evaluation episode
        start_time = time.time()

        def save(path: Path) -> None:
            """A checkpoint, enough to resume or evaluate (the loop's state: between two iterations of one process)."""
            loop = None
            if not within_iteration and args.world_size == 1:  # (torchrun's rank 0 holds its own envs' alone)
                loop = {
                    "layout": layout,
                    "env": envs.state_dict() if is_toy else None,
                    "raw_obs": raw_obs,
                    "resets": dict(vars(resets)),  # stale, waiting, episode_step, next_step_mode
                    "training_step": training_step,
                    "first_lengths": first_lengths,
                    "first_episode": first_episode,
                    "tracked": tracked,
                    "ep_return": ep_return,
                    "discounted_return": discounted_return,
                    "ep_success": ep_success,
                    "occupancy": torch.as_tensor(np.array(toy_diagnostics.occupancy)) if is_toy else None,
                    "accuracy": torch.as_tensor(np.array(toy_diagnostics.accuracy)) if is_toy else None,
                }
            numpy_state = np.random.get_state()
            state = {
                "script": SCRIPT,
                "env_id": args.env_id,
                "model": agent.state_dict(),
                "optimizer": optimizer.state_dict(),
                "global_step": global_step,
                "iteration": global_step // (args.batch_size * args.world_size),  # rollouts collected
                "steps_per_iteration": args.batch_size * args.world_size,  # (a resume's must be the same)
                "wandb_id": wandb_id,
                "advance_env_steps": advance_env_steps,
                "evaluated": evaluated_step == global_step,  # an evaluation logged at its step (not a Ctrl-C's in one)
                "rng": {  # the random generators: torch's (CPU, the device's on CUDA), numpy's, Python's
                    "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                    "numpy": [*numpy_state[:1], numpy_state[1].tolist(), *numpy_state[2:]],  # (weights_only: no arrays)
                    "python": random.getstate(),
                },
                "loop": loop,
            }
            for name, rms in normalizers.items():  # obs_rms, reward_rms
                state[name] = {"mean": rms.mean, "var": rms.var, "count": rms.count}
            write_whole(path, partial(torch.save, state))  # (weights_only loads it)

        def log_evaluation(checkpoint_name: Optional[str]) -> dict:
            nonlocal evaluated_step
            if rank > 0:  # DDP: rank 0 alone evaluates and saves
                return {}
            eval_start = clock(device)
            video = f"{video_dir}/global_step_{global_step}" if video_dir and is_gym else None  # (ManiSkill: its own)
            results = evaluate(agent, eval_envs, obs_rms, H, args.seed + global_step, absorbing, video)
            results = {name: float(value) for name, value in results.items()}
            for name, value in results.items():
                log(name, value, global_step)
            log("time/eval", clock(device) - eval_start, global_step)
            evaluated_step = global_step
            evaluation = " ".join(f"{name}={value:.3f}" for name, value in results.items())
            print(f"global_step={global_step} {evaluation}", flush=True)
            if args.save_model and checkpoint_name:
                save(run_dir / checkpoint_name)
            return results

        if args.evaluate:  # one result line, and eval_<checkpoint name>.json beside the checkpoint
            evaluation = {
                "checkpoint": args.checkpoint,
                "global_step": global_step,
                "eval_seed": args.seed + global_step,
                "num_eval_envs": args.num_eval_envs,
                "episodes": args.num_eval_envs,  # (one per eval env)
                **log_evaluation(None),
            }
            eval_file = Path(args.checkpoint).parent / f"eval_{Path(args.checkpoint).stem}.json"
            if rank == 0:  # (torchrun: rank 0 alone evaluates)
                write_whole(eval_file, lambda tmp: tmp.write_text(json.dumps(evaluation, indent=2)))
            if video_dir:
                print(f"videos: {video_dir}", flush=True)
            return summary
        dtype = torch.long if is_toy else torch.float32  # rollout storage (K, N, ...): the chain's are indices
        obs_buf = torch.zeros((K, N, *envs.single_observation_space.shape), dtype=dtype, device=device)
        actions_buf = torch.zeros((K, N, *envs.single_action_space.shape), dtype=dtype, device=device)
        logprobs_buf = torch.zeros((K, N), device=device)
        rewards_buf = torch.zeros((K, N), device=device)
        values_buf = torch.zeros((K, N), device=device)
        final_values_buf = torch.zeros((K, N), device=device)
        no_bootstrap_buf = torch.zeros((K, N), dtype=torch.bool, device=device)
        dones_buf = torch.zeros((K, N), dtype=torch.bool, device=device)
        valid_buf = torch.zeros((K, N), dtype=torch.bool, device=device)
        final_mask_buf = torch.zeros((K, N), dtype=torch.bool, device=device)
        correct_buf = torch.zeros((K, N), dtype=torch.bool, device=device)
        episode_step_buf = torch.zeros((K, N), dtype=torch.long, device=device)
        act = partial(policy_step, agent)
        compute_gradients = partial(minibatch_gradients, agent, optimizer, args)  # of a minibatch, left in .grad
        if args.cudagraphs:  # as ppo_fast.py: the policy step and the minibatch gradients replayed as CUDA graphs
            from tensordict.nn import CudaGraphModule

            act, compute_gradients = CudaGraphModule(act), CudaGraphModule(compute_gradients)

        # ---- STAGGER: advance group j by j * S steps before training (App. B.1), or continue the checkpoint's envs ---
        resets = ResetState(N, device, envs.metadata["autoreset_mode"] == gym.vector.AutoresetMode.NEXT_STEP)
        starts = stagger_start_steps(args.num_stagger_groups, args.stagger_step)  # the reset gates' schedule
        advance_length = starts[0]  # (group 0 starts last)
        layout = [N, K, H, args.reset_scheme, args.stagger_step, asdict(args.toy), device.type]  # (what the loop fits)
        problem = resume_problem(resumed, args, layout) if resuming else None
        loop = resumed["loop"] if resuming and problem is None else None
        if resuming and args.world_size == 1:  # the random generators (torchrun: each rank's own seed, as at the start)
            rng = resumed["rng"]
            torch.set_rng_state(rng["torch"])
            if torch.is_tensor(rng["cuda"]) and device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], device)
            np.random.set_state((rng["numpy"][0], np.array(rng["numpy"][1], dtype=np.uint32), *rng["numpy"][2:]))
            random.setstate(rng["python"])
        advance_steps = advance_length * N * args.world_size  # (of all ranks)
        advance = f"advance of {advance_length} steps x {N * args.world_size} envs = {advance_steps} env steps"
        if loop is None:
            if rank == 0 and problem:  # RESUME: re-stagger, and say so
                restagger = f" and re-stagger ({advance})" if args.stagger else ""
                print(f"resume: {problem}: envs start anew{restagger}", flush=True)
            if rank == 0 and advance_length > 0:  # (a long advance is not silent)
                print(f"stagger: {args.num_stagger_groups} groups S = {args.stagger_step} apart, {advance}", flush=True)
            raw_obs = stagger_advance(envs, resets, agent, obs_rms, args, seed + global_step)
            obs_rms.update(raw_obs, resets.trained_on())  # the observations trained on from here (not the advance's)
            obs_rms.merge_ranks()
            advance_env_steps += advance_steps
        else:  # RESUME: the toy chain's envs and the loop continue where the checkpoint left them (one process)
            envs.load_state_dict(loop["env"])
            raw_obs = loop["raw_obs"].to(device)
            for name, value in loop["resets"].items():  # (ResetState's)
                setattr(resets, name, value.to(device) if torch.is_tensor(value) else value)
        loop = loop or {}  # the loop's carried state: the checkpoint's, or its start (each env's first episode)
        # RANDOM START ([21]): each env's first episode is cut (truncated) after first_lengths ~ U[1, H] training steps
        random_start = args.reset_scheme == "random-start"
        training_step = loop.get("training_step", 0)  # the reset gates' clock, less the advance
        first_lengths = loop.get("first_lengths", random_start_lengths(N, H, seed + global_step)).to(device)
        first_episode = loop.get("first_episode", torch.full((N,), random_start)).to(device)
        tracked = loop.get("tracked", (resets.episode_step == 0) & ~first_episode).to(device)  # begun in training
        ep_return = loop.get("ep_return", torch.zeros(N)).to(device)
        discounted_return = loop.get("discounted_return", torch.zeros(N)).to(device)  # --normalize-reward (phase 3)
        ep_success = loop.get("ep_success", torch.zeros(N, dtype=torch.bool)).to(device)
        toy_diagnostics = ToyChainDiagnostics(envs) if is_toy else None
        if is_toy and loop:  # (App. E's diagnostics of the updates so far)
            toy_diagnostics.occupancy = list(loop["occupancy"].numpy())
            toy_diagnostics.accuracy = list(loop["accuracy"].numpy())
        cut_steps = set(first_lengths.tolist()) - {H} if random_start else set()
        total_steps = args.num_iterations * args.batch_size * args.world_size  # (the run's last global_step)
        progress_names = ["charts/episodic_return", "charts/success_rate"][: 1 if is_gym else 2]  # (Gymnasium: none)
        latest_progress = time.time()
        if stop:
            stop.training = True

        for iteration in range(global_step // (args.batch_size * args.world_size) + 1, args.num_iterations + 1):
            stopping = stop and (stop.requested or os.getppid() != stop.launcher)  # (launcher gone: torchrun killed)
            if stop and all_reduce_sum(torch.tensor(float(stopping), device=device)) > 0:  # DDP: any rank's
                raise KeyboardInterrupt  # Ctrl-C stops every rank here
            # ---- 1. evaluate and checkpoint, every --eval-freq iterations (before the rollout, as ManiSkill's ppo.py)
            due = args.eval_freq > 0 and (iteration - 1) % args.eval_freq == 0
            # RESUME: none at the checkpoint's step where the run logged one there (checkpoints of old: always)
            if due and not (resuming and global_step == start_step and resumed.get("evaluated", True)):
                log_evaluation(f"ckpt_{global_step}.pt")
            # ---- 2. collect: K steps of every env (timed as a whole: a timer per env step would sync CUDA twice) ---
            within_iteration = True  # (to its end: the loop's state is the checkpoint's only between iterations)
            rollout_start = clock(device)
            ended = {"return": 0.0, "length": 0.0, "successes": 0.0, "episodes": 0.0}  # sums over the episodes ended
            for step in range(K):
                obs = obs_rms.normalize(raw_obs)
                obs_buf[step] = obs
                episode_step_buf[step] = resets.episode_step
                actions_buf[step], logprobs_buf[step], values_buf[step] = act(obs)
                raw_obs, reward, terminated, truncated, info = envs.step(actions_buf[step])
                final_mask = info.get("_final_obs", torch.zeros_like(terminated, dtype=torch.bool))
                final_obs = info.get("final_obs")
                training_step += 1
                if training_step in cut_steps:  # RANDOM START: truncate and reset the first episodes this long
                    cut = (first_lengths == training_step) & first_episode & ~(terminated | truncated)
                    if bool(cut.any()):  # (a host sync at fewer than H steps of the whole run)
                        truncated = truncated | cut
                        raw_obs, final_obs, final_mask = reset_inside_step(envs, cut, raw_obs, final_obs, final_mask)
                # STAGGER: a reset gate (Sec. 3.3): as a group reaches H, the envs waiting since a termination reset too
                if args.stagger and is_reset_gate(advance_length + training_step, starts, H):
                    gated = resets.gated(terminated, final_mask)
                    if bool(gated.any()):  # (a host sync once per gate: every S >= K steps)
                        raw_obs, final_obs, final_mask = reset_inside_step(envs, gated, raw_obs, final_obs, final_mask)
                first_episode = first_episode & ~(terminated | truncated)
                rewards_buf[step], dones_buf[step] = reward, terminated | truncated
                no_bootstrap_buf[step] = terminated & (args.bootstrap_at_done == "truncated")
                final_mask_buf[step] = final_mask
                # where an env reset in this step, the bootstrap value is V(true last observation): info["final_obs"]
                if final_obs is not None:
                    with torch.no_grad():
                        final_values_buf[step] = agent.get_value(obs_rms.normalize(final_obs))
                # STAGGER: an env that terminated waits, masked, for the next reset gate (its steps are not trained on)
                valid, episode_end = resets.step(terminated, truncated, final_mask)
                valid_buf[step] = valid
                correct_buf[step] = info.get("correct", False)  # ToyChain: the action was its block's target
                # episode statistics, over the trained-on steps of the episodes that started in training
                ep_return = ep_return + reward * valid
                ep_success = ep_success | (info["success"] & valid)
                recorded = episode_end & tracked
                ended["return"] += (ep_return * recorded).sum()
                ended["length"] += ((episode_step_buf[step] + 1) * recorded).sum()  # (waits and stale steps come after)
                ended["successes"] += (ep_success * recorded).sum()
                ended["episodes"] += (1.0 * recorded).sum()
                ep_return = ep_return * ~episode_end
                ep_success = ep_success & ~episode_end
                tracked = tracked | (resets.episode_step == 0)
                obs_rms.update(raw_obs, resets.trained_on())  # the observations that will be trained on
            global_step += N * K * args.world_size  # DDP: the env steps of all ranks
            obs_rms.merge_ranks()  # DDP: every rank normalizes alike from here on
            # ---- 3. targets: GAE, bootstrapping V(true next state) under either autoreset mode -----------------------
            if args.normalize_reward:  # CleanRL's reward scaling, from the trained-on steps' discounted returns
                step_returns, discounted_return = discounted_returns(
                    rewards_buf, valid_buf, dones_buf, args.gamma, discounted_return
                )
                reward_rms.update(step_returns, valid_buf)  # (a host sync, once per update)
                reward_rms.merge_ranks()  # DDP: every rank scales alike
            rewards = reward_rms.scale(rewards_buf)  # (the rewards themselves without --normalize-reward)
            with torch.no_grad():
                last_value = agent.get_value(obs_rms.normalize(raw_obs))
                next_values = torch.cat([values_buf[1:], last_value.unsqueeze(0)])
                next_values = torch.where(final_mask_buf, final_values_buf, next_values)
                advantages, returns = compute_gae(
                    rewards, values_buf, next_values, no_bootstrap_buf, dones_buf, args.gamma, args.gae_lambda
                )
            update_start = clock(device)
            # ---- 4. update: epochs of shuffled minibatches -----------------------------------------------------------
            batch = {  # the rollout, (K, N, ...) -> (K * N, ...)
                "obs": obs_buf.flatten(0, 1),
                "actions": actions_buf.flatten(0, 1),
                "logprobs": logprobs_buf.flatten(0, 1),
                "valid": valid_buf.flatten(0, 1),
                "advantages": advantages.flatten(0, 1),
                "returns": returns.flatten(0, 1),
            }
            losses = ppo_update(compute_gradients, optimizer, batch, args)
            ended = {key: all_reduce_sum(total) for key, total in ended.items()}  # DDP: the episodes of all ranks
            if rank > 0:  # DDP: rank 0 alone logs (the losses and episodes of all ranks, the rest of its own batch)
                continue
            with torch.no_grad():
                # App. E.0.1: value error and policy oscillation 0.5 E[(log pi_new - log pi_old)^2] over the batch.
                _, newlogprob, _, _ = agent.get_action_and_value(batch["obs"], batch["actions"])
                b_valid, b_returns = batch["valid"], batch["returns"]
                value_mse = masked_mean((values_buf.flatten() - b_returns).square(), b_valid)
                returns_var = masked_mean((b_returns - masked_mean(b_returns, b_valid)).square(), b_valid)
                scalars = {
                    **losses,  # losses/policy_loss, ... (ppo_loss)
                    "losses/explained_variance": 1 - value_mse / returns_var.clamp(min=1e-8),
                    "stagger/value_mse": value_mse,
                    "stagger/policy_kl": 0.5 * masked_mean((newlogprob - batch["logprobs"]).square(), b_valid),
                    "stagger/valid_fraction": valid_buf.float().mean(),
                }
            # ---- 5. log: the scalars above in one device sync (stacked, copied to the host and named back at once) ---
            for name, value in zip(scalars, torch.stack(list(scalars.values())).tolist()):
                log(name, value, global_step)
            log("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            sps = (global_step - start_step) / (time.time() - start_time)
            log("charts/SPS", sps, global_step)
            log("charts/env_steps_simulated", advance_env_steps + global_step, global_step)  # (the advances too)
            if ended["episodes"] > 0:
                log("charts/episodic_return", ended["return"] / ended["episodes"], global_step)
                log("charts/episodic_length", ended["length"] / ended["episodes"], global_step)
                log("charts/success_rate", ended["successes"] / ended["episodes"], global_step)
            for name, value in batch_temporal_stats(episode_step_buf, valid_buf, H, K).items():
                log(name, value, global_step)  # stagger/episode_step_min, stagger/episode_step_max, ...
            log("time/rollout", update_start - rollout_start, global_step)
            log("time/update", clock(device) - update_start, global_step)
            if is_toy:  # App. C / E: batch accuracy, block occupancy, per-block accuracy and forgetting
                log("toy/accuracy", masked_mean(correct_buf.float(), valid_buf), global_step)
                log("toy/forgetting_mean", toy_diagnostics.record(obs_buf, agent.action_probs()), global_step)
            if not args.quiet and time.time() - latest_progress >= args.progress_interval:  # the progress line
                latest_progress = time.time()
                left = hms(max(total_steps - global_step, 0) / sps) if sps > 0 else "?"
                done = f"global_step={global_step}/{total_steps} ({100 * global_step // total_steps}%) SPS={sps:.0f}"
                latest = "".join(f" {name}={last[name]:.4g}" for name in progress_names if name in last)
                print(f"progress {done} elapsed={hms(latest_progress - start_time)} left={left}{latest}", flush=True)
            within_iteration = False

        log_evaluation("final_ckpt.pt")
        if is_toy and toy_diagnostics.accuracy:
            summary["toy/forgetting_mean_overall"] = toy_diagnostics.save(run_dir / "toy_diagnostics.npz")
    except KeyboardInterrupt:
        summary["interrupted"] = True
        if rank == 0 and args.save_model and global_step > start_step:  # (nothing new to save before training)
            print("interrupted: writing summary.json and final_ckpt.pt", flush=True)
            save(run_dir / "final_ckpt.pt")
        raise
    finally:
        wall = time.time() - start_time
        summary["global_step"] = global_step
        summary["advance_env_steps"] = advance_env_steps  # the stagger advances' env steps (a resumed run's too)
        summary["env_steps_simulated"] = advance_env_steps + global_step  # all the simulator took (not evaluations)
        summary["wall_time_s"] = wall
        summary["sps"] = (global_step - start_step) / max(wall, 1e-9)
        for name, value in last.items():  # the last value of every logged scalar
            summary[name] = value
        if writer is not None:
            write_whole(run_dir / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2)))
            writer.close()
        for vector_env in (envs, eval_envs):
            if vector_env is not None:
                vector_env.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except ArgsError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
