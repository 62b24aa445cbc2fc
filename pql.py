"""Parallel Q-Learning (PQL): DDPG with two Q functions (the min of both in the target), n-step returns and mixed
exploration noise, split into three processes that run at the same time (Sec. 3.1, Fig. 1, Alg. 1-3), for massively
parallel simulation (ManiSkill3) and a continuous-action toy chain:
  Actor      (the main process) steps N envs with its copy of the policy plus mixed exploration noise (Sec. 3.3),
             keeps the observation normalizer, builds n-step transitions and hands them over;
  V-learner  (a spawned process) keeps a replay buffer of transitions and updates Q1, Q2 (and their target networks)
             against a lagged copy of the policy, which plays the target policy (Sec. 3.2, third point);
  P-learner  (a spawned process) keeps a buffer of states and updates the policy to maximize min(Q1, Q2).
Once per Actor step, through preallocated slots (SlotRing), the Actor sends each learner its data, the normalizer
statistics and a network (the V-learner the policy it acts with, the P-learner the newest Q functions); the learners
send back their own (as the original code's driver relays them). Whichever process is ahead of the speed ratios
beta_a:v (Actor steps per V-update, 1:8; 1:4 on CPU simulation) and beta_p:v (P-updates per V-update, 1:2) waits
(Sec. 3.2). Baselines (Sec. 4.1): --ddpg-n, the paper's DDPG(n) as the original code runs it; --sequential, PQL's
schedule run serially.

Paper: "Parallel Q-Learning: Scaling Off-policy Reinforcement Learning under Massively Parallel Simulation",
Zechu Li, Tao Chen, Zhang-Wei Hong, Anurag Ajay, Pulkit Agrawal (ICML 2023), arXiv:2307.12983.

Map from the paper to this file
  Sec. 3.1, Fig. 1, Alg. 1   main (the Actor loop), NStepAssembler, SlotRing, network_sent_back (transfers)
  Sec. 3.1, Alg. 3           VLearner (double Q, n-step target, target nets), ReplayBuffer, learner_process
  Sec. 3.1, Alg. 2           PLearner (maximize min Q over its state buffer)
  Sec. 3.2                   actor_may_step, v_may_update, p_may_update, may_update (ratio control), pql/ratio_*
  Sec. 3.3                   mixed_exploration_sigmas (sigma_i spread over [0.05, 0.8] across envs), explore
  Sec. 4.1 DDPG(n)           SerialLearners (--ddpg-n, and the --sequential ablation)
  App. B.1, Table B.1/B.2    Args defaults, PRESETS (batch 8192, buffer 5M, Adam lr 5e-4, tau 0.05, clip 0.5, n = 3)
  App. C, PQL-D              --distributional: 51 atoms on [-10, 10], categorical_projection
  (runs, not in the paper)   progress_line, save_checkpoint and main's resume, evaluate_checkpoint (--evaluate)
Departures from the original code: Adam as App. B.1 says (the original uses AdamW, weight decay 0.01); the n-step
discount comes from --gamma (the original hard-codes 0.99; ManiSkill: 0.8, see README.md); episode ends follow
--bootstrap-at-done (truncated: a time limit bootstraps Q'(true final observation) and a termination bootstraps 0;
always: both bootstrap, ManiSkill's default, whose successes terminate with positive reward); the original treats
time-outs as terminal. Autoreset (Gymnasium's vector autoreset modes): same-step only, as ManiSkill; the true last
observation is info["final_obs"]. Evaluation runs in the Actor; the learners soon wait for it (summary: eval_time_s).
A resume (--checkpoint) continues the run in its directory from the checkpoint's networks, generators (of all three
processes) and the Actor's carried state (on the toy chain the env's too), but not bit-identically: the processes race,
and the replay buffers are not saved (the learners refill them from new env steps, after a new warm-up).
Examples: README.md.
"""

from __future__ import annotations

import copy
import ctypes
import glob
import json
import os
import random
import signal
import sys
import textwrap
import time
import traceback
from collections import deque, namedtuple
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.nn.utils import parameters_to_vector
from torch.utils.tensorboard import SummaryWriter

from toy_chain_env import ToyChainContinuousConfig


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of torch and the environments, >= 0 (the learners sample with seed + 1 and seed + 2)"""
    cuda: bool = True
    """use CUDA when it is available: the default device of all three processes (and ManiSkill's GPU simulation)"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{env_id}__{exp_name}__{seed}__{unix_time}/"""
    track: bool = False
    """mirror the TensorBoard scalars to Weights & Biases"""
    wandb_project_name: str = "pql"
    """wandb project name"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    save_model: bool = False
    """write checkpoints: ckpt_{global_step}.pt at each evaluation but a run's first, final_ckpt.pt at its end and on
    Ctrl-C (once the run has stepped)"""
    checkpoint: Optional[str] = None
    """a checkpoint whose run to continue (in its directory; the same --num-envs, --nstep, --toy.*), or to --evaluate"""
    evaluate: bool = False
    """only evaluate the deterministic policy of --checkpoint, beside it (eval_<checkpoint stem>.json), then exit"""
    capture_video: bool = False
    """ManiSkill3: record the evaluations' first 8 eval envs in the run's videos/ (--evaluate: beside the checkpoint)"""
    progress_interval: float = 15.0
    """seconds between two progress lines, >= 1"""
    quiet: bool = False
    """no progress lines (settings, evaluations and errors still print)"""

    env_id: str = "PickCube-v1"
    """ToyChainContinuous-v0 (preset toy) or a ManiSkill3 task, PushCube-v1, ... (preset gpu on a GPU, else cpu)"""
    num_envs: Optional[int] = None
    """parallel training envs N, >= 1 (default: toy chain 64; ManiSkill gpu 4096 (Table B.1), cpu 8)"""
    num_eval_envs: Optional[int] = None
    """parallel evaluation envs, >= 1 (default: toy chain 64; ManiSkill gpu 16, cpu 8)"""
    horizon: Optional[int] = None
    """ManiSkill episode length H, >= 1 (default: the task's max_episode_steps); ToyChain: --toy.horizon"""
    toy: ToyChainContinuousConfig = field(default_factory=lambda: ToyChainContinuousConfig(autoreset_mode="same_step"))
    """ToyChainContinuous-v0 settings (same-step autoreset, as ManiSkill)"""
    bootstrap_at_done: Optional[Literal["always", "truncated"]] = None
    """episode ends that bootstrap Q'(true last obs) (default: toy chain truncated; ManiSkill always)"""
    ddpg_n: bool = False
    """the paper's DDPG(n) baseline (Sec. 4.1): one process, 1/beta_a:v x (critic, actor, soft update) per env step"""
    sequential: bool = False
    """ablation: PQL's schedule (p:v ratio, lagged target policy, copied Q functions) run serially in one process"""
    actor_device: Optional[str] = None
    """device of the Actor (simulation, exploration, n-step assembly): cpu, cuda, cuda:N (default: cuda if used)"""
    v_learner_device: Optional[str] = None
    """device of the V-learner: its replay buffer and the Q functions (default: as --actor-device)"""
    p_learner_device: Optional[str] = None
    """device of the P-learner: its state buffer and the policy (default: as --actor-device)"""
    beta_a_v: Optional[float] = None
    """beta_a:v = f_a / f_v > 0, Actor steps per V-update (Sec. 3.2; default: toy, gpu 1/8; cpu 1/4; see PRESETS)"""
    beta_p_v: float = 1 / 2
    """beta_p:v = f_p / f_v > 0, P-learner updates per V-learner update (Sec. 3.2; default 1:2)"""
    total_timesteps: Optional[int] = None
    """env steps of the whole run, warm-up included, >= 1 (default: toy chain 64 * 600; ManiSkill gpu 30M, cpu 200k)"""
    gamma: Optional[float] = None
    """discount in [0, 1] (default: toy chain 0.99 (Table B.1); ManiSkill 0.8, as its own PPO and SAC baselines)"""
    nstep: int = 3
    """n of the n-step returns, >= 1 (Table B.1, App. C: n = 3 works best)"""
    tau: float = 0.05
    """target-network update rate in [0, 1], after every V-update (Table B.1)"""
    batch_size: Optional[int] = None
    """batch size of both learners, >= 1 (default: toy chain 1024; ManiSkill gpu 8192 (Table B.1), cpu 256)"""
    buffer_size: int = 5_000_000
    """replay buffer capacity of each learner, >= 1 (Table B.1; a run never holds more than it collects)"""
    learning_rate: float = 5e-4
    """Adam learning rate of the policy and the Q functions, > 0 (Table B.1)"""
    max_grad_norm: float = 0.5
    """gradient-norm clip of both learners, > 0 (Table B.1)"""
    warm_up_steps: int = 32
    """Actor steps with uniform random actions (a resume's: its policy's) before learning starts, >= 0 (Table B.1)"""
    reward_scale: float = 0.1
    """rewards are multiplied by this (> 0) for learning (Table B.2: 0.01-1); returns are logged unscaled"""
    norm_obs: Optional[bool] = None
    """running mean/std observation normalization (Table B.1; off: clip to +-5; default: toy chain off, ManiSkill on)"""
    sigma_min: float = 0.05
    """mixed exploration: smallest noise std, of env 1, >= 0 (Sec. 3.3)"""
    sigma_max: float = 0.8
    """mixed exploration: largest noise std, of env N, >= --sigma-min (Sec. 3.3)"""
    target_noise_std: float = 0.8
    """std (>= 0) of the noise added to the target policy's action, clipped to +-0.2 (the original code's values)"""
    distributional: bool = False
    """PQL-D: categorical Q distributions with the C51 projection, 51 atoms on [-10, 10] (App. C)"""
    eval_freq: Optional[int] = None
    """evaluate every this many Actor steps and at the end; 0: only at the end (default: toy 25; gpu 200; cpu 250)"""

    num_actor_steps: tyro.conf.Suppress[int] = 0  # (this and the three below: filled in by resolve_args)
    resolved_horizon: tyro.conf.Suppress[int] = 0
    sim_backend: tyro.conf.Suppress[str] = ""
    hidden_dims: tyro.conf.Suppress[Optional[tuple[int, ...]]] = None  # of the policy and each Q MLP (presets)


TOY_ENV_ID = "ToyChainContinuous-v0"
# Presets: "toy" for the toy chain (small networks and batches: about a minute on two CPU cores), "gpu" for ManiSkill3
# on GPU simulation (Table B.1 and the original code's networks), "cpu" for CPU simulation (for trying things out).
PRESETS = {
    "num_envs": {"toy": 64, "gpu": 4096, "cpu": 8},
    "num_eval_envs": {"toy": 64, "gpu": 16, "cpu": 8},
    "batch_size": {"toy": 1024, "gpu": 8192, "cpu": 256},
    "total_timesteps": {"toy": 64 * 600, "gpu": 30_000_000, "cpu": 200_000},
    "eval_freq": {"toy": 25, "gpu": 200, "cpu": 250},
    "gamma": {"toy": 0.99, "gpu": 0.8, "cpu": 0.8},
    "beta_a_v": {"toy": 1 / 8, "gpu": 1 / 8, "cpu": 1 / 4},
    "norm_obs": {"toy": False, "gpu": True, "cpu": True},
    "hidden_dims": {"toy": (256, 256), "gpu": (512, 256, 128), "cpu": (512, 256, 128)},
    "bootstrap_at_done": {"toy": "truncated", "gpu": "always", "cpu": "always"},
}
LOG_EVERY = 5  # Actor steps between two writes of the training scalars
VIDEO_ENVS = 8  # --capture-video records this many evaluation envs at most, as ManiSkill's baselines
NUM_ATOMS, V_MIN, V_MAX = 51, -10.0, 10.0  # PQL-D's support (App. C)
RATIO_EPS = 1e-9  # slack of the speed-ratio comparisons (Sec. 3.2) for floating-point ratios
POLL_S = 2e-4  # seconds between two looks of a waiting process at the shared counters
ROLES = {"v_learner": "V-learner", "p_learner": "P-learner"}
# A vector step of N envs in NStepAssembler's window (next_obs: the true one); a learner's update: loss, normalized obs
WindowStep = namedtuple("WindowStep", "obs action reward no_bootstrap done next_obs")
UpdateResult = namedtuple("UpdateResult", "loss obs")


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or process starts."""


class ProcessFailed(RuntimeError):
    """A learner process failed or died; the message holds its traceback (or its exit code)."""


# What --evaluate uses (the checkpoint, the evaluation's envs and device, the networks' shape): other flags are refused
EVALUATE_USES = (
    "env_id",
    "seed",
    "cuda",
    "checkpoint",
    "evaluate",
    "capture_video",
    "horizon",
    "num_eval_envs",
    "toy",
    "actor_device",
    "distributional",
)


def resolve_args(args: Args) -> Args:
    """A copy of `args` with presets, devices and derived sizes filled in; checks what users get wrong (ArgsError)."""
    args = replace(args)
    is_toy = args.env_id == TOY_ENV_ID
    defaults = Args()
    given = [item.name for item in fields(Args) if getattr(args, item.name) != getattr(defaults, item.name)]
    toy_given = [name for name, value in asdict(args.toy).items() if value != getattr(defaults.toy, name)]
    if not is_toy:
        from mani_skill.utils.registration import REGISTERED_ENVS

        if args.env_id not in REGISTERED_ENVS:
            raise ArgsError(f"--env-id {args.env_id!r} is not {TOY_ENV_ID} or a registered ManiSkill3 task")
    args.actor_device = args.actor_device or ("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    args.v_learner_device = args.v_learner_device or args.actor_device
    args.p_learner_device = args.v_learner_device if args.ddpg_n else (args.p_learner_device or args.actor_device)
    preset = "toy" if is_toy else ("gpu" if args.actor_device.startswith("cuda") else "cpu")
    if preset == "cpu":
        print(f"note: without CUDA, {args.env_id} runs a short trial on CPU simulation (preset cpu); flags override it")
    for name, values in PRESETS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[preset])
    gpus = [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    devices = ["cpu"] + (["cuda"] if gpus else []) + gpus  # the values of --*-device that this machine has
    checks = [  # (flag, value, within its domain, the domain)
        ("--horizon", args.horizon, args.horizon is None or args.horizon >= 1, ">= 1"),
        ("--beta-a-v", args.beta_a_v, args.beta_a_v <= 1 or not args.ddpg_n, "<= 1 with --ddpg-n (whole updates)"),
        ("--gamma", args.gamma, 0 <= args.gamma <= 1, "in [0, 1]"),
        ("--tau", args.tau, 0 <= args.tau <= 1, "in [0, 1]"),
        ("--sigma-max", args.sigma_max, args.sigma_max >= args.sigma_min, f">= --sigma-min ({args.sigma_min})"),
        ("--eval-freq", args.eval_freq, args.eval_freq >= 0, ">= 0 (0: only at the end)"),
        ("--toy.autoreset-mode", args.toy.autoreset_mode, args.toy.autoreset_mode == "same_step", "same_step"),
    ]
    shared_domains = [  # (flags, the domain they share, within it)
        (("actor_device", "v_learner_device", "p_learner_device"), f"one of {devices}", lambda value: value in devices),
        (("seed", "warm_up_steps", "sigma_min", "target_noise_std"), ">= 0", lambda value: value >= 0),
        (("num_envs", "num_eval_envs", "total_timesteps", "nstep", "batch_size"), ">= 1", lambda value: value >= 1),
        (("buffer_size", "progress_interval"), ">= 1", lambda value: value >= 1),
        (("beta_a_v", "beta_p_v", "learning_rate", "max_grad_norm", "reward_scale"), "> 0", lambda value: value > 0),
    ]
    for names, domain, within in shared_domains:
        checks += [(f"--{name}", getattr(args, name), within(getattr(args, name)), domain) for name in names]
    for flag, value, ok, domain in checks:
        if not ok:
            raise ArgsError(f"{flag.replace('_', '-')} {value}: must be {domain}")
    if is_toy:
        try:
            args.toy.validate()  # the --toy.* flags, each named in its message
        except ValueError as error:
            raise ArgsError(str(error)) from error
    resuming = args.checkpoint is not None and not args.evaluate
    why_unused = {  # a flag given where it would do nothing is refused, saying why and what to use instead
        "horizon": is_toy and f"{TOY_ENV_ID} takes --toy.horizon",
        "toy": not is_toy and f"it sets {TOY_ENV_ID}, not {args.env_id}",
        "capture_video": is_toy and "the toy chain has no renderer; record a ManiSkill3 task",
        "sequential": args.ddpg_n and "--ddpg-n runs the baseline, --sequential the ablation: use one of them",
        "p_learner_device": args.ddpg_n and "--ddpg-n updates the policy in its one process, on --v-learner-device",
        "beta_p_v": args.ddpg_n and "--ddpg-n makes one policy update per critic update",
        "progress_interval": args.quiet and "--quiet prints no progress lines",
        **dict.fromkeys(("wandb_project_name", "wandb_entity"), not args.track and "it names the W&B run of --track"),
        **dict.fromkeys(
            ("output_dir", "exp_name"), resuming and "a resumed run continues in its checkpoint's directory"
        ),
    }
    for name in given:
        reason = why_unused.get(name) or (args.evaluate and name not in EVALUATE_USES and "--evaluate only evaluates")
        if reason:
            flag = f"toy.{toy_given[0]}" if name == "toy" else name
            value = getattr(args.toy, toy_given[0]) if name == "toy" else getattr(args, name)
            raise ArgsError(f"--{flag.replace('_', '-')} {value}: does nothing here ({reason})")
    actor_device = torch.device(args.actor_device)
    if is_toy:
        args.sim_backend = "torch"
    elif actor_device.type == "cuda":  # by index: a bare "physx_cuda" is ManiSkill's current device, SAPIEN's first GPU
        gpu_index = torch.cuda.current_device() if actor_device.index is None else actor_device.index
        args.sim_backend = f"physx_cuda:{gpu_index}"
    else:
        args.sim_backend = "physx_cpu"
    args.resolved_horizon = args.toy.horizon if is_toy else (args.horizon or gym.spec(args.env_id).max_episode_steps)
    icd = glob.glob("/usr/share/vulkan/icd.d/*.json") + glob.glob("/etc/vulkan/icd.d/*.json")
    if not is_toy and sys.platform == "linux" and not (icd or os.environ.get("VK_ICD_FILENAMES")):
        raise ArgsError("ManiSkill3 needs a Vulkan driver, even for state-only simulation: bash .ci/install_system.sh")
    args.num_actor_steps = args.total_timesteps // args.num_envs
    if not args.evaluate and args.num_actor_steps <= args.warm_up_steps + args.nstep:
        steps = f"{args.num_actor_steps} Actor steps of {args.num_envs} envs <= --warm-up-steps + --nstep"
        raise ArgsError(f"--total-timesteps {args.total_timesteps}: {steps}, nothing would be learned")
    if args.evaluate and not args.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    if args.checkpoint:
        check_checkpoint(args)
    return args


def check_checkpoint(args: Args) -> None:
    """--checkpoint must be pql.py's, of --env-id and --distributional (the networks' shapes); to resume, also of
    --num-envs, --nstep, --toy.*, the device types (the generators' states) and more than a warm-up before
    --total-timesteps (a resume continues the run with the Actor's carried state). Else ArgsError."""
    flag = f"--checkpoint {args.checkpoint}"
    if not os.path.isfile(args.checkpoint):
        raise ArgsError(f"{flag}: no such file")
    try:
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    except Exception as error:  # the innermost error's first line (torch's own first line is about weights_only)
        cause = error.__context__ or error
        reason = str(cause).strip().splitlines() or [type(cause).__name__]
        raise ArgsError(f"{flag}: not a checkpoint of pql.py ({reason[0]})") from error
    script = ckpt.get("script") if isinstance(ckpt, dict) else None
    if script is None:
        raise ArgsError(f'{flag}: not a checkpoint of pql.py (no "script" in it)')
    if script != "pql.py":
        raise ArgsError(f"{flag}: a checkpoint of {script}, not of pql.py")
    if ckpt["env_id"] != args.env_id:
        raise ArgsError(f"{flag}: a checkpoint of {ckpt['env_id']}, not of --env-id {args.env_id}")
    saved = json.loads(ckpt["args"])
    kept = [("distributional", args.distributional, saved["distributional"])]  # (the networks' shapes)
    if not args.evaluate:
        kept += [("num_envs", args.num_envs, saved["num_envs"]), ("nstep", args.nstep, saved["nstep"])]
        kept += [(f"toy.{name}", value, saved["toy"][name]) for name, value in asdict(args.toy).items()]
        devices = ("actor_device", "v_learner_device", "p_learner_device")  # (a CPU and a CUDA generator differ)
        kept += [(name, torch.device(getattr(args, name)).type, torch.device(saved[name]).type) for name in devices]
    for name, value, theirs in kept:
        if value != theirs:
            setting = f"--{name.replace('_', '-')} {value}"
            use = "its networks fit only that" if name == "distributional" else "a resume continues it with that"
            raise ArgsError(f"{setting}: the checkpoint's run has {theirs}; {use}")
    if args.evaluate:
        return
    if ckpt["iteration"] >= args.num_actor_steps:
        steps = f"the checkpoint is at global step {ckpt['global_step']} already; pass a larger value"
        raise ArgsError(f"--total-timesteps {args.total_timesteps}: {steps}")
    if args.num_actor_steps - ckpt["iteration"] <= warm_up_length(args):
        steps = f"{args.num_actor_steps - ckpt['iteration']} Actor steps left after the checkpoint <= the warm-up"
        raise ArgsError(f"--total-timesteps {args.total_timesteps}: {steps}, nothing would be learned")


def warm_up_length(args: Args) -> int:
    """Actor steps before learning starts (a resume's too): --warm-up-steps, at least the n - 1 that fill the window."""
    return max(args.warm_up_steps, args.nstep - 1)


def format_settings(args: Args) -> str:
    """The resolved settings, `name=value` in field order (the toy chain's, `toy.horizon=200`, on it only, never the
    test hook toy.crash_at_step), then the devices in use, in lines of at most 120 characters."""
    pairs = []
    for name, value in asdict(args).items():
        if name != "toy":
            pairs.append(f"{name}={value}".replace(" ", ""))  # (a tuple's spaces would split it)
        elif args.env_id == TOY_ENV_ID:
            pairs += [f"toy.{key}={nested}" for key, nested in value.items() if key != "crash_at_step"]
    devices = dict.fromkeys([args.actor_device, args.v_learner_device, args.p_learner_device])  # (in use, once each)
    pairs.append("device=" + ",".join(devices))
    return "settings:\n" + textwrap.fill(" ".join(pairs), width=120, break_long_words=False, break_on_hyphens=False)


# ---- Environments (same-step autoreset: the true last observation is info["final_obs"]) ------------------------------
def make_maniskill_env(args: Args, num_envs: int, evaluation: bool, video_dir: Optional[Path] = None):
    """A state-observation ManiSkill env, flat actions; evaluation: a new scene each reset (ManiSkill's protocol);
    video_dir: ManiSkill's RecordEpisode records the first VIDEO_ENVS envs, tiled, a video per episode."""
    if mp.parent_process() is not None:  # an env worker process: the Actor handles Ctrl-C, before anything starts
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    import mani_skill.envs  # noqa: F401  (registers the tasks in this process)
    from mani_skill.utils.wrappers.flatten import FlattenActionSpaceWrapper
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper
    from mani_skill.utils.wrappers.record import RecordEpisode

    if not video_dir:
        render_backend = "none"  # no render system (ManiSkill would build one on the first GPU)
    elif args.sim_backend.startswith("physx_cuda"):
        render_backend = args.sim_backend.replace("physx_", "")  # cuda:N, the simulation's GPU
    else:  # CPU simulation: on the CPU without CUDA (asked for a GPU, each worker would warn that it falls back)
        render_backend = "gpu" if torch.cuda.is_available() else "cpu"
    env = gym.make(
        args.env_id,
        num_envs=num_envs,
        max_episode_steps=args.resolved_horizon,
        obs_mode="state",
        sim_backend=args.sim_backend,
        render_backend=render_backend,
        render_mode="rgb_array" if video_dir else None,
        reconfiguration_freq=int(evaluation),
    )
    if video_dir:
        env = RecordEpisode(
            FirstFrames(env),
            video_dir,
            save_trajectory=False,
            max_steps_per_video=args.resolved_horizon,
            avoid_overwriting_video=True,  # (a resume's, --evaluate's videos go on from the last one's number)
        )
    if isinstance(env.action_space, gym.spaces.Dict):
        env = FlattenActionSpaceWrapper(env)
    if args.sim_backend == "physx_cpu":
        env = CPUGymWrapper(env)
    return env


class FirstFrames(gym.Wrapper):
    """The frames of the first VIDEO_ENVS envs only (a tile of thousands of GPU-simulated envs would not fit)."""

    def render(self):
        return self.env.render()[:VIDEO_ENVS]


class ManiSkillVecEnv(gym.vector.VectorEnv):
    """A ManiSkill3 task as a same-step autoreset vector env of torch tensors (physx_cpu: one worker process per env).
    Training envs reset when truncated or terminated; evaluation envs only at the horizon (ManiSkill's protocol)."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, args: Args, num_envs: int, device: torch.device, evaluation: bool, video_dir=None):
        self.num_envs, self.device, self.reset_on_termination = num_envs, device, not evaluation
        self.gpu = args.sim_backend.startswith("physx_cuda")
        make = partial(make_maniskill_env, args, evaluation=evaluation)
        if self.gpu:
            self.env = make(num_envs=num_envs, video_dir=video_dir)
        else:  # a worker process per env; the first VIDEO_ENVS record a video each, in video_dir/env{i}
            video_dirs = [
                video_dir / f"env{index}" if video_dir and index < VIDEO_ENVS else None for index in range(num_envs)
            ]
            self.env = gym.vector.AsyncVectorEnv(
                [partial(make, num_envs=1, video_dir=env_video_dir) for env_video_dir in video_dirs],
                context="forkserver",
                autoreset_mode=gym.vector.AutoresetMode.DISABLED,
            )
        self.single_observation_space = self.env.unwrapped.single_observation_space  # (a vector env's is itself)
        # the flattened Box of FlattenActionSpaceWrapper (multi-robot tasks), not the task's Dict
        self.single_action_space = getattr(self.env, "single_action_space", self.env.unwrapped.single_action_space)

    def as_tensor(self, array, dtype) -> torch.Tensor:
        return torch.as_tensor(array if torch.is_tensor(array) else np.asarray(array), device=self.device, dtype=dtype)

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        obs, _ = self.env.reset(seed=seed, options=options)
        return self.as_tensor(obs, torch.float32).reshape(self.num_envs, -1), {}

    def step(self, actions: torch.Tensor):
        obs, reward, terminated, truncated, info = self.env.step(actions if self.gpu else actions.cpu().numpy())
        obs = self.as_tensor(obs, torch.float32).reshape(self.num_envs, -1)
        reward = self.as_tensor(reward, torch.float32).reshape(self.num_envs)
        terminated = self.as_tensor(terminated, torch.bool).reshape(-1)
        truncated = self.as_tensor(truncated, torch.bool).reshape(-1)
        success = self.as_tensor(info.get("success", np.zeros(self.num_envs, bool)), torch.bool).reshape(-1)
        reset_now = truncated | (terminated & self.reset_on_termination)
        final_obs = obs
        if bool(reset_now.any()):  # partial reset: ManiSkill on the GPU takes env indices, a vector env a mask
            # the GPU simulation may write the reset into the tensors it returned: copies first (as ManiSkillVectorEnv)
            final_obs = obs.clone()
            success = success.clone()
            options = {"env_idx": reset_now.nonzero()[:, 0]} if self.gpu else {"reset_mask": reset_now.cpu().numpy()}
            obs, _ = self.reset(options=options)
        return obs, reward, terminated, truncated, {"success": success, "final_obs": final_obs, "_final_obs": reset_now}

    def close_extras(self, **kwargs):  # (env workers hold nothing to save: ending them is quicker than closing each)
        self.env.close(**({} if self.gpu else {"terminate": True}))


def make_env(args: Args, num_envs: int, device: torch.device, evaluation: bool, video_dir: Optional[Path] = None):
    if args.env_id == TOY_ENV_ID:
        return gym.make_vec(TOY_ENV_ID, num_envs=num_envs, config=args.toy, device=device)
    return ManiSkillVecEnv(args, num_envs, device, evaluation, video_dir)


# ---- Pure functions the algorithm relies on (importable, tested in tests/test_pql.py) --------------------------------
def mixed_exploration_sigmas(num_envs: int, sigma_min: float, sigma_max: float, device=None) -> torch.Tensor:
    """Sec. 3.3, mixed exploration: env i of N explores with noise std
    sigma_i = sigma_min + (i - 1) / (N - 1) * (sigma_max - sigma_min), i = 1..N (sigma_min when N = 1)."""
    return torch.linspace(sigma_min, sigma_max, num_envs, device=device)


def explore(action: torch.Tensor, sigmas: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sec. 3.3: a_t = clip(pi(s_t) + N(0, sigma_i^2), -1, 1), env i's noise std sigma_i (sigmas: (N,))."""
    noise = torch.randn(action.shape, device=action.device, generator=generator) * sigmas[:, None]
    return (action + noise).clamp(-1.0, 1.0)


def nstep_targets(rewards: torch.Tensor, no_bootstrap: torch.Tensor, dones: torch.Tensor, gamma: float):
    """n-step return of a window of n consecutive steps t..t+n-1 of N envs (tensors of shape (n, N)).

    The window is cut at the first episode end (dones): with m = 1 + the index of the first end (m = n if none),
        return   = sum_{k < m} gamma^k r_{t+k}
        discount = 0 if step t+m-1 is in no_bootstrap (a termination under --bootstrap-at-done truncated), else gamma^m
        last     = m - 1, the step whose true next observation is bootstrapped from:
    target = return + discount * Q'(s_{t+m}, pi(s_{t+m})). Returns (returns, discounts, last), each of shape (N,).
    """
    nstep = rewards.shape[0]
    done = dones.to(rewards.dtype)
    ended_before = (torch.cumsum(done, 0) - done) > 0  # an episode end happened at an earlier step of the window
    alive = (~ended_before).to(rewards.dtype)
    powers = gamma ** torch.arange(nstep, device=rewards.device, dtype=rewards.dtype)
    returns = (rewards * alive * powers[:, None]).sum(0)
    used = alive.sum(0).long()  # m
    last = used - 1
    cut = no_bootstrap.gather(0, last[None])[0]
    discounts = torch.where(cut, torch.zeros_like(returns), gamma ** used.to(rewards.dtype))
    return returns, discounts, last


class NStepAssembler:
    """The Actor's n-step transitions (Alg. 1; Table B.1: n = 3) from a sliding window of N envs' last n steps: push()
    takes a vector step (with the *true* next observation) and returns the window's oldest step as a transition."""

    def __init__(self, nstep: int, gamma: float, bootstrap_at_done: str):
        self.nstep, self.gamma, self.bootstrap_at_done = nstep, gamma, bootstrap_at_done
        self.window: deque = deque()  # of WindowStep

    def push(self, obs, action, reward, terminated, truncated, next_obs) -> Optional[dict]:
        no_bootstrap = terminated if self.bootstrap_at_done == "truncated" else torch.zeros_like(terminated)
        self.window.append(WindowStep(obs, action, reward, no_bootstrap, terminated | truncated, next_obs))
        if len(self.window) < self.nstep:
            return None
        rewards = torch.stack([step.reward for step in self.window])
        no_bootstraps = torch.stack([step.no_bootstrap for step in self.window])
        dones = torch.stack([step.done for step in self.window])
        next_obs_all = torch.stack([step.next_obs for step in self.window])
        returns, discounts, last = nstep_targets(rewards, no_bootstraps, dones, self.gamma)
        bootstrap_obs = next_obs_all[last, torch.arange(last.shape[0], device=last.device)]
        oldest = self.window.popleft()
        return dict(obs=oldest.obs, action=oldest.action, reward=returns, next_obs=bootstrap_obs, discount=discounts)


def categorical_projection(
    probs: torch.Tensor, returns: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
) -> torch.Tensor:
    """C51 projection (Bellemare et al. 2017, Alg. 1; PQL-D, App. C) of returns + discount * Z, Z ~ `probs` (B, K) on
    `support` (K,): shifted atoms, clamped to its ends, split their mass between their two neighbours by closeness."""
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
    target_params = list(target.parameters())
    torch._foreach_mul_(target_params, 1.0 - tau)
    torch._foreach_add_(target_params, list(source.parameters()), alpha=tau)


# Speed-ratio control (Sec. 3.2), k_v = 1 / beta_a:v V-updates per Actor step, k_p = 1 / beta_p:v per P-update: the
# process ahead waits. The Actor may be two steps ahead of the V-learner (slack 2 * max(k_v, 1) V-updates: it simulates
# step A + 1 while the V-learner trains on step A); the V-learner may use the data's budget k_v * A and be two
# P-updates ahead of the P-learner, which never gets ahead of it. This never deadlocks; the ratios stay near target.
def actor_may_step(actor_steps: int, v_updates: int, beta_a_v: float) -> bool:
    """May the Actor take learning step A + 1 (A = actor_steps taken since learning started)?"""
    k_v = 1.0 / beta_a_v
    return k_v * (actor_steps + 1) <= v_updates + 2.0 * max(k_v, 1.0) + RATIO_EPS


def v_may_update(v_updates: int, actor_steps: int, p_updates: int, beta_a_v: float, beta_p_v: float) -> bool:
    """May the V-learner do update V + 1: within the data's budget k_v * A, and not too far ahead of the P-learner?"""
    k_v, k_p = 1.0 / beta_a_v, 1.0 / beta_p_v
    return (
        v_updates + 1 <= k_v * actor_steps + RATIO_EPS
        and v_updates + 1 <= k_p * p_updates + 2.0 * max(k_p, 1.0) + RATIO_EPS
    )


def p_may_update(p_updates: int, v_updates: int, beta_p_v: float) -> bool:
    """May the P-learner do update P + 1 (it needs k_p * (P + 1) V-updates done)?"""
    return (p_updates + 1) / beta_p_v <= v_updates + RATIO_EPS


class RunningMeanStd:
    """Table B.1's "Normalized Observations": running mean and variance (Chan et al.'s parallel update), the Actor's."""

    def __init__(self, shape, device, epsilon: float = 1e-4):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(epsilon, device=device)

    def update(self, batch: torch.Tensor) -> None:
        batch_mean, batch_var, added = batch.mean(0), batch.var(0, unbiased=False), batch.shape[0]
        delta, total = batch_mean - self.mean, self.count + added
        self.mean += delta * added / total
        correction = delta.square() * self.count * added / total
        self.var.copy_((self.var * self.count + batch_var * added + correction) / total)
        self.count = total

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        """(obs - mean) / sqrt(var + 1e-8), clipped to [-5, 5]; the same in all three processes."""
        return ((obs - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-5.0, 5.0)


def transition_shapes(obs_dim: int, act_dim: int) -> dict:
    """The fields of one n-step transition (float32), as the Actor sends them and the V-learner stores them."""
    return {"obs": (obs_dim,), "action": (act_dim,), "reward": (), "next_obs": (obs_dim,), "discount": ()}


class ReplayBuffer:
    """A ring buffer of preallocated float32 tensors (`shapes`: of one entry) on one device, sampled uniformly."""

    def __init__(self, capacity: int, shapes: dict, device: torch.device):
        self.capacity, self.device, self.pos, self.size = capacity, device, 0, 0
        self.data = {name: torch.empty((capacity, *shape), device=device) for name, shape in shapes.items()}

    def add(self, batch: dict) -> None:
        count = next(iter(batch.values())).shape[0]
        index = (self.pos + torch.arange(count, device=self.device)) % self.capacity
        for name, buf in self.data.items():
            buf[index] = batch[name].to(self.device)
        self.pos = (self.pos + count) % self.capacity
        self.size = min(self.size + count, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict:
        index = torch.randint(self.size, (batch_size,), device=self.device, generator=generator)
        return {name: buf[index] for name, buf in self.data.items()}


# ---- Networks --------------------------------------------------------------------------------------------------------
def mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers with ELU between them (the original code's MLPNet: no normalization, PyTorch's default init)."""
    layers = [layer for n_in, n_out in zip(sizes[:-1], sizes[1:]) for layer in (nn.Linear(n_in, n_out), nn.ELU())]
    return nn.Sequential(*layers[:-1])  # no ELU after the output layer


class Policy(nn.Module):
    """Deterministic policy pi(s) = tanh(MLP(s)) in [-1, 1]^d (DDPG)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        self.net = mlp([obs_dim, *hidden, act_dim])

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(obs))


class Critic(nn.Module):
    """Q1, Q2 (double Q): MLPs on [s, a]; PQL-D (App. C): each gives logits over linspace(V_MIN, V_MAX, NUM_ATOMS)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...], distributional: bool = False):
        super().__init__()
        self.distributional = distributional
        num_atoms = NUM_ATOMS if distributional else 1
        self.q1 = mlp([obs_dim + act_dim, *hidden, num_atoms])
        self.q2 = mlp([obs_dim + act_dim, *hidden, num_atoms])
        self.register_buffer("support", torch.linspace(V_MIN, V_MAX, num_atoms))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw outputs of both heads: Q values (B, 1), or logits (B, num_atoms) with PQL-D."""
        obs_action = torch.cat([obs, action], dim=-1)
        return self.q1(obs_action), self.q2(obs_action)

    def q_values(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q1(s, a), Q2(s, a) of shape (B,) (the means of the distributions with PQL-D)."""
        out1, out2 = self(obs, action)
        if self.distributional:
            return (out1.softmax(-1) * self.support).sum(-1), (out2.softmax(-1) * self.support).sum(-1)
        return out1[:, 0], out2[:, 0]


@torch.no_grad()
def load_vector(module: nn.Module, vector: torch.Tensor) -> None:
    """Copies a flat parameter vector (parameters_to_vector's layout) into `module`'s parameters."""
    offset = 0
    for param in module.parameters():
        param.copy_(vector[offset : offset + param.numel()].view_as(param))
        offset += param.numel()


def initial_networks(args: Args, obs_dim: int, act_dim: int, device) -> tuple[Policy, Critic, Optional[dict]]:
    """The same initial networks in all three processes (seeded), or those of --checkpoint (then also returned)."""
    torch.manual_seed(args.seed)
    policy = Policy(obs_dim, act_dim, args.hidden_dims)
    critic = Critic(obs_dim, act_dim, args.hidden_dims, args.distributional)
    state = None
    if args.checkpoint:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        try:
            policy.load_state_dict(state["model"]["policy"])
            critic.load_state_dict(state["model"]["critic"])
        except RuntimeError as error:
            fix = "was it trained with another --env-id or --distributional?"
            raise ArgsError(f"--checkpoint {args.checkpoint} does not fit these networks ({fix}): {error}") from error
    return policy.to(device), critic.to(device), state


# ---- The learners (Alg. 2, Alg. 3): the same classes run in their own processes or, with --ddpg-n / --sequential, here
class VLearner:
    """Sec. 3.1 V-learner: a replay buffer of n-step transitions, Q1, Q2 with target networks, and a lagged copy of
    the policy that plays the target policy (Sec. 3.2, third point: no separate target policy)."""

    def __init__(self, args: Args, obs_dim: int, act_dim: int, capacity: int, device: torch.device):
        self.args, self.device = args, device
        self.policy, self.critic, state = initial_networks(args, obs_dim, act_dim, device)
        self.critic_target = copy.deepcopy(self.critic)
        self.optimizer = torch.optim.Adam(self.critic.parameters(), lr=args.learning_rate)
        self.generator = torch.Generator(device=device).manual_seed(args.seed + 1)  # batches, target noise
        if state is not None:
            self.critic_target.load_state_dict(state["model"]["critic_target"])
            self.optimizer.load_state_dict(state["optimizer"]["critic"])
            self.optimizer.param_groups[0]["lr"] = args.learning_rate  # (not the checkpoint's)
            self.generator.set_state(state["rng"]["v_learner"])
        self.buffer = ReplayBuffer(capacity, transition_shapes(obs_dim, act_dim), device)
        self.obs_rms = RunningMeanStd((obs_dim,), device)  # the Actor's, received with every message

    def receive(self, message: dict) -> None:
        """Alg. 3, "if new data received": one Actor step's transitions, its policy (the target policy), statistics."""
        self.buffer.add({name: message[name] for name in self.buffer.data})
        load_vector(self.policy, message["policy"])
        self.obs_rms.mean.copy_(message["obs_mean"])
        self.obs_rms.var.copy_(message["obs_var"])

    @torch.no_grad()
    def target(self, returns: torch.Tensor, discounts: torch.Tensor, next_obs: torch.Tensor) -> torch.Tensor:
        """The n-step double-Q target y = R + discount * min(Q1', Q2')(s', pi^v(s') + clip(noise)) (target networks
        Q', the lagged policy pi^v); with PQL-D the projected target distribution (B, NUM_ATOMS)."""
        next_action = self.policy(next_obs)
        noise = torch.randn(next_action.shape, device=self.device, generator=self.generator)
        noise = (noise * self.args.target_noise_std).clamp(-0.2, 0.2)
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

    def update(self) -> UpdateResult:
        """Alg. 3: Q1, Q2 on a sampled batch, then their targets' soft update."""
        batch = self.buffer.sample(self.args.batch_size, self.generator)
        obs = self.obs_rms.normalize(batch["obs"])
        target = self.target(batch["reward"], batch["discount"], self.obs_rms.normalize(batch["next_obs"]))
        out1, out2 = self.critic(obs, batch["action"])
        if self.critic.distributional:  # cross-entropy to the projected target distribution, for both heads
            loss = -(target * out1.log_softmax(-1)).sum(-1).mean() - (target * out2.log_softmax(-1)).sum(-1).mean()
        else:
            loss = F.mse_loss(out1[:, 0], target) + F.mse_loss(out2[:, 0], target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.critic.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        soft_update_(self.critic_target, self.critic, self.args.tau)
        return UpdateResult(loss=loss.detach(), obs=obs)

    def state_dict(self) -> dict:
        model = {"critic": self.critic.state_dict(), "critic_target": self.critic_target.state_dict()}
        optimizer = {"critic": self.optimizer.state_dict()}
        return {"model": model, "optimizer": optimizer, "rng": {"v_learner": self.generator.get_state()}}


class PLearner:
    """Sec. 3.1 P-learner (Alg. 2): a buffer of states, the policy, and a copy of Q1, Q2 received with the data."""

    def __init__(self, args: Args, obs_dim: int, act_dim: int, capacity: int, device: torch.device):
        self.args, self.device = args, device
        self.policy, self.critic, state = initial_networks(args, obs_dim, act_dim, device)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=args.learning_rate)
        self.generator = torch.Generator(device=device).manual_seed(args.seed + 2)  # batches
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"]["policy"])
            self.optimizer.param_groups[0]["lr"] = args.learning_rate  # (not the checkpoint's)
            self.generator.set_state(state["rng"]["p_learner"])
        self.buffer = ReplayBuffer(capacity, {"obs": (obs_dim,)}, device)
        self.obs_rms = RunningMeanStd((obs_dim,), device)  # the Actor's, received with every message

    def receive(self, message: dict) -> None:
        """One Actor step's message (Alg. 2): its states, the newest Q functions and the normalizer statistics."""
        self.buffer.add({"obs": message["obs"]})
        load_vector(self.critic, message["critic"])
        self.obs_rms.mean.copy_(message["obs_mean"])
        self.obs_rms.var.copy_(message["obs_var"])

    def update(self, obs: Optional[torch.Tensor] = None) -> UpdateResult:
        """Alg. 2: maximize min(Q1, Q2)(s, pi(s)) over normalized states (sampled unless given)."""
        if obs is None:
            obs = self.obs_rms.normalize(self.buffer.sample(self.args.batch_size, self.generator)["obs"])
        q1, q2 = self.critic.q_values(obs, self.policy(obs))
        loss = -torch.min(q1, q2).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward(inputs=list(self.policy.parameters()))  # the Q functions stay as they are
        nn.utils.clip_grad_norm_(self.policy.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        return UpdateResult(loss=loss.detach(), obs=obs)

    def state_dict(self) -> dict:
        optimizer = {"policy": self.optimizer.state_dict()}
        return {
            "model": {"policy": self.policy.state_dict()},
            "optimizer": optimizer,
            "rng": {"p_learner": self.generator.get_state()},
        }


def network_sent_back(role: str, learner) -> dict:
    """What a learner sends back after new data (Sec. 3.1, Fig. 1): the V-learner its online Q functions (not the slow
    target networks) for the P-learner; the P-learner its policy, the Actor's and (lagged) the V-learner's target."""
    name = "critic" if role == "v_learner" else "policy"
    return {name: parameters_to_vector(getattr(learner, name).parameters()).detach()}


# ---- Moving data and networks between the processes (Sec. 3.1: "Data Transfer", "Network Transfer") ------------------
class SlotRing:
    """A one-way channel between two processes: `num_slots` preallocated slots (dicts of tensors) in shared memory (CPU)
    or CUDA memory shared by CUDA IPC, and two counts (written, read). A slot is written only when the reader is done
    with it (has_room): no lock, nothing pickled, no transfer left half done. On CUDA the host never waits: the streams
    wait for each slot's interprocess events (`read` before a write, `written` before a read), recorded before the
    count that announces them moves."""

    def __init__(self, shapes: dict, device, num_slots: int):
        self.device, self.num_slots = torch.device(device), num_slots
        # share_memory_() moves CPU tensors to shared memory; CUDA tensors go to the other process by CUDA IPC
        self.slots = [
            {name: torch.zeros(shape, device=self.device).share_memory_() for name, shape in shapes.items()}
            for _ in range(num_slots)
        ]
        self.written = mp.RawValue(ctypes.c_int64)  # slots written (by the writer), in shared memory
        self.read = mp.RawValue(ctypes.c_int64)  # slots read (by the reader)
        self.written_events = self.read_events = None
        if self.device.type == "cuda":  # recorded once here, so that they exist on the slots' device
            self.written_events = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
            self.read_events = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
            for event in self.written_events + self.read_events:
                event.record(torch.cuda.current_stream(self.device))

    def has_room(self) -> bool:
        return self.written.value - self.read.value < self.num_slots

    def put(self, message: dict) -> None:
        """Writer side (call only when has_room())."""
        index = self.written.value % self.num_slots
        if self.written_events:  # the reader's copies out of this slot are done before it is overwritten
            torch.cuda.current_stream(self.device).wait_event(self.read_events[index])
        for key, tensor in self.slots[index].items():
            tensor.copy_(message[key])
        if self.written_events:  # the reader's stream will wait for these copies
            self.written_events[index].record(torch.cuda.current_stream(self.device))
        self.written.value += 1

    def take(self, consume, newest_only: bool = False) -> int:
        """Reader side: passes each new slot (or only the newest) to `consume`, which copies what it keeps."""
        written = self.written.value
        read = self.read.value
        for count in range(max(read, written - 1) if newest_only else read, written):
            index = count % self.num_slots
            if self.written_events:
                torch.cuda.current_stream(self.device).wait_event(self.written_events[index])
            consume(self.slots[index])
            if self.written_events:
                self.read_events[index].record(torch.cuda.current_stream(self.device))
        self.read.value = written
        return written - read


class LearnerCounts(ctypes.Structure):
    """One learner's shared counts (written by it only): updates done, checkpoint requests served, its last loss (once
    reported: it may be NaN)."""

    _fields_ = [
        ("updates", ctypes.c_int64),
        ("served", ctypes.c_int64),
        ("loss", ctypes.c_double),
        ("loss_reported", ctypes.c_bool),
    ]


class SharedCounters(ctypes.Structure):
    """Counts of the ratio control (Sec. 3.2) and checkpoints, last losses; in shared memory: mp.RawValue(this)."""

    _fields_ = [
        ("actor_steps", ctypes.c_int64),  # Actor steps since learning started (written by the Actor)
        ("checkpoint_requests", ctypes.c_int64),  # written by the Actor
        ("v_learner", LearnerCounts),
        ("p_learner", LearnerCounts),
    ]


def may_update(role: str, counters: SharedCounters, args: Args) -> bool:
    """Sec. 3.2's rule for learner `role` on the shared counts (the learners, --sequential and the end of a run)."""
    if role == "v_learner":
        v_updates = counters.v_learner.updates
        return v_may_update(v_updates, counters.actor_steps, counters.p_learner.updates, args.beta_a_v, args.beta_p_v)
    return p_may_update(counters.p_learner.updates, counters.v_learner.updates, args.beta_p_v)


def learner_process(role, args, sizes, inbox, outbox, counters, stop, run_dir, threads) -> None:
    """The V-learner or P-learner process (Alg. 2, 3): takes the Actor's messages, sends back its network, serves
    checkpoint requests and updates as the ratios allow (Sec. 3.2) until `stop` (errors set it) or the Actor ends."""
    try:
        torch.set_num_threads(threads)
        device = torch.device(args.v_learner_device if role == "v_learner" else args.p_learner_device)
        mine = counters.v_learner if role == "v_learner" else counters.p_learner  # the shared counts it writes
        if device.type == "cuda" and device.index is not None:  # plain "cuda" is the current device already
            torch.cuda.set_device(device)
        learner = VLearner(args, *sizes, device) if role == "v_learner" else PLearner(args, *sizes, device)
        result = None  # of its last update
        while not stop.is_set():
            if inbox.take(learner.receive) and outbox.has_room():  # new data: send back my network
                outbox.put(network_sent_back(role, learner))
            if counters.checkpoint_requests > mine.served:
                request = counters.checkpoint_requests
                torch.save(learner.state_dict(), Path(run_dir, f"{role}_state.pt"))
                mine.served = request
            if may_update(role, counters, args) and learner.buffer.size > 0:
                result = learner.update()
                mine.updates += 1
                if mine.updates % 64 == 0:  # its loss for the Actor's log, not at every update (a GPU sync)
                    mine.loss = result.loss.item()
                    mine.loss_reported = True
                continue
            if result is not None:  # idle: its last loss
                mine.loss = result.loss.item()
                mine.loss_reported = True
            if not mp.parent_process().is_alive():  # the Actor was killed (SIGKILL): no orphans
                return
            time.sleep(POLL_S)
    except BaseException:  # noqa: B036 - everything goes to the Actor
        Path(run_dir, f"{role}_error.txt").write_text(f"the {ROLES[role]} process failed:\n{traceback.format_exc()}")
        stop.set()


def start_learners(args, ctx, supervisor, counters, sizes, numels: dict, threads: int) -> tuple[dict, dict]:
    """Sec. 3.1: starts both learner processes. Returns the SlotRings (float32) to them (Alg. 2, 3) and back."""
    obs_dim, act_dim, _ = sizes
    num_envs, stats = args.num_envs, {"obs_mean": (obs_dim,), "obs_var": (obs_dim,)}
    transitions = {name: (num_envs, *shape) for name, shape in transition_shapes(obs_dim, act_dim).items()}
    to_shapes = {
        "v_learner": {**transitions, "policy": (numels["policy"],), **stats},
        "p_learner": {"obs": (num_envs, obs_dim), "critic": (numels["critic"],), **stats},
    }
    back_shapes = {"v_learner": {"critic": (numels["critic"],)}, "p_learner": {"policy": (numels["policy"],)}}
    devices = {"v_learner": args.v_learner_device, "p_learner": args.p_learner_device}
    to_learner = {role: SlotRing(to_shapes[role], devices[role], 4) for role in ROLES}
    from_learner = {role: SlotRing(back_shapes[role], devices[role], 2) for role in ROLES}
    for role in ROLES:
        channels = (to_learner[role], from_learner[role])
        supervisor.processes[role] = ctx.Process(
            target=learner_process,
            name=f"pql-{role}",
            daemon=True,
            args=(role, args, sizes, *channels, counters, supervisor.stop, str(supervisor.run_dir), threads),
        )
    for stale in supervisor.run_dir.glob("*_error.txt"):  # of a learner that failed before a resume: not this one
        stale.unlink()
    # SIGINT blocked while they start: the learners inherit the block (never see Ctrl-C), the Actor gets it on unblock
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for role, process in supervisor.processes.items():
            process.start()
            print(f"{ROLES[role]} started: pid {process.pid}", flush=True)
    finally:  # (a SIGTERM or an error meanwhile: Ctrl-C is not left blocked)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return to_learner, from_learner


class SerialLearners:
    """Sec. 4.1's baselines in the Actor's process: --ddpg-n, DDPG(n) as the original code runs it (one live policy and
    critic; k_v x (critic update, actor update on the same batch)); --sequential, PQL's schedule run serially."""

    def __init__(self, args: Args, sizes: tuple[int, int, int]):
        self.args, (obs_dim, act_dim, capacity) = args, sizes
        self.v_learner = VLearner(args, obs_dim, act_dim, capacity, torch.device(args.v_learner_device))
        p_capacity = 0 if args.ddpg_n else capacity
        self.p_learner = PLearner(args, obs_dim, act_dim, p_capacity, torch.device(args.p_learner_device))
        if args.ddpg_n:
            self.v_learner.policy, self.p_learner.critic = self.p_learner.policy, self.v_learner.critic
        self.losses: dict = {}  # the last losses, as tensors: read when logged (no GPU sync per step)

    def update(self, counters: SharedCounters) -> None:
        if self.args.ddpg_n:
            k_v = round(1 / self.args.beta_a_v)
            for _ in range(k_v):
                v_result = self.v_learner.update()
                self.losses["losses/qf_loss"] = v_result.loss
                self.losses["losses/actor_loss"] = self.p_learner.update(v_result.obs).loss  # on the same batch
            counters.v_learner.updates += k_v
            counters.p_learner.updates += k_v
            return
        while True:  # Sec. 3.2's rule, serially: P-updates first, as their V-updates allow
            if may_update("p_learner", counters, self.args):
                self.losses["losses/actor_loss"] = self.p_learner.update().loss
                counters.p_learner.updates += 1
            elif may_update("v_learner", counters, self.args):
                self.losses["losses/qf_loss"] = self.v_learner.update().loss
                counters.v_learner.updates += 1
            else:
                break


# ---- The Actor's safe points, evaluation, checkpoints --------------------------------------------------------------
class Supervisor:
    """The Actor's safe points: Ctrl-C / SIGTERM and failed learners (they set the event `stop`)."""

    def __init__(self, run_dir: Path, stop):
        self.run_dir, self.stop = run_dir, stop
        self.processes: dict = {}
        self.stop_requested: list = []  # the signals received

    def handle_signals(self, at_once: bool) -> None:
        """Ctrl-C / SIGTERM: at once (KeyboardInterrupt) while nothing can be left half done (envs and processes
        starting), else noted for the Actor's next safe point (a step, a wait, an evaluation step)."""
        noted = lambda signum, frame: self.stop_requested.append(signum)  # noqa: E731
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.default_int_handler if at_once else noted)

    def check(self, interruptible: bool = True) -> None:
        """Raises KeyboardInterrupt after Ctrl-C, ProcessFailed when a learner failed or died."""
        if self.stop_requested and interruptible:
            raise KeyboardInterrupt  # at a safe point, never inside a transfer
        dead = [role for role, process in self.processes.items() if not process.is_alive()]
        if self.stop.is_set() or dead:
            self.stop.set()
            errors = sorted(self.run_dir.glob("*_error.txt"))
            if errors:
                raise ProcessFailed(errors[0].read_text().rstrip())
            code = self.processes[dead[0]].exitcode if dead else None
            signal_note = f", killed by signal {-code}" if code and code < 0 else ""
            name = ROLES[dead[0]] if dead else "learner"
            raise ProcessFailed(f"the {name} process stopped (exit code {code}{signal_note})")

    def wait_for(self, condition, timeout: float = float("inf"), interruptible: bool = True) -> float:
        """Waits (bounded) until condition() holds, at safe points. Returns the seconds waited."""
        start = time.time()
        while not condition():
            self.check(interruptible)
            if time.time() - start > timeout:
                raise TimeoutError(f"the learners did not answer within {timeout:.0f} s")
            time.sleep(POLL_S)
        return time.time() - start


def to_env_action(action: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The policy's action in [-1, 1]^d, scaled to the env's action space [low, high] (bounds: the rows low, high)."""
    low, high = bounds
    return low + (action + 1.0) * 0.5 * (high - low)


@torch.no_grad()
def evaluate(policy: Policy, eval_envs, obs_rms: RunningMeanStd, bounds, horizon: int, check, seed: int) -> dict:
    """One H-step episode of every eval env with the deterministic policy (ManiSkill's protocol: a termination does
    not end it), calling check() at every step. Means of the unscaled return, success_once and success_at_end."""
    start = time.time()
    obs, _ = eval_envs.reset(seed=seed)
    ret, success_once = 0.0, False
    for _ in range(horizon):
        check()
        obs, reward, terminated, truncated, info = eval_envs.step(to_env_action(policy(obs_rms.normalize(obs)), bounds))
        ret, success_once = ret + reward, success_once | info["success"]
    return {
        "eval/return": ret.mean().item(),
        "eval/success_once": success_once.float().mean().item(),
        "eval/success_at_end": info["success"].float().mean().item(),
        "eval/episode_len": horizon,
        "time/eval": time.time() - start,
    }


def format_eval(global_step: int, metrics: dict) -> str:
    """An evaluation's line, as printed during training and by --evaluate: `global_step=N eval/return=... ...`."""
    values = " ".join(f"{name}={value:.4g}" for name, value in metrics.items() if name.startswith("eval/"))
    return f"global_step={global_step} {values}"


def hms(seconds: float) -> str:
    """H:MM:SS (hours may exceed 24)."""
    return f"{int(seconds) // 3600}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"


def progress_line(args: Args, global_step: int, sps: float, elapsed: float, last: dict, counters) -> str:
    """Env steps done of the total, SPS (as charts/SPS), elapsed and estimated time left, the latest episodic return
    and success rate, and each process's count against the speed ratios of Sec. 3.2 (measured/target)."""
    total = args.num_actor_steps * args.num_envs
    left = hms((total - global_step) / sps) if sps > 0 else "?"
    line = f"progress global_step={global_step}/{total} ({100 * global_step // total}%) SPS={sps:.0f}"
    line += f" elapsed={hms(elapsed)} left={left}"
    line += "".join(
        f" {name}={last[name]:.4g}" for name in ("charts/episodic_return", "charts/success_rate") if name in last
    )
    v_updates = counters.v_learner.updates
    a_v = f"{counters.actor_steps / v_updates:.3f}" if v_updates else "?"
    p_v = f"{counters.p_learner.updates / v_updates:.3f}" if v_updates else "?"
    target_p_v = 1.0 if args.ddpg_n else args.beta_p_v  # DDPG(n): a policy update with every critic update
    line += f" actor_steps={counters.actor_steps} v_updates={v_updates} p_updates={counters.p_learner.updates}"
    return f"{line} a:v={a_v}/{args.beta_a_v:.3f} p:v={p_v}/{target_p_v:.3f}"


def rng_states() -> dict:
    """The global random generators: torch's (CPU, CUDA), numpy's and Python's."""
    kind, key, *position = np.random.get_state()
    numpy_state = (kind, key.tolist(), *position)  # (weights_only: no numpy arrays)
    cuda = torch.cuda.get_rng_state_all()
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": numpy_state, "python": random.getstate()}


def write_whole(path: Path, write) -> None:
    """write(a temporary file), then renamed to `path`: a crash or Ctrl-C leaves the old file or none, never half of
    one, and no temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(path: Path, args, supervisor, counters, serial, actor: dict, carried: dict) -> None:
    """The learners' networks, optimizers and generators (the learner processes write their parts), the shared counts,
    the Actor's `actor` (global_step, iteration, obs_rms, wandb_id) and its generators and `carried` state; no replay
    buffers (a resumed run refills them). Written to a temporary file, then renamed."""
    if serial is None:
        counters.checkpoint_requests += 1
        request = counters.checkpoint_requests
        served = lambda: min(counters.v_learner.served, counters.p_learner.served) >= request  # noqa: E731
        supervisor.wait_for(served, timeout=60.0, interruptible=False)
        v_part = torch.load(supervisor.run_dir / "v_learner_state.pt", map_location="cpu", weights_only=True)
        p_part = torch.load(supervisor.run_dir / "p_learner_state.pt", map_location="cpu", weights_only=True)
        for role in ROLES:
            (supervisor.run_dir / f"{role}_state.pt").unlink()
    else:
        v_part = serial.v_learner.state_dict()
        p_part = serial.p_learner.state_dict()
    counts = dict(actor_steps=counters.actor_steps, v_updates=counters.v_learner.updates)
    state = {
        "script": "pql.py",
        "env_id": args.env_id,
        "model": {**v_part["model"], **p_part["model"]},
        "optimizer": {**v_part["optimizer"], **p_part["optimizer"]},
        "rng": {**v_part["rng"], **p_part["rng"]},
        "counts": {**counts, "p_updates": counters.p_learner.updates},
        **actor,
        "actor": carried,
        "args": json.dumps(asdict(args)),
    }
    write_whole(path, partial(torch.save, state))


def check_buffer_memory(args: Args, obs_dim: int, act_dim: int, capacity: int) -> None:
    """The replay buffers of both learners must fit in the free memory of their devices (else ArgsError)."""
    needed = {args.v_learner_device: 0, args.p_learner_device: 0}  # bytes of replay buffer on each device:
    needed[args.v_learner_device] += capacity * 4 * (2 * obs_dim + act_dim + 2)  # V-learner: s, s', a, r, discount
    needed[args.p_learner_device] += capacity * 4 * obs_dim  # P-learner: s
    free_on_cpu = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for device, bytes_needed in needed.items():
        free, _total = torch.cuda.mem_get_info(device) if torch.device(device).type == "cuda" else (free_on_cpu, 0)
        if bytes_needed > free:
            memory = f"{bytes_needed / 2**30:.1f} GiB on {device}, {free / 2**30:.1f} GiB free"
            raise ArgsError(f"--buffer-size {args.buffer_size}: the buffers need {memory}; use a smaller --buffer-size")


def actor_networks(args: Args, envs, device: torch.device) -> tuple:
    """The Actor's policy and critic (initial, or those of --checkpoint, then returned with it), its observation
    normalizer and the action bounds (the rows low, high of the envs' action space)."""
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    space = envs.single_action_space
    bounds = torch.as_tensor(np.stack([space.low, space.high]), dtype=torch.float32, device=device)
    policy, critic, ckpt = initial_networks(args, obs_dim, bounds.shape[1], device)
    obs_rms = RunningMeanStd((obs_dim,), device)
    if ckpt is not None:
        obs_rms.mean = ckpt["obs_rms"]["mean"].to(device)
        obs_rms.var = ckpt["obs_rms"]["var"].to(device)
        obs_rms.count = ckpt["obs_rms"]["count"].to(device)
    return policy, critic, obs_rms, bounds, ckpt


def evaluate_checkpoint(args: Args) -> dict:
    """--evaluate: one evaluation of the checkpoint's policy, seeded as its run's evaluation at that step (the same
    episodes if --seed, --num-eval-envs and --horizon are the run's); prints its line and writes
    eval_<checkpoint stem>.json (and the videos) beside the checkpoint. No run directory."""
    path = Path(args.checkpoint)
    device = torch.device(args.actor_device)
    video_dir = path.parent / "videos" if args.capture_video else None
    # (a Ctrl-C while its env workers start: multiprocessing ends them, daemons, as this process exits)
    eval_envs = make_env(args, args.num_eval_envs, device, evaluation=True, video_dir=video_dir)
    try:
        policy, _, obs_rms, bounds, ckpt = actor_networks(args, eval_envs, device)
        seed = args.seed + 10_000 + ckpt["iteration"]
        metrics = evaluate(policy, eval_envs, obs_rms, bounds, args.resolved_horizon, lambda: None, seed)
    finally:
        eval_envs.close()
    print(format_eval(ckpt["global_step"], metrics), flush=True)
    if video_dir:
        print(f"videos: {video_dir}", flush=True)
    result = {**metrics, "checkpoint": str(path), "global_step": ckpt["global_step"], "eval_seed": seed}
    result["num_eval_envs"] = args.num_eval_envs
    result["num_eval_episodes"] = args.num_eval_envs  # one episode of each eval env
    write_whole(path.parent / f"eval_{path.stem}.json", lambda tmp: tmp.write_text(json.dumps(result, indent=2)))
    return {"interrupted": False, **result}


def open_run_logs(args: Args, run_dir: Path, wandb_id: Optional[str], purge_step: Optional[int]) -> SummaryWriter:
    """Writes config.json, starts the W&B run (--track) and returns the TensorBoard writer (a resume's purges the
    steps after its checkpoint: no step twice)."""
    write_whole(run_dir / "config.json", lambda tmp: tmp.write_text(json.dumps(asdict(args), indent=2)))
    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            name=run_dir.name,
            id=wandb_id,
            resume="allow",
            config=asdict(args),
            sync_tensorboard=True,
            save_code=True,
        )
    return SummaryWriter(str(run_dir), purge_step=purge_step)


# ---- The Actor (Alg. 1): the main process ----------------------------------------------------------------------------
def main(args: Args) -> dict:
    args = resolve_args(args)
    print(format_settings(args), flush=True)
    if args.evaluate:
        return evaluate_checkpoint(args)
    is_toy = args.env_id == TOY_ENV_ID
    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True) if args.checkpoint else None
    if ckpt is None:
        run_dir = Path(args.output_dir, f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
        run_dir.mkdir(parents=True, exist_ok=False)
    else:  # a resume continues the checkpoint's run: its directory, TensorBoard stream and W&B run
        run_dir = Path(args.checkpoint).parent
        print(f"resuming {run_dir} at global step {ckpt['global_step']} (iteration {ckpt['iteration']})", flush=True)
        warm_up = f"a warm-up of {warm_up_length(args)} Actor steps with the checkpoint's policy"
        simulator = "" if is_toy else "; the simulator's state is not in it either: the envs start anew"
        print(f"resume: the replay buffers are not in the checkpoint: the learners refill them ({warm_up}){simulator}")
    parallel = not (args.ddpg_n or args.sequential)
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // 3) if parallel else cores  # torch threads per process: the cores split among them
    threads = min(threads, int(os.environ.get("OMP_NUM_THREADS", threads)))  # a user's OMP_NUM_THREADS caps them
    torch.set_num_threads(threads)
    device = torch.device(args.actor_device)
    ctx = mp.get_context("spawn")
    supervisor = Supervisor(run_dir, ctx.Event())
    wandb_id = ckpt["wandb_id"] if ckpt else None
    if args.track:
        wandb_id = wandb_id or os.urandom(4).hex()  # (a new run's id: 8 characters, as W&B's own)
    # a resume writes into its run directory only once its networks and generators are loaded: one refused or
    # interrupted before leaves the run as it was
    writer = None if ckpt else open_run_logs(args, run_dir, wandb_id, None)
    last: dict[str, float] = {}  # the last value of every scalar, for summary.json

    def log(values: dict) -> None:
        for name, value in values.items():
            writer.add_scalar(name, float(value), global_step)
            last[name] = float(value)

    def checkpoint(path: Path) -> None:  # with what the Actor carries from step to step, at this moment
        window = [list(step) for step in assembler.window]
        env_state = envs.unwrapped.state_dict() if is_toy else None
        carried = dict(obs=raw_obs, window=window, episode=episode, env=env_state, explore=explore_rng.get_state())
        actor = dict(global_step=global_step, iteration=iteration, obs_rms=vars(obs_rms), wandb_id=wandb_id)
        save_checkpoint(path, args, supervisor, counters, serial, actor, {"rng": rng_states(), **carried})

    summary: dict = {"interrupted": False, "eval_time_s": 0.0}
    envs = eval_envs = serial = None
    counters = mp.RawValue(SharedCounters)  # zeros, in shared memory
    iteration = global_step = 0  # Actor steps and env steps taken
    if ckpt is not None:
        iteration = ckpt["iteration"]
        global_step = ckpt["global_step"]
        counters.actor_steps = ckpt["counts"]["actor_steps"]
        counters.v_learner.updates = ckpt["counts"]["v_updates"]
        counters.p_learner.updates = ckpt["counts"]["p_updates"]
    first_step = iteration  # of this run (or resumed segment), and its env steps
    start_step = global_step
    start_time = time.time()
    supervisor.handle_signals(at_once=True)
    try:
        # ---- build: envs, networks, the learners (a Ctrl-C meanwhile ends the run at once) -----------------------
        video_dir = run_dir / "videos" if args.capture_video else None
        eval_envs = make_env(args, args.num_eval_envs, device, evaluation=True, video_dir=video_dir)
        if video_dir:
            print(f"videos: {video_dir}", flush=True)
        policy, critic, obs_rms, bounds, _ = actor_networks(args, eval_envs, device)
        obs_dim = obs_rms.mean.shape[0]
        act_dim = bounds.shape[1]
        evaluation = partial(evaluate, policy, eval_envs, obs_rms, bounds, args.resolved_horizon, supervisor.check)
        capacity = min(args.buffer_size, args.num_actor_steps * args.num_envs)
        check_buffer_memory(args, obs_dim, act_dim, capacity)
        envs = make_env(args, args.num_envs, device, evaluation=False)
        num_envs = args.num_envs
        sigmas = mixed_exploration_sigmas(num_envs, args.sigma_min, args.sigma_max, device)  # Sec. 3.3
        explore_rng = torch.Generator(device=device).manual_seed(args.seed)  # warm-up actions, exploration noise
        assembler = NStepAssembler(args.nstep, args.gamma, args.bootstrap_at_done)
        episode = {  # the episodes the envs are in; the sums over those ended since the last log
            "return": torch.zeros(num_envs, device=device),
            "length": torch.zeros(num_envs, dtype=torch.long, device=device),
            "success_once": torch.zeros(num_envs, dtype=torch.bool, device=device),
            "ended": torch.zeros(4, device=device),  # count, return, length, success
        }
        if ckpt is not None and is_toy:  # the toy chain's state is in the checkpoint: all continues where it was
            carried = ckpt["actor"]
            envs.unwrapped.load_state_dict(carried["env"])
            raw_obs = carried["obs"].to(device)
            assembler.window.extend(WindowStep(*[value.to(device) for value in step]) for step in carried["window"])
            episode = {name: value.to(device) for name, value in carried["episode"].items()}
        else:
            raw_obs, _ = envs.reset(seed=args.seed + iteration)
        critic_vector = parameters_to_vector(critic.parameters()).detach().to(args.p_learner_device)
        sizes = (obs_dim, act_dim, capacity)
        if parallel:
            numels = {"policy": sum(param.numel() for param in policy.parameters()), "critic": critic_vector.numel()}
            to_learner, from_learner = start_learners(args, ctx, supervisor, counters, sizes, numels, threads)
        else:
            serial = SerialLearners(args, sizes)
        if ckpt is not None:  # the generators (after the networks' seeded initialization)
            torch.set_rng_state(ckpt["actor"]["rng"]["torch"])
            torch.cuda.set_rng_state_all(ckpt["actor"]["rng"]["cuda"][: torch.cuda.device_count()])
            np.random.set_state(ckpt["actor"]["rng"]["numpy"])
            random.setstate(ckpt["actor"]["rng"]["python"])
            explore_rng.set_state(ckpt["actor"]["explore"])
            writer = open_run_logs(args, run_dir, wandb_id, ckpt["global_step"])
        warm_up_end = first_step + warm_up_length(args)  # learning starts after the warm-up
        timers = {"time/rollout": 0.0, "time/update": 0.0}  # seconds since the last log
        supervisor.handle_signals(at_once=False)
        train_start = time.time()
        last_progress = train_start
        while iteration < args.num_actor_steps:
            # ---- 1. evaluate (and checkpoint) every --eval-freq Actor steps --------------------------------------
            supervisor.check()
            if args.eval_freq > 0 and iteration % args.eval_freq == 0:
                metrics = evaluation(seed=args.seed + 10_000 + iteration)  # the learners idle meanwhile
                summary["eval_time_s"] += metrics["time/eval"]
                log(metrics)
                print(format_eval(global_step, metrics), flush=True)
                if args.save_model and iteration > first_step:
                    checkpoint(run_dir / f"ckpt_{global_step}.pt")
            learning = iteration >= warm_up_end
            # ---- 2. the learners' newest networks (Alg. 1); Sec. 3.2: wait while ahead of the V-learner -----------
            if parallel:
                if learning:
                    timers["time/update"] += supervisor.wait_for(
                        lambda: actor_may_step(counters.actor_steps, counters.v_learner.updates, args.beta_a_v)
                    )
                from_learner["p_learner"].take(lambda slot: load_vector(policy, slot["policy"]), newest_only=True)
                from_learner["v_learner"].take(lambda slot: critic_vector.copy_(slot["critic"]), newest_only=True)
            else:
                load_vector(policy, network_sent_back("p_learner", serial.p_learner)["policy"])
                critic_vector = network_sent_back("v_learner", serial.v_learner)["critic"]
            # ---- 3. act: warm-up actions, then pi(s) + N(0, sigma_i^2), sigma_i fixed per env (Sec. 3.3) ----------
            step_start = time.time()
            with torch.no_grad():
                if iteration < warm_up_end and ckpt is None:  # Table B.1 warm-up: uniform random actions
                    action = torch.rand((num_envs, act_dim), device=device, generator=explore_rng) * 2.0 - 1.0
                else:
                    action = explore(policy(obs_rms.normalize(raw_obs)), sigmas, explore_rng)
            next_raw, reward, terminated, truncated, info = envs.step(to_env_action(action, bounds))
            # the true next observation: where an env reset in this step (same-step autoreset), info["final_obs"]
            true_next = torch.where(info["_final_obs"][:, None], info["final_obs"].reshape(num_envs, -1), next_raw)
            transitions = assembler.push(raw_obs, action, reward * args.reward_scale, terminated, truncated, true_next)
            if args.norm_obs:
                obs_rms.update(next_raw)
            raw_obs = next_raw
            # ---- 4. send data, the normalizer and the newest networks (Alg. 1) -------------------------------------
            if transitions is not None:
                normalizer = {"obs_mean": obs_rms.mean, "obs_var": obs_rms.var}
                messages = {
                    "v_learner": {**transitions, **normalizer, "policy": parameters_to_vector(policy.parameters())},
                    "p_learner": {"obs": transitions["obs"], **normalizer, "critic": critic_vector},
                }
                if parallel:
                    for role in ROLES:
                        # (a Ctrl-C waits for the step's end: the env has stepped, the counters must follow)
                        timers["time/update"] += supervisor.wait_for(to_learner[role].has_room, interruptible=False)
                        to_learner[role].put(messages[role])
                else:  # (each learner copies the tensors to its device)
                    serial.v_learner.receive(messages["v_learner"])
                    if args.sequential:
                        serial.p_learner.receive(messages["p_learner"])
            if learning:
                counters.actor_steps += 1
            timers["time/rollout"] += time.time() - step_start
            # ---- (the baselines of Sec. 4.1, --ddpg-n and --sequential: the updates, here, serially) ----------------
            if learning and serial is not None:
                update_start = time.time()
                serial.update(counters)
                timers["time/update"] += time.time() - update_start
            # ---- 5. episode statistics (unscaled rewards), the log and the progress line ---------------------------
            done = terminated | truncated
            episode["return"] += reward
            episode["length"] += 1
            episode["success_once"] |= info["success"]
            ended = [done.sum(), (episode["return"] * done).sum(), (episode["length"] * done).sum()]
            episode["ended"] += torch.stack([*ended, (episode["success_once"] & done).sum()]).float()
            episode["return"] *= ~done
            episode["length"] *= ~done
            episode["success_once"] &= ~done
            iteration += 1
            global_step += num_envs
            sps = (global_step - start_step) / (time.time() - train_start)  # as charts/SPS: since training started
            if iteration % LOG_EVERY == 0:
                count, returns, lengths, successes = episode["ended"].tolist()  # (on CUDA: syncs before the timers)
                log({"charts/SPS": sps, **timers})
                if count > 0:
                    log({"charts/episodic_return": returns / count, "charts/episodic_length": lengths / count})
                    log({"charts/success_rate": successes / count})
                v_updates = counters.v_learner.updates
                if v_updates > 0:  # the measured speed ratios (Sec. 3.2)
                    log({"pql/ratio_a_v": counters.actor_steps / v_updates})
                    log({"pql/ratio_p_v": counters.p_learner.updates / v_updates})
                if parallel and counters.v_learner.loss_reported:  # each learner's last loss
                    log({"losses/qf_loss": counters.v_learner.loss})
                if parallel and counters.p_learner.loss_reported:
                    log({"losses/actor_loss": counters.p_learner.loss})
                if not parallel:
                    log(serial.losses)
                episode["ended"].zero_()
                timers = dict.fromkeys(timers, 0.0)
            if not args.quiet and time.time() - last_progress >= args.progress_interval:
                last_progress = time.time()
                print(progress_line(args, global_step, sps, last_progress - train_start, last, counters), flush=True)

        # ---- the end: the learners finish the updates the last Actor steps paid for; the final evaluation ---------
        if parallel:
            supervisor.wait_for(lambda: not any(may_update(role, counters, args) for role in ROLES))
            from_learner["p_learner"].take(lambda slot: load_vector(policy, slot["policy"]), newest_only=True)
        else:
            load_vector(policy, network_sent_back("p_learner", serial.p_learner)["policy"])
        metrics = evaluation(seed=args.seed + 10_000 + iteration)
        summary["eval_time_s"] += metrics["time/eval"]
        log(metrics)
        print(format_eval(global_step, metrics), flush=True)
        if args.save_model:
            checkpoint(run_dir / "final_ckpt.pt")
    except KeyboardInterrupt:
        summary["interrupted"] = True
        save = args.save_model and iteration > first_step  # (a checkpoint once this run has stepped)
        print("interrupted: writing summary.json" + (" and a checkpoint" if save else ""), flush=True)
        if save:  # (a learner that cannot answer: exit 1)
            checkpoint(run_dir / "final_ckpt.pt")
    finally:
        supervisor.handle_signals(at_once=False)  # (a Ctrl-C during the clean-up waits for it)
        wall = time.time() - start_time
        summary["global_step"] = global_step
        summary["iteration"] = iteration
        summary["wall_time_s"] = wall
        summary["sps"] = (global_step - start_step) / wall
        for name, value in last.items():  # the last value of every logged scalar
            summary[name] = value
        summary["pql/learning_steps"] = counters.actor_steps
        summary["pql/v_updates"] = counters.v_learner.updates
        summary["pql/p_updates"] = counters.p_learner.updates
        if counters.v_learner.updates > 0:
            summary["pql/ratio_a_v"] = counters.actor_steps / counters.v_learner.updates
            summary["pql/ratio_p_v"] = counters.p_learner.updates / counters.v_learner.updates
        if writer is not None:  # (not a resume that ended before its run continued)
            write_whole(run_dir / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2)))
            writer.close()
        supervisor.stop.set()  # the learners end at their next look at it
        for env in (envs, eval_envs):
            if env is not None:
                env.close()
        deadline = time.time() + 5.0
        for process in mp.active_children():  # the learners (5 s to end), the workers of an env interrupted starting
            if process in supervisor.processes.values():
                process.join(max(0.0, deadline - time.time()))
            process.kill()
    return summary


if __name__ == "__main__":
    try:
        if main(tyro.cli(Args))["interrupted"]:
            sys.exit(130)
    except KeyboardInterrupt:  # before the run started (or in --evaluate): nothing to write
        sys.exit(130)
    except (ArgsError, ProcessFailed, TimeoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2 if isinstance(error, ArgsError) else 1)
