"""Cleanba IMPALA: IMPALA with V-trace on the Cleanba actor/learner architecture, in PyTorch (EnvPool, toy chain).

Paper: "Cleanba: A Reproducible and Efficient Distributed Reinforcement Learning Platform",
Shengyi Huang, Jiayi Weng, Rujikorn Charakorn, Min Lin, Zhongwen Xu, Santiago Ontanon (ICLR 2024), arXiv:2310.00036.
IMPALA and V-trace: Espeholt et al., "IMPALA: Scalable Distributed Deep-RL with ..." (ICML 2018), arXiv:1802.01561.

Actor threads step EnvPool with the policy mu they hold; the learner corrects for the gap to its own policy pi with
V-trace (importance ratios pi/mu). Each actor thread meets the learner through a rollout queue and a params queue of
size 1 (Fig. 1, right). By default the actor skips its params get at iteration 2 (Cleanba's architecture): from update 2
on, the learner trains on data of pi_{i-1} whatever the speed of either side (Table 1; Sec. 5.3: no cost in data
efficiency for IMPALA); --no-concurrency is synchronous. The batch is local_num_envs x num_steps per learner process
(Sec. 4.1, App. A); torchrun runs learners whose summed gradients make one learner's step on the global minibatch.

Map from the paper to this file
  Fig. 1 right, Table 1    ActorThread.actor_loop, train, blocking, should_get_params
  Sec. 4.1, App. A         resolve_args                                  (local_num_envs, world_size, batch sizes)
  Sec. 4.2                 cleanba/rollout_queue_get_time, cleanba/params_queue_get_time
  Sec. 5 (Machado et al.)  make_env                                      (sticky actions, full action space)
  App. B, Table 3          vtrace, impala_loss, Learner                  (RMSprop eps 0.01, lr 6e-4 annealed, clip 40)
  Sec. 5 (Espeholt 2018)   Agent                                         (IMPALA ResNet 16/32/32, 256 hidden)
  Sec. 3 (Fig. 2)          --debug-learner-delay                         (a slow learner: same numbers, slower)
  Table 1, resumed         save_checkpoint, ActorThread.carried, train   (the same run: bit-identical on ToyChain-v0)
Autoreset: EnvPool's next-step mode (ToyChain-v0 too): the step after an episode end only resets the env; that row is
masked out of the loss, the trace is cut at every end, and its observation (the true last one) is bootstrapped at a
truncation (at every end with --bootstrap-at-done always).
Departures (classic control, from Table 3; benchmarks/results/cleanba_classic*.md): 8 minibatches, RMSprop epsilon 0.1
and a constant learning rate (V converges once the task is solved; a late fall is still learned from); on CartPole-v1
no entropy bonus, which drifts a solved policy away; Acrobot-v1 keeps 0.01: its -1 per step gives no signal until the
goal is found, and without the bonus seed 5 never finds it.
Resume: all randomness derives from the seed, the iteration and the step; with the actors' carried state (chains,
observations, episode sums) and the next rollout's policy in the checkpoint, a one-process ToyChain-v0 run resumes
bit-identical. EnvPool's state cannot be saved: resumed Atari and classic-control runs start new episodes.

Examples
  python cleanba_impala.py --env-id ToyChain-v0                              # seconds on a CPU
  python cleanba_impala.py --env-id Breakout-v5 --actor-device-ids 0         # Table 3, 50M steps on GPU 0
  torchrun --nproc_per_node 2 cleanba_impala.py --env-id Breakout-v5 --local-num-envs 64   # 2 learners, same batch
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import os
import queue
import sys
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

from toy_chain_env import ToyChainConfig, ToyChainPool


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run directory name)"""
    seed: int = 1
    """seed of the network, the environments and the action sampling (>= 0)"""
    torch_deterministic: bool = True
    """deterministic torch algorithms: on CUDA an op without a deterministic kernel raises an error"""
    cuda: bool = True
    """use CUDA when it is available"""
    output_dir: str = "runs"
    """runs are written to {output_dir}/{env_id}__{exp_name}__{seed}__{unix_time}/"""
    track: bool = False
    """mirror the TensorBoard scalars to Weights & Biases (needs `pip install wandb`)"""
    wandb_project_name: str = "cleanba"
    """wandb project name"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    save_model: bool = False
    """write ckpt_{global_step}.pt every --checkpoint-freq iterations and final_ckpt.pt at the end"""
    checkpoint_freq: int = 500
    """iterations between two ckpt_{global_step}.pt (>= 1)"""
    checkpoint: Optional[str] = None
    """a checkpoint of this script: its run goes on in its directory (up to --total-timesteps), or --evaluate it"""
    evaluate: bool = False
    """only evaluate the policy of --checkpoint: one result line and eval_<name>.json beside it, no run directory"""
    num_eval_episodes: int = 100
    """episodes of the final evaluation and of --evaluate (>= 1 there), one per eval env, >= 0 (0: none; 10: noisy)"""
    capture_video: bool = False
    """record the final evaluation's first episode as mp4 in the run's videos/ (--evaluate: beside the checkpoint)"""
    progress_interval: float = 15.0
    """seconds between two progress lines, >= 1"""
    quiet: bool = False
    """no progress lines (settings, evaluations and errors still print)"""

    env_id: str = "Breakout-v5"
    """EnvPool Atari (Breakout-v5, Pong-v5, ...), EnvPool classic control (CartPole-v1, Acrobot-v1) or ToyChain-v0"""
    max_episode_steps: Optional[int] = None
    """episode time limit in agent steps, >= 1 (default: Atari 27,000 = 108,000 frames, Sec. 5; classic its own 500)"""
    bootstrap_at_done: Literal["always", "truncated"] = "truncated"
    """truncated: a time limit bootstraps V(last observation), a termination 0; always: every episode end bootstraps"""
    toy: ToyChainConfig = field(default_factory=ToyChainConfig)
    """ToyChain-v0 settings (always next-step autoreset, as EnvPool)"""

    local_num_envs: Optional[int] = None
    """envs per learner process (>= 1), split over its actor threads (default: Atari 128, Table 3; classic 16; ToyChain
    32). The original Cleanba's --local-num-envs counts envs per ACTOR THREAD: ours = theirs x threads x devices"""
    num_actor_threads: int = 2
    """actor threads per actor device (>= 1), each with its own EnvPool and queues (hardware, not a hyperparameter)"""
    actor_device_ids: Optional[list[int]] = None
    """CUDA devices (local indices) of this process's actor threads (default: the learner's device); needs CUDA"""
    concurrency: bool = True
    """Cleanba's architecture (data of the second-latest policy); --no-concurrency: synchronous"""
    debug_learner_delay: float = 0.0
    """seconds (>= 0) the learner sleeps after each update (Sec. 3): a slower learner must give exactly the same run"""

    total_timesteps: Optional[int] = None
    """env steps of all processes, at least one batch (default: Atari 50M, Table 3; classic 500k; ToyChain 64,000)"""
    learning_rate: float = 6e-4
    """RMSprop learning rate (> 0; Table 3)"""
    anneal_lr: Optional[bool] = None
    """linearly decay the learning rate to 0 (default: Atari and ToyChain True, Table 3; classic False, a departure)"""
    num_steps: Optional[int] = None
    """unroll length per env and update (>= 1; default: Atari 20, Table 3; classic 20; ToyChain 10)"""
    gamma: float = 0.99
    """discount factor (in [0, 1]; Table 3)"""
    vtrace_lambda: float = 1.0
    """lambda, the V-trace mixing parameter (in [0, 1]; Table 3)"""
    clip_rho_threshold: float = 1.0
    """rho-bar (> 0), clip of the importance ratios in the V-trace targets (Table 3); c-bar is 1 (rlax's, Cleanba's)"""
    clip_pg_rho_threshold: float = 1.0
    """rho-bar_pg (> 0), clip of the importance ratios of the policy-gradient advantages (Table 3)"""
    num_minibatches: Optional[int] = None
    """minibatches of whole env sequences, one pass (>= 1; default: Atari 4, Table 3; classic 8; ToyChain 4)"""
    ent_coef: Optional[float] = None
    """entropy coefficient, >= 0 (default: Atari 0.01, Table 3; CartPole 0, a departure; Acrobot and ToyChain 0.01)"""
    vf_coef: float = 0.5
    """baseline coefficient (>= 0): the loss has vf_coef x 0.5 x sum (v_s - V)^2 (Table 3, as Cleanba and torchbeast)"""
    max_grad_norm: float = 40.0
    """global gradient-norm clip (> 0; Table 3)"""
    rmsprop_eps: Optional[float] = None
    """RMSprop epsilon outside the square root (> 0; default: Atari 0.01, Table 3; classic 0.1; ToyChain 0.01)"""
    rmsprop_alpha: float = 0.99
    """RMSprop decay (in [0, 1); Table 3)"""

    # filled in by resolve_args (App. A)
    world_size: tyro.conf.Suppress[int] = 1
    num_envs: tyro.conf.Suppress[int] = 0
    envs_per_thread: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    local_minibatch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    num_iterations: tyro.conf.Suppress[int] = 0


SCRIPT = os.path.basename(__file__)  # named in every checkpoint
TOY_ENV_ID = "ToyChain-v0"
CLASSIC_ENVS = {"CartPole-v1": (4, 2), "Acrobot-v1": (6, 3)}  # EnvPool classic control: observation size, actions
# App. B Table 3 (Atari, ToyChain); classic control: the departures of the docstring
TABLE_3 = dict(num_minibatches=4, rmsprop_eps=0.01, ent_coef=0.01, anneal_lr=True)
CLASSIC_DEPARTURES = dict(num_minibatches=8, rmsprop_eps=0.1, anneal_lr=False)
CLASSIC_ENT_COEF = {"CartPole-v1": 0.0, "Acrobot-v1": 0.01}  # per task: the departures of the docstring
AT_LEAST_ONE = (
    "checkpoint_freq",
    "progress_interval",
    "local_num_envs",
    "num_actor_threads",
    "total_timesteps",
    "num_steps",
    "num_minibatches",
)
NAMING = ("output_dir", "exp_name")  # a resumed run's directory is the checkpoint's
# what --evaluate reads; every other setting is training's
EVALUATION = (
    "seed",
    "torch_deterministic",
    "cuda",
    "checkpoint",
    "evaluate",
    "num_eval_episodes",
    "capture_video",
    "env_id",
    "max_episode_steps",
    "toy",
)
PRESETS = {
    "atari": dict(TABLE_3, local_num_envs=128, num_steps=20, total_timesteps=50_000_000, max_episode_steps=27000),
    "classic": dict(
        local_num_envs=16, num_steps=20, total_timesteps=500_000, max_episode_steps=500, **CLASSIC_DEPARTURES
    ),
    "toy": dict(TABLE_3, local_num_envs=32, num_steps=10, total_timesteps=64_000),
}


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or thread starts."""


def env_family(env_id: str) -> Optional[str]:
    """'toy', 'classic' or 'atari' (an EnvPool Atari task id); None for anything else."""
    if env_id == TOY_ENV_ID:
        return "toy"
    if env_id in CLASSIC_ENVS:
        return "classic"
    from envpool.registration import registry

    return "atari" if registry.specs.get(env_id, [None])[0] == "envpool.atari" else None  # where EnvPool has it


def resolve_args(args: Args, world_size: int = 1) -> Args:
    """A copy of `args` with the presets and the App. A sizes filled in (actor threads are hardware, Sec. 4.1)."""
    args = dataclasses.replace(args)
    family = env_family(args.env_id)
    if family is None:
        known = f"an EnvPool Atari task (Breakout-v5, ...), an EnvPool classic-control task ({', '.join(CLASSIC_ENVS)})"
        raise ArgsError(f"--env-id {args.env_id!r}: must be {known} or {TOY_ENV_ID}")
    if family == "toy":
        if args.toy.autoreset_mode != "next_step":
            raise ArgsError("--toy.autoreset-mode: this script consumes next-step autoreset (EnvPool's); use next_step")
        try:
            args.toy.validate()  # every --toy.* flag, each named with its value and domain
        except ValueError as error:
            raise ArgsError(str(error)) from None
    given = {name for name, value in asdict(args).items() if value != asdict(Args())[name]}  # before the presets
    toy_given = [name for name, value in asdict(args.toy).items() if value != getattr(ToyChainConfig(), name)]
    if toy_given and family != "toy":
        raise ArgsError(f"--toy.{toy_given[0].replace('_', '-')}: does nothing on {args.env_id}, not {TOY_ENV_ID}")
    if family == "classic" and args.ent_coef is None:
        args.ent_coef = CLASSIC_ENT_COEF[args.env_id]
    for name, value in PRESETS[family].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    checks = [(name, getattr(args, name) >= 1, ">= 1") for name in AT_LEAST_ONE]  # (setting, in its domain, domain)
    checks += [
        (name, getattr(args, name) >= 0, ">= 0") for name in ("seed", "debug_learner_delay", "ent_coef", "vf_coef")
    ]
    checks += [(name, getattr(args, name) > 0, "> 0") for name in ("learning_rate", "max_grad_norm", "rmsprop_eps")]
    checks += [(name, getattr(args, name) > 0, "> 0") for name in ("clip_rho_threshold", "clip_pg_rho_threshold")]
    checks += [(name, 0 <= getattr(args, name) <= 1, "in [0, 1]") for name in ("gamma", "vtrace_lambda")]
    checks.append(("rmsprop_alpha", 0 <= args.rmsprop_alpha < 1, "in [0, 1)"))
    checks.append(("num_eval_episodes", args.num_eval_episodes >= args.evaluate, f">= {int(args.evaluate)}"))
    checks.append(("max_episode_steps", args.max_episode_steps is None or args.max_episode_steps >= 1, ">= 1"))
    for name, within, domain in checks:
        if not within:
            raise ArgsError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be {domain}")
    idle = [  # (setting, where it would do nothing, whether that is here): refused rather than ignored
        ("checkpoint_freq", "without --save-model", not args.save_model),
        ("progress_interval", "with --quiet", args.quiet),
        *[(name, "without --track", not args.track) for name in ("wandb_project_name", "wandb_entity")],
        ("max_episode_steps", f"on {TOY_ENV_ID}: use --toy.horizon", family == "toy"),
        ("capture_video", f"on {TOY_ENV_ID}: it has nothing to render", family == "toy"),
        ("capture_video", "with --num-eval-episodes 0: there is no evaluation to record", args.num_eval_episodes == 0),
        *[(name, "with --evaluate", args.evaluate) for name in asdict(args) if name not in EVALUATION],
        *[(name, "with --checkpoint: its run goes on in its directory", bool(args.checkpoint)) for name in NAMING],
    ]
    for name, where, idle_here in idle:
        value = getattr(args, name)
        if idle_here and name in given:
            flag = ("--no-" if value is False else "--") + name.replace("_", "-")
            raise ArgsError(f"{flag}{'' if isinstance(value, bool) else f' {value}'}: does nothing {where}")
    cuda_devices = torch.cuda.device_count() if args.cuda else 0
    for device_id in args.actor_device_ids or []:
        if not 0 <= device_id < cuda_devices:
            raise ArgsError(f"--actor-device-ids {device_id}: must be a CUDA device index in [0, {cuda_devices})")
    threads = args.num_actor_threads * len(args.actor_device_ids or [0])
    if args.local_num_envs % threads:
        raise ArgsError(f"--local-num-envs {args.local_num_envs} does not split over {threads} actor threads")
    args.world_size = world_size
    args.envs_per_thread = args.local_num_envs // threads
    args.num_envs = args.local_num_envs * world_size
    args.local_batch_size = args.local_num_envs * args.num_steps
    args.batch_size = args.local_batch_size * world_size
    if args.local_num_envs % args.num_minibatches:
        raise ArgsError(f"--num-minibatches {args.num_minibatches}: must divide --local-num-envs {args.local_num_envs}")
    args.local_minibatch_size = args.local_batch_size // args.num_minibatches
    args.minibatch_size = args.local_minibatch_size * world_size
    args.num_iterations = args.total_timesteps // args.batch_size
    if args.num_iterations < 1 and not args.evaluate:
        raise ArgsError(f"--total-timesteps {args.total_timesteps}: must be at least one batch ({args.batch_size})")
    if args.evaluate and not args.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    if args.evaluate and world_size > 1:
        raise ArgsError("--evaluate: one process evaluates; run it without torchrun")
    if args.capture_video and importlib.util.find_spec("imageio_ffmpeg") is None:
        raise ArgsError("--capture-video: writing mp4 needs imageio-ffmpeg (pip install 'imageio[ffmpeg]')")
    if args.checkpoint:
        state = load_checkpoint(args.checkpoint, args.env_id)
        saved_batch = state.get("batch_size", state["global_step"] // max(state["iteration"], 1))  # older: derived
        if not args.evaluate and saved_batch != args.batch_size:  # the iterations count batches of the old size
            batch = f"--local-num-envs {args.local_num_envs} x --num-steps {args.num_steps} x {world_size} process(es)"
            saved = f"{args.batch_size} env steps an iteration, the checkpoint's {saved_batch}: resume with its batch"
            raise ArgsError(f"{batch} = {saved}")
        if not args.evaluate and state["iteration"] >= args.num_iterations:
            done = f"the checkpoint is at global step {state['global_step']} already; pass a larger value"
            raise ArgsError(f"--total-timesteps {args.total_timesteps}: {done}")
    return args


def load_checkpoint(path: str, env_id: str) -> dict:
    """A checkpoint of this script and task as torch.load(weights_only=True) reads it; anything else: ArgsError."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's own message starts with weights_only; the error under it says what it found
        found = (str(error.__context__ or error).strip().splitlines() or ["empty"])[0]
        raise ArgsError(f"--checkpoint {path}: not a checkpoint of {SCRIPT} ({found})") from None
    if not isinstance(state, dict) or "script" not in state:
        raise ArgsError(f"--checkpoint {path}: not a checkpoint of {SCRIPT} (no 'script' entry)")
    if (state["script"], state["env_id"]) != (SCRIPT, env_id):
        found = f"a checkpoint of {state['script']} on {state['env_id']}, not of {SCRIPT} on {env_id}"
        raise ArgsError(f"--checkpoint {path}: {found}")
    return state


def format_settings(args: Args, device: torch.device) -> str:
    """The resolved settings as `name=value` pairs in field order, in lines of 120 characters, then the device; the
    toy chain's (`toy.horizon=200`) on ToyChain-v0 only, never its test hook crash_at_step."""
    pairs = []
    for name, value in asdict(args).items():
        if name != "toy":
            pairs.append(f"{name}={value}")
        elif args.env_id == TOY_ENV_ID:
            pairs.extend(f"toy.{key}={inner}" for key, inner in value.items() if key != "crash_at_step")
    pairs.append(f"device={device}")
    return "settings:\n" + textwrap.fill(" ".join(pairs), width=120, break_long_words=False, break_on_hyphens=False)


# ---- Environments: EnvPool Atari and classic control, ToyChain-v0 behind EnvPool's API (all next-step autoreset) ----
def env_seeds(seed: int, rank: int, first_env: int, num_envs: int, start_iteration: int) -> list[int]:
    """One seed per env from its global index (the same whatever the actor threads); a resumed run draws new ones."""
    return [
        int(np.random.SeedSequence([seed, rank, first_env + env, start_iteration]).generate_state(1)[0] >> 1)
        for env in range(num_envs)
    ]


def make_env(args: Args, num_envs: int, seeds: list[int], render: bool = False):  # render: env.render(env_ids)
    if args.env_id == TOY_ENV_ID:
        return ToyChainPool(args.toy, num_envs, seeds[0])
    import envpool

    pool = dict(env_type="gymnasium", num_envs=num_envs, batch_size=num_envs, seed=seeds)
    episodes = dict(max_episode_steps=args.max_episode_steps, render_mode="rgb_array" if render else None)
    if args.env_id in CLASSIC_ENVS:  # reaching the time limit is a truncation; a fallen pole is a termination
        return envpool.make(args.env_id, **pool, **episodes)
    # Sec. 5 (Machado et al. 2018); rewards clipped for learning, info["reward"] keeps the raw game score
    protocol = dict(repeat_action_probability=0.25, full_action_space=True, episodic_life=False, noop_max=1)
    frames = dict(reward_clip=True, stack_num=4, frame_skip=4, img_height=84, img_width=84, gray_scale=True)
    return envpool.make(args.env_id, **pool, **episodes, **protocol, **frames)


# ---- Pure functions (importable, tested in tests/test_cleanba_impala.py) ----
def should_get_params(iteration: int, concurrency: bool, first: bool = False) -> bool:
    """Fig. 1 (right), line 7: params before every rollout (a run's first, resumed or not, always), except at iteration
    2 with concurrency (D_2 from pi_1)."""
    return first or not (concurrency and iteration == 2)


def noise_seed(seed: int, rank: int, iteration: int, step: int, stream: int = 0) -> int:
    """Seed of the sampling noise at one rollout step: a function of the seed and the iteration, not of timing."""
    return int(np.random.SeedSequence([seed, rank, iteration, step, stream]).generate_state(1)[0])


def sample_actions(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel-max: argmax(logits + Gumbel noise) is a sample of Categorical(logits) (as Cleanba's actors do)."""
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
    return torch.argmax(logits + gumbel, dim=-1)


def logprob_entropy(logits: torch.Tensor, actions: torch.Tensor):
    log_probs = torch.log_softmax(logits, dim=-1)
    logprob = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprob, entropy


def vtrace(
    values, next_values, rewards, no_bootstrap, dones, log_rhos, gamma, lambda_=1.0, rho_bar=1.0, pg_rho_bar=1.0
):
    """V-trace targets and policy-gradient advantages over (T, N), without gradient (Espeholt et al. 2018, Sec. 4.1).
    Row t is one transition x_t --a_t--> x'_t, its reward and flags those the env returned for a_t (rlax's convention):
      values[t] = V(x_t);  next_values[t] = V(x'_t) (values[t + 1], V(o_T) for the last row)
      rewards[t] = r_t;  no_bootstrap[t] = cut_t: x'_t is not bootstrapped;  dones[t] = done_t: a_t ended the episode
      log_rhos[t] = log pi(a_t|x_t) - log mu(a_t|x_t), learner over behaviour (actor) policy
    With rho_t = exp(log_rhos[t]) and c_t = lambda min(1, rho_t):
      delta_t   = min(rho-bar, rho_t) (r_t + gamma (1 - cut_t) next_values[t] - values[t])
      v_t - V   = delta_t + gamma (1 - done_t) c_t (v_{t+1} - V(x_{t+1}))
      q_t       = r_t + gamma (1 - cut_t) (lambda v_{t+1} + (1 - lambda) V(x_{t+1}) if not done_t and t < T - 1,
                                          else next_values[t])
      pg_adv_t  = min(rho-bar_pg, rho_t) (q_t - values[t])
    With only terminations as episode ends this is rlax.vtrace_td_error_and_advantage, discount_t = gamma (1 - cut)."""
    with torch.no_grad():
        rhos = log_rhos.exp()
        discounts = gamma * (1.0 - no_bootstrap.to(values.dtype))
        traces = gamma * (1.0 - dones.to(values.dtype)) * lambda_ * rhos.clamp(max=1.0)
        deltas = rhos.clamp(max=rho_bar) * (rewards + discounts * next_values - values)
        errors = torch.zeros_like(values)
        accumulated = torch.zeros_like(values[0])
        for step in reversed(range(values.shape[0])):
            accumulated = deltas[step] + traces[step] * accumulated
            errors[step] = accumulated
        vs = values + errors
        vs_next = torch.cat([vs[1:], next_values[-1:]], dim=0)
        values_next = torch.cat([values[1:], next_values[-1:]], dim=0)
        bootstrap = torch.where(dones, next_values, lambda_ * vs_next + (1.0 - lambda_) * values_next)
        pg_advantages = rhos.clamp(max=pg_rho_bar) * (rewards + discounts * bootstrap - values)
    return vs, pg_advantages


def impala_loss(agent: nn.Module, batch: dict, args: Args):
    """The IMPALA loss of whole env sequences (Espeholt et al. 2018, Sec. 4.2) and its terms, summed over the valid rows
    as Cleanba and torchbeast do: -log pi(a_t|x_t) pg_adv_t + vf_coef 0.5 (v_t - V(x_t))^2 - ent_coef H(pi(.|x_t))."""
    obs = batch["obs"]
    num_steps, num_envs = obs.shape[:2]
    all_logits, all_values = agent(torch.cat([obs, batch["next_obs"].unsqueeze(0)]).flatten(0, 1))
    logits = all_logits[: num_steps * num_envs].view(num_steps, num_envs, -1)  # the policy at o_0 .. o_{T-1}
    values = all_values.view(num_steps + 1, num_envs)  # V(o_0) .. V(o_T)
    logprob, entropy = logprob_entropy(logits, batch["actions"])
    log_rhos = logprob.detach() - batch["logprobs"]
    dones = batch["terminations"] | batch["truncations"]  # every end cuts the trace
    no_bootstrap = batch["terminations"] if args.bootstrap_at_done == "truncated" else torch.zeros_like(dones)
    fixed = values.detach()  # the targets and advantages carry no gradient
    vs, pg_advantages = vtrace(
        fixed[:-1],
        fixed[1:],
        batch["rewards"],
        no_bootstrap,
        dones,
        log_rhos,
        gamma=args.gamma,
        lambda_=args.vtrace_lambda,
        rho_bar=args.clip_rho_threshold,
        pg_rho_bar=args.clip_pg_rho_threshold,
    )
    valid = batch["valid"].float()  # next-step reset rows carry no transition
    policy_loss = (-logprob * pg_advantages * valid).sum()
    value_loss = (0.5 * (vs - values[:num_steps]).square() * valid).sum()
    entropy = (entropy * valid).sum()
    loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy
    rhos = log_rhos.exp()  # log_rhos carries no gradient
    sums = {
        "policy_loss": policy_loss,
        "value_loss": value_loss,
        "entropy": entropy,
        "approx_kl": (((rhos - 1) - log_rhos) * valid).sum(),
        "rho_mean": (rhos * valid).sum(),
        "rho_clipfrac": ((rhos > args.clip_rho_threshold).float() * valid).sum(),
        "count": valid.sum(),
    }
    return loss, {name: value.detach().double() for name, value in sums.items()}


# ---- Networks ----
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def two_layers(inputs: int, activation) -> list[nn.Module]:
    """Two 64-unit layers: CleanRL's classic-control networks (tanh) and the ToyChain torso (ReLU)."""
    return [layer_init(nn.Linear(inputs, 64)), activation(), layer_init(nn.Linear(64, 64)), activation()]


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, inputs):
        return inputs + self.conv1(F.relu(self.conv0(F.relu(inputs))))


def conv_sequence(in_channels: int, out_channels: int) -> nn.Sequential:
    """IMPALA ResNet stage: conv 3x3 -> max-pool 3x3 stride 2 -> two residual blocks (84 -> 42 -> 21 -> 11)."""
    conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
    pool = nn.MaxPool2d(3, stride=2, padding=1)
    return nn.Sequential(conv, pool, ResidualBlock(out_channels), ResidualBlock(out_channels))


class Agent(nn.Module):
    """Policy and value heads on a shared torso: the IMPALA ResNet on Atari frames (Sec. 5), 2 x 64 ReLU on ToyChain."""

    def __init__(self, args: Args):
        super().__init__()
        self.obs_scale = 255.0 if env_family(args.env_id) == "atari" else 1.0  # Atari: uint8 frames
        self.num_blocks = args.toy.num_blocks if args.env_id == TOY_ENV_ID else 0  # ToyChain: one-hot block index
        if args.env_id in CLASSIC_ENVS:  # no shared torso: two networks, as CleanRL's ppo.py
            obs_size, num_actions = CLASSIC_ENVS[args.env_id]
            self.torso = nn.Identity()
            self.actor = nn.Sequential(*two_layers(obs_size, nn.Tanh), layer_init(nn.Linear(64, num_actions), std=0.01))
            self.critic = nn.Sequential(*two_layers(obs_size, nn.Tanh), layer_init(nn.Linear(64, 1), std=1.0))
            return
        if args.env_id == TOY_ENV_ID:
            num_actions = args.toy.num_actions
            hidden = 64
            self.torso = nn.Sequential(*two_layers(self.num_blocks, nn.ReLU))
        else:
            num_actions = 18  # the full action space (Sec. 5)
            hidden = 256
            stages = [conv_sequence(4, 16), conv_sequence(16, 32), conv_sequence(32, 32)]
            self.torso = nn.Sequential(
                *stages, nn.ReLU(), nn.Flatten(), layer_init(nn.Linear(32 * 11 * 11, hidden)), nn.ReLU()
            )
        self.actor = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, obs: torch.Tensor):
        if self.num_blocks:
            hidden = self.torso(F.one_hot(obs.long(), self.num_blocks).float())
        else:
            hidden = self.torso(obs.float() / self.obs_scale)
        return self.actor(hidden), self.critic(hidden)[:, 0]


# ---- Actor threads (Fig. 1 right: `def actor()`) ----
class Stopped(Exception):
    """The other side of a queue is gone (the run is ending, or an actor thread failed)."""


def blocking(call, alive):
    """queue.get / queue.put that blocks as in Fig. 1 but raises Stopped once alive() is False (checked every 0.5 s)."""
    while True:
        try:
            return call(timeout=0.5)
        except (queue.Empty, queue.Full):
            if not alive():
                raise Stopped


class Episodes:
    """Per-env running raw game score (never the clipped reward) and length, and the sums over the ended episodes."""

    def __init__(self, num_envs: int):
        self.returns = torch.zeros(num_envs, dtype=torch.float64)
        self.lengths = torch.zeros(num_envs)
        self.stale = torch.zeros(num_envs, dtype=torch.bool)  # this env's next step only resets it
        self.sums = dict(count=0.0, returns=0.0, lengths=0.0, successes=0.0)

    def step(self, reward, info: dict, done: torch.Tensor, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Accounts one env step (a stale reset row counts for nothing); sums the ended episodes where `counted`."""
        valid = ~self.stale
        self.returns += torch.as_tensor(info["reward"] if "reward" in info else reward).double() * valid
        self.lengths += valid.float()
        ended = done & valid
        summed = ended if counted is None else ended & counted
        self.sums["count"] += float(summed.sum())
        self.sums["returns"] += float(self.returns[summed].sum())
        self.sums["lengths"] += float(self.lengths[summed].sum())
        if "success" in info:  # ToyChain: in the last block when the episode ended
            self.sums["successes"] += float((torch.as_tensor(info["success"]) & summed).sum())
        self.returns[ended] = 0.0
        self.lengths[ended] = 0.0
        self.stale = done
        return ended

    def state_dict(self) -> dict:
        return {name: getattr(self, name).clone() for name in ("returns", "lengths", "stale")}

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value.clone())


ROLLOUT_KEYS = ("obs", "actions", "logprobs", "rewards", "terminations", "truncations", "valid")


class ActorThread(threading.Thread):
    """Its own EnvPool, network copy on its device, params queue and rollout queue of size 1 (Fig. 1 right); resumed,
    what it carried out of the rollout before start_iteration (the rollout's "carried")."""

    def __init__(self, args: Args, index: int, device, rank: int, start_iteration: int, template, stop, carried=None):
        super().__init__(daemon=True, name=f"actor-{index}")
        self.args = args
        self.device = device
        self.rank = rank
        self.start_iteration = start_iteration
        self.stop = stop
        self.carried = carried
        self.params_queue: queue.Queue = queue.Queue(maxsize=1)
        self.rollout_queue: queue.Queue = queue.Queue(maxsize=1)
        self.error: Optional[BaseException] = None
        self.first_env = index * args.envs_per_thread
        seeds = env_seeds(args.seed, rank, self.first_env, args.envs_per_thread, start_iteration)
        self.envs = make_env(args, args.envs_per_thread, seeds)
        self.agent = copy.deepcopy(template).to(device)
        self.generator = torch.Generator(device=device)  # re-seeded at every step (noise_seed)

    @torch.no_grad()
    def policy(self, obs: torch.Tensor, iteration: int, step: int):
        """Actions and their log-probabilities under the actor's policy mu (the noise rows of its envs)."""
        logits, _ = self.agent(obs.to(self.device))
        self.generator.manual_seed(noise_seed(self.args.seed, self.rank, iteration, step))
        uniform = torch.rand((self.args.local_num_envs, logits.shape[-1]), generator=self.generator, device=self.device)
        action = sample_actions(logits, uniform[self.first_env : self.first_env + logits.shape[0]])
        logprob, _ = logprob_entropy(logits, action)
        action, logprob = torch.stack([action.float(), logprob]).cpu()  # one device-to-host copy
        return action.long(), logprob

    def running(self) -> bool:
        return not self.stop.is_set()

    def run(self) -> None:
        try:
            self.actor_loop()
        except Stopped:
            pass
        except BaseException as error:  # reported by the learner, which then ends the run with this error
            self.error = error
        finally:
            self.envs.close()

    def actor_loop(self) -> None:
        args = self.args
        envs = self.envs
        env_ids = np.arange(args.envs_per_thread, dtype=np.int32)
        episodes = Episodes(args.envs_per_thread)
        if self.carried is None:
            envs.async_reset()
            obs = torch.tensor(envs.recv()[0])
        else:  # resumed: the chains, observations and running episodes where the checkpoint's rollout left them
            envs.load_state_dict(self.carried["env"])
            obs = self.carried["obs"]
            episodes.load_state_dict(self.carried["episodes"])
        policy_version = 0
        for iteration in range(self.start_iteration, args.num_iterations + 1):  # the learner iteration it is for
            start = time.perf_counter()
            if should_get_params(iteration, args.concurrency, first=iteration == self.start_iteration):
                policy_version, params = blocking(self.params_queue.get, self.running)
                self.agent.load_state_dict(params)
            params_queue_get_time = time.perf_counter() - start
            rollout_start = time.perf_counter()
            storage = {key: [] for key in ROLLOUT_KEYS}
            episodes.sums = {key: 0.0 for key in episodes.sums}
            for step in range(args.num_steps):
                if self.stop.is_set():  # the run ends (Ctrl-C): not after the rest of a long rollout
                    raise Stopped
                action, logprob = self.policy(obs, iteration, step)
                envs.send(action.numpy(), env_ids)  # the envs step in EnvPool's threads while the row is stored
                storage["obs"].append(obs)
                storage["actions"].append(action)
                storage["logprobs"].append(logprob)  # log mu(a_t|o_t), the behaviour policy's
                storage["valid"].append(~episodes.stale)  # False on a next-step reset row (its action is ignored)
                next_obs, reward, terminated, truncated, info = envs.recv()  # o_{t+1}, r_t and the flags of a_t
                obs = torch.tensor(next_obs)
                storage["rewards"].append(torch.tensor(reward, dtype=torch.float32))
                storage["terminations"].append(torch.tensor(terminated))
                storage["truncations"].append(torch.tensor(truncated))
                episodes.step(reward, info, torch.tensor(terminated | truncated))
            rollout = {key: torch.stack(rows) for key, rows in storage.items()}
            rollout["next_obs"] = obs  # o_T: the learner's V(o_T) bootstraps the last row
            rollout["policy_version"] = policy_version
            rollout["episodes"] = episodes.sums
            rollout["params_queue_get_time"] = params_queue_get_time
            rollout["rollout_time"] = time.perf_counter() - rollout_start
            env_state = envs.state_dict() if args.env_id == TOY_ENV_ID else None  # EnvPool's cannot be saved
            rollout["carried"] = {"env": env_state, "obs": obs, "episodes": episodes.state_dict()}  # for a checkpoint
            blocking(partial(self.rollout_queue.put, rollout), self.running)


# ---- Learner (Fig. 1 right: `def learner()`) ----
def all_reduce_sum(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class Learner:
    """The network and RMSprop on the learner device, one IMPALA update per batch, and the run's carry: what a
    checkpoint needs besides them (train replaces it whole after each iteration)."""

    STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "rho_mean", "rho_clipfrac")

    def __init__(self, args: Args, agent: nn.Module, device: torch.device, rank: int):
        self.args = args
        self.agent = agent
        self.device = device
        self.rank = rank
        self.optimizer = torch.optim.RMSprop(
            agent.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps
        )
        self.carry = {"iteration": 0, "global_step": 0, "actors": None, "previous_model": None, "wandb_id": None}

    def update(self, batch: dict, iteration: int) -> dict:
        """num_minibatches RMSprop steps, each on whole env sequences (one pass, no shuffling, as Cleanba)."""
        args = self.args
        lr = args.learning_rate * (1.0 - (iteration - 1.0) / args.num_iterations if args.anneal_lr else 1.0)
        self.optimizer.param_groups[0]["lr"] = lr
        envs_per_minibatch = args.local_num_envs // args.num_minibatches
        totals = {name: 0.0 for name in (*self.STATS, "count", "grad_norm")}
        for start in range(0, args.local_num_envs, envs_per_minibatch):
            columns = slice(start, start + envs_per_minibatch)
            minibatch = {key: value[:, columns] for key, value in batch.items() if key != "next_obs"}
            minibatch["next_obs"] = batch["next_obs"][columns]
            for name, value in self.minibatch_step(minibatch).items():
                totals[name] += value
        out = {name: float(totals[name] / totals["count"].clamp(min=1)) for name in self.STATS}
        out["grad_norm"] = float(totals["grad_norm"] / args.num_minibatches)
        out["learning_rate"] = lr
        return out

    def minibatch_step(self, minibatch: dict) -> dict:
        """One RMSprop step on the SUM of all learners' gradients: one learner's step on the global batch (App. A)."""
        args = self.args
        loss, sums = impala_loss(self.agent, minibatch, args)
        self.optimizer.zero_grad()
        loss.backward()
        for param in self.agent.parameters():  # the sum of all learners' gradients (not their mean)
            all_reduce_sum(param.grad, args.world_size)
        grad_norm = nn.utils.clip_grad_norm_(self.agent.parameters(), args.max_grad_norm)
        self.optimizer.step()
        names = (*self.STATS, "count")
        summed = all_reduce_sum(torch.stack([sums[name] for name in names]), args.world_size)  # one all-reduce
        stats = dict(zip(names, summed))  # named back at once
        stats["grad_norm"] = grad_norm.detach().double().to(self.device)
        return stats


# ---- Logging, checkpoints, evaluation ----
class Logger:
    """TensorBoard (wandb with --track), updates.jsonl, and the last value of each scalar for summary.json. A run
    resumed at global step `resumed_at` drops what the old run logged after it (TensorBoard's purge_step)."""

    def __init__(self, run_dir: Path, args: Args, resumed_at: Optional[int], wandb_id: Optional[str]):
        self.wandb_id = wandb_id  # kept in every checkpoint, so that a resumed run goes on in the same W&B run
        if args.track:
            import wandb

            self.wandb_id = wandb.init(  # the checkpoint's W&B run, else a new one: its id is kept
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=asdict(args),
                name=run_dir.name,
                id=wandb_id,
                resume="allow",
                save_code=True,
            ).id
        purge_step = None if resumed_at is None else resumed_at + 1  # the checkpoint's iteration is logged at its step
        self.writer = SummaryWriter(str(run_dir), purge_step=purge_step)
        jsonl = run_dir / "updates.jsonl"
        if purge_step is not None and jsonl.exists():  # split("\n")[:-1]: not a killed run's partial last line
            rows = [row for row in jsonl.read_text().split("\n")[:-1] if json.loads(row)["global_step"] < purge_step]
            write_whole(jsonl, lambda tmp: tmp.write_text("".join(row + "\n" for row in rows)))
        self.jsonl = open(jsonl, "a")
        self.last: dict[str, float] = {}

    def scalars(self, values: dict, step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
            self.last[name] = float(value)
        self.jsonl.write(json.dumps({"global_step": step, **values}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def write_whole(path: Path, write) -> None:
    """write(a temporary file), then renamed to `path`: a crash or Ctrl-C leaves the old file or none, never half of
    one, and no temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: dict) -> None:
    write_whole(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def save_checkpoint(path: Path, args: Args, learner: Learner) -> None:
    """The model, the optimizer and learner.carry: the iteration and global step done, each actor thread's carried
    state at the end of the rollout that iteration trained on, pi_iteration (with --concurrency the next rollout's
    policy) and the W&B id; the env steps an iteration. No global random stream is read after the network's
    initialization (noise_seed, env_seeds)."""
    state = {"script": SCRIPT, "env_id": args.env_id, "model": learner.agent.state_dict(), **learner.carry}
    state["optimizer"] = learner.optimizer.state_dict()
    state["batch_size"] = args.batch_size  # env steps an iteration: a resume must make the same
    write_whole(path, partial(torch.save, state))


@torch.no_grad()
def evaluate(args: Args, agent: nn.Module, device, global_step: int, video: Optional[Path] = None) -> dict:
    """num_eval_episodes episodes, one per env of a separate pool, counted as the actors count theirs (raw score),
    printed as `global_step=N eval/return=...`; with `video`, the first env's episode is written there (mp4)."""
    count = args.num_eval_episodes
    envs = make_env(args, count, env_seeds(args.seed, 10_000, 0, count, 0), render=video is not None)
    generator = torch.Generator(device=device).manual_seed(args.seed + 12345)
    episodes = Episodes(count)
    finished = torch.zeros(count, dtype=torch.bool)  # each env counts its first episode only
    frames = []
    try:
        envs.async_reset()
        obs = envs.recv()[0]
        while not bool(finished.all()):
            if video is not None and not finished[0]:
                frames.append(envs.render(env_ids=[0])[0])
            logits, _ = agent(torch.tensor(obs).to(device))
            action = sample_actions(logits, torch.rand(logits.shape, generator=generator, device=device))
            envs.send(action.cpu().numpy(), np.arange(count, dtype=np.int32))
            obs, reward, terminated, truncated, info = envs.recv()
            finished |= episodes.step(reward, info, torch.tensor(terminated | truncated), counted=~finished)
    finally:
        envs.close()
    if video is not None:
        import imageio

        video.parent.mkdir(exist_ok=True)
        unfinished = video.with_name(video.stem + ".partial.mp4")  # (imageio writes by the suffix) renamed once whole
        # real time on CartPole (0.02 s a step) and Atari (4 frames of 60 Hz); Acrobot (0.2 s a step) at Gymnasium's 15
        try:
            imageio.mimsave(unfinished, frames, fps=50 if args.env_id == "CartPole-v1" else 15, macro_block_size=2)
            os.replace(unfinished, video)
        finally:
            unfinished.unlink(missing_ok=True)
    out = {"eval/return": episodes.sums["returns"] / count, "eval/episode_len": episodes.sums["lengths"] / count}
    if args.env_id == TOY_ENV_ID:
        out["eval/success_at_end"] = episodes.sums["successes"] / count
    print(f"global_step={global_step} " + " ".join(f"{name}={value:.3f}" for name, value in out.items()), flush=True)
    if video is not None:
        print(f"video: {video}", flush=True)
    return out


def progress_line(args: Args, global_step: int, sps: float, train_start: float, last: dict) -> str:
    """Env steps done of the total, charts/SPS, the time since training started, the time left at that speed (H:MM:SS)
    and the latest episodic return (and success rate)."""
    clock = lambda secs: f"{int(secs) // 3600}:{int(secs) % 3600 // 60:02d}:{int(secs) % 60:02d}"  # noqa: E731
    total = args.num_iterations * args.batch_size
    left = clock(max(total - global_step, 0) / sps) if sps > 0 else "?"
    line = f"progress global_step={global_step}/{total} ({100 * global_step // total}%) SPS={sps:.0f}"
    extras = [f" {name}={last[name]:.4g}" for name in ("charts/episodic_return", "charts/success_rate") if name in last]
    return line + f" elapsed={clock(time.time() - train_start)} left={left}" + "".join(extras)


# ---- Training: the learner loop in the main thread (Fig. 1 right: `def learner()`), actor threads beside it ----
def publish_params(params: dict, actors: list[ActorThread], version: int) -> None:
    """Fig. 1 right: param_Q.put(params) for every actor thread, a snapshot on its device."""
    for actor in actors:
        snapshot = {name: params[name].detach().to(actor.device, copy=True) for name in params}
        if actor.device.type == "cuda":
            torch.cuda.synchronize(actor.device)
        blocking(partial(actor.params_queue.put, (version, snapshot)), actor.is_alive)


def train(args: Args, learner: Learner, actors: list, logger, run_dir) -> Optional[BaseException]:
    """Iterations carry["iteration"] + 1 .. num_iterations (i turns pi_i into pi_{i+1}); after each, learner.carry (a
    new dict, assigned at once) holds what a checkpoint needs besides the model and optimizer. Returns None at the end,
    the error of a failed actor thread, or KeyboardInterrupt on Ctrl-C (the model and optimizer then those of the last
    finished iteration)."""
    agent = learner.agent
    start_iteration = learner.carry["iteration"] + 1
    before = None  # the model and optimizer before the update in progress
    try:
        # Table 1: pi_start makes the first rollout; resumed with --concurrency pi_{start-1} does, pi_start the next
        lagged = args.concurrency and start_iteration > 1
        first = learner.carry["previous_model"] if lagged else agent.state_dict()
        publish_params(first, actors, start_iteration - 1 if lagged else start_iteration)
        for actor in actors:
            actor.start()
        if lagged:
            publish_params(agent.state_dict(), actors, start_iteration)
        train_start = time.time()
        start_step = learner.carry["global_step"]
        next_progress = train_start + args.progress_interval
        for iteration in range(start_iteration, args.num_iterations + 1):
            # 1. Rollouts: rollout_Q.get() from every actor thread
            start = time.perf_counter()
            rollouts = [blocking(actor.rollout_queue.get, actor.is_alive) for actor in actors]
            rollout_queue_get_time = time.perf_counter() - start
            batch = {key: torch.cat([rollout[key] for rollout in rollouts], dim=1) for key in ROLLOUT_KEYS}
            batch["next_obs"] = torch.cat([rollout["next_obs"] for rollout in rollouts])
            batch = {key: value.to(learner.device) for key, value in batch.items()}
            # 2. Update, then param_Q.put(): pi_{iteration + 1}
            start = time.perf_counter()
            previous = {name: value.clone() for name, value in agent.state_dict().items()}  # pi_iteration
            optimizer = copy.deepcopy(learner.optimizer.state_dict())
            before = {"iteration": iteration - 1, "model": previous, "optimizer": optimizer}
            losses = learner.update(batch, iteration)
            update_time = time.perf_counter() - start
            global_step = learner.carry["global_step"] + args.batch_size
            # one assignment: a Ctrl-C leaves the carry of one iteration, never half of two
            learner.carry = {
                "iteration": iteration,
                "global_step": global_step,
                "actors": [rollout["carried"] for rollout in rollouts],
                "previous_model": previous,
                "wandb_id": learner.carry["wandb_id"],
            }
            if iteration < args.num_iterations:
                publish_params(agent.state_dict(), actors, iteration + 1)
            if args.debug_learner_delay > 0:
                time.sleep(args.debug_learner_delay)  # Sec. 3: a slow learner changes the wall clock, nothing else
            # 3. Log and checkpoint
            names = ("count", "returns", "lengths", "successes")
            episodes = [[rollout["episodes"][name] for name in names] for rollout in rollouts]
            summed = torch.tensor(episodes, dtype=torch.float64, device=learner.device).sum(0)
            count, returns, lengths, successes = all_reduce_sum(summed, args.world_size).tolist()  # one all-reduce
            if learner.rank != 0:
                continue
            data_version = rollouts[0]["policy_version"]  # the same in every actor thread
            params_queue_get_time = float(np.mean([rollout["params_queue_get_time"] for rollout in rollouts]))
            row = {
                "losses/policy_loss": losses["policy_loss"],
                "losses/value_loss": losses["value_loss"],
                "losses/entropy": losses["entropy"],
                "losses/approx_kl": losses["approx_kl"],
                "losses/grad_norm": losses["grad_norm"],
                "cleanba/rho_mean": losses["rho_mean"],  # how far behind the behaviour policy is
                "cleanba/rho_clipfrac": losses["rho_clipfrac"],
                "charts/learning_rate": losses["learning_rate"],
                "charts/SPS": (global_step - start_step) / (time.time() - train_start),
                "cleanba/data_policy_version": data_version,
                "cleanba/learner_policy_version": iteration,
                "cleanba/policy_lag": iteration - data_version,
                # Sec. 4.2: rollout_Q.get() longer than param_Q.get(): the actors are the bottleneck
                "cleanba/rollout_queue_get_time": rollout_queue_get_time,
                "cleanba/params_queue_get_time": params_queue_get_time,
                "time/rollout": float(np.mean([rollout["rollout_time"] for rollout in rollouts])),
                "time/update": update_time,
            }
            if count > 0:
                row["charts/episodic_return"] = returns / count
                row["charts/episodic_length"] = lengths / count
                if args.env_id == TOY_ENV_ID:
                    row["charts/success_rate"] = successes / count
            logger.scalars(row, global_step)
            if not args.quiet and time.time() >= next_progress:
                next_progress = time.time() + args.progress_interval
                print(progress_line(args, global_step, row["charts/SPS"], train_start, logger.last), flush=True)
            if args.save_model and iteration % args.checkpoint_freq == 0:
                save_checkpoint(run_dir / f"ckpt_{global_step}.pt", args, learner)
    except Stopped:  # an actor thread died: the caller ends the run with its error
        return next((actor.error for actor in actors if actor.error is not None), None)
    except KeyboardInterrupt as interrupt:
        if before is not None and before["iteration"] == learner.carry["iteration"]:  # stopped in an update: undone
            agent.load_state_dict(before["model"])
            learner.optimizer.load_state_dict(before["optimizer"])
        return interrupt
    return None


def main(args: Args) -> dict:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    args = resolve_args(args, world_size)
    use_cuda = args.cuda and torch.cuda.is_available()
    if use_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        learner_device = torch.device("cuda", local_rank)  # torchrun: learner process LOCAL_RANK on GPU LOCAL_RANK
        torch.cuda.set_device(learner_device)
        actor_devices = [torch.device("cuda", index) for index in (args.actor_device_ids or [local_rank])]
    else:
        learner_device = torch.device("cpu")
        actor_devices = [learner_device]
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    torch.use_deterministic_algorithms(args.torch_deterministic)  # on CUDA: an error for a non-deterministic op
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cudnn.benchmark = not args.torch_deterministic
    torch.manual_seed(args.seed)  # the network's initialization; envs and sampling have their own seeds
    agent = Agent(args).to(learner_device)
    learner = Learner(args, agent, learner_device, rank)
    if args.checkpoint:
        state = load_checkpoint(args.checkpoint, args.env_id)
        try:
            agent.load_state_dict(state["model"])
            learner.optimizer.load_state_dict(state["optimizer"])
        except Exception as error:  # a checkpoint of another network (the toy chain's settings)
            reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]  # one line
            raise ArgsError(f"--checkpoint {args.checkpoint}: not a checkpoint of this network ({reason})") from None
        learner.carry = {name: state[name] for name in learner.carry}
        learner.optimizer.param_groups[0]["eps"] = args.rmsprop_eps  # the command's, not the checkpoint's
        learner.optimizer.param_groups[0]["alpha"] = args.rmsprop_alpha  # (lr: set at every update)
    if world_size > 1:  # every learner starts from rank 0's parameters
        for param in agent.parameters():
            dist.broadcast(param.data, src=0)
    if args.evaluate:  # one result line, eval_<checkpoint name>.json (and .mp4) beside the checkpoint
        print(format_settings(args, learner_device), flush=True)
        path = Path(args.checkpoint)
        video = path.with_name(f"eval_{path.stem}.mp4") if args.capture_video else None
        results = evaluate(args, agent, learner_device, learner.carry["global_step"], video)
        evaluation = {
            "checkpoint": str(path),
            "global_step": learner.carry["global_step"],
            "eval_seed": args.seed,
            "num_eval_episodes": args.num_eval_episodes,
            **results,
        }
        write_json(path.with_name(f"eval_{path.stem}.json"), evaluation)
        return results
    start_iteration = learner.carry["iteration"] + 1
    start_step = learner.carry["global_step"]
    saved = [len(carried["obs"]) for carried in learner.carry["actors"] or []]  # envs per thread of the checkpoint
    threads = len(actor_devices) * args.num_actor_threads
    exact = args.env_id == TOY_ENV_ID and world_size == 1 and saved == [args.envs_per_thread] * threads
    logger = None
    run_dir = None
    interrupted = False
    start_time = time.time()
    stop = threading.Event()
    actors = []
    try:
        if rank == 0:
            run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
            run_dir = Path(args.checkpoint).parent if args.checkpoint else Path(args.output_dir) / run_name
            run_dir.mkdir(parents=True, exist_ok=bool(args.checkpoint))
            write_json(run_dir / "config.json", asdict(args))
            resumed_at = start_step if args.checkpoint else None
            logger = Logger(run_dir, args, resumed_at, learner.carry["wandb_id"])
            learner.carry["wandb_id"] = logger.wandb_id
            print(format_settings(args, learner_device), flush=True)
        if rank == 0 and args.checkpoint:
            print(f"resuming {run_dir} at global step {start_step} (iteration {start_iteration - 1})")
        if rank == 0 and args.checkpoint and not exact:
            why = "it is not of these actor threads" if world_size == 1 else "it holds one process's, not every rank's"
            why = why if args.env_id == TOY_ENV_ID else "EnvPool's cannot be saved"
            print(f"resume: the envs' state is not in the checkpoint ({why}): they start new episodes")
        for device_index, device in enumerate(actor_devices):
            for thread in range(args.num_actor_threads):
                index = device_index * args.num_actor_threads + thread
                carried = learner.carry["actors"][index] if exact else None
                actors.append(ActorThread(args, index, device, rank, start_iteration, agent, stop, carried))
        stopped = train(args, learner, actors, logger, run_dir)  # None, Ctrl-C or a failed actor's error
        if stopped is not None and not isinstance(stopped, KeyboardInterrupt):
            raise RuntimeError(f"an actor thread failed: {stopped!r}") from stopped
        if rank == 0 and args.save_model and learner.carry["iteration"] >= start_iteration:
            save_checkpoint(run_dir / "final_ckpt.pt", args, learner)
        if stopped is not None:
            raise stopped
        if rank == 0 and args.num_eval_episodes > 0:
            start = time.perf_counter()
            video = run_dir / "videos" / f"eval_{learner.carry['global_step']}.mp4" if args.capture_video else None
            results = evaluate(args, agent, learner_device, learner.carry["global_step"], video)
            logger.scalars({**results, "time/eval": time.perf_counter() - start}, learner.carry["global_step"])
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        stop.set()
        for actor in actors:
            if actor.ident is None:  # not started (Ctrl-C while the pools were made): its envs are closed here
                actor.envs.close()
            else:
                actor.join(timeout=10)
        wall_time = time.time() - start_time
        sps = (learner.carry["global_step"] - start_step) / wall_time
        summary = {
            "iteration": learner.carry["iteration"],
            "global_step": learner.carry["global_step"],
            "interrupted": interrupted,
            "world_size": world_size,
            "wall_time_s": wall_time,
            "sps": sps,
        }
        if logger is not None:
            for name, value in logger.last.items():  # the last value of every logged scalar
                summary[name] = value
            write_json(run_dir / "summary.json", summary)
            logger.close()
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    cli_args = tyro.cli(Args)
    try:
        main(cli_args)
    except ArgsError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
