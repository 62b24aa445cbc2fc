"""Cleanba IMPALA: IMPALA with V-trace on the Cleanba actor/learner architecture, in PyTorch (EnvPool Atari, toy chain).

Paper: "Cleanba: A Reproducible and Efficient Distributed Reinforcement Learning Platform",
Shengyi Huang, Jiayi Weng, Rujikorn Charakorn, Min Lin, Zhongwen Xu, Santiago Ontanon (ICLR 2024), arXiv:2310.00036.
IMPALA and V-trace: Espeholt et al., "IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner
Architectures" (ICML 2018).

Actor threads step EnvPool with its asynchronous send/recv API and sample actions from the policy they hold; the
learner corrects for the gap between that behaviour policy and its own with V-trace, the importance ratios being the
learner's over the actor's log-probabilities of the actions taken. Actor and learner meet through one rollout queue
and one params queue per actor thread, both of size 1 (Fig. 1, right); the actor skips its params get at iteration 2,
so from iteration 3 on the learner trains on data of the second-latest policy whatever the speed of either side
(Table 1, Sec. 4.2). --no-concurrency is the synchronous architecture. The batch is local_num_envs x num_steps per
learner process whatever the number of actor threads (Sec. 4.1, App. A); torchrun runs several learners whose
gradients are all-reduced (NCCL on GPUs, gloo on CPU).

Map from the paper to this file
  Fig. 1 right, Table 1    ActorThread.actor_loop (params get skipped at iteration 2), train, should_get_params,
                           expected_data_version                    (queues of size 1, second-latest policy)
  Sec. 4.1, App. A         derive_batch_sizes, resolve_args          (local_num_envs, world_size, batch sizes)
  Sec. 4.2                 cleanba/rollout_queue_get_time, cleanba/params_queue_get_time and the time/... metrics
  Sec. 5 (Machado et al.)  AtariPool                                 (sticky actions, full action space, no life loss)
  App. B, Table 3          vtrace, impala_loss_terms, Learner.update (RMSprop eps 0.01 decay 0.99, lr 6e-4 annealed,
                           20 steps, grad-norm clip 40, rho-bar = c-bar = 1, lambda = 1)
  Sec. 5 (Espeholt 2018)   AtariAgent                                (IMPALA ResNet 16/32/32, 256 hidden)
  Sec. 3 (Fig. 2)          --debug-learner-delay                     (a slow learner: same numbers, only slower)
Time alignment. Row t of a rollout is one transition: (o_t, a_t, log mu(a_t|o_t), r_t, terminated_t, truncated_t),
r_t and the flags being what the env returned for a_t. The original Cleanba script pairs the reward and done flag
that arrive *with* o_t with a_t (one step early, see ../shared/reference/cleanba.md, Sec. 3.2); here they belong to
a_t, as in rlax's and torchbeast's convention, and a test pins it down on a hand-worked episode.
Autoreset: EnvPool is a next-step autoreset env: the step after an episode end only resets the env (its action is
ignored); that row is masked out of the loss and the V-trace recursion is cut at every episode end. A termination
bootstraps 0, a truncation V(true last observation): the stale row's observation in next-step mode, info["final_obs"]
in ToyChain's same-step mode (--toy.autoreset-mode same_step).

Examples
  python cleanba_impala.py --env-id ToyChain-v0                              # a minute on a CPU
  python cleanba_impala.py --env-id Breakout-v5                              # Table 3, 50M steps (a GPU: --actor-device-ids 0 --learner-device-ids 0)
  python cleanba_impala.py --env-id Breakout-v5 --no-concurrency             # the synchronous architecture
  torchrun --nproc_per_node 2 cleanba_impala.py --env-id Breakout-v5 --local-num-envs 64   # 2 learners, same batch as 1 x 128
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
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
    """seed of the network, the environments and the action sampling"""
    torch_deterministic: bool = True
    """deterministic torch algorithms (cuDNN/cuBLAS), so that --debug-learner-delay changes nothing on a GPU either"""
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
    capture_video: bool = False
    """record a video of the first evaluation episode (Atari) into the run directory"""
    save_model: bool = False
    """write checkpoints (ckpt_{global_step}.pt every --checkpoint-freq updates, final_ckpt.pt at the end)"""
    checkpoint: Optional[str] = None
    """a checkpoint to resume training from (or to evaluate, with --evaluate)"""
    evaluate: bool = False
    """only evaluate the policy of --checkpoint, then exit"""
    progress_bar: bool = True
    """show a progress bar with SPS and the episodic return"""

    # ---- environment ------------------------------------------------------------------------------------------
    env_id: str = "Breakout-v5"
    """an EnvPool Atari task id (Breakout-v5, Pong-v5, ...) or ToyChain-v0"""
    max_episode_steps: int = 27000
    """Atari: episode time limit in agent steps, 27,000 = 108,000 frames (Sec. 5; a truncation, bootstrapped)"""
    repeat_action_probability: float = 0.25
    """Atari: sticky actions (Sec. 5, Machado et al. 2018)"""
    full_action_space: bool = True
    """Atari: all 18 actions (Sec. 5, Machado et al. 2018)"""
    episodic_life: bool = False
    """Atari: end an episode at every life loss (Sec. 5: no loss-of-life signal, so off)"""
    noop_max: int = 1
    """Atari: random no-ops at reset (Cleanba: 1, i.e. none; sticky actions give the randomness)"""
    reward_clip: bool = True
    """Atari: learn from rewards clipped to [-1, 1]; charts/episodic_return always sums the raw game score"""
    env_threads: int = 0
    """EnvPool worker threads per actor thread's pool (0: EnvPool's default, one per env up to the core count)"""
    toy: ToyChainConfig = field(default_factory=ToyChainConfig)
    """ToyChain-v0 settings"""

    # ---- Cleanba architecture (Sec. 4, App. A) ----------------------------------------------------------------
    local_num_envs: Optional[int] = None
    """envs per learner process (App. A), split evenly over its actor threads (default: 128 Atari, 32 ToyChain)"""
    num_envs: Optional[int] = None
    """all envs = local_num_envs x world_size (App. A); give this or --local-num-envs"""
    num_actor_threads: int = 2
    """actor threads per actor device, each with its own EnvPool, rollout queue and params queue (hardware, not a hyperparameter)"""
    actor_device_ids: Optional[list[int]] = None
    """CUDA devices (local indices) of this process's actor threads (default: the learner's device)"""
    learner_device_ids: Optional[list[int]] = None
    """CUDA device of each learner process on this node, indexed by LOCAL_RANK (default: device LOCAL_RANK)"""
    concurrency: bool = True
    """Cleanba's architecture (the learner trains on data of the second-latest policy); --no-concurrency: synchronous"""
    debug_learner_delay: float = 0.0
    """seconds the learner sleeps after each update (Sec. 3): a slower learner must give exactly the same run"""

    # ---- IMPALA (App. B, Table 3) -------------------------------------------------------------------------------
    total_timesteps: Optional[int] = None
    """env steps of all processes together (default: 50M Atari, Table 3; 64,000 ToyChain)"""
    learning_rate: float = 6e-4
    """RMSprop learning rate (Table 3)"""
    anneal_lr: bool = True
    """linearly decay the learning rate to 0 (Table 3)"""
    num_steps: Optional[int] = None
    """rollout (unroll) length per env and update (default: 20 Atari, Table 3; 10 ToyChain)"""
    gamma: float = 0.99
    """discount factor (Table 3)"""
    vtrace_lambda: float = 1.0
    """lambda, the V-trace mixing parameter (Table 3)"""
    clip_rho_threshold: float = 1.0
    """rho-bar, clip of the importance ratios in the V-trace targets (Table 3)"""
    clip_c_threshold: float = 1.0
    """c-bar, clip of the trace coefficients c_t = lambda min(c-bar, rho_t) (rlax's and Cleanba's 1)"""
    clip_pg_rho_threshold: float = 1.0
    """rho-bar_pg, clip of the importance ratios of the policy-gradient advantages (Table 3)"""
    num_minibatches: int = 4
    """minibatches per update, each a contiguous group of whole env sequences; one pass (Table 3)"""
    gradient_accumulation_steps: int = 1
    """split each minibatch into this many micro-batches (of envs) whose gradients add up (less memory, same update)"""
    ent_coef: float = 0.01
    """entropy coefficient (Table 3)"""
    vf_coef: float = 0.5
    """baseline coefficient: the loss has vf_coef x 0.5 x sum (v_s - V)^2 (Table 3, as Cleanba and torchbeast)"""
    max_grad_norm: float = 40.0
    """global gradient-norm clip (Table 3)"""
    rmsprop_eps: float = 0.01
    """RMSprop epsilon, added outside the square root as in PyTorch (Table 3)"""
    rmsprop_alpha: float = 0.99
    """RMSprop decay (Table 3)"""

    # ---- evaluation, checkpoints, speed ----------------------------------------------------------------------
    num_eval_episodes: int = 10
    """episodes of the final evaluation (one per eval env; 0: none) and of --evaluate"""
    eval_deterministic: bool = False
    """evaluate the greedy policy instead of sampling from it (Cleanba's evaluation samples)"""
    checkpoint_freq: int = 500
    """with --save-model, write ckpt_{global_step}.pt every this many updates"""
    torch_threads: Optional[int] = None
    """torch intra-op threads of this process (default: torch's)"""

    # ---- filled in by resolve_args ------------------------------------------------------------------------------
    world_size: tyro.conf.Suppress[int] = 1
    envs_per_thread: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    local_minibatch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    num_updates: tyro.conf.Suppress[int] = 0


TOY_ENV_ID = "ToyChain-v0"
# App. B Table 3 (Atari) and small settings for the toy chain; any flag overrides them.
PRESETS = {
    "atari": dict(local_num_envs=128, num_steps=20, total_timesteps=50_000_000),
    "toy": dict(local_num_envs=32, num_steps=10, total_timesteps=64_000),
}


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or process starts."""


# =====================================================================================================================
# Argument resolution: presets, App. A batch sizes, validation (all before any env or thread starts)
# =====================================================================================================================
def is_atari_env(env_id: str) -> bool:
    """True for an EnvPool Atari task id."""
    from envpool.registration import registry

    spec = registry.specs.get(env_id)
    return spec is not None and spec[0] == "envpool.atari"


def derive_batch_sizes(local_num_envs: int, num_steps: int, num_minibatches: int, world_size: int) -> dict:
    """App. A: the batch sizes of one learner process (local_*) and of all processes together.

    local_batch_size = local_num_envs * num_steps,  batch_size = world_size * local_batch_size,
    local_minibatch_size = local_batch_size / num_minibatches,  minibatch_size = world_size * local_minibatch_size,
    num_envs = world_size * local_num_envs. Actor threads and devices do not appear: they are hardware.
    """
    local_batch_size = local_num_envs * num_steps
    return dict(
        num_envs=local_num_envs * world_size,
        local_batch_size=local_batch_size,
        batch_size=local_batch_size * world_size,
        local_minibatch_size=local_batch_size // num_minibatches,
        minibatch_size=local_batch_size // num_minibatches * world_size,
    )


def resolve_args(args: Args, world_size: int = 1) -> Args:
    """Fills presets and the App. A sizes into a copy of `args` and validates it. Raises ArgsError."""
    a = Args(**{**asdict(args), "toy": ToyChainConfig(**asdict(args.toy))})
    is_toy = a.env_id == TOY_ENV_ID
    if not is_toy and not is_atari_env(a.env_id):
        raise ArgsError(f"--env-id {a.env_id!r} is neither an EnvPool Atari task (Breakout-v5, Pong-v5, ...) nor "
                        f"{TOY_ENV_ID}")
    preset = PRESETS["toy" if is_toy else "atari"]
    a.world_size = world_size
    if a.num_envs is not None:
        if a.num_envs % world_size:
            raise ArgsError(f"--num-envs {a.num_envs} does not split over {world_size} learner processes "
                            f"(App. A: num_envs = world_size x local_num_envs)")
        if a.local_num_envs is not None and a.local_num_envs * world_size != a.num_envs:
            raise ArgsError(f"--num-envs {a.num_envs} != --local-num-envs {a.local_num_envs} x world size "
                            f"{world_size}; give only one of them")
        a.local_num_envs = a.num_envs // world_size
    for name in ("local_num_envs", "num_steps", "total_timesteps"):
        if getattr(a, name) is None:
            setattr(a, name, preset[name])
    for name in ("local_num_envs", "num_steps", "num_minibatches", "num_actor_threads",
                 "gradient_accumulation_steps", "checkpoint_freq"):
        if getattr(a, name) < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.num_eval_episodes < 0 or a.debug_learner_delay < 0:
        raise ArgsError("--num-eval-episodes and --debug-learner-delay must be >= 0")

    use_cuda = a.cuda and torch.cuda.is_available()
    for name in ("actor_device_ids", "learner_device_ids"):
        ids = getattr(a, name)
        if ids is None:
            continue
        if not use_cuda:
            raise ArgsError(f"--{name.replace('_', '-')} names CUDA devices, but CUDA is not used here "
                            f"({'--no-cuda' if not a.cuda else 'no GPU'}); leave it out to run on the CPU")
        bad = [i for i in ids if not 0 <= i < torch.cuda.device_count()]
        if bad or not ids:
            raise ArgsError(f"--{name.replace('_', '-')} {ids}: this node has CUDA devices "
                            f"0..{torch.cuda.device_count() - 1}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if a.learner_device_ids is not None and len(a.learner_device_ids) not in (1, local_world):
        raise ArgsError(f"--learner-device-ids needs one device per learner process on this node ({local_world}), "
                        f"got {a.learner_device_ids}")
    if a.learner_device_ids is not None and len(a.learner_device_ids) == 1 and local_world > 1:
        raise ArgsError(f"{local_world} learner processes cannot share the one learner device "
                        f"{a.learner_device_ids}; give one per process")

    num_actor_devices = len(a.actor_device_ids) if a.actor_device_ids else 1
    threads = a.num_actor_threads * num_actor_devices
    if a.local_num_envs % threads:
        raise ArgsError(f"--local-num-envs {a.local_num_envs} does not split over {threads} actor threads "
                        f"(--num-actor-threads {a.num_actor_threads} x {num_actor_devices} actor device(s))")
    a.envs_per_thread = a.local_num_envs // threads
    sizes = derive_batch_sizes(a.local_num_envs, a.num_steps, a.num_minibatches, world_size)
    a.num_envs = sizes["num_envs"]
    a.local_batch_size, a.batch_size = sizes["local_batch_size"], sizes["batch_size"]
    a.local_minibatch_size, a.minibatch_size = sizes["local_minibatch_size"], sizes["minibatch_size"]
    if a.local_num_envs % a.num_minibatches:
        raise ArgsError(f"--local-num-envs {a.local_num_envs} does not split into --num-minibatches "
                        f"{a.num_minibatches} minibatches of whole env sequences (V-trace runs along each sequence)")
    if (a.local_num_envs // a.num_minibatches) % a.gradient_accumulation_steps:
        raise ArgsError(f"the {a.local_num_envs // a.num_minibatches} envs of a minibatch do not split into "
                        f"--gradient-accumulation-steps {a.gradient_accumulation_steps} equal micro-batches")
    a.num_updates = a.total_timesteps // a.batch_size
    if a.num_updates < 1 and not a.evaluate:
        raise ArgsError(f"--total-timesteps {a.total_timesteps} is less than one batch ({a.batch_size} = "
                        f"world_size {world_size} x local_num_envs {a.local_num_envs} x num_steps {a.num_steps})")
    if not 0.0 <= a.vtrace_lambda <= 1.0:
        raise ArgsError(f"--vtrace-lambda must be in [0, 1], got {a.vtrace_lambda}")
    if min(a.clip_rho_threshold, a.clip_c_threshold, a.clip_pg_rho_threshold) <= 0:
        raise ArgsError("--clip-rho-threshold, --clip-c-threshold and --clip-pg-rho-threshold must be > 0")
    if is_toy:
        try:
            a.toy.validate()
        except ValueError as e:
            raise ArgsError(str(e)) from e
        if a.capture_video:
            raise ArgsError("--capture-video: ToyChain has no renderer (it is for Atari tasks)")
    elif not 0.0 <= a.repeat_action_probability <= 1.0 or a.max_episode_steps < 1:
        raise ArgsError("--repeat-action-probability must be in [0, 1] and --max-episode-steps >= 1")
    if a.evaluate and not a.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    if a.evaluate and a.num_eval_episodes < 1:
        raise ArgsError("--evaluate needs --num-eval-episodes >= 1")
    if a.evaluate and world_size > 1:
        raise ArgsError("--evaluate runs in one process; start it with python, not torchrun")
    if a.checkpoint and not os.path.isfile(a.checkpoint):
        raise ArgsError(f"--checkpoint {a.checkpoint}: no such file")
    return a


# =====================================================================================================================
# Environments: EnvPool Atari and ToyChain behind one send/recv interface of CPU torch tensors
# =====================================================================================================================
@dataclass
class Step:
    """What one recv returns, ordered by env index. obs/reward/flags are CPU tensors; raw_reward is the unclipped game
    score (for the logged returns); final_obs is the true last observation where a same-step env reset (else None)."""

    obs: torch.Tensor
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    raw_reward: torch.Tensor
    final_obs: Optional[torch.Tensor] = None
    final_mask: Optional[torch.Tensor] = None
    success: Optional[torch.Tensor] = None
    correct: Optional[torch.Tensor] = None


class AtariPool:
    """An EnvPool Atari pool with EnvPool's asynchronous send/recv API. batch_size = num_envs, so recv returns every
    env, in the order of env ids (EnvPool writes results in send order when the batch is the whole pool), and the
    run is deterministic. EnvPool autoresets in next-step mode: the step after an episode end returns the reset
    observation (reward 0, no flags) and ignores the action sent."""

    next_step_mode = True

    def __init__(self, args: Args, num_envs: int, seeds: list[int], render: bool = False):
        import envpool

        self.pool = envpool.make(
            args.env_id, env_type="gymnasium", num_envs=num_envs, batch_size=num_envs, seed=seeds,
            num_threads=args.env_threads, max_episode_steps=args.max_episode_steps,
            repeat_action_probability=args.repeat_action_probability, full_action_space=args.full_action_space,
            episodic_life=args.episodic_life, noop_max=args.noop_max, reward_clip=args.reward_clip,
            stack_num=4, frame_skip=4, img_height=84, img_width=84, gray_scale=True,
            **({"render_mode": "rgb_array"} if render else {}),
        )
        self.num_envs = num_envs
        self.obs_shape = tuple(self.pool.observation_space.shape)  # (4, 84, 84) uint8
        self.obs_dtype = torch.uint8
        self.num_actions = int(self.pool.action_space.n)
        self._env_ids = np.arange(num_envs, dtype=np.int32)

    def async_reset(self) -> None:
        self.pool.async_reset()

    def send(self, actions: np.ndarray) -> None:
        self.pool.send(actions.astype(np.int32), self._env_ids)

    def recv(self) -> Step:
        obs, reward, terminated, truncated, info = self.pool.recv()
        order = np.argsort(info["env_id"], kind="stable")  # identity with batch_size = num_envs; kept as a guard
        return Step(obs=torch.from_numpy(obs[order]), reward=torch.from_numpy(reward[order]).float(),
                    terminated=torch.from_numpy(terminated[order]), truncated=torch.from_numpy(truncated[order]),
                    raw_reward=torch.from_numpy(info["reward"][order]).float())

    def render_first(self) -> np.ndarray:
        return self.pool.render(env_ids=np.array([0]))[0]

    def close(self) -> None:
        self.pool.close()


class ToyChainPool:
    """ToyChain-v0 (on the CPU) behind the same send/recv interface, in either autoreset mode."""

    def __init__(self, args: Args, num_envs: int, seed: int):
        self.env = ToyChainVectorEnv(num_envs, args.toy, device="cpu")
        self.next_step_mode = args.toy.autoreset_mode == "next_step"
        self.num_envs, self.seed = num_envs, seed
        self.obs_shape, self.obs_dtype = (), torch.long
        self.num_actions = args.toy.num_actions
        self._actions: Optional[np.ndarray] = None

    def async_reset(self) -> None:
        self._actions = None

    def send(self, actions: np.ndarray) -> None:
        self._actions = actions

    def recv(self) -> Step:
        if self._actions is None:  # the reset that async_reset asked for
            obs, _ = self.env.reset(seed=self.seed)
            zeros = torch.zeros(self.num_envs)
            false = torch.zeros(self.num_envs, dtype=torch.bool)
            return Step(obs=obs, reward=zeros, terminated=false, truncated=false, raw_reward=zeros,
                        success=false, correct=false)
        obs, reward, terminated, truncated, info = self.env.step(torch.as_tensor(self._actions))
        self._actions = None
        step = Step(obs=obs, reward=reward, terminated=terminated, truncated=truncated, raw_reward=reward,
                    success=info["success"], correct=info["correct"])
        if not self.next_step_mode:
            step.final_obs, step.final_mask = info["final_obs"], info["_final_obs"]
        return step

    def close(self) -> None:
        self.env.close()


def env_seeds(seed: int, rank: int, first_env: int, num_envs: int, start_update: int) -> list[int]:
    """One seed per env from its global index (rank, env index within the process), so that the same env gets the
    same seed whatever the number of actor threads it is split over; resuming at a later update draws new ones."""
    return [int(np.random.SeedSequence([seed, rank, first_env + i, start_update]).generate_state(1)[0] >> 1)
            for i in range(num_envs)]


def make_env(args: Args, num_envs: int, rank: int, first_env: int, start_update: int, render: bool = False):
    """The envs of one actor thread: envs first_env .. first_env + num_envs - 1 of this learner process."""
    if args.env_id == TOY_ENV_ID:
        return ToyChainPool(args, num_envs, env_seeds(args.seed, rank, first_env, 1, start_update)[0])
    return AtariPool(args, num_envs, env_seeds(args.seed, rank, first_env, num_envs, start_update), render)


# =====================================================================================================================
# Pure functions (importable, tested in tests/test_cleanba_ppo.py)
# =====================================================================================================================
def should_get_params(iteration: int, concurrency: bool) -> bool:
    """Fig. 1 (right), line 7: the actor gets new params before every rollout, except at iteration 2 with
    concurrency, so that it rolls out D_2 with pi_1 while the learner trains pi_1 on D_1."""
    return not (concurrency and iteration == 2)


def expected_data_version(update: int, concurrency: bool) -> int:
    """The policy version behind the data of learner update `update` (1-based; update i turns pi_i into pi_{i+1}):
    Table 1: i with the synchronous architecture; i - 1 from update 2 on with Cleanba's (update 1: pi_1)."""
    return max(update - 1, 1) if concurrency else update


def noise_seed(seed: int, rank: int, update: int, step: int, stream: int = 0) -> int:
    """Seed of the sampling noise of all envs of a learner process at one rollout step (stream 0; the same whatever
    the number of actor threads, each taking its envs' rows) or of the learner's minibatch shuffling (stream 1): a
    function of the seed and the update number alone, so independent of timing and of resuming."""
    return int(np.random.SeedSequence([seed, rank, update, step, stream]).generate_state(1)[0])


def sample_actions(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel-max: argmax(logits + Gumbel noise) is a sample of Categorical(logits) (as Cleanba's actors do)."""
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
    return torch.argmax(logits + gumbel, dim=-1)


def vtrace(values, next_values, rewards, terminations, dones, log_rhos, gamma: float, lambda_: float = 1.0,
           clip_rho_threshold: float = 1.0, clip_c_threshold: float = 1.0, clip_pg_rho_threshold: float = 1.0):
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, Sec. 4.1; rlax's vtrace) over (T, N).

    Time alignment: row t is one transition, x_t --a_t--> x'_t.
      values[t]       = V(x_t), the state in which a_t was taken
      next_values[t]  = V(x'_t), the true next state of a_t: values[t + 1] inside the rollout (in next-step autoreset
                        that is the stale row's observation, the episode's true last one), V(o_T) for the last row,
                        V(info["final_obs"]) where a same-step env reset
      rewards[t]      = r_t, the reward the env returned for a_t
      terminations[t] = a_t ended the episode in a terminal state (bootstrap 0)
      dones[t]        = a_t ended the episode (terminated or truncated): row t + 1 is not the same episode, so
                        the trace is cut there (a truncation still bootstraps next_values[t])
      log_rhos[t]     = log pi(a_t|x_t) - log mu(a_t|x_t), learner over behaviour (actor) policy
    With rho_t = exp(log_rhos[t]), rho-bar, c-bar, rho-bar_pg the clip thresholds:
      delta_t   = min(rho-bar, rho_t) (r_t + gamma (1 - terminated_t) next_values[t] - values[t])
      v_s - V   = delta_t + gamma (1 - done_t) c_t (v_{s+1} - V(x_{t+1})),   c_t = lambda min(c-bar, rho_t)
      q_t       = r_t + gamma (1 - terminated_t) (lambda v_{t+1} + (1 - lambda) V(x_{t+1}) if not done_t and t < T-1,
                                                  else next_values[t])
      pg_adv_t  = min(rho-bar_pg, rho_t) (q_t - values[t])
    Returns (vs, pg_advantages), both without gradient. With only terminations as episode ends this is exactly
    rlax.vtrace_td_error_and_advantage(v_tm1=values, v_t=next_values, r_t=rewards, discount_t=gamma (1 - term)).
    """
    with torch.no_grad():
        rhos = log_rhos.exp()
        clipped_rhos = rhos.clamp(max=clip_rho_threshold)
        cs = lambda_ * rhos.clamp(max=clip_c_threshold)
        discounts = gamma * (1.0 - terminations.to(values.dtype))
        traces = gamma * (1.0 - dones.to(values.dtype))
        deltas = clipped_rhos * (rewards + discounts * next_values - values)
        errors = torch.zeros_like(values)
        acc = torch.zeros_like(values[0])
        for t in reversed(range(values.shape[0])):
            acc = deltas[t] + traces[t] * cs[t] * acc
            errors[t] = acc
        vs = values + errors
        vs_next = torch.cat([vs[1:], next_values[-1:]], dim=0)
        values_next = torch.cat([values[1:], next_values[-1:]], dim=0)
        continues = (1.0 - dones.to(values.dtype)).bool()
        bootstrap = torch.where(continues, lambda_ * vs_next + (1.0 - lambda_) * values_next, next_values)
        q = rewards + discounts * bootstrap
        pg_advantages = rhos.clamp(max=clip_pg_rho_threshold) * (q - values)
    return vs, pg_advantages


def impala_loss_terms(logprob, entropy, values, vs, pg_advantages) -> dict:
    """Per-sample IMPALA terms (Espeholt et al. 2018, Sec. 4.2; Cleanba and torchbeast sum them over the batch):
    policy gradient -log pi(a_t) x pg_adv_t, baseline 0.5 (v_s - V(x_t))^2 and entropy H(pi(.|x_t))."""
    return {"policy_loss": -logprob * pg_advantages, "value_loss": 0.5 * (vs - values).square(), "entropy": entropy}


def logits_logprob_entropy(logits: torch.Tensor, actions: torch.Tensor):
    log_probs = torch.log_softmax(logits, dim=-1)
    logprob = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprob, entropy


# =====================================================================================================================
# Networks
# =====================================================================================================================
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ConvSequence(nn.Module):
    """IMPALA ResNet stage: conv 3x3 -> max-pool 3x3 stride 2 -> two residual blocks (84 -> 42 -> 21 -> 11)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.res0, self.res1 = ResidualBlock(out_channels), ResidualBlock(out_channels)

    def forward(self, x):
        return self.res1(self.res0(self.pool(self.conv(x))))


class AtariAgent(nn.Module):
    """The IMPALA ResNet (Espeholt et al. 2018; Sec. 5): stages of 16/32/32 channels, ReLU, a 256-unit dense layer,
    and policy (orthogonal gain 0.01) and value (gain 1) heads on the shared torso. Input: (B, 4, 84, 84) uint8."""

    def __init__(self, num_actions: int, channels=(16, 32, 32), hidden: int = 256):
        super().__init__()
        stages, in_ch = [], 4
        for ch in channels:
            stages.append(ConvSequence(in_ch, ch))
            in_ch = ch
        self.torso = nn.Sequential(*stages, nn.ReLU(), nn.Flatten(), layer_init(nn.Linear(in_ch * 11 * 11, hidden)),
                                   nn.ReLU())
        self.actor = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, obs: torch.Tensor):
        hidden = self.torso(obs.float() / 255.0)
        return self.actor(hidden), self.critic(hidden)[:, 0]

    def policy_logits(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self.torso(obs.float() / 255.0))


class ChainAgent(nn.Module):
    """An MLP for ToyChain: one-hot block index -> 2 x 64 ReLU -> policy and value heads on the shared torso."""

    def __init__(self, num_blocks: int, num_actions: int, hidden: int = 64):
        super().__init__()
        self.num_blocks = num_blocks
        self.torso = nn.Sequential(layer_init(nn.Linear(num_blocks, hidden)), nn.ReLU(),
                                   layer_init(nn.Linear(hidden, hidden)), nn.ReLU())
        self.actor = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    def forward(self, obs: torch.Tensor):
        hidden = self.torso(F.one_hot(obs.long(), self.num_blocks).float())
        return self.actor(hidden), self.critic(hidden)[:, 0]

    def policy_logits(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self.torso(F.one_hot(obs.long(), self.num_blocks).float()))


def make_agent(args: Args, num_actions: int) -> nn.Module:
    if args.env_id == TOY_ENV_ID:
        return ChainAgent(args.toy.num_blocks, num_actions)
    return AtariAgent(num_actions)


# =====================================================================================================================
# Actor threads (Fig. 1 right: `def actor()`)
# =====================================================================================================================
@dataclass
class Rollout:
    """One actor thread's rollout D, put on its rollout queue: (T, n) CPU tensors, row t = (o_t, a_t, r_t)."""

    policy_version: int  # the version of the params that collected every row (Table 1)
    iteration: int  # the actor's iteration counter (1-based)
    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor  # log mu(a_t|o_t), the behaviour policy's (the actor's) log-probability
    rewards: torch.Tensor
    terminations: torch.Tensor
    truncations: torch.Tensor
    valid: torch.Tensor  # False on next-step autoreset rows (the action was ignored)
    final_obs: torch.Tensor  # same-step: the true last observation where a truncated env reset (final_mask)
    final_mask: torch.Tensor
    next_obs: torch.Tensor  # o_T, whose value (the learner's) bootstraps the last row
    episodes: dict  # sums over the episodes that ended in this rollout
    timing: dict


class ActorThread(threading.Thread):
    """One actor thread: its own EnvPool (envs_per_thread envs), its own copy of the network on its device, and its
    own params queue and rollout queue of size 1 (Fig. 1 right)."""

    def __init__(self, args: Args, thread_index: int, device: torch.device, rank: int, start_update: int,
                 num_iterations: int, template: nn.Module, stop: threading.Event, pin_memory: bool):
        super().__init__(daemon=True, name=f"actor-{thread_index}")
        self.args, self.index, self.device, self.rank = args, thread_index, device, rank
        self.start_update, self.num_iterations, self.stop = start_update, num_iterations, stop
        self.params_queue: queue.Queue = queue.Queue(maxsize=1)
        self.rollout_queue: queue.Queue = queue.Queue(maxsize=1)
        self.error: Optional[BaseException] = None
        self.first_env = thread_index * args.envs_per_thread
        self.envs = make_env(args, args.envs_per_thread, rank, self.first_env, start_update)
        self.agent = copy.deepcopy(template).to(device)
        self.agent.eval()
        # Two rollout buffers used in turn: the actor writes D_{k+2} only after it got pi_{k+1} (concurrent) or
        # pi_{k+2} (synchronous), i.e. after the learner finished update k and with it every read of D_k.
        T, n = args.num_steps, args.envs_per_thread
        self.buffers = [self._alloc(T, n, pin_memory) for _ in range(2)]

    def _alloc(self, T: int, n: int, pin: bool) -> dict:
        def z(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        obs_shape, obs_dtype = self.envs.obs_shape, self.envs.obs_dtype
        same_step = not self.envs.next_step_mode  # only ToyChain: EnvPool is next-step
        return dict(obs=z((T, n, *obs_shape), obs_dtype), actions=z((T, n), torch.long),
                    logprobs=z((T, n), torch.float32), rewards=z((T, n), torch.float32),
                    terminations=z((T, n), torch.bool), truncations=z((T, n), torch.bool),
                    valid=z((T, n), torch.bool), final_obs=z((T, n, *obs_shape) if same_step else (0,), obs_dtype),
                    final_mask=z((T, n), torch.bool), next_obs=z((n, *obs_shape), obs_dtype))

    def run(self) -> None:
        try:
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.actor_loop()
        except BaseException as e:  # reported by the learner, which then ends the run with this error
            self.error = e
        finally:
            self.envs.close()

    def put(self, q: queue.Queue, item) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    @torch.no_grad()
    def policy(self, obs_cpu: torch.Tensor, update: int, step: int):
        """Actions and their log-probabilities under the actor's policy mu, for this thread's envs."""
        obs = obs_cpu.to(self.device, non_blocking=True)
        logits = self.agent.policy_logits(obs)
        generator = torch.Generator(device=self.device).manual_seed(noise_seed(self.args.seed, self.rank, update, step))
        uniform = torch.rand((self.args.local_num_envs, logits.shape[-1]), generator=generator, device=self.device)
        action = sample_actions(logits, uniform[self.first_env:self.first_env + logits.shape[0]])
        logprob, _ = logits_logprob_entropy(logits, action)
        return action.cpu(), logprob.cpu()

    def actor_loop(self) -> None:
        args, envs = self.args, self.envs
        T, n = args.num_steps, args.envs_per_thread
        envs.async_reset()
        step = envs.recv()
        stale = torch.zeros(n, dtype=torch.bool)  # next-step mode: this env's next step only resets it
        ep_return, ep_length, ep_success = torch.zeros(n, dtype=torch.float64), torch.zeros(n), torch.zeros(n)
        policy_version, put_time = 0, 0.0
        for iteration in range(1, self.num_iterations + 1):
            update = self.start_update + iteration - 1  # the learner update that will train on this rollout
            t0 = time.perf_counter()
            if should_get_params(iteration, args.concurrency):
                got = self.get(self.params_queue)
                if got is None:
                    return
                policy_version, params = got
                self.agent.load_state_dict(params)
            params_get_time = time.perf_counter() - t0

            buf = self.buffers[iteration % 2]
            timing = dict(env_send=0.0, env_recv=0.0, inference=0.0, storage=0.0)
            episodes = dict(count=0.0, returns=0.0, lengths=0.0, successes=0.0, correct=0.0, steps=0.0)
            rollout_start = time.perf_counter()
            for t in range(T):
                t0 = time.perf_counter()
                buf["obs"][t].copy_(step.obs)
                buf["valid"][t] = ~stale
                t1 = time.perf_counter()
                action, logprob = self.policy(buf["obs"][t], update, t)
                t2 = time.perf_counter()
                envs.send(action.numpy())  # the envs step in EnvPool's threads while this thread stores the row
                t3 = time.perf_counter()
                buf["actions"][t], buf["logprobs"][t] = action, logprob
                t4 = time.perf_counter()
                step = envs.recv()  # the result of a_t: o_{t+1}, r_t and the flags of a_t
                t5 = time.perf_counter()
                buf["rewards"][t], buf["terminations"][t], buf["truncations"][t] = (
                    step.reward, step.terminated, step.truncated)
                done = step.terminated | step.truncated
                valid = ~stale
                buf["final_mask"][t] = False
                if step.final_mask is not None:  # same-step: keep the true last observation of a truncation
                    boot = step.final_mask & step.truncated
                    buf["final_obs"][t] = step.final_obs
                    buf["final_mask"][t] = boot
                # episode statistics: raw game score over the episode's real steps
                ep_return += step.raw_reward.double() * valid
                ep_length += valid.float()
                ended = done & valid
                if step.success is not None:
                    ep_success = torch.maximum(ep_success, (step.success & valid).float())
                    episodes["correct"] += float((step.correct & valid).sum())
                episodes["steps"] += float(valid.sum())
                if bool(ended.any()):
                    episodes["count"] += float(ended.sum())
                    episodes["returns"] += float(ep_return[ended].sum())
                    episodes["lengths"] += float(ep_length[ended].sum())
                    episodes["successes"] += float(ep_success[ended].sum())
                    ep_return[ended], ep_length[ended], ep_success[ended] = 0.0, 0.0, 0.0
                stale = done if envs.next_step_mode else torch.zeros_like(done)
                t6 = time.perf_counter()
                timing["storage"] += (t1 - t0) + (t4 - t3) + (t6 - t5)
                timing["inference"] += t2 - t1
                timing["env_send"] += t3 - t2
                timing["env_recv"] += t5 - t4
            buf["next_obs"].copy_(step.obs)  # o_T: the learner bootstraps the last row with its V(o_T)
            timing.update(rollout=time.perf_counter() - rollout_start, params_queue_get=params_get_time,
                          rollout_queue_put=put_time)
            rollout = Rollout(policy_version=policy_version, iteration=iteration, episodes=episodes, timing=timing,
                              **buf)
            t0 = time.perf_counter()
            if not self.put(self.rollout_queue, rollout):
                return
            put_time = time.perf_counter() - t0  # reported with the next rollout


# =====================================================================================================================
# Learner (Fig. 1 right: `def learner()`)
# =====================================================================================================================
def all_reduce_sum(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_gradients(parameters: list[torch.nn.Parameter], world_size: int) -> None:
    """Sums the gradients of all learners in one flat all-reduce (each learner's loss is its share of the loss of the
    global minibatch, so the sum is the gradient of that loss: Cleanba's pmean over learner devices)."""
    if world_size == 1:
        return
    grads = [p.grad for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class Learner:
    """Holds the network and the optimizer on the learner device and performs one IMPALA update per batch."""

    STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "rho_mean", "rho_clipfrac", "grad_norm")

    def __init__(self, args: Args, agent: nn.Module, device: torch.device, rank: int):
        self.args, self.agent, self.device, self.rank = args, agent, device, rank
        # Table 3: RMSprop with eps 0.01 (outside the square root) and decay 0.99, no momentum, not centred.
        self.optimizer = torch.optim.RMSprop(agent.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha,
                                             eps=args.rmsprop_eps, momentum=0.0, centered=False)
        self.params = [p for p in agent.parameters()]

    def learning_rate(self, update: int) -> float:
        """Table 3: linearly decreased to 0; update u (1-based) uses lr0 * (1 - (u - 1) / num_updates)."""
        if not self.args.anneal_lr:
            return self.args.learning_rate
        return self.args.learning_rate * (1.0 - (update - 1.0) / self.args.num_updates)

    def update(self, batch: dict, update: int) -> dict:
        """num_minibatches RMSprop steps, each on a contiguous group of whole env sequences (one pass, no shuffling,
        as Cleanba). batch: (T, local_num_envs) tensors on the learner device (next_obs: (local_num_envs, ...))."""
        args = self.args
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(update)
        envs_per_minibatch = args.local_num_envs // args.num_minibatches
        sums = torch.zeros(len(self.STATS) + 1, dtype=torch.float64, device=self.device)
        self.agent.train()
        for start in range(0, args.local_num_envs, envs_per_minibatch):
            sums += self.minibatch_step(batch, slice(start, start + envs_per_minibatch))
        self.agent.eval()
        count = sums[-1].clamp(min=1)
        out = {name: (sums[i] / count).item() for i, name in enumerate(self.STATS[:-1])}
        out["grad_norm"] = (sums[-2] / args.num_minibatches).item()
        out["learning_rate"] = self.optimizer.param_groups[0]["lr"]
        return out

    def micro_losses(self, batch: dict, cols: slice):
        """The summed IMPALA loss of the env columns `cols` and its logged sums. The learner evaluates its network on
        o_0 .. o_{T-1} and o_T (and on the same-step final observations), then runs V-trace under no_grad."""
        args = self.args
        obs, next_obs = batch["obs"][:, cols], batch["next_obs"][cols]
        T, n = obs.shape[:2]
        logits, values = self.agent(torch.cat([obs, next_obs.unsqueeze(0)]).flatten(0, 1))
        logits, values = logits[:T * n].view(T, n, -1), values.view(T + 1, n)
        next_values = values[1:]
        final_mask = batch["final_mask"][:, cols]
        if batch["final_obs"].numel() and bool(final_mask.any()):  # same-step truncations: V(true last observation)
            _, final_values = self.agent(batch["final_obs"][:, cols][final_mask])
            next_values = next_values.clone()
            next_values[final_mask] = final_values
        values = values[:T]
        logprob, entropy = logits_logprob_entropy(logits, batch["actions"][:, cols])
        log_rhos = logprob.detach() - batch["logprobs"][:, cols]
        terminations = batch["terminations"][:, cols]
        dones = terminations | batch["truncations"][:, cols]
        vs, pg_adv = vtrace(values.detach(), next_values.detach(), batch["rewards"][:, cols], terminations, dones,
                            log_rhos, args.gamma, args.vtrace_lambda, args.clip_rho_threshold,
                            args.clip_c_threshold, args.clip_pg_rho_threshold)
        terms = impala_loss_terms(logprob, entropy, values, vs, pg_adv)
        w = batch["valid"][:, cols].float()  # next-step autoreset rows carry no transition
        loss = ((terms["policy_loss"] + args.vf_coef * terms["value_loss"] - args.ent_coef * terms["entropy"])
                * w).sum()
        with torch.no_grad():
            rhos = log_rhos.exp()
            logged = torch.stack([(terms["policy_loss"] * w).sum(), (terms["value_loss"] * w).sum(),
                                  (terms["entropy"] * w).sum(), (((rhos - 1) - log_rhos) * w).sum(),
                                  (rhos * w).sum(), ((rhos > args.clip_rho_threshold).float() * w).sum()]).double()
        return loss, logged, w.sum().double()

    def minibatch_step(self, batch: dict, cols: slice) -> torch.Tensor:
        """One RMSprop step on the env columns `cols` of every learner, in gradient_accumulation_steps micro-batches.
        The losses are sums over the minibatch (Cleanba, torchbeast): the all-reduce adds the learners' gradients, so
        the step is that of one learner holding the whole global minibatch (App. A: same hyperparameters, same
        update, whatever the world size). Returns the global sums of the logged terms, grad norm, count."""
        args = self.args
        self.optimizer.zero_grad(set_to_none=False)
        sums = torch.zeros(len(self.STATS) - 1, dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        width = (cols.stop - cols.start) // args.gradient_accumulation_steps
        for start in range(cols.start, cols.stop, width):
            loss, logged, n = self.micro_losses(batch, slice(start, start + width))
            loss.backward()
            sums += logged
            count += n
        all_reduce_gradients(self.params, args.world_size)
        grad_norm = nn.utils.clip_grad_norm_(self.params, args.max_grad_norm)
        self.optimizer.step()
        sums = all_reduce_sum(torch.cat([sums, count.view(1)]), args.world_size)
        return torch.cat([sums[:-1], grad_norm.detach().double().view(1).to(self.device), sums[-1:]])


def gather_batch(rollouts: list[Rollout], device: torch.device) -> dict:
    """The learner's batch: the actor threads' rollouts side by side along the env axis, in thread order (so the
    batch is the same whatever the number of threads), moved to the learner device."""
    keys = ("obs", "actions", "logprobs", "rewards", "terminations", "truncations", "valid", "final_obs",
            "final_mask")
    def to_device(name: str, dim: int) -> torch.Tensor:  # from the pinned buffers (asynchronous on a GPU), then cat
        return torch.cat([getattr(r, name).to(device, non_blocking=True) for r in rollouts], dim=dim)

    batch = {k: to_device(k, 1 if getattr(rollouts[0], k).dim() > 1 else 0) for k in keys}
    batch["next_obs"] = to_device("next_obs", 0)
    return batch


# =====================================================================================================================
# Logging, checkpoints, evaluation
# =====================================================================================================================
class Logger:
    """TensorBoard scalars (mirrored to wandb with --track) and updates.jsonl (one line per update, exact floats);
    keeps the last value of each scalar for summary.json. Only learner rank 0 logs."""

    def __init__(self, run_dir: Path, args: Args, run_name: str):
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=asdict(args), name=run_name, save_code=True)
        self.writer = SummaryWriter(str(run_dir))
        self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v}|" for k, v in asdict(args).items()))
        self.jsonl = open(run_dir / "updates.jsonl", "a")
        self.last: dict[str, float] = {}

    def scalar(self, name: str, value, step: int) -> None:
        value = float(value)
        self.writer.add_scalar(name, value, step)
        self.last[name] = value

    def record(self, row: dict) -> None:
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def save_checkpoint(path: Path, agent, optimizer, update: int, global_step: int, args: Args) -> None:
    """Model, optimizer, the update reached and the global step (all randomness derives from the seed and the update
    number). Written to a temporary file and renamed, so a crash never leaves a half-written checkpoint."""
    state = {"agent": agent.state_dict(), "optimizer": optimizer.state_dict(), "update": update,
             "global_step": global_step, "policy_version": update + 1, "args": asdict(args)}
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(path: str, agent, optimizer) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    try:
        agent.load_state_dict(state["agent"])
    except RuntimeError as e:
        raise ArgsError(f"--checkpoint {path} does not fit this network (it was trained on "
                        f"{state.get('args', {}).get('env_id')}); {e}") from e
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state


@torch.no_grad()
def evaluate(args: Args, agent: nn.Module, device: torch.device, video_path: Optional[Path] = None) -> dict:
    """num_eval_episodes episodes, one per env of a separate pool (seeds apart from training): the policy samples
    (or acts greedily with --eval-deterministic); returns eval/return (raw game score), episode_len and, on ToyChain,
    success_at_end. With video_path, the first env's episode is written as an mp4."""
    n = args.num_eval_episodes
    envs = make_env(args, n, rank=10_000, first_env=0, start_update=0, render=video_path is not None)
    frames = []
    try:
        envs.async_reset()
        step = envs.recv()
        stale = torch.zeros(n, dtype=torch.bool)
        finished = torch.zeros(n, dtype=torch.bool)
        ep_return, ep_len = torch.zeros(n, dtype=torch.float64), torch.zeros(n)
        success = torch.zeros(n)
        generator = torch.Generator(device=device).manual_seed(args.seed + 12345)
        limit = (args.max_episode_steps if args.env_id != TOY_ENV_ID else args.toy.horizon) + 2
        for _ in range(limit):
            if video_path is not None and not bool(finished[0]):
                frames.append(envs.render_first())
            logits, _ = agent(step.obs.to(device))
            if args.eval_deterministic:
                action = logits.argmax(-1)
            else:
                action = sample_actions(logits, torch.rand(logits.shape, generator=generator, device=device))
            envs.send(action.cpu().numpy())
            step = envs.recv()
            valid = ~stale & ~finished
            ep_return += step.raw_reward.double() * valid
            ep_len += valid.float()
            ended = (step.terminated | step.truncated) & valid
            if step.success is not None:
                success = torch.where(ended, step.success.float(), success)
            finished |= ended
            stale = (step.terminated | step.truncated) if envs.next_step_mode else torch.zeros_like(stale)
            if bool(finished.all()):
                break
    finally:
        envs.close()
    if video_path is not None and frames:
        import imageio

        imageio.mimsave(str(video_path), frames, fps=30)
    out = {"return": float(ep_return[finished].mean()), "episode_len": float(ep_len[finished].mean()),
           "episodes": int(finished.sum())}
    if args.env_id == TOY_ENV_ID:
        out["success_at_end"] = float(success[finished].mean())
    return out


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
# Main: the learner loop in the main thread, actor threads beside it
# =====================================================================================================================
def setup_distributed() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; a plain `python` run is rank 0 of 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world_size, int(os.environ.get("LOCAL_RANK", "0"))


def main(args: Args) -> dict:
    rank, world_size, local_rank = setup_distributed()
    args = resolve_args(args, world_size)
    if args.torch_deterministic:  # before the first cuBLAS call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    use_cuda = args.cuda and torch.cuda.is_available()
    if use_cuda:
        learner_index = args.learner_device_ids[local_rank] if args.learner_device_ids else local_rank
        learner_device = torch.device("cuda", learner_index)
        torch.cuda.set_device(learner_device)
        actor_devices = [torch.device("cuda", i) for i in (args.actor_device_ids or [learner_index])]
    else:
        learner_device = torch.device("cpu")
        actor_devices = [torch.device("cpu")]
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.torch_deterministic:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True, warn_only=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    probe = make_env(args, 1, rank, 0, 0)
    num_actions = probe.num_actions
    probe.close()
    agent = make_agent(args, num_actions).to(learner_device)
    learner = Learner(args, agent, learner_device, rank)
    start_update, global_step = 1, 0
    if args.checkpoint:
        ckpt = load_checkpoint(args.checkpoint, agent, None if args.evaluate else learner.optimizer)
        start_update, global_step = ckpt["update"] + 1, ckpt["global_step"]
    if world_size > 1:  # every learner starts from rank 0's parameters
        for p in agent.parameters():
            dist.broadcast(p.data, src=0)

    logger, run_dir = None, None
    if rank == 0:
        run_name, run_dir = make_run_dir(args)
        (run_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))
        logger = Logger(run_dir, args, run_name)
    summary: dict = {"run_dir": str(run_dir), "global_step": global_step, "update": start_update - 1,
                     "world_size": world_size, "interrupted": False}
    start_time, start_step = time.time(), global_step
    stop = threading.Event()
    actors: list[ActorThread] = []
    try:
        if args.evaluate:
            metrics = evaluate(args, agent.eval(), learner_device,
                               run_dir / "eval.mp4" if args.capture_video else None)
            for k, v in metrics.items():
                logger.scalar(f"eval/{k}", v, global_step)
            print(" ".join(f"eval/{k}={v:.4f}" for k, v in metrics.items()))
            return summary
        if start_update > 1:
            print(f"resuming from {args.checkpoint} at update {start_update}, global step {global_step}")
        num_iterations = args.num_updates - start_update + 1
        threads_per_device = args.num_actor_threads
        for d, device in enumerate(actor_devices):
            for j in range(threads_per_device):
                actors.append(ActorThread(args, d * threads_per_device + j, device, rank, start_update,
                                          num_iterations, agent, stop, pin_memory=use_cuda))
        train(args, learner, actors, actor_devices, logger, run_dir, rank, start_update, global_step, summary)
        if rank == 0 and args.num_eval_episodes > 0:
            metrics = evaluate(args, agent.eval(), learner_device,
                               run_dir / "eval.mp4" if args.capture_video else None)
            for k, v in metrics.items():
                logger.scalar(f"eval/{k}", v, summary["global_step"])
        if world_size > 1:  # the all-reduce keeps every learner's parameters identical: check it
            flat = torch.cat([p.detach().reshape(-1) for p in agent.parameters()])
            high, low = flat.clone(), flat.clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            summary["params_max_abs_diff_across_learners"] = float((high - low).abs().max())
    except KeyboardInterrupt:
        summary["interrupted"] = True
        if rank == 0:
            print("interrupted: writing summary.json" + (" and a checkpoint" if args.save_model else ""))
            if args.save_model and summary["update"] >= 1:
                save_checkpoint(run_dir / "final_ckpt.pt", agent, learner.optimizer, summary["update"],
                                summary["global_step"], args)
        raise
    finally:
        stop.set()
        for actor in actors:
            actor.join(timeout=10)
        if rank == 0:
            wall = time.time() - start_time
            summary.update(wall_time_s=wall, sps=(summary["global_step"] - start_step) / max(wall, 1e-9))
            summary.update(logger.last)
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            logger.close()
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return summary


def get_rollout(actor: ActorThread) -> Rollout:
    """Blocking get from one actor's rollout queue; an actor thread that failed ends the run with its error."""
    while True:
        try:
            return actor.rollout_queue.get(timeout=0.5)
        except queue.Empty:
            if actor.error is not None:
                raise RuntimeError(f"actor thread {actor.index} failed: {actor.error!r}") from actor.error
            if not actor.is_alive():
                raise RuntimeError(f"actor thread {actor.index} ended without producing a rollout")


def publish_params(agent: nn.Module, actors: list[ActorThread], actor_devices, version: int, device) -> None:
    """Put a snapshot of the learner's parameters (policy version `version`) on every actor's params queue (Fig. 1
    right, line 15). A fresh copy per actor device: the optimizer keeps changing the learner's own tensors."""
    snapshots = {dev: {k: v.detach().to(dev, copy=True) for k, v in agent.state_dict().items()}
                 for dev in set(actor_devices)}
    if device.type == "cuda":  # copies done (and every read of the consumed batch) before an actor sees them
        for dev in set(actor_devices) | {device}:
            torch.cuda.synchronize(dev)
    for actor in actors:
        while True:
            try:
                actor.params_queue.put((version, snapshots[actor.device]), timeout=0.5)
                break
            except queue.Full:
                if actor.error is not None or not actor.is_alive():
                    raise RuntimeError(f"actor thread {actor.index} failed: {actor.error!r}") from actor.error


def train(args: Args, learner: Learner, actors: list[ActorThread], actor_devices, logger: Optional[Logger],
          run_dir: Optional[Path], rank: int, start_update: int, global_step: int, summary: dict) -> None:
    agent, device = learner.agent, learner.device
    publish_params(agent, actors, actor_devices, start_update, device)  # Fig. 1 right, line 16: pi_1 to every actor
    for actor in actors:
        actor.start()
    progress = None
    if rank == 0 and args.progress_bar:
        from tqdm import tqdm

        progress = tqdm(total=args.num_updates, initial=start_update - 1, desc=args.env_id, dynamic_ncols=True)
    train_start, start_step = time.time(), global_step
    for update in range(start_update, args.num_updates + 1):
        learner_version = update  # the learner holds pi_update and turns it into pi_{update+1}
        t0 = time.perf_counter()
        rollouts = [get_rollout(actor) for actor in actors]  # fixed thread order: a deterministic batch
        rollout_queue_get_time = time.perf_counter() - t0
        versions = {r.policy_version for r in rollouts}
        if len(versions) != 1:
            raise RuntimeError(f"update {update}: actor threads sent data of different policy versions {versions}")
        data_version = versions.pop()

        t0 = time.perf_counter()
        batch = gather_batch(rollouts, device)
        stats = learner.update(batch, update)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        update_time = time.perf_counter() - t0
        global_step += args.batch_size
        if update < args.num_updates:  # the last params would have no reader
            publish_params(agent, actors, actor_devices, learner_version + 1, device)
        if args.debug_learner_delay > 0:
            time.sleep(args.debug_learner_delay)  # Sec. 3: a slow learner (changes the wall clock, nothing else)

        # ---- logging (all learners take part in the all-reduce; rank 0 writes) -----------------------------------
        ep = torch.tensor([[r.episodes[k] for k in ("count", "returns", "lengths", "successes", "correct", "steps")]
                           for r in rollouts], dtype=torch.float64).sum(0).to(device)
        ep = all_reduce_sum(ep, args.world_size).tolist()
        if rank != 0:
            continue
        timing = {k: float(np.mean([r.timing[k] for r in rollouts])) for k in rollouts[0].timing}
        row = {"update": update, "global_step": global_step, "data_policy_version": data_version,
               "learner_policy_version": learner_version, "actor_iteration": rollouts[0].iteration, **stats}
        if ep[0] > 0:
            row.update(episodic_return=ep[1] / ep[0], episodic_length=ep[2] / ep[0], episodes=ep[0])
            if args.env_id == TOY_ENV_ID:
                row["success_rate"] = ep[3] / ep[0]
        if args.env_id == TOY_ENV_ID:
            row["toy_accuracy"] = ep[4] / max(ep[5], 1.0)
        log_update(logger, args, row, timing, rollout_queue_get_time, update_time, train_start, start_step,
                   [a.rollout_queue.qsize() for a in actors], [a.params_queue.qsize() for a in actors])
        summary["update"], summary["global_step"] = update, global_step
        if args.save_model and update % args.checkpoint_freq == 0:
            save_checkpoint(run_dir / f"ckpt_{global_step}.pt", agent, learner.optimizer, update, global_step, args)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(sps=f"{logger.last['charts/SPS']:.0f}",
                                 ret=f"{logger.last.get('charts/episodic_return', float('nan')):.2f}")
    if progress is not None:
        progress.close()
    summary["update"], summary["global_step"] = args.num_updates, global_step
    if rank == 0 and args.save_model:
        save_checkpoint(run_dir / "final_ckpt.pt", agent, learner.optimizer, args.num_updates, global_step, args)


def log_update(logger: Logger, args: Args, row: dict, timing: dict, rollout_queue_get_time: float,
               update_time: float, train_start: float, start_step: int, rollout_qsizes, params_qsizes) -> None:
    step = row["global_step"]
    log = logger.scalar
    log("charts/SPS", (step - start_step) / (time.time() - train_start), step)
    log("charts/learning_rate", row["learning_rate"], step)
    for name in Learner.STATS:  # V-trace diagnostics: mean importance ratio pi/mu and how often rho-bar clips it
        log(f"{'cleanba' if name.startswith('rho') else 'losses'}/{name}", row[name], step)
    for name, key in (("episodic_return", "episodic_return"), ("episodic_length", "episodic_length"),
                      ("success_rate", "success_rate")):
        if key in row:
            log(f"charts/{name}", row[key], step)
    if "toy_accuracy" in row:
        log("toy/accuracy", row["toy_accuracy"], step)
    # Table 1: which policy produced the data of this update, and how far behind the learner it is.
    log("cleanba/data_policy_version", row["data_policy_version"], step)
    log("cleanba/learner_policy_version", row["learner_policy_version"], step)
    log("cleanba/policy_lag", row["learner_policy_version"] - row["data_policy_version"], step)
    # Sec. 4.2: rollout_queue_get_time > params_queue_get_time means the actors are the bottleneck, and vice versa.
    log("cleanba/rollout_queue_get_time", rollout_queue_get_time, step)
    log("cleanba/params_queue_get_time", timing["params_queue_get"], step)
    log("cleanba/rollout_queue_put_time", timing["rollout_queue_put"], step)
    log("cleanba/rollout_params_queue_get_time_diff", rollout_queue_get_time - timing["params_queue_get"], step)
    log("cleanba/rollout_queue_size", float(np.mean(rollout_qsizes)), step)
    log("cleanba/params_queue_size", float(np.mean(params_qsizes)), step)
    for name in ("rollout", "env_send", "env_recv", "inference", "storage"):
        log(f"time/{name}", timing[name], step)
    log("time/update", update_time, step)
    logger.record({**row, "time": {**timing, "rollout_queue_get": rollout_queue_get_time, "update": update_time,
                                   "elapsed": time.time() - train_start}})


if __name__ == "__main__":
    cli_args = tyro.cli(Args)
    try:
        main(cli_args)
    except ArgsError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
