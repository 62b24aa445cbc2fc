"""PPO with Variable Experience Rollout (VER): env worker processes, dynamic batching, DD-PPO.

Paper: "VER: Scaling On-Policy RL Leads to the Emergence of Navigation in Embodied Rearrangement",
Erik Wijmans, Irfan Essa, Dhruv Batra (NeurIPS 2022), arXiv:2210.05064.

Batched on-policy RL waits for the slowest env at every step and at the end of every rollout. VER removes both waits
while staying on-policy: env workers step their envs independently into shared memory; the main process (the inference
worker) batches whatever observations are waiting (dynamic batching); a rollout ends once T x N steps are collected in
total, however many each env gave, and actions still in flight are carried into the next rollout. PPO learns on the
variable-length sequences, weighted by truncated importance weights. Under torchrun every rank collects and learns
(DD-PPO), and stragglers among the ranks are preempted.

Map from the paper to this file
  Sec. 2.1, Fig. 2   env_worker, SharedSlots, EnvWorkers; Collector (the inference worker, dynamic batching)
  Sec. 2.2 VER       Collector.collect (T x N steps, no per-env quota), Collector.start_next_rollout (inflight
                     actions); --no-variable-experience (NoVER), --sync (SyncOnRL, DD-PPO's collection)
  Sec. 2.2, Fig. 3B  build_sequences, make_minibatches (shuffle sequences, cut into equal-size minibatches)
  Sec. 2.2, Fig. 3C  pack_layout, Agent.evaluate (LSTM over a PackedSequence, each piece from its stored state)
  GAE                compute_gae_packed (over sequences split at rollout and episode boundaries)
  Sec. 4 "Training"  importance_weights (truncated at 1.0), ppo_loss (learned entropy coefficient), ppo_update
  Sec. 2.3           allreduce_gradients, optimal_preemption_time (argmax_S S/(Time(S)+LT)), ver_stop_rule,
                     fill_from_previous; ddppo_stop_rule (--sync under torchrun, --sync-frac)
  Not in VER         RunningMeanStd (obs_rms): observation normalization as ppo_staggered.py, Box observations only
Autoreset (Gymnasium's vector autoreset modes): none in the collector. Each env worker resets its own env in the step
that ends an episode and reports the true last observation with the reset one (ToyChain in same_step mode for that).
ver/straggler_share (logged, and in the progress line): the share of envs (all ranks) that gave fewer than T steps to
the last rollout, those VER did not wait for; 0 with NoVER and --sync (every env gives T) unless a rank is preempted.
A resume (main's save) is not bit-identical: dynamic batching depends on timing. Checkpoints hold rank 0's generators
and toy chains; ManiSkill's envs (the simulator's state is not saved) and the other ranks' start anew.

Examples
  python ppo_ver.py --toy.step-time-mean 0.004 --toy.step-time-spread 1  # VER, heterogeneous simulation time
  python ppo_ver.py --env-id PickCube-v1 --num-envs 8 --recurrent        # ManiSkill3, an LSTM policy
  torchrun --standalone --nproc_per_node 2 ppo_ver.py --num-envs 8       # DD-PPO: 2 ranks (gloo on CPU, NCCL on GPUs)
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import pickle
import signal
import socket
import sys
import textwrap
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import forkserver
from multiprocessing.connection import wait as wait_for_connections
from pathlib import Path
from typing import Callable, Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import tyro
from torch.nn.utils.rnn import PackedSequence
from torch.utils.tensorboard import SummaryWriter

from toy_chain_env import ToyChainWorkerConfig, ToyChainWorkerEnv, draw_target_actions


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of torch, of the minibatch shuffling and of the environments (env e of rank r is seeded seed + r * N + e)"""
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
    save_model: bool = False
    """write checkpoints (ckpt_{global_step}.pt at every evaluation, final_ckpt.pt at the end and on Ctrl-C)"""
    checkpoint: Optional[str] = None
    """a checkpoint of this script: continue its run, in its folder (or evaluate it, with --evaluate)"""
    evaluate: bool = False
    """only evaluate the policy of --checkpoint (one result line; eval_<checkpoint name>.json beside it), then exit"""
    progress_interval: float = 15.0
    """seconds between two progress lines, >= 1"""
    quiet: bool = False
    """no progress lines (settings, evaluations and errors still print)"""

    env_id: str = "ToyChain-v0"
    """ToyChain-v0 or a ManiSkill3 task id (PickCube-v1, StackCube-v1, ...)"""
    num_envs: Optional[int] = None
    """N: envs per rank, each stepped in its own env worker process (default: ToyChain 16; ManiSkill 8)"""
    toy: ToyChainWorkerConfig = field(default_factory=ToyChainWorkerConfig)
    """ToyChain-v0 settings (the step-time and straggler options make its simulation time heterogeneous, VER Sec. 2)"""
    bootstrap_at_done: Optional[Literal["always", "truncated"]] = None
    """V(true last obs) at every episode end, or at truncations only (default: ToyChain truncated; ManiSkill always)"""

    total_timesteps: Optional[int] = None
    """env steps to train for, all ranks together (default: ToyChain 300k; ManiSkill 2M)"""
    learning_rate: Optional[float] = None
    """Adam learning rate, > 0 (default: ToyChain 2.5e-4, as Sec. 4; ManiSkill 3e-4)"""
    num_steps: Optional[int] = None
    """T: a rollout collects T x N steps per rank, T per env on average with VER (default: ToyChain 32; ManiSkill 16)"""
    gamma: Optional[float] = None
    """discount factor in [0, 1] (default: ToyChain 0.99; ManiSkill 0.8)"""
    gae_lambda: Optional[float] = None
    """GAE lambda in [0, 1] (default: ToyChain 0.95; ManiSkill 0.9)"""
    num_minibatches: int = 4
    """minibatches per epoch, each of T x N / num_minibatches steps (Sec. 2.2)"""
    update_epochs: int = 4
    """PPO epochs over each rollout"""
    clip_coef: float = 0.2
    """PPO clipping coefficient, > 0"""
    ent_coef: Optional[float] = None
    """entropy bonus coefficient, >= 0; with --learned-ent-coef its start (default: ToyChain 0.01; ManiSkill 0)"""
    learned_ent_coef: bool = False
    """learn the entropy coefficient alpha in [1e-4, 1] towards --target-entropy (Sec. 4)"""
    target_entropy: float = 0.0
    """lambda: the minimum policy entropy that the learned coefficient enforces (Sec. 4 sets 0)"""
    vf_coef: float = 0.5
    """value-loss coefficient, >= 0"""
    max_grad_norm: float = 0.5
    """gradient-norm clip, > 0"""
    target_kl: Optional[float] = None
    """stop an update's epochs once the approximate KL exceeds this, > 0 (default: ToyChain off; ManiSkill 0.1)"""
    recurrent: bool = False
    """an LSTM policy trained on packed sequences (Sec. 2.2, Fig. 3C); default: an MLP"""

    variable_experience: bool = True
    """VER: T x N steps per rollout from any envs (Sec. 2.2); --no-variable-experience is NoVER: T from every env"""
    sync: bool = False
    """SyncOnRL (DD-PPO's collection): step all envs, wait for all of them, then act; implies NoVER"""
    inference_min_batch: Optional[int] = None
    """dynamic batching: act once this many envs are waiting (default: N / 1.5, as habitat-lab; --sync waits for N)"""
    sync_frac: float = 0.6
    """DD-PPO's preemption (--sync under torchrun), in [0, 1]: stop once this fraction of the ranks have finished"""

    eval_freq: int = 10
    """evaluate every this many iterations (and at the end); 0 = only at the end"""
    num_eval_episodes: int = 16
    """evaluation episodes, >= 1 (deterministic policy, one env in the main process; ToyChain: no step delays)"""

    # filled in by resolve_args
    batch_size: tyro.conf.Suppress[int] = 0
    world_size: tyro.conf.Suppress[int] = 1
    env_kind: tyro.conf.Suppress[str] = ""


PRESETS = {  # defaults (ToyChain-v0, ManiSkill3 tasks): any flag overrides them; ManiSkill's PPO baseline on few envs
    "num_envs": (16, 8),
    "num_steps": (32, 16),
    "total_timesteps": (300_000, 2_000_000),
    "learning_rate": (2.5e-4, 3e-4),
    "gamma": (0.99, 0.8),
    "gae_lambda": (0.95, 0.9),
    "target_kl": (None, 0.1),
    "ent_coef": (0.01, 0.0),
    "bootstrap_at_done": ("truncated", "always"),
}


class ArgsError(ValueError):
    """Bad command-line input, reported before any env or process starts (a checkpoint of another network: once the
    network is built, before any env worker starts or anything is written)."""


class WorkerError(RuntimeError):
    """An env worker raised or died: the run ends with its message."""


# ---- Argument resolution: presets, derived sizes, checks (all before any env or process starts) ----------------------
def check_domains(args: Args) -> None:
    """Every numeric flag within its domain (presets filled in), else ArgsError "--flag VALUE: must be DOMAIN"."""
    rows = [  # (flag, value, within its domain, the domain)
        ("--seed", args.seed, args.seed >= 0, ">= 0"),
        ("--num-envs", args.num_envs, args.num_envs >= 1, ">= 1"),
        ("--total-timesteps", args.total_timesteps, args.total_timesteps >= 1, ">= 1"),
        ("--learning-rate", args.learning_rate, args.learning_rate > 0, "> 0"),
        ("--num-steps", args.num_steps, args.num_steps >= 1, ">= 1"),
        ("--gamma", args.gamma, 0 <= args.gamma <= 1, "in [0, 1]"),
        ("--gae-lambda", args.gae_lambda, 0 <= args.gae_lambda <= 1, "in [0, 1]"),
        ("--num-minibatches", args.num_minibatches, args.num_minibatches >= 1, ">= 1"),
        ("--update-epochs", args.update_epochs, args.update_epochs >= 1, ">= 1"),
        ("--clip-coef", args.clip_coef, args.clip_coef > 0, "> 0"),
        ("--ent-coef", args.ent_coef, args.ent_coef >= 0, ">= 0"),
        ("--target-entropy", args.target_entropy, math.isfinite(args.target_entropy), "a finite number"),
        ("--vf-coef", args.vf_coef, args.vf_coef >= 0, ">= 0"),
        ("--max-grad-norm", args.max_grad_norm, args.max_grad_norm > 0, "> 0"),
        ("--target-kl", args.target_kl, args.target_kl is None or args.target_kl > 0, "> 0"),
        ("--inference-min-batch", args.inference_min_batch, args.inference_min_batch >= 1, ">= 1"),
        ("--sync-frac", args.sync_frac, 0 <= args.sync_frac <= 1, "in [0, 1]"),
        ("--eval-freq", args.eval_freq, args.eval_freq >= 0, ">= 0 (0: only at the end)"),
        ("--num-eval-episodes", args.num_eval_episodes, args.num_eval_episodes >= 1, ">= 1"),
        ("--progress-interval", args.progress_interval, args.progress_interval >= 1, ">= 1"),
    ]
    for flag, value, ok, domain in rows:
        if not ok:
            raise ArgsError(f"{flag} {value}: must be {domain}")
    if args.learned_ent_coef and not 1e-4 <= args.ent_coef <= 1:
        raise ArgsError(f"--ent-coef {args.ent_coef}: must be in [1e-4, 1] with --learned-ent-coef")
    if args.checkpoint and not os.path.exists(args.checkpoint):
        raise ArgsError(f"--checkpoint {args.checkpoint}: no such file")


def check_unused(args: Args, given: dict) -> None:
    """Refuses a flag given (`given`: the fields that differ from their defaults, as given) where it would do nothing."""
    resuming = args.checkpoint is not None and not args.evaluate
    evaluation_uses = ("checkpoint", "evaluate", "env_id", "seed", "cuda", "torch_deterministic", "num_eval_episodes")
    rules = [  # (field, does nothing here, the reason)
        ("sync_frac", not (args.sync and args.world_size > 1), "without --sync under torchrun (DD-PPO's preemption)"),
        ("target_entropy", not args.learned_ent_coef, "without --learned-ent-coef"),
        ("inference_min_batch", args.sync, "with --sync, which acts once all N envs are ready"),
        ("wandb_project_name", not args.track, "without --track"),
        ("wandb_entity", not args.track, "without --track"),
        ("toy.slow_rank_factor", args.world_size == 1, "on one rank (it slows rank 0 of two or more, under torchrun)"),
        ("output_dir", resuming, "on a resume, which continues in the checkpoint's folder"),
        ("exp_name", resuming, "on a resume, which continues in the checkpoint's folder"),
        ("progress_interval", args.quiet, "with --quiet, which prints no progress lines"),
    ]
    for name in given:
        toy_timing = name.startswith(("toy.step_time", "toy.slow"))  # (ToyChain evaluates without delays)
        rules.append((name, toy_timing and args.toy.step_time_mean == 0, "without --toy.step-time-mean > 0"))
        rules.append((name, name.startswith("toy.") and args.env_kind != "toy", f"on {args.env_id} (ToyChain-v0's)"))
        policy = name in ("recurrent", "learned_ent_coef", "ent_coef") or name.startswith("toy.") and not toy_timing
        rules.append((name, args.evaluate and not (name in evaluation_uses or policy), "with --evaluate"))
    for name, unused, reason in rules:
        if name in given and unused:
            raise ArgsError(f"--{name.replace('_', '-')} {given[name]}: does nothing {reason}")


def check_checkpoint(args: Args) -> None:
    """--checkpoint: a checkpoint of this script and task, and (to resume) short of --total-timesteps."""
    try:
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
        first_line = (str(error) or type(error).__name__).splitlines()[0]
        raise ArgsError(f"--checkpoint {args.checkpoint}: not a checkpoint of ppo_ver.py ({first_line})") from error
    if not isinstance(checkpoint, dict) or "script" not in checkpoint:
        raise ArgsError(f'--checkpoint {args.checkpoint}: not a checkpoint of ppo_ver.py (no "script" in it)')
    for found, expected in ((checkpoint["script"], "ppo_ver.py"), (checkpoint.get("env_id"), args.env_id)):
        if found != expected:
            raise ArgsError(f"--checkpoint {args.checkpoint}: a checkpoint of {found}, not of {expected}")
    if "global_step" not in checkpoint:
        raise ArgsError(f'--checkpoint {args.checkpoint}: not a checkpoint of ppo_ver.py (no "global_step" in it)')
    step = checkpoint["global_step"]
    total = args.total_timesteps
    if not args.evaluate and step >= total:
        message = f"--total-timesteps {total}: the checkpoint is at global step {step} already; pass a larger value"
        raise ArgsError(message)
    saved_steps = checkpoint.get("steps_per_iteration", args.batch_size * args.world_size)  # (older checkpoints: none)
    if not args.evaluate and saved_steps != args.batch_size * args.world_size:
        ours = f"{args.num_steps} x {args.num_envs} x {args.world_size} = {args.batch_size * args.world_size}"
        message = f"--num-steps, --num-envs and ranks: T x N x ranks = {ours} steps per iteration, the checkpoint's"
        raise ArgsError(f"{message} run {saved_steps}; resume with the same")


def resolve_args(args: Args, world_size: Optional[int] = None) -> Args:
    """Fills the presets and derived sizes into a copy of `args` and validates it. Raises ArgsError."""
    defaults = Args()
    given = {key: value for key, value in vars(args).items() if key != "toy" and value != getattr(defaults, key)}
    for name, value in vars(args.toy).items():
        if value != getattr(defaults.toy, name):
            given[f"toy.{name}"] = value
    resolved = replace(args, toy=replace(args.toy))
    resolved.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    resolved.env_kind = "toy" if resolved.env_id == "ToyChain-v0" else "maniskill"
    for name, (toy, maniskill) in PRESETS.items():
        if getattr(resolved, name) is None:
            setattr(resolved, name, toy if resolved.env_kind == "toy" else maniskill)
    if resolved.sync:  # step all N envs, wait for all of them, act on all
        resolved.variable_experience = False
        resolved.inference_min_batch = resolved.num_envs
    if resolved.inference_min_batch is None:
        resolved.inference_min_batch = max(1, int(resolved.num_envs / 1.5))  # habitat-lab's default
    check_domains(resolved)
    if resolved.env_kind == "toy":
        try:
            resolved.toy.validate()  # "--toy.horizon must be >= 1, got 0", ...
        except ValueError as error:
            raise ArgsError(str(error)) from error
    else:
        from mani_skill.utils.registration import REGISTERED_ENVS

        if resolved.env_id not in REGISTERED_ENVS:
            raise ArgsError(f"--env-id {resolved.env_id!r}: neither ToyChain-v0 nor a ManiSkill3 task")
        icd_files = glob.glob("/usr/share/vulkan/icd.d/*.json") + glob.glob("/etc/vulkan/icd.d/*.json")
        if sys.platform.startswith("linux") and not (icd_files or os.environ.get("VK_ICD_FILENAMES")):
            raise ArgsError("ManiSkill3 needs a Vulkan driver, even for state observations: bash .ci/install_system.sh")
    if resolved.evaluate and not resolved.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    if resolved.evaluate and resolved.world_size > 1:
        raise ArgsError(f"--evaluate: one process evaluates; run it without torchrun ({resolved.world_size} ranks)")
    resolved.batch_size = resolved.num_envs * resolved.num_steps
    if resolved.batch_size % resolved.num_minibatches != 0:
        batch = f"T*N = {resolved.num_steps}*{resolved.num_envs} = {resolved.batch_size}"
        raise ArgsError(f"--num-minibatches {resolved.num_minibatches}: must divide the batch {batch} (Sec. 2.2)")
    if resolved.checkpoint:  # (after the checks above: --checkpoint may name a file that is no checkpoint at all)
        check_checkpoint(resolved)
    check_unused(resolved, given)
    return resolved


def format_settings(args: Args, device) -> str:
    """The resolved settings as `name=value` pairs in field order (toy.horizon=200 on the toy chain only, never the test
    hook toy.crash_at_step), then the device."""
    pairs = [f"{name}={value}" for name, value in asdict(args).items() if name != "toy"]
    if args.env_kind == "toy":
        pairs += [f"toy.{name}={value}" for name, value in asdict(args.toy).items() if name != "crash_at_step"]
    pairs.append(f"device={device}")
    lines = textwrap.wrap(" ".join(pairs), width=120, break_long_words=False, break_on_hyphens=False)
    return "\n".join(["settings:", *lines])


# ---- Environments: one env as a worker (or the evaluation loop) steps it ---------------------------------------------
class ManiSkillEnv(gym.Wrapper):
    """One ManiSkill3 env (CPU simulation) with ToyChainWorkerEnv's interface (step() resets an ended episode)."""

    def reset(self, seed: Optional[int] = None) -> np.ndarray:
        return np.asarray(self.env.reset(seed=seed)[0])

    def step(self, action: np.ndarray):
        action = np.clip(action, self.action_space.low, self.action_space.high)
        obs, reward, terminated, truncated, info = self.env.step(action)
        final_obs = np.asarray(obs) if terminated or truncated else None
        if final_obs is not None:
            obs, _ = self.env.reset()
        success = bool(info.get("success", False))
        return np.asarray(obs), float(reward), bool(terminated), bool(truncated), final_obs, success


def make_env(args: Args, evaluation: bool = False, rank: int = 0, env_index: int = 0):
    """Env `env_index` of `rank`; evaluation: ToyChain without delays or crashes, ManiSkill a new scene per reset."""
    if args.env_kind == "toy":  # same_step autoreset (ToyChainWorkerConfig has no other)
        step_time = 0.0 if evaluation else args.toy.step_time_of(rank, args.world_size, env_index)
        config = replace(args.toy, step_time_mean=step_time, crash_at_step=0 if evaluation else args.toy.crash_at_step)
        return ToyChainWorkerEnv(config)
    import mani_skill.envs  # noqa: F401  (registers the tasks in this process)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    sim = dict(obs_mode="state", sim_backend="physx_cpu", reconfiguration_freq=int(evaluation))
    render_backend = "gpu" if torch.cuda.is_available() else "cpu"  # (asked for a GPU, each worker would warn: none)
    env = gym.make(args.env_id, num_envs=1, render_backend=render_backend, **sim)
    return ManiSkillEnv(CPUGymWrapper(env, ignore_terminations=evaluation))


# ---- Env workers (Sec. 2.1, Fig. 2): processes that write into preallocated shared CPU memory ------------------------
class SharedSlots:
    """Shared CPU memory, one slot per env (Sec. 2.1): step results and actions; a pipe only says which env is ready."""

    def __init__(self, num_envs: int, env):
        def shared(shape, dtype):
            return torch.zeros((num_envs, *shape), dtype=dtype).share_memory_()

        def slot_for(space: gym.Space) -> torch.Tensor:  # a Box (ManiSkill) as float32, a Discrete (ToyChain) as int64
            return shared(space.shape, torch.int64 if isinstance(space, gym.spaces.Discrete) else torch.float32)

        self.obs = slot_for(env.observation_space)  # (N, *obs_shape): the observation to act on
        self.final_obs = slot_for(env.observation_space)  # the true last observation of an episode that ended in a step
        self.action = slot_for(env.action_space)  # (N, *act_shape)
        self.reward = shared((), torch.float64)
        self.terminated = shared((), torch.bool)
        self.truncated = shared((), torch.bool)
        self.success = shared((), torch.bool)
        self.busy_time = shared((), torch.float64)  # seconds the env's last step took in its worker (simulation time)


def env_worker(env_index: int, args: Args, slots: SharedSlots, conn, rank: int, resume: Optional[tuple]) -> None:
    """An env worker process (Sec. 2.1): steps its env as the main process asks, never waiting for the others; sends
    its env's state for a checkpoint and (`resume`: a state and observation) starts from one (the toy chain)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle: it shuts the workers down
    torch.set_num_threads(1)
    view = {name: slot[env_index].numpy() for name, slot in vars(slots).items()}
    try:
        env = make_env(args, rank=rank, env_index=env_index)
        view["obs"][...] = env.reset(seed=args.seed + rank * args.num_envs + env_index)
        if resume is not None:
            env.load_state_dict(resume[0])
            view["obs"][...] = resume[1].numpy()
        conn.send("ready")
        while True:
            if conn.recv() == "state":  # as torch.save's bytes (a tensor sent as such would go by shared memory)
                buffer = io.BytesIO()
                torch.save(env.state_dict(), buffer)
                conn.send(buffer.getvalue())
                continue
            start = time.perf_counter()
            obs, reward, terminated, truncated, final_obs, success = env.step(view["action"].copy())
            view["busy_time"][...] = time.perf_counter() - start
            view["obs"][...] = obs
            view["reward"][...] = reward
            view["terminated"][...] = terminated
            view["truncated"][...] = truncated
            view["success"][...] = success
            if final_obs is not None:
                view["final_obs"][...] = final_obs
            conn.send("ready")
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the pipe is closed: nobody to report to, just exit (no orphans)
    except BaseException:
        conn.send(f"env worker {env_index} (pid {os.getpid()}):\n{traceback.format_exc()}")
        sys.exit(1)


class EnvWorkers:
    """This rank's env workers, one per env and pipe, from a forkserver (no CUDA or thread state inherited)."""

    def __init__(self, args: Args, slots: SharedSlots, rank: int, saved: Optional[dict] = None):
        """`saved`: the toy chains' {"states", "obs"} in a checkpoint, to resume from."""
        ctx = mp.get_context("forkserver")
        preload = ["torch", "gymnasium", "numpy", "toy_chain_env"]
        ctx.set_forkserver_preload(preload + (["mani_skill.envs"] if args.env_kind == "maniskill" else []))
        ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the forkserver, its imports (seconds with
        try:  # ManiSkill) and its children: Ctrl-C is the main process's to handle, and it ends them
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, ignored)
        self.processes = []
        self.conns = []
        self.pending = []  # envs whose step result fetch_states() read: the next poll() returns them
        try:
            for env_index in range(args.num_envs):
                parent, child = ctx.Pipe(duplex=True)
                resumes = saved is not None and env_index < len(saved["states"])  # (more envs: the others start anew)
                resume = (saved["states"][env_index], saved["obs"][env_index]) if resumes else None
                worker_args = (env_index, args, slots, child, rank, resume)
                name = f"ver-env-worker-{env_index}"
                process = ctx.Process(target=env_worker, args=worker_args, daemon=True, name=name)
                process.start()
                child.close()
                self.processes.append(process)
                self.conns.append(parent)
        except BaseException:  # Ctrl-C while they start: those started end too
            self.close()
            raise

    def send_step(self, env_ids) -> None:
        for env in env_ids:
            try:
                self.conns[env].send("step")
            except (BrokenPipeError, ConnectionResetError):
                self._raise_dead(env)

    def poll(self, timeout: float) -> list[int]:
        """Env ids whose result arrived within `timeout` s (math.inf: until one has). Raises WorkerError."""
        arrived = self.pending
        self.pending = []
        wait = 0 if arrived else None if timeout == math.inf else max(timeout, 0)
        for conn in wait_for_connections(self.conns, timeout=wait):
            env = self.conns.index(conn)
            while conn.poll():  # a process that ended may have sent its traceback first; then its pipe is at EOF
                try:
                    message = conn.recv()
                except (EOFError, ConnectionResetError):
                    self._raise_dead(env)
                if message != "ready":
                    raise WorkerError(message)
                arrived.append(env)
        return arrived

    def fetch_states(self) -> Optional[list]:
        """Each env's state_dict (toy chain) for a checkpoint; a step result read on the way is left to the next poll().
        Ctrl-C waits for them (not half a message in a pipe); None if a pipe fails (a poll() read that Ctrl-C cut)."""
        states = []
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for conn in self.conns:
                conn.send("state")
            for env, conn in enumerate(self.conns):
                while (message := conn.recv()) == "ready":
                    self.pending.append(env)
                if not isinstance(message, bytes):
                    raise WorkerError(message)
                states.append(torch.load(io.BytesIO(message), weights_only=True))
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return states

    def _raise_dead(self, env: int):
        process = self.processes[env]
        process.join(timeout=1.0)
        raise WorkerError(f"env worker {env} (pid {process.pid}) died with exit code {process.exitcode} (killed?)")

    def close(self, timeout: float = 3.0) -> None:
        for conn in self.conns:
            conn.close()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=1.0)


# ---- Pure functions the algorithm relies on (importable, tested in tests/test_ppo_ver.py) ----------------------------
def sequence_starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of the sequences stored one after another starts: [0, l0, l0 + l1, ...] (no entry for the end)."""
    return np.cumsum(lengths) - lengths


def build_sequences(env_ids: np.ndarray, episode_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sec. 2.2: a rollout's steps as sequences (one env's one episode each, in time order): (step indices, lengths)."""
    order = np.lexsort((episode_ids, env_ids))  # stable: time order is kept inside each (env, episode)
    env_sorted = env_ids[order]
    episode_sorted = episode_ids[order]
    new_sequence = np.ones(len(order), dtype=bool)
    new_sequence[1:] = (env_sorted[1:] != env_sorted[:-1]) | (episode_sorted[1:] != episode_sorted[:-1])
    starts = np.flatnonzero(new_sequence)
    lengths = np.diff(np.append(starts, len(order)))
    return order.astype(np.int64), lengths.astype(np.int64)


def pack_layout(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The PackedSequence layout of sequences stored one after another (Fig. 3C): packed[j] = flat[select[j]];
    batch_sizes[t] = the number of sequences longer than t; sorted_sequences: by decreasing length (the batch order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    sorted_sequences = np.argsort(-lengths, kind="stable")
    rank = np.empty_like(sorted_sequences)
    rank[sorted_sequences] = np.arange(len(lengths))
    max_len = int(lengths.max(initial=0))
    batch_sizes = len(lengths) - np.cumsum(np.bincount(lengths, minlength=max_len + 1))[:max_len]
    offsets = sequence_starts(batch_sizes)
    starts = sequence_starts(lengths)
    t_of_flat = np.arange(lengths.sum()) - np.repeat(starts, lengths)
    packed_of_flat = offsets[t_of_flat] + np.repeat(rank, lengths)
    select = np.empty_like(packed_of_flat)
    select[packed_of_flat] = np.arange(len(packed_of_flat))
    return select, batch_sizes.astype(np.int64), sorted_sequences


def compute_gae_packed(rewards, values, next_values, batch_sizes: np.ndarray, gamma: float, gae_lambda: float):
    """GAE over variable-length sequences in packed order (pack_layout): A_t = delta_t + gamma * lambda * A_{t+1} inside
    a sequence, delta_t at its last step; next_values holds V(s_{t+1}), V(true last obs) or 0 at an episode end."""
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(rewards)
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)])
    following = torch.zeros(0, dtype=rewards.dtype, device=rewards.device)  # A_{t+1} of the sequences still running
    for step in reversed(range(len(batch_sizes))):  # the sequences running at step t+1 are a prefix of those at t
        running = int(batch_sizes[step])  # the sequences still running at this step
        carried = nn.functional.pad(following, (0, running - following.numel()))  # A_{t+1}; 0 after a sequence's end
        following = deltas[offsets[step] : offsets[step] + running] + gamma * gae_lambda * carried
        advantages[offsets[step] : offsets[step] + running] = following
    return advantages


def make_minibatches(lengths: np.ndarray, num_minibatches: int, rng: np.random.Generator) -> list[tuple]:
    """Sec. 2.2, Fig. 3B: shuffle the sequences, concatenate, cut into equal chunks: (step indices, piece lengths)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    size = total // num_minibatches
    starts = sequence_starts(lengths)
    permutation = rng.permutation(len(lengths))
    perm_lengths = lengths[permutation]
    flat = np.repeat(starts[permutation] - sequence_starts(perm_lengths), perm_lengths) + np.arange(total)
    boundaries = np.union1d(np.cumsum(perm_lengths), np.arange(0, total + 1, size))  # 0, sequence ends and cuts
    minibatches = []
    for index in range(num_minibatches):
        inside = boundaries[(boundaries >= index * size) & (boundaries <= (index + 1) * size)]
        minibatches.append((flat[index * size : (index + 1) * size], np.diff(inside)))
    return minibatches


def importance_weights(env_ids: torch.Tensor, num_envs: int, num_steps: int, clip_max: float = 1.0) -> torch.Tensor:
    """Sec. 4 (as IMPALA): env e gave n_e steps where uniform sampling gives T; its steps weigh min(clip_max, T/n_e)."""
    counts = torch.bincount(env_ids, minlength=num_envs).to(torch.float32)
    return (num_steps / counts[env_ids]).clamp(max=clip_max)


def optimal_preemption_time(
    step_times: np.ndarray, rank_cap: int, env_cap: Optional[int], learn_time: float, resolution: float = 1e-3
) -> tuple[float, int, float]:
    """Sec. 2.3: the rollout time t* maximizing S(t) / (t + LT): env e of rank r gives floor(t / step_times[r, e])
    steps, at most env_cap (T with NoVER), a rank at most rank_cap = T x N. Returns (t*, S(t*), t_full: all full)."""
    tau = np.asarray(step_times, dtype=np.float64)
    if env_cap is None:  # VER: a rank reaches its cap by (cap + N) / (its step rate) at the latest
        bound = ((rank_cap + tau.shape[1]) / (1.0 / tau).sum(axis=1)).max()
    else:
        bound = (tau.max(axis=1) * env_cap).max()
    candidates = [np.arange(1, int(math.ceil(bound / step)) + 1) * step for step in tau.ravel()]
    times = np.unique(np.ceil(np.concatenate(candidates) / resolution - 1e-9) * resolution)
    counts = np.floor(times[:, None, None] / tau[None] + 1e-9)
    if env_cap is not None:
        counts = np.minimum(counts, env_cap)
    steps = np.minimum(counts.sum(axis=2), rank_cap).sum(axis=1)
    full = np.flatnonzero(steps >= rank_cap * tau.shape[0])
    last = full[0] if len(full) else len(times) - 1
    times = times[: last + 1]
    steps = steps[: last + 1]
    best = int(np.argmax(steps / (times + learn_time)))
    return float(times[best]), int(steps[best]), float(times[-1])


class RunningMeanStd:
    """Observation normalization, not in VER (Chan et al.'s parallel update), clipped to +-10; identity for Discrete."""

    def __init__(self, shape, device, enabled: bool):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(1e-4, device=device)
        self.enabled = enabled
        self.merged = self.totals()  # DD-PPO: the totals that all ranks share (those of the last merge)

    def update(self, obs: torch.Tensor) -> None:
        if self.enabled:
            batch_mean = obs.mean(0)
            batch_var = obs.var(0, unbiased=False)
            batch_count = obs.shape[0]
            delta = batch_mean - self.mean
            share = batch_count / (self.count + batch_count)  # the batch's weight
            self.mean = self.mean + delta * share
            self.var = self.var * (1 - share) + batch_var * share + delta.square() * share * (1 - share)
            self.count = self.count + batch_count

    def totals(self) -> torch.Tensor:
        """Count, sum and sum of squares of the observations so far (they add up over ranks), in float64."""
        count = self.count.double().expand(self.mean.shape)
        return torch.stack([count, count * self.mean, count * (self.var + self.mean.square())])

    def merge_ranks(self) -> None:
        """DD-PPO, once per update: every rank's observations since the last merge join the shared statistics."""
        if self.enabled and dist.is_initialized():
            new = self.totals() - self.merged
            dist.all_reduce(new)
            count, total, total_sq = new + self.merged
            self.mean = (total / count).float()
            self.count = count.max().float()
            self.var = (total_sq / count - (total / count).square()).clamp(min=0).float()
            self.merged = self.totals()

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return obs
        return ((obs - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-10.0, 10.0)


# ---- Networks --------------------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(sizes: list[int], out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes[:-2], sizes[1:-1]):
        layers += [layer_init(nn.Linear(n_in, n_out)), nn.Tanh()]
    return nn.Sequential(*layers, layer_init(nn.Linear(sizes[-2], sizes[-1]), std=out_std))


class Agent(nn.Module):
    """Actor-critic: MLPs, or with --recurrent one LSTM for both heads (the paper's has 2 layers, Sec. 4; here 1)."""

    def __init__(
        self,
        obs_space: gym.Space,
        act_space: gym.Space,
        recurrent: bool,
        ent_coef: float,
        learned_ent_coef: bool,
        hidden_sizes: tuple[int, ...] = (256, 256),
        lstm_hidden_size: int = 128,
        lstm_layers: int = 1,
    ):
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
            self.input_layer = nn.Sequential(layer_init(nn.Linear(in_dim, hidden_sizes[0])), nn.Tanh())
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
            self.actor_logstd = nn.Parameter(torch.full((1, out_dim), -0.5))  # ManiSkill's ppo.py: std 0.61
        if learned_ent_coef:  # Sec. 4: alpha, learned in log space, starting from ent_coef (--ent-coef)
            self.log_ent_coef = nn.Parameter(torch.tensor(math.log(ent_coef)))
        self.lstm_shape = (lstm_layers, lstm_hidden_size) if recurrent else None

    def initial_state(self, num_envs: int, device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The recurrent state (h, c), each (layers, num_envs, hidden), of episode starts; None for the MLP."""
        if not self.recurrent:
            return None
        hidden = torch.zeros(self.lstm_shape[0], num_envs, self.lstm_shape[1], device=device)
        return hidden, torch.zeros_like(hidden)

    def _heads(self, features):
        out = self.actor(features)
        if self.continuous:  # independent action dimensions: log_prob and entropy sum over them
            normal = torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
            action_dist = torch.distributions.Independent(normal, 1, validate_args=False)
        else:
            action_dist = torch.distributions.Categorical(logits=out, validate_args=False)
        return action_dist, self.critic(features).squeeze(-1)

    def step(self, obs, state):
        """Inference, one step of every env: (action distribution, value, next_state)."""
        features = self.embed(obs)
        if not self.recurrent:
            return (*self._heads(features), None)
        out, next_state = self.lstm(self.input_layer(features).unsqueeze(0), state)
        return (*self._heads(out[0]), next_state)

    def evaluate(self, obs, actions, state0=None, piece_lengths: Optional[np.ndarray] = None):
        """Log-probs, entropies and values of stored steps (learning). Recurrent: the minibatch's pieces of sequences
        (make_minibatches) run through the LSTM as one PackedSequence (Fig. 3C), each from its stored state `state0`."""
        features = self.embed(obs)
        if self.recurrent:
            select, batch_sizes, sorted_pieces = pack_layout(piece_lengths)
            select_t = torch.as_tensor(select, device=features.device)
            order = torch.as_tensor(sorted_pieces, device=features.device)
            packed = PackedSequence(self.input_layer(features)[select_t], torch.as_tensor(batch_sizes))
            hidden0, cell0 = state0
            out, _ = self.lstm(packed, (hidden0[:, order].contiguous(), cell0[:, order].contiguous()))
            features = torch.empty_like(out.data)
            features[select_t] = out.data  # back from packed order to the minibatch's order
        action_dist, value = self._heads(features)
        return action_dist.log_prob(actions), action_dist.entropy(), value


# ---- Rollout storage and collection (Sec. 2.1, 2.2) ------------------------------------------------------------------
class RolloutStorage:
    """A rollout's steps, a row each in acting order (VER has no (T, N) shape, Sec. 2.2); (T + 2) x N rows: N carried
    in, T x N completed, N in flight."""

    def __init__(self, capacity: int, slots: SharedSlots, lstm_shape: Optional[tuple], device):
        self.device = device
        self.size = 0
        self.obs = torch.zeros((capacity, *slots.obs.shape[1:]), dtype=slots.obs.dtype, device=device)
        self.actions = torch.zeros((capacity, *slots.action.shape[1:]), dtype=slots.action.dtype, device=device)
        self.logprobs = torch.zeros(capacity, device=device)
        self.values = torch.zeros(capacity, device=device)
        self.next_values = torch.full((capacity,), math.nan, device=device)  # V(s_{t+1}) for GAE, once known
        # (h, c) of the recurrent state the policy acted from (zeros at an episode start): (capacity, 2, layers, hidden)
        self.hidden = None if lstm_shape is None else torch.zeros((capacity, 2, *lstm_shape), device=device)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.complete = np.zeros(capacity, dtype=bool)  # its reward has arrived
        self.env_ids = np.zeros(capacity, dtype=np.int64)
        self.episode_ids = np.zeros(capacity, dtype=np.int64)

    def keep(self, rows: np.ndarray) -> None:
        """Starts a new rollout that holds only `rows` (moved to the front, in order): the carried-over steps."""
        k = len(rows)
        for value in vars(self).values():  # every per-row tensor and array
            if isinstance(value, (torch.Tensor, np.ndarray)):
                value[:k] = value[torch.as_tensor(rows, device=self.device) if torch.is_tensor(value) else rows]
        self.next_values[k:] = math.nan
        self.complete[k:] = False
        self.size = k


def build_batch(st: RolloutStorage, num_envs: int, num_steps: int, gamma: float, gae_lambda: float) -> dict:
    """A rollout's completed steps, sequence after sequence, with advantages, importance weights and "lengths"."""
    rows = np.flatnonzero(st.complete[: st.size])
    order, lengths = build_sequences(st.env_ids[rows], st.episode_ids[rows])
    rows = rows[order]
    rows_t = torch.as_tensor(rows, device=st.device)
    values = st.values[rows_t]
    next_values = st.next_values[rows_t]
    select, batch_sizes, _ = pack_layout(lengths)
    sel = torch.as_tensor(select, device=st.device)
    rewards = torch.as_tensor(st.rewards[rows], device=st.device)
    advantages = torch.empty_like(values)
    advantages[sel] = compute_gae_packed(rewards[sel], values[sel], next_values[sel], batch_sizes, gamma, gae_lambda)
    env_ids = torch.as_tensor(st.env_ids[rows], device=st.device)
    return dict(
        obs=st.obs[rows_t],
        actions=st.actions[rows_t],
        logprobs=st.logprobs[rows_t],
        values=values,
        advantages=advantages,
        returns=advantages + values,
        weights=importance_weights(env_ids, num_envs, num_steps),
        hidden=None if st.hidden is None else st.hidden[rows_t],
        env_ids=env_ids,
        lengths=lengths,
    )


def fill_from_previous(batch: dict, previous: dict, size: int, rng: np.random.Generator) -> dict:
    """Sec. 2.3: a preempted rank fills its batch up to `size` steps with the previous rollout's sequences (random
    order, the last one cut), keeping their old advantages and log-probabilities: no correction for staleness."""
    missing = size - int(batch["lengths"].sum())
    if missing <= 0:
        return batch
    order = rng.permutation(len(previous["lengths"]))
    starts = sequence_starts(previous["lengths"])
    idx = np.concatenate([np.arange(starts[s], starts[s] + previous["lengths"][s]) for s in order])[:missing]
    lengths = previous["lengths"][order]
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), missing) + 1].copy()
    lengths[-1] -= lengths.sum() - missing
    filled = {"lengths": np.concatenate([batch["lengths"], lengths])}
    for key, value in batch.items():
        if key == "lengths" or value is None:
            filled.setdefault(key, value)
        else:
            filled[key] = torch.cat([value, previous[key][torch.as_tensor(idx, device=value.device)]])
    return filled


STEPPING, ARRIVED, COMPLETED, HELD = 0, 1, 2, 3  # an env's state in Collector.env_state (see its docstring)


class Rollout:
    """What one rollout of Collector.collect() gave on this rank."""

    def __init__(self, num_envs: int, start_time: float):
        self.start_time = start_time  # Collector.clock() at its start
        self.steps_per_env = np.zeros(num_envs, dtype=np.int64)  # steps each env completed
        self.arrival_interval_sum = np.zeros(num_envs)  # seconds between consecutive arrivals of each env
        self.arrival_interval_count = np.zeros(num_envs)
        self.step_times = None  # (N,) Sec. 2.3's Time(S) per env, filled in at the end
        self.env_steps = 0  # steps completed: T x N unless preempted
        self.env_busy_time = 0.0  # seconds the envs spent simulating those steps, in their workers
        self.inference_batch_sizes = []  # envs in each policy call
        self.episode_returns = []  # of the episodes that ended in this rollout
        self.episode_lengths = []
        self.episode_successes = []  # success at any step of the episode


class Collector:
    """Experience collection of one rank (Sec. 2.1, 2.2, Fig. 2); the main process is the inference worker.
    Each env is in one of these states (env_state):
      STEPPING   its worker simulates the policy's action (the step's row is "in flight"), or, at the start, resets
      ARRIVED    the result is in its shared-memory slot, not yet read
      COMPLETED  the result is in the step's row; the new observation waits for an action
      HELD       NoVER and sync only: the env has its T steps and waits for the next rollout"""

    clock = staticmethod(time.perf_counter)  # seconds (tests use a simulated clock)

    def __init__(self, args: Args, workers: EnvWorkers, slots: SharedSlots, agent: Agent, obs_rms, device):
        self.args = args
        self.workers = workers
        self.slots = slots
        self.agent = agent
        self.device = device
        self.obs_rms = obs_rms  # RunningMeanStd: updated with the observations acted on, which are stored normalized
        num_envs = args.num_envs
        self.num_envs = num_envs
        self.rollout_size = args.num_steps * num_envs  # T x N
        self.quota = None if args.variable_experience else args.num_steps  # NoVER and sync: T steps from every env
        self.min_batch = args.inference_min_batch
        self.policy_step_time = 0.02  # running mean of one inference, for the adaptive wait
        self.storage = RolloutStorage((args.num_steps + 2) * num_envs, slots, agent.lstm_shape, device)
        self.recurrent_state = agent.initial_state(num_envs, device)  # after each env's last action
        self.env_state = np.full(num_envs, STEPPING)  # the workers start by resetting their envs
        # One step of env e to its V(s_t+1): the policy acts on s_t, stored as row r (inflight_row[e] = r); the worker
        # steps; s_t+1 arrives (arrival_time[e] orders arrivals) and completes row r with its reward; row r then waits
        # (awaiting_row[e] = r) until the policy acts on s_t+1, whose value becomes next_values[r] (or, at the end of
        # the rollout, bootstrap() computes V of the observations that still wait).
        self.inflight_row = np.full(num_envs, -1)  # stepping or arrived: the row of the step whose result is unread
        self.awaiting_row = np.full(num_envs, -1)  # row of the env's last completed step that needs V(next obs)
        self.arrival_time = np.full(num_envs, -math.inf)  # the env's last arrival: first come, first completed
        self.episode_id = np.zeros(num_envs, dtype=np.int64)
        self.episode_start = np.ones(num_envs, dtype=bool)  # the env's current observation starts an episode
        self.episode_return = np.zeros(num_envs)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self.episode_success = np.zeros(num_envs, dtype=bool)
        self.view = {name: slot.numpy() for name, slot in vars(slots).items()}  # numpy views of the shared slots

    def collect(self, stop_early: Optional[Callable[[int, float], bool]] = None) -> Rollout:
        """One rollout: T x N steps, fewer if `stop_early(steps so far, seconds in)` preempts it (Sec. 2.3)."""
        rollout = Rollout(self.num_envs, start_time=self.clock())
        self.env_state[self.env_state == HELD] = COMPLETED  # held envs (NoVER) are ready for an action again
        poll_at_most = 0.005 if stop_early is not None and self.min_batch < self.num_envs else math.inf
        while True:
            self.wait_for_requests(rollout, poll_at_most)
            self.complete_arrived(rollout)
            if rollout.env_steps == self.rollout_size:
                break
            if stop_early is not None and stop_early(rollout.env_steps, self.clock() - rollout.start_time):
                break
            self.act(rollout)
        # V (this policy) of the observations waiting for an action bootstraps their envs' last steps
        envs = np.flatnonzero(self.awaiting_row >= 0)
        if len(envs) > 0:
            self.bootstrap(self.awaiting_row[envs], envs, self.slots.obs)
        self.awaiting_row[envs] = -1
        # Sec. 2.3's Time(S): each env's mean time per step in this rollout (the whole rollout if < 2 steps)
        duration = max(self.clock() - rollout.start_time, 1e-3)
        intervals = np.maximum(rollout.arrival_interval_count, 1)
        mean_interval = rollout.arrival_interval_sum / intervals
        rollout.step_times = np.where(rollout.arrival_interval_count > 0, mean_interval, duration)
        return rollout

    def wait_for_requests(self, rollout: Rollout, poll_at_most: float = math.inf) -> None:
        """Dynamic batching (Sec. 2.1, footnote 2): until min_batch envs are ready, or all unheld ones are, or the first
        has waited half a policy step (not in sync), or poll_at_most."""
        start = self.clock()
        max_wait = math.inf if self.min_batch >= self.num_envs else 0.5 * self.policy_step_time
        while True:
            ready = np.count_nonzero((self.env_state == ARRIVED) | (self.env_state == COMPLETED))
            held = np.count_nonzero(self.env_state == HELD)
            if ready >= self.min_batch or (ready > 0 and ready + held == self.num_envs):  # none is stepping
                return
            timeout = min(poll_at_most, max_wait if ready > 0 else math.inf) - (self.clock() - start)
            if timeout <= 0:
                return
            arrived = self.workers.poll(timeout)
            now = self.clock()
            for env in arrived:  # STEPPING -> ARRIVED; the times between arrivals estimate Time(S) (Sec. 2.3)
                self.env_state[env] = ARRIVED
                if self.arrival_time[env] >= rollout.start_time:
                    rollout.arrival_interval_sum[env] += now - self.arrival_time[env]
                    rollout.arrival_interval_count[env] += 1
                self.arrival_time[env] = now

    def complete_arrived(self, rollout: Rollout) -> None:
        """ARRIVED -> COMPLETED (or HELD), first come first, while the rollout needs steps; the others are carried."""
        arrived = np.flatnonzero(self.env_state == ARRIVED)
        arrived = arrived[np.argsort(self.arrival_time[arrived], kind="stable")]
        final_rows = []
        final_envs = []
        for env in arrived:
            if rollout.env_steps == self.rollout_size:
                break
            row = self.inflight_row[env]
            self.inflight_row[env] = -1
            if row >= 0 and self.record_result(rollout, env, row):
                final_rows.append(row)
                final_envs.append(env)
            has_its_quota = self.quota is not None and rollout.steps_per_env[env] >= self.quota  # NoVER: T steps
            self.env_state[env] = HELD if has_its_quota else COMPLETED
        if final_rows:  # V(true last observation), from the state the env's own last step left (not zeros)
            self.bootstrap(np.array(final_rows), np.array(final_envs), self.slots.final_obs)

    def record_result(self, rollout: Rollout, env: int, row: int) -> bool:
        """Env `env`'s result completes the step at `row`; returns True if it needs V(true last observation)."""
        reward = float(self.view["reward"][env])
        terminated = bool(self.view["terminated"][env])
        truncated = bool(self.view["truncated"][env])
        success = bool(self.view["success"][env])
        self.storage.rewards[row] = reward
        self.storage.complete[row] = True
        rollout.env_steps += 1
        rollout.steps_per_env[env] += 1
        rollout.env_busy_time += float(self.view["busy_time"][env])
        self.episode_return[env] += reward
        self.episode_length[env] += 1
        self.episode_success[env] |= success
        if not (terminated or truncated):
            self.awaiting_row[env] = row  # V(next observation): when the policy acts on it, or at the rollout's end
            return False
        rollout.episode_returns.append(self.episode_return[env])
        rollout.episode_lengths.append(self.episode_length[env])
        rollout.episode_successes.append(self.episode_success[env])
        self.episode_return[env] = 0.0
        self.episode_length[env] = 0
        self.episode_success[env] = False
        self.episode_id[env] += 1
        self.episode_start[env] = True
        if terminated and self.args.bootstrap_at_done == "truncated":
            self.storage.next_values[row] = 0.0
            return False
        return True

    def act(self, rollout: Rollout) -> None:
        """Runs the policy on every COMPLETED env, stores the steps, sends the actions (STEPPING)."""
        envs = np.flatnonzero(self.env_state == COMPLETED)
        if len(envs) == 0:
            return
        start = self.clock()
        idx = torch.as_tensor(envs)
        with torch.no_grad():
            raw_obs = self.slots.obs[idx].to(self.device)
            self.obs_rms.update(raw_obs)
            obs = self.obs_rms.normalize(raw_obs)  # what the policy sees and the storage keeps
            state = self.state_of(envs, reset=self.episode_start[envs])
            action_dist, value, next_state = self.agent.step(obs, state)
            action = action_dist.sample()
            logprob = action_dist.log_prob(action)
        storage = self.storage
        rows = np.arange(storage.size, storage.size + len(envs))
        storage.size += len(envs)
        rows_t = torch.as_tensor(rows, device=self.device)
        storage.obs[rows_t] = obs
        storage.actions[rows_t] = action
        storage.logprobs[rows_t] = logprob
        storage.values[rows_t] = value
        if state is not None:  # the state the policy acted from, before this step
            storage.hidden[rows_t] = torch.stack(state).permute(2, 0, 1, 3)
            for stored, new in zip(self.recurrent_state, next_state):  # h, then c
                stored[:, idx.to(self.device)] = new
        storage.env_ids[rows] = envs
        storage.episode_ids[rows] = self.episode_id[envs]
        waiting = self.awaiting_row[envs] >= 0  # V of this observation bootstraps the env's previous step
        awaiting_rows = torch.as_tensor(self.awaiting_row[envs][waiting], device=self.device)
        storage.next_values[awaiting_rows] = value[torch.as_tensor(waiting, device=self.device)]
        self.awaiting_row[envs] = -1
        self.inflight_row[envs] = rows
        self.episode_start[envs] = False
        self.slots.action[idx] = action.to("cpu")
        self.env_state[envs] = STEPPING
        self.workers.send_step(envs)
        self.policy_step_time = 0.9 * self.policy_step_time + 0.1 * (self.clock() - start)
        rollout.inference_batch_sizes.append(len(envs))

    def bootstrap(self, rows: np.ndarray, envs: np.ndarray, observations: torch.Tensor) -> None:
        """V(s_{t+1}) of the steps at `rows`: V of `envs`' normalized `observations`, from their last step's state."""
        with torch.no_grad():
            obs = self.obs_rms.normalize(observations[torch.as_tensor(envs)].to(self.device))
            _, values, _ = self.agent.step(obs, self.state_of(envs))
        self.storage.next_values[torch.as_tensor(rows, device=self.device)] = values

    def start_next_rollout(self) -> int:
        """After the update: the steps in flight go on into the next rollout ("Inflight actions"); returns how many."""
        envs = np.flatnonzero(self.inflight_row >= 0)
        self.storage.keep(self.inflight_row[envs])
        self.inflight_row[envs] = np.arange(len(envs))
        return len(envs)

    def state_dict(self) -> dict:
        """Each env's episode so far, for a checkpoint: its counters, whether it starts, its recurrent state; a step in
        flight counts as recorded (the workers' saved states are past it, its result in the slots: fetch_states)."""
        flight = self.inflight_row >= 0
        ended = flight & (self.view["terminated"] | self.view["truncated"])
        return {
            "episode_return": torch.from_numpy(
                np.where(ended, 0.0, self.episode_return + flight * self.view["reward"])
            ),
            "episode_length": torch.from_numpy(np.where(ended, 0, self.episode_length + flight)),
            "episode_success": torch.from_numpy(~ended & (self.episode_success | flight & self.view["success"])),
            "episode_start": torch.from_numpy(self.episode_start | ended),
            "recurrent_state": [state.cpu() for state in self.recurrent_state or ()],  # (h, c); none for the MLP
        }

    def load_state_dict(self, saved: dict) -> None:
        """A checkpoint's state_dict() into the first envs (more envs: the others start anew, as in EnvWorkers)."""
        k = min(self.num_envs, len(saved["episode_start"]))
        for name in ("episode_return", "episode_length", "episode_success", "episode_start"):
            getattr(self, name)[:k] = saved[name][:k].numpy()
        if self.recurrent_state is not None:
            for stored, state in zip(self.recurrent_state, saved["recurrent_state"]):  # h, then c
                stored[:, :k] = state[:, :k].to(self.device)

    def state_of(self, envs: np.ndarray, reset: Optional[np.ndarray] = None):
        """The recurrent state (h, c) of `envs` after their last step (zeros where `reset`), or None for the MLP."""
        if self.recurrent_state is None:
            return None
        idx = torch.as_tensor(envs, device=self.device)
        hidden, cell = self.recurrent_state
        if reset is None:
            return hidden[:, idx], cell[:, idx]
        keep = torch.as_tensor(~reset, device=self.device, dtype=hidden.dtype).view(1, -1, 1)
        return hidden[:, idx] * keep, cell[:, idx] * keep


# ---- DD-PPO (Sec. 2.3): every rank collects and learns; gradients are all-reduced; stragglers are preempted ----------
def all_reduce_named(values: dict, device) -> dict:
    """Named numbers summed over the ranks as one vector, named back at once."""
    vector = torch.tensor([float(value) for value in values.values()], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(vector)
    return dict(zip(values, vector.tolist()))


def allreduce_gradients(parameters) -> None:
    """DD-PPO: average the gradients of all ranks."""
    for param in parameters:
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()


def ver_stop_rule(gathered: np.ndarray, rank_cap: int, env_cap: Optional[int]) -> tuple[Callable, float]:
    """Sec. 2.3: stop t* s into the rollout unless every rank is full by then (gathered[r]: rank r's step times, LT)."""
    t_star, _, t_full = optimal_preemption_time(gathered[:, :-1], rank_cap, env_cap, float(gathered[:, -1].mean()))
    stop_after = t_star if t_star < t_full else math.inf
    return (lambda steps, elapsed: elapsed >= stop_after), t_star


def ddppo_stop_rule(store: dist.Store, args: Args, iteration: int) -> Callable:
    """DD-PPO's preemption (Wijmans et al. 2020): stop once --sync-frac of the ranks are done, after a quarter batch."""
    key = f"done_{iteration}"
    return lambda steps, elapsed: steps >= args.batch_size / 4 and store.add(key, 0) >= args.sync_frac * args.world_size


# ---- PPO update (Sec. 2.2, 4) ----------------------------------------------------------------------------------------
def ppo_loss(agent: Agent, minibatch: dict, state0, piece_lengths, args: Args) -> tuple[torch.Tensor, dict]:
    """Sec. 4: the clipped surrogate, value loss and entropy bonus, each weighted by the importance weights; with
    --learned-ent-coef, ent_coef is [alpha]_sg and alpha * ([unweighted mean entropy]_sg - target) is added."""
    newlogprob, entropy, newvalue = agent.evaluate(minibatch["obs"], minibatch["actions"], state0, piece_lengths)
    logratio = newlogprob - minibatch["logprobs"]
    ratio = logratio.exp()
    advantages = minibatch["advantages"]
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    weights = minibatch["weights"]
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef))
    value_error = (newvalue - minibatch["returns"]).square()  # not clipped (CleanRL and habitat-lab clip it)
    pg_loss = (weights * pg).mean()
    v_loss = 0.5 * (weights * value_error).mean()
    entropy_bonus = (weights * entropy).mean()
    if args.learned_ent_coef:  # Sec. 4: - [alpha]_sg H + alpha ([H]_sg - lambda), H unweighted in the second term
        alpha = agent.log_ent_coef.exp()
        alpha_loss = alpha * (entropy.mean().detach() - args.target_entropy)
        loss = pg_loss + args.vf_coef * v_loss - alpha.detach() * entropy_bonus + alpha_loss
    else:
        loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy_bonus
    stats = {
        "losses/policy_loss": pg_loss,
        "losses/value_loss": v_loss,
        "losses/entropy": entropy.mean(),
        "losses/old_approx_kl": (-logratio).mean(),
        "losses/approx_kl": ((ratio - 1) - logratio).mean(),
        "losses/clipfrac": ((ratio - 1.0).abs() > args.clip_coef).float().mean(),
    }
    return loss, {name: value.detach() for name, value in stats.items()}


def ppo_update(args: Args, agent: Agent, optimizer: torch.optim.Optimizer, batch: dict, rng: np.random.Generator):
    """PPO epochs over VER minibatches (Sec. 2.2), gradients averaged over the ranks (DD-PPO), alpha in [1e-4, 1]."""
    device = batch["obs"].device
    policy_params = [param for name, param in agent.named_parameters() if name != "log_ent_coef"]
    totals = {}
    updates = 0
    for epoch in range(args.update_epochs):
        for mb_idx, piece_lengths in make_minibatches(batch["lengths"], args.num_minibatches, rng):
            idx = torch.as_tensor(mb_idx, device=device)
            minibatch = {
                key: batch[key][idx] for key in ("obs", "actions", "logprobs", "advantages", "returns", "weights")
            }
            state0 = None
            if agent.recurrent:  # each piece starts from the stored state of its first step
                first = torch.as_tensor(mb_idx[sequence_starts(piece_lengths)], device=device)
                state0 = batch["hidden"][first].permute(1, 2, 0, 3)  # (h, c): (layers, pieces, hidden)
            loss, stats = ppo_loss(agent, minibatch, state0, piece_lengths, args)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if dist.is_initialized():
                allreduce_gradients(agent.parameters())
            nn.utils.clip_grad_norm_(policy_params, args.max_grad_norm)
            optimizer.step()
            if args.learned_ent_coef:
                with torch.no_grad():
                    agent.log_ent_coef.clamp_(math.log(1e-4), 0.0)
            totals = {name: totals.get(name, 0.0) + value for name, value in stats.items()}
            updates += 1
        if args.target_kl is not None:  # the mean over ranks: the same decision on every rank
            if all_reduce_named(stats, device)["losses/approx_kl"] / args.world_size > args.target_kl:
                break
    means = dict(zip(totals, (torch.stack(list(totals.values())) / max(updates, 1)).tolist()))  # one device sync
    means["losses/ent_coef"] = float(agent.log_ent_coef.detach().exp()) if args.learned_ent_coef else args.ent_coef
    means["losses/explained_variance"] = float(1 - (batch["returns"] - batch["values"]).var() / batch["returns"].var())
    return means


# ---- Checkpoints, evaluation, progress -------------------------------------------------------------------------------
def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """write(a temporary file), then renamed to `path`: Ctrl-C never leaves half a checkpoint or summary."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def rng_state(rng: np.random.Generator, device) -> dict:
    """The random generators this process draws from: torch's and `rng` (none draws from numpy's or Python's global)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "generator": rng.bit_generator.state,  # minibatches and fill_from_previous
    }


def set_rng_state(state: dict, rng: np.random.Generator, device) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    rng.bit_generator.state = state["generator"]


def hms(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def progress_line(global_step: int, total: int, sps: float, elapsed: float, latest: dict) -> str:
    """Steps done of the total, SPS (charts/SPS), elapsed and left (H:MM:SS, "?" while SPS is 0), then the latest
    episodic return and success rate, and ver/straggler_share (the module docstring defines it), once logged."""
    left = hms(max(total - global_step, 0) / sps) if sps > 0 else "?"
    line = f"progress global_step={global_step}/{total} ({100 * global_step // total}%) SPS={sps:.0f}"
    line += f" elapsed={hms(elapsed)} left={left}"
    for name in ("charts/episodic_return", "charts/success_rate", "ver/straggler_share"):
        if name in latest:
            line += f" {name}={latest[name]:{'.2f' if name == 'ver/straggler_share' else '.4g'}}"
    return line


@torch.no_grad()
def evaluate(agent: Agent, env, obs_rms: RunningMeanStd, num_episodes: int, seed: int, device) -> dict:
    """Means of eval/* over `num_episodes` episodes of the deterministic policy on one env (obs_rms not updated)."""
    totals = {"eval/return": 0.0, "eval/episode_len": 0.0, "eval/success_once": 0.0, "eval/success_at_end": 0.0}
    obs = env.reset(seed=seed)  # (then an ended episode resets the env itself: step() returns the next one's start)
    for episode in range(num_episodes):
        state = agent.initial_state(1, device)
        success_once = False
        done = False
        while not done:
            policy, _, state = agent.step(obs_rms.normalize(torch.as_tensor(obs, device=device).unsqueeze(0)), state)
            action = (policy.mean if agent.continuous else policy.probs.argmax(-1))[0].cpu().numpy()
            obs, reward, terminated, truncated, _, success = env.step(action)
            totals["eval/return"] += reward
            totals["eval/episode_len"] += 1
            success_once |= success
            done = terminated or truncated
        totals["eval/success_once"] += success_once
        totals["eval/success_at_end"] += success
    return {name: total / num_episodes for name, total in totals.items()}


# ---- Training loop ---------------------------------------------------------------------------------------------------
def rank0_store(rank: int, world_size: int) -> dist.Store:
    """Rank 0's store, counting the ranks done (DD-PPO's preemption); torchrun's own dies with it, before the ranks."""
    server = None
    address = [socket.gethostname(), 0]
    if rank == 0:
        server = dist.TCPStore(address[0], 0, world_size, is_master=True, wait_for_workers=False)
        address[1] = server.port
    dist.broadcast_object_list(address, src=0)
    host, port = address
    return dist.PrefixStore("ppo_ver", server or dist.TCPStore(host, port, world_size, is_master=False))


def main(args: Args) -> dict:
    args = resolve_args(args)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM (e.g. from torchrun) is handled as Ctrl-C
    rank = int(os.environ.get("RANK", "0"))
    distributed = args.world_size > 1
    launcher = os.getppid()  # torchrun: if it is killed, the ranks are adopted by another process and stop
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if use_cuda else "cpu")
    if rank == 0:
        print(format_settings(args, device), flush=True)
    if use_cuda:
        torch.cuda.set_device(device)
    synchronize = torch.cuda.synchronize if use_cuda else (lambda: None)  # queued GPU work, before a timer is read
    if distributed:  # torchrun: NCCL on GPUs, gloo on CPU, one GPU per local rank; a store counts the ranks done
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        store = rank0_store(rank, args.world_size)
    if device.type == "cpu":
        torch.set_num_threads(1)  # leave the cores to the env workers
    torch.manual_seed(args.seed)  # DD-PPO: the same initial weights on every rank (or the same checkpoint)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True) if args.checkpoint else None
    resuming = checkpoint is not None and not args.evaluate
    writer = None  # rank 0 logs, evaluates and saves, in the run directory (none with --evaluate)
    run_dir = None
    wandb_id = checkpoint.get("wandb_id") if resuming else None  # (kept by a resume without --track)
    last = {}  # the last value of each metric, for summary.json and the progress line

    def log(metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            last[name] = float(value)
            writer.add_scalar(name, float(value), step)

    def evaluate_and_log() -> dict:  # rank 0: one line, and (training) TensorBoard
        eval_start = time.perf_counter()
        metrics = evaluate(agent, eval_env, obs_rms, args.num_eval_episodes, args.seed + 10_000 + iteration, device)
        line = " ".join(f"{name}={value:.4g}" for name, value in metrics.items())
        print(f"global_step={global_step} {line}", flush=True)
        if writer is not None:
            log(metrics, global_step)
            log({"time/eval": time.perf_counter() - eval_start}, global_step)
        return metrics

    def save(name: str) -> None:  # rank 0: with its random generators and (toy chain) envs, not the other ranks'
        states = workers.fetch_states() if args.env_kind == "toy" else None  # (None if Ctrl-C cut a pipe read short)
        episodes = collector.state_dict()  # each env's episode so far (after fetch_states: the steps in flight ended)
        checkpoint = {
            "script": "ppo_ver.py",
            "env_id": args.env_id,
            "model": agent.state_dict(),
            "optimizer": optimizer.state_dict(),
            "global_step": global_step,
            "iteration": summary["iteration"],  # (that of global_step: Ctrl-C may come in the middle of one)
            "steps_per_iteration": args.batch_size * args.world_size,
            "obs_rms": {"mean": obs_rms.mean, "var": obs_rms.var, "count": obs_rms.count},
            "rng": rng_state(rng, device),
            "envs": None if states is None else {"states": states, "obs": slots.obs.clone(), "collector": episodes},
            "wandb_id": wandb_id,
        }
        write_whole(run_dir / name, lambda tmp: torch.save(checkpoint, tmp))

    def open_run() -> None:  # rank 0 of a training run: its directory, config.json, W&B run and TensorBoard stream
        nonlocal run_dir, wandb_id, writer
        run_dir = Path(args.output_dir) / f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
        if resuming:  # the same run directory, TensorBoard stream and W&B run
            run_dir = Path(args.checkpoint).parent
        if args.track:  # (before anything is written: a W&B error leaves the run directory as it was)
            import wandb

            wandb_id = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=asdict(args),
                name=run_dir.name,
                save_code=True,
                id=wandb_id,  # None: W&B makes one, then stored in every checkpoint
                resume="allow",
            ).id
        run_dir.mkdir(parents=True, exist_ok=resuming)
        write_whole(run_dir / "config.json", lambda tmp: tmp.write_text(json.dumps(asdict(args), indent=2)))
        # TensorBoard drops the old files' events logged after the checkpoint: no duplicated or backward steps
        writer = SummaryWriter(str(run_dir), purge_step=global_step + 1 if resuming else None)

    summary: dict = {"interrupted": False}
    env_busy_time = 0.0
    global_step = 0
    iteration = 0  # updates made
    start_time = time.time()
    start_step = 0
    workers = None  # (the finally below needs them)
    eval_env = None
    try:  # from here on (env construction included), Ctrl-C or an error still writes summary.json (once there is a run)
        eval_env = make_env(args, evaluation=True)  # its spaces shape the shared slots and the network
        slots = SharedSlots(args.num_envs, eval_env)
        agent = Agent(
            eval_env.observation_space, eval_env.action_space, args.recurrent, args.ent_coef, args.learned_ent_coef
        ).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
        obs_rms = RunningMeanStd(slots.obs.shape[1:], device, enabled=slots.obs.is_floating_point())  # Box (float) only
        if checkpoint is not None:  # (before the run directory: a checkpoint of another policy changes nothing there)
            try:
                agent.load_state_dict(checkpoint["model"])
                if resuming:
                    optimizer.load_state_dict(checkpoint["optimizer"])
                for group in optimizer.param_groups:  # this command's --learning-rate, not the checkpoint's
                    group["lr"] = args.learning_rate
                for name in ("mean", "var", "count"):
                    setattr(obs_rms, name, checkpoint["obs_rms"][name].to(device))
                iteration = checkpoint["iteration"]
            except (RuntimeError, KeyError, ValueError) as error:
                raise ArgsError(f"--checkpoint {args.checkpoint}: not a checkpoint of this configuration ({error})")
            obs_rms.merged = obs_rms.totals()  # (every rank loads the same)
            global_step = checkpoint["global_step"]
            start_step = global_step  # SPS counts the steps of this run
        torch.manual_seed(args.seed + 1000 * rank + iteration)  # per-rank action sampling
        rng = np.random.default_rng(args.seed + 7919 * rank + iteration)
        if resuming and rank == 0:  # (the other ranks' generators and envs start anew)
            set_rng_state(checkpoint["rng"], rng, device)
        if args.evaluate:  # one line, and eval_<checkpoint name>.json beside the checkpoint
            metrics = {
                "checkpoint": args.checkpoint,
                "global_step": global_step,
                "eval_seed": args.seed + 10_000 + iteration,
                "num_eval_episodes": args.num_eval_episodes,
                **evaluate_and_log(),
            }
            path = Path(args.checkpoint).with_name(f"eval_{Path(args.checkpoint).stem}.json")
            write_whole(path, lambda tmp: tmp.write_text(json.dumps(metrics, indent=2)))
            return metrics
        if rank == 0 and resuming:
            print(f"resuming {Path(args.checkpoint).parent} at global step {global_step} (iteration {iteration})")
            if checkpoint["envs"] is None:  # ManiSkill's simulator state cannot be saved
                print(f"resume: the envs' state is not in the checkpoint ({args.env_id}): they start anew")
        if rank == 0 and not resuming:  # (a resume writes into its run once its workers have started: Ctrl-C before
            open_run()  # leaves the run as it was)
        saved_envs = checkpoint["envs"] if resuming and rank == 0 else None
        workers = EnvWorkers(args, slots, rank, saved_envs)
        collector = Collector(args, workers, slots, agent, obs_rms, device)
        if saved_envs is not None and "collector" in saved_envs:  # (older checkpoints hold none: counters from 0)
            collector.load_state_dict(saved_envs["collector"])
        if rank == 0 and resuming:
            open_run()
        if args.env_kind == "toy":
            targets = draw_target_actions(args.toy).to(device)
        previous = None  # the previous rollout's batch
        rollout = None
        update_time = 0.0
        train_start = time.time()
        next_progress = train_start + args.progress_interval
        while global_step < args.total_timesteps:
            iteration += 1

            # 1. Collect T x N steps (Sec. 2.1, 2.2); under torchrun, preempt stragglers among the ranks (Sec. 2.3).
            stop_early = None
            t_star = math.nan
            if distributed and previous is not None:
                if args.sync:
                    stop_early = ddppo_stop_rule(store, args, iteration)
                else:
                    gathered = [None] * args.world_size  # every rank computes the same t* from the same numbers
                    dist.all_gather_object(gathered, [*rollout.step_times, update_time])  # (rank r's row)
                    stop_early, t_star = ver_stop_rule(np.array(gathered), args.batch_size, collector.quota)
            rollout_start = time.perf_counter()
            rollout = collector.collect(stop_early)
            if distributed:
                store.add(f"done_{iteration}", 1)
            synchronize()
            rollout_time = time.perf_counter() - rollout_start

            # 2. Returns over variable-length sequences and importance weights; a preempted rank is filled up.
            update_start = time.perf_counter()
            batch = build_batch(collector.storage, args.num_envs, args.num_steps, args.gamma, args.gae_lambda)
            fresh = int(batch["lengths"].sum())
            batch = fill_from_previous(batch, previous, args.batch_size, rng)  # unchanged unless preempted
            previous = batch

            # 3. PPO update (Sec. 2.2, 4), then the next rollout starts with the steps still in flight.
            losses = ppo_update(args, agent, optimizer, batch, rng)
            obs_rms.merge_ranks()  # DD-PPO: every rank normalizes the next rollout alike
            carried = collector.start_next_rollout()
            synchronize()
            update_time = time.perf_counter() - update_start  # LT of Sec. 2.3

            # 4. Counters of all ranks, logging (rank 0), evaluation and checkpoints.
            counts = {
                "env_steps": rollout.env_steps,
                "env_busy_time": rollout.env_busy_time,
                "episodes": len(rollout.episode_returns),
                "return": sum(rollout.episode_returns),
                "length": sum(rollout.episode_lengths),
                "success": sum(rollout.episode_successes),
                "stragglers": np.count_nonzero(rollout.steps_per_env < args.num_steps),  # (module docstring)
                "preempted_ranks": float(fresh < args.batch_size),
                "launchers_gone": float(distributed and os.getppid() != launcher),
            }
            counts = all_reduce_named(counts, device)
            steps = int(counts["env_steps"])
            global_step += steps  # (no call between these two stores: a Ctrl-C cannot split the pair save reads)
            summary["iteration"] = iteration
            env_busy_time += counts["env_busy_time"]
            if counts["launchers_gone"] > 0:  # torchrun was killed: every rank stops here, as at Ctrl-C
                print(f"rank {rank}: the launcher (pid {launcher}) is gone: stopping", file=sys.stderr)
                raise KeyboardInterrupt
            if rank > 0:
                continue
            metrics = {
                "charts/SPS": (global_step - start_step) / (time.time() - train_start),
                "charts/learning_rate": args.learning_rate,  # constant: CleanRL anneals it, VER a cosine (Sec. 4)
                "ver/steps_per_env_min": rollout.steps_per_env.min(),
                "ver/steps_per_env_max": rollout.steps_per_env.max(),
                "ver/straggler_share": counts["stragglers"] / (args.num_envs * args.world_size),
                "ver/importance_weight_min": batch["weights"].min(),
                "ver/inference_batch_size_mean": np.mean(rollout.inference_batch_sizes or [0]),
                "ver/inflight_carried": carried,
                "ver/env_utilization": rollout.env_busy_time / (args.num_envs * rollout_time),
                "ver/preempted_ranks": counts["preempted_ranks"],
                "ver/filled_fraction": 1.0 - fresh / len(batch["weights"]),  # rank 0's batch
                "time/rollout": rollout_time,
                "time/update": update_time,
            }
            if counts["episodes"] > 0:
                metrics["charts/episodic_return"] = counts["return"] / counts["episodes"]
                metrics["charts/episodic_length"] = counts["length"] / counts["episodes"]
                metrics["charts/success_rate"] = counts["success"] / counts["episodes"]
            if not math.isnan(t_star):
                metrics["ver/preemption_time"] = t_star
            if args.env_kind == "toy" and fresh > 0:
                correct = batch["actions"][:fresh] == targets[batch["obs"][:fresh]]
                metrics["toy/accuracy"] = correct.float().mean()
            log(losses, global_step)  # losses/* (ppo_update)
            log(metrics, global_step)
            if not args.quiet and time.time() >= next_progress:
                next_progress = time.time() + args.progress_interval
                elapsed = time.time() - train_start
                print(progress_line(global_step, args.total_timesteps, last["charts/SPS"], elapsed, last), flush=True)
            if args.eval_freq and iteration % args.eval_freq == 0 and global_step < args.total_timesteps:
                evaluate_and_log()
                if args.save_model:
                    save(f"ckpt_{global_step}.pt")
        if distributed:  # DD-PPO keeps the ranks' weights (and obs_rms) identical: check it (summary.json)
            weights = torch.cat([tensor.detach().reshape(-1) for tensor in [*agent.parameters(), obs_rms.totals()]])
            rank0_weights = weights.clone()
            dist.broadcast(rank0_weights, src=0)
            difference = (weights - rank0_weights).abs().max()
            dist.all_reduce(difference, op=dist.ReduceOp.MAX)
            summary["ddp/max_weight_difference"] = float(difference)
        if rank == 0:
            evaluate_and_log()
            if args.save_model:
                save("final_ckpt.pt")
    except WorkerError as error:
        summary["error"] = str(error)
        raise
    except KeyboardInterrupt:
        summary["interrupted"] = True
        if rank == 0 and args.save_model and "iteration" in summary:
            print("interrupted: writing summary.json and a checkpoint", file=sys.stderr)
            save("final_ckpt.pt")
        raise
    finally:
        if workers is not None:
            workers.close()
        if eval_env is not None:
            eval_env.close()
        if writer is not None:  # rank 0 of a training run
            wall = time.time() - start_time
            summary["run_dir"] = str(run_dir)
            summary["global_step"] = global_step
            summary["wall_time_s"] = wall
            summary["env_busy_time_s"] = env_busy_time
            summary["sps"] = (global_step - start_step) / wall
            for name, value in last.items():  # the last value of each metric
                summary[name] = value
            write_whole(run_dir / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=2)))
            writer.close()
        if distributed:
            dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except ArgsError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except WorkerError as error:
        print(f"error: an env worker failed; the run was stopped.\n{error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
