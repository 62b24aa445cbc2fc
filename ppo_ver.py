"""PPO with Variable Experience Rollout (VER): env worker processes, dynamic batching, DD-PPO.

Paper: "VER: Scaling On-Policy RL Leads to the Emergence of Navigation in Embodied Rearrangement",
Erik Wijmans, Irfan Essa, Dhruv Batra (NeurIPS 2022), arXiv:2210.05064.

Batched on-policy RL waits for the slowest environment twice: at every step (action-level stragglers) and at the
end of every rollout of T steps per env (episode-level stragglers). VER removes both waits while staying on-policy:
env workers (processes) step their envs independently and write results into shared memory; the main process (the
inference worker) batches whatever observations are waiting (dynamic batching) and sends actions back; a rollout
ends as soon as T x N steps have been collected in total, however many each env contributed (fast envs contribute
more), and actions still being simulated then are carried into the next rollout. Learning is PPO on sequences of
variable length, corrected for the biased sampling by truncated importance weights. With torchrun, every process
(rank) collects and learns (DD-PPO), gradients are all-reduced, and stragglers among the ranks are preempted.

Map from the paper to this file
  Sec. 2.1, Fig. 2   env_worker, SharedSlots, EnvWorkers (processes, shared CPU memory, pipes); Collector (the main
                     process is the inference worker: dynamic batching with a minimum batch size)
  Sec. 2.2 VER       Collector.collect (T x N steps per rollout, no per-env quota); Collector.start_next_rollout
                     (inflight actions carried over); --no-variable-experience (NoVER), --sync (SyncOnRL, DD-PPO)
  Sec. 2.2, Fig. 3B  build_sequences, make_minibatches (shuffle sequences, cut into equal-size minibatches)
  Sec. 2.2, Fig. 3C  pack_layout, Agent.evaluate (LSTM over a PackedSequence, each piece from its stored state)
  GAE                compute_gae_packed (over sequences split at rollout and episode boundaries)
  Sec. 4 "Training"  importance_weights (truncated at 1.0), ppo_loss (weighted losses, learned entropy coef.),
                     ppo_update
  Sec. 2.3           allreduce_gradients (DD-PPO), optimal_preemption_time (argmax_S S/(Time(S)+LT)), ver_stop_rule,
                     fill_from_previous (a preempted rank's batch is filled with the previous rollout's experience);
                     --sync under torchrun preempts with DD-PPO's own rule instead (--sync-frac)
  Not in VER         RunningMeanStd (obs_rms): observation normalization (running mean/std, as ppo_staggered.py /
                     Table 3 of the staggered-resets paper; ManiSkill tasks only)
Autoreset (autoreset_modes.txt): none in the collector. Each env worker resets its own env in the step that ends an
episode and reports the true last observation with the reset one (ToyChain runs in same_step mode for that).
--bootstrap-at-done (CONVENTIONS.md): `truncated` bootstraps V(true last observation) at time limits and 0 at
terminations; `always` bootstraps V(true last observation) at every episode end (ManiSkill's default).

Examples
  python ppo_ver.py --toy.step-time-mean 0.004 --toy.step-time-spread 1  # VER, heterogeneous simulation time
  python ppo_ver.py --env-id PickCube-v1 --num-envs 8 --recurrent        # ManiSkill3, an LSTM policy
  torchrun --standalone --nproc_per_node 2 ppo_ver.py --num-envs 8       # DD-PPO: 2 ranks (gloo on CPU, NCCL on GPUs)
"""

from __future__ import annotations

import glob
import json
import math
import os
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field, replace
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
    save_model: bool = False
    """write checkpoints (ckpt_{global_step}.pt at every evaluation, final_ckpt.pt at the end and on Ctrl-C)"""
    checkpoint: Optional[str] = None
    """a checkpoint to resume training from (or to evaluate, with --evaluate)"""
    evaluate: bool = False
    """only evaluate the policy of --checkpoint, then exit"""

    # ---- environment ------------------------------------------------------------------------------------------
    env_id: str = "ToyChain-v0"
    """ToyChain-v0 or a ManiSkill3 task id (PickCube-v1, StackCube-v1, ...)"""
    num_envs: Optional[int] = None
    """N: environments per rank, each stepped in its own env worker process (default: 16 ToyChain, 8 otherwise)"""
    horizon: Optional[int] = None
    """max_episode_steps of a ManiSkill task (default: its registered one); ToyChain: --toy.horizon"""
    toy: ToyChainWorkerConfig = field(default_factory=ToyChainWorkerConfig)
    """ToyChain-v0 settings (the step-time and straggler options make its simulation time heterogeneous, VER Sec. 2)"""
    bootstrap_at_done: Optional[Literal["always", "truncated"]] = None
    """what an episode end bootstraps (CONVENTIONS.md): V(true last obs) always, or only at truncations (0 at
    terminations) (default: always for ManiSkill tasks, truncated otherwise)"""

    # ---- PPO ------------------------------------------------------------------------------------------------------
    total_timesteps: Optional[int] = None
    """env steps to train for, all ranks together (default: 300k ToyChain, 2M ManiSkill)"""
    learning_rate: Optional[float] = None
    """Adam learning rate (default: 2.5e-4, Sec. 4; 3e-4 ManiSkill)"""
    num_steps: Optional[int] = None
    """T: a rollout collects T x N steps per rank (T per env on average with VER) (default: 32 ToyChain, 16 ManiSkill)"""
    gamma: Optional[float] = None
    """discount factor (default: 0.99; 0.8 ManiSkill)"""
    gae_lambda: Optional[float] = None
    """GAE lambda (default: 0.95; 0.9 ManiSkill)"""
    num_minibatches: int = 4
    """minibatches per epoch, each of T x N / num_minibatches steps (Sec. 2.2)"""
    update_epochs: int = 4
    """PPO epochs over each rollout"""
    clip_coef: float = 0.2
    """PPO clipping coefficient"""
    ent_coef: Optional[float] = None
    """entropy bonus coefficient; with --learned-ent-coef its initial value (default: 0.01; 0 ManiSkill)"""
    learned_ent_coef: bool = False
    """learn the entropy coefficient alpha in [1e-4, 1] towards --target-entropy (Sec. 4: alpha([H]_sg - lambda) - [alpha]_sg H)"""
    target_entropy: float = 0.0
    """lambda: the minimum policy entropy that the learned coefficient enforces (Sec. 4 sets 0)"""
    vf_coef: float = 0.5
    """value-loss coefficient"""
    max_grad_norm: float = 0.5
    """gradient-norm clip"""
    target_kl: Optional[float] = None
    """stop an update's epochs once the approximate KL exceeds this (default: off; 0.1 ManiSkill)"""
    recurrent: bool = False
    """an LSTM policy trained on packed sequences (Sec. 2.2, Fig. 3C); default: an MLP"""

    # ---- VER (Sec. 2), and DD-PPO under torchrun (Sec. 2.3) ----------------------------------------------------------
    variable_experience: bool = True
    """variable experience rollout: T x N steps per rollout from any envs (Sec. 2.2); --no-variable-experience is NoVER: the same workers and dynamic batching, but exactly T steps from every env"""
    sync: bool = False
    """SyncOnRL (DD-PPO's collection): step all envs, wait for all of them, then act; implies NoVER"""
    inference_min_batch: Optional[int] = None
    """dynamic batching: act once this many envs are waiting, or after half a policy step's time (default: N / 1.5, as habitat-lab)"""
    sync_frac: float = 0.6
    """DD-PPO's preemption rule (--sync under torchrun): a rank stops collecting once this fraction of the ranks have finished their rollout (and it has a quarter of its own)"""

    # ---- evaluation -------------------------------------------------------------------------------------------------
    eval_freq: int = 10
    """evaluate every this many iterations (and at the end); 0 = only at the end"""
    num_eval_episodes: int = 16
    """evaluation episodes (deterministic policy, one env in the main process, one episode after another; ToyChain: no step delays)"""

    # ---- filled in by resolve_args ------------------------------------------------------------------------------
    batch_size: tyro.conf.Suppress[int] = 0
    world_size: tyro.conf.Suppress[int] = 1
    env_kind: tyro.conf.Suppress[str] = ""


# Defaults per kind of env (any flag overrides them).
PRESETS: dict[str, dict] = {
    "toy": dict(
        num_envs=16,
        num_steps=32,
        total_timesteps=300_000,
        learning_rate=2.5e-4,
        gamma=0.99,
        gae_lambda=0.95,
        ent_coef=0.01,
        bootstrap_at_done="truncated",
    ),
    # ManiSkill's PPO baseline (gamma 0.8, lambda 0.9, target KL 0.1, bootstrap at every end) for a few CPU envs: T 16
    "maniskill": dict(
        num_envs=8,
        num_steps=16,
        total_timesteps=2_000_000,
        learning_rate=3e-4,
        gamma=0.8,
        gae_lambda=0.9,
        target_kl=0.1,
        ent_coef=0.0,
        bootstrap_at_done="always",
    ),
}


class ArgsError(ValueError):
    """Bad command-line input, reported before any environment or process starts."""


class WorkerError(RuntimeError):
    """An env worker raised or died: the run ends with its message."""


# ---- Argument resolution: presets, derived sizes, checks (all before any env or process starts) -----------------------
def resolve_args(args: Args, world_size: Optional[int] = None) -> Args:
    """Fills the presets and derived sizes into a copy of `args` and validates it. Raises ArgsError."""
    resolved = replace(args, toy=replace(args.toy))
    resolved.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    kind = resolved.env_kind = "toy" if resolved.env_id == "ToyChain-v0" else "maniskill"
    for name, value in PRESETS[kind].items():
        if getattr(resolved, name) is None:
            setattr(resolved, name, value)
    if kind == "toy":
        resolved.toy.autoreset_mode = "same_step"  # the worker resets its chain and reports the true last observation
        try:
            resolved.toy.validate()
        except ValueError as error:
            raise ArgsError(str(error)) from error
    else:
        from mani_skill.utils.registration import REGISTERED_ENVS

        if resolved.env_id not in REGISTERED_ENVS:
            raise ArgsError(f"--env-id {resolved.env_id!r}: neither ToyChain-v0 nor a ManiSkill3 task")
        icd_files = glob.glob("/usr/share/vulkan/icd.d/*.json") + glob.glob("/etc/vulkan/icd.d/*.json")
        if sys.platform.startswith("linux") and not (icd_files or os.environ.get("VK_ICD_FILENAMES")):
            raise ArgsError(
                "ManiSkill3 needs a Vulkan driver, even for state-only simulation: bash .ci/install_system.sh"
            )
    if resolved.evaluate and not resolved.checkpoint:
        raise ArgsError("--evaluate needs --checkpoint PATH")
    N = resolved.num_envs
    if resolved.sync:  # step all N envs, wait for all of them, act on all
        resolved.variable_experience = False
        resolved.inference_min_batch = N
    if resolved.inference_min_batch is None:
        resolved.inference_min_batch = max(1, int(N / 1.5))  # habitat-lab's default
    resolved.batch_size = N * resolved.num_steps
    if resolved.batch_size % resolved.num_minibatches != 0:
        raise ArgsError(
            f"the batch T*N = {resolved.num_steps}*{N} = {resolved.batch_size} does not split into --num-minibatches "
            f"{resolved.num_minibatches} equal minibatches (Sec. 2.2); pick T, N or minibatches so that it divides"
        )
    return resolved


# ---- Environments: one env as a worker (or the evaluation loop) steps it ----------------------------------------------
class ManiSkillEnv:
    """One ManiSkill3 env (CPU simulation), numpy in and out, with ToyChainWorkerEnv's interface: step() resets an
    ended episode itself and returns (obs, reward, terminated, truncated, final_obs: true last obs or None, success)."""

    def __init__(self, env):
        self.env, self.observation_space, self.action_space = env, env.observation_space, env.action_space

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

    def close(self) -> None:
        self.env.close()


def make_env(args: Args, evaluation: bool = False, rank: int = 0, env_index: int = 0):
    """ToyChain-v0 or a ManiSkill3 task on CPU simulation (physx_cpu), as env `env_index` of `rank`. Evaluation:
    ToyChain without delays, stragglers or crashes; ManiSkill ignores terminations, new scene per reset (protocol)."""
    if args.env_kind == "toy":  # same_step autoreset (resolve_args)
        step_time = 0.0 if evaluation else args.toy.step_time_of(rank, args.world_size, env_index)
        config = replace(args.toy, step_time_mean=step_time, crash_at_step=0 if evaluation else args.toy.crash_at_step)
        return ToyChainWorkerEnv(config)
    import mani_skill.envs  # noqa: F401  (registers the tasks in this process)
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    sim = dict(obs_mode="state", sim_backend="physx_cpu", reconfiguration_freq=int(evaluation))
    env = gym.make(args.env_id, num_envs=1, max_episode_steps=args.horizon, **sim)
    return ManiSkillEnv(CPUGymWrapper(env, ignore_terminations=evaluation))


# ---- Env workers (Sec. 2.1, Fig. 2): processes that write into preallocated shared CPU memory -------------------------
@dataclass
class SharedSlots:
    """Preallocated shared CPU memory with one slot per env (Sec. 2.1): a worker writes the result of a step into
    its env's slot and the main process writes the next action there. A pipe message only says which env is ready."""

    obs: torch.Tensor  # (N, *obs_shape): the observation to act on
    final_obs: torch.Tensor  # (N, *obs_shape): the true last observation of an episode that ended in this step
    action: torch.Tensor  # (N, *act_shape)
    reward: torch.Tensor  # (N,) float64
    terminated: torch.Tensor  # (N,) bool
    truncated: torch.Tensor  # (N,) bool
    success: torch.Tensor  # (N,) bool
    busy_time: torch.Tensor  # (N,) float64: seconds the env's last step took in its worker (simulation time)

    @staticmethod
    def allocate(num_envs: int, env) -> "SharedSlots":
        """Slots for num_envs copies of `env`: a Box (ManiSkill) as float32, a Discrete space (ToyChain) as int64."""

        def shared(shape, dtype):
            return torch.zeros((num_envs, *shape), dtype=dtype).share_memory_()

        def slot_for(space: gym.Space) -> torch.Tensor:  # (a Discrete space's shape is ())
            return shared(space.shape, torch.int64 if isinstance(space, gym.spaces.Discrete) else torch.float32)

        return SharedSlots(
            obs=slot_for(env.observation_space),
            final_obs=slot_for(env.observation_space),
            action=slot_for(env.action_space),
            reward=shared((), torch.float64),
            terminated=shared((), torch.bool),
            truncated=shared((), torch.bool),
            success=shared((), torch.bool),
            busy_time=shared((), torch.float64),
        )


def env_worker(env_index: int, args: Args, slots: SharedSlots, conn, rank: int) -> None:
    """An env worker process (Sec. 2.1): builds and resets its env, then steps it as the main process asks, writing each
    result into the env's shared-memory slot, never waiting for others; exits when its pipe closes or after an error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle: it shuts the workers down
    torch.set_num_threads(1)
    view = {name: slot[env_index].numpy() for name, slot in vars(slots).items()}
    try:
        env = make_env(args, rank=rank, env_index=env_index)
        view["obs"][...] = env.reset(seed=args.seed + rank * args.num_envs + env_index)
        conn.send("ready")
        while conn.recv() == "step":
            start = time.perf_counter()
            obs, reward, terminated, truncated, final_obs, success = env.step(view["action"].copy())
            view["busy_time"][...] = time.perf_counter() - start
            view["obs"][...], view["reward"][...], view["success"][...] = obs, reward, success
            view["terminated"][...], view["truncated"][...] = terminated, truncated
            if final_obs is not None:
                view["final_obs"][...] = final_obs
            conn.send("ready")
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the pipe is closed: nobody to report to, just exit (no orphans)
    except BaseException:
        conn.send(f"env worker {env_index} (pid {os.getpid()}):\n{traceback.format_exc()}")
        sys.exit(1)


class EnvWorkers:
    """The env worker processes of this rank, one per env, a duplex pipe to each. They start from a forkserver (fast:
    torch and gymnasium are imported once; no CUDA or thread state is inherited). A pipe is also a liveness signal:
    if a worker dies, poll() raises WorkerError; if the main process dies, the pipes close and the workers exit."""

    def __init__(self, args: Args, slots: SharedSlots, rank: int):
        ctx = mp.get_context("forkserver")
        preload = ["torch", "gymnasium", "numpy", "toy_chain_env"]
        ctx.set_forkserver_preload(preload + (["mani_skill.envs"] if args.env_kind == "maniskill" else []))
        self.processes, self.conns = [], []
        for e in range(args.num_envs):
            parent, child = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=env_worker, args=(e, args, slots, child, rank), daemon=True, name=f"ver-env-worker-{e}"
            )
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)

    def send_step(self, env_ids) -> None:
        for e in env_ids:
            try:
                self.conns[e].send("step")
            except (BrokenPipeError, ConnectionResetError):
                self._raise_dead(e)

    def poll(self, timeout: float) -> list[int]:
        """Env ids whose step result arrived within `timeout` seconds (all that are ready, without waiting longer
        once one is; math.inf: until one is). Raises WorkerError if a worker reported an error or died."""
        arrived = []
        for conn in wait_for_connections(self.conns, timeout=None if timeout == math.inf else max(timeout, 0)):
            e = self.conns.index(conn)
            while conn.poll():  # a process that ended may have sent its traceback first; then its pipe is at EOF
                try:
                    message = conn.recv()
                except (EOFError, ConnectionResetError):
                    self._raise_dead(e)
                if message != "ready":
                    raise WorkerError(message)
                arrived.append(e)
        return arrived

    def _raise_dead(self, e: int):
        p = self.processes[e]
        p.join(timeout=1.0)
        raise WorkerError(f"env worker {e} (pid {p.pid}) died with exit code {p.exitcode} (killed, or a native crash)")

    def close(self, timeout: float = 3.0) -> None:
        """Closes the pipes (a worker exits when its pipe closes), waits up to `timeout` s, then kills what is left."""
        for conn in self.conns:
            conn.close()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=1.0)
        self.processes, self.conns = [], []


# ---- Pure functions the algorithm relies on (importable, tested in tests/test_ppo_ver.py) -----------------------------
def sequence_starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of the sequences stored one after another starts: [0, l0, l0 + l1, ...] (no entry for the end)."""
    return np.cumsum(lengths) - lengths


def build_sequences(env_ids: np.ndarray, episode_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups the steps of one rollout (in time order per env, as collected) into sequences: one env's one episode in
    time order (Sec. 2.2: a sequence starts at a rollout or episode start). Returns (order, lengths): the step indices
    sequence after sequence, and the length of each sequence."""
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
      sorted_sequences                 the sequences by decreasing length: the batch order of the packed data"""
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


def compute_gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    batch_sizes: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> torch.Tensor:
    """GAE over variable-length sequences in PackedSequence layout (inputs in packed order, see pack_layout).
    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * A_{t+1}       inside a sequence; A = delta at a sequence's last step
    Sequences end at episode ends, where next_values holds V(true last observation) or 0 (a termination with
    --bootstrap-at-done truncated), and at the rollout's end (next_values = V(next observation), the bootstrap).
    Time runs backwards over the packed steps; the sequences present at step t+1 are a prefix of those at t."""
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(rewards)
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)])
    following = torch.zeros(0, dtype=rewards.dtype, device=rewards.device)  # A_{t+1} of the sequences still running
    for t in reversed(range(len(batch_sizes))):
        n = int(batch_sizes[t])
        carried = nn.functional.pad(following, (0, n - following.numel()))  # A_{t+1}; 0 after a sequence's end
        following = deltas[offsets[t] : offsets[t] + n] + gamma * gae_lambda * carried
        advantages[offsets[t] : offsets[t] + n] = following
    return advantages


def make_minibatches(
    lengths: np.ndarray, num_minibatches: int, rng: np.random.Generator
) -> list[tuple[np.ndarray, np.ndarray]]:
    """VER's minibatches (Sec. 2.2, Fig. 3B): shuffle the sequences, concatenate their steps and cut the result into
    `num_minibatches` equal chunks; a cut inside a sequence makes each piece its own sequence (from the stored
    recurrent state of its first step). Returns, per minibatch, (its steps' indices, its pieces' lengths)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    size = total // num_minibatches
    starts = sequence_starts(lengths)
    permutation = rng.permutation(len(lengths))
    perm_lengths = lengths[permutation]
    flat = np.repeat(starts[permutation] - sequence_starts(perm_lengths), perm_lengths) + np.arange(total)
    boundaries = np.union1d(np.cumsum(perm_lengths), np.arange(0, total + 1, size))  # 0, sequence ends and cuts
    minibatches = []
    for b in range(num_minibatches):
        inside = boundaries[(boundaries >= b * size) & (boundaries <= (b + 1) * size)]
        minibatches.append((flat[b * size : (b + 1) * size], np.diff(inside)))
    return minibatches


def importance_weights(env_ids: torch.Tensor, num_envs: int, num_steps: int, clip_max: float = 1.0) -> torch.Tensor:
    """Truncated importance weights of VER's biased sampling (Sec. 4 "Training", truncated as in IMPALA): uniform
    sampling would give every env T steps; VER gives env e n_e, so its steps are weighted w_e = min(clip_max, T / n_e)
    (1.0 in the paper): over-represented fast envs are down-weighted. NoVER, sync: T steps each, all weights 1."""
    counts = torch.bincount(env_ids, minlength=num_envs).to(torch.float32)
    return (num_steps / counts[env_ids]).clamp(max=clip_max)


def optimal_preemption_time(
    step_times: np.ndarray, rank_cap: int, env_cap: Optional[int], learn_time: float, resolution: float = 1e-3
) -> tuple[float, int, float]:
    """The straggler preemption rule of Sec. 2.3: collect the S steps that maximize S / (Time(S) + LT).
    step_times[r, e] is the mean time env e of rank r took per step in the previous rollout (simulation plus
    inference); in a rollout of length t it collects floor(t / step_times[r, e]) steps, at most env_cap (T with
    NoVER; None with VER), and rank r at most rank_cap = T x N. Candidate rollout times are the times at which some
    env finishes a step (rounded up to `resolution`). Returns (t*, S(t*), t_full): the best rollout time, its steps,
    and the time at which every rank has its full batch (no preemption is needed when t* == t_full)."""
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
    """Observation normalization, a departure from VER (as ppo_staggered.py, Table 3 of the staggered-resets paper):
    running mean and variance (Chan et al.'s parallel update), normalized observations clipped to +-10. Enabled for
    Box observations (ManiSkill); the identity for a Discrete one (ToyChain's block index, which is embedded)."""

    def __init__(self, shape, device, enabled: bool):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(1e-4, device=device)
        self.enabled = enabled
        self.merged = self.totals()  # DD-PPO: the totals that all ranks share (those of the last merge)

    def update(self, x: torch.Tensor) -> None:
        if self.enabled:
            batch_mean, batch_var, batch_count = x.mean(0), x.var(0, unbiased=False), x.shape[0]
            delta, share = batch_mean - self.mean, batch_count / (self.count + batch_count)  # the batch's weight
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
            self.mean, self.count = (total / count).float(), count.max().float()
            self.var = (total_sq / count - (total / count).square()).clamp(min=0).float()
            self.merged = self.totals()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-10.0, 10.0) if self.enabled else x


# ---- Networks ---------------------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(sizes: list[int], out_std: float) -> nn.Sequential:
    """Tanh MLP with orthogonal init; the last layer has gain `out_std` and no activation."""
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes[:-2], sizes[1:-1]):
        layers += [layer_init(nn.Linear(n_in, n_out)), nn.Tanh()]
    return nn.Sequential(*layers, layer_init(nn.Linear(sizes[-2], sizes[-1]), std=out_std))


class Agent(nn.Module):
    """Actor-critic for Box or Discrete observations (ToyChain's block index, embedded first) and actions. MLP
    (default): separate actor and critic MLPs. --recurrent: an input layer and an LSTM shared by the actor and critic
    heads (the paper's is a 2-layer LSTM, Sec. 4; here 1 layer), trained over packed sequences. Sizes are not flags.
    Continuous actions: a Gaussian, learned state-independent log std. log_ent_coef: the entropy coefficient alpha."""

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
        log_alpha = torch.tensor(math.log(ent_coef) if ent_coef > 0 else -math.inf)
        if learned_ent_coef:
            self.log_ent_coef = nn.Parameter(log_alpha)
        else:
            self.register_buffer("log_ent_coef", log_alpha)
        self.lstm_shape = (lstm_layers, lstm_hidden_size) if recurrent else None

    def initial_state(self, n: int, device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The recurrent state (h, c), each (layers, n, hidden), of n episode starts; None for the MLP."""
        if not self.recurrent:
            return None
        return tuple(torch.zeros(self.lstm_shape[0], n, self.lstm_shape[1], device=device) for _ in range(2))

    def _heads(self, features):
        out = self.actor(features)
        if self.continuous:  # independent action dimensions: log_prob and entropy sum over them
            normal = torch.distributions.Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
            dist = torch.distributions.Independent(normal, 1, validate_args=False)
        else:
            dist = torch.distributions.Categorical(logits=out, validate_args=False)
        return dist, self.critic(features).squeeze(-1)

    def step(self, obs, state):
        """One step of every env (inference): returns (dist, value, next_state); `state` is zeros at episode starts."""
        x = self.embed(obs)
        if not self.recurrent:
            return (*self._heads(x), None)
        out, next_state = self.lstm(self.input_layer(x).unsqueeze(0), state)
        return (*self._heads(out[0]), next_state)

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
        dist, value = self._heads(x)
        return dist.log_prob(actions), dist.entropy(), value


# ---- Rollout storage and collection (Sec. 2.1, 2.2) -------------------------------------------------------------------
class RolloutStorage:
    """The steps of one rollout, one row per (env, step) in the order the policy acted: a linear buffer, as VER has no
    (T, N) shape (Sec. 2.2). A row is written when the policy acts and completed when the env's result arrives.
    Capacity (T + 2) x N: at most N carried-in rows, T x N completed ones and one in flight per env."""

    def __init__(self, capacity: int, slots: SharedSlots, lstm_shape: Optional[tuple], device):
        self.device, self.size = device, 0
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


# A batch is a dict of per-step tensors on the training device (obs, actions, logprobs, values, advantages, returns,
# weights, hidden, env_ids), its steps sequence after sequence, and "lengths": the sequence lengths (numpy).
def build_batch(st: RolloutStorage, num_envs: int, num_steps: int, gamma: float, gae_lambda: float) -> dict:
    """The completed steps of a rollout as sequences, with GAE advantages and importance weights."""
    rows = np.flatnonzero(st.complete[: st.size])
    order, lengths = build_sequences(st.env_ids[rows], st.episode_ids[rows])
    rows = rows[order]
    rows_t = torch.as_tensor(rows, device=st.device)
    values, next_values = st.values[rows_t], st.next_values[rows_t]
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
    """Sec. 2.3: a preempted rank fills its batch up to `size` steps with experience from the previous rollout
    (whole sequences in random order, the last one cut), on which PPO then runs extra epochs without correcting for
    its staleness. The filled steps keep their old advantages, returns and behaviour log-probabilities."""
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


class Collector:
    """Experience collection of one rank (Sec. 2.1, 2.2, Fig. 2); the main process is the inference worker.
    Each env is in one of these states:
      stepping   its worker simulates the action the policy chose (the step's row is "in flight"); at the start,
                 its worker builds and resets the env (the first observation arrives without a row)
      arrived    the result (reward, flags, next observation) is in its shared-memory slot, not yet read
      completed  the result was recorded into the step's row; the new observation waits for an action
      held       NoVER and sync only: the env has its T steps and waits for the next rollout
      acting     in the batch the policy runs on now, after which it is stepping again
    VER: a rollout ends once T x N steps are complete, whichever envs gave them. Then every env is stepping or arrived
    (its step is carried into the next rollout: "Inflight actions", Sec. 2.2), or completed (its observation gets an
    action from the next policy, and its value under this one bootstraps this rollout). NoVER: an env is held once
    it has T steps; the rollout ends when all are. Sync (SyncOnRL): NoVER acting on all envs at once. A step's
    V(s_{t+1}) is its next observation's value when the policy acts on it (or at the rollout's end); at an episode
    end, V(true last observation) from the env's own recurrent state (0: termination, --bootstrap-at-done truncated)."""

    clock = staticmethod(time.perf_counter)  # seconds (tests use a simulated clock)

    def __init__(self, args: Args, workers: EnvWorkers, slots: SharedSlots, agent: Agent, obs_rms, device):
        self.args, self.workers, self.slots, self.agent, self.device = args, workers, slots, agent, device
        self.obs_rms = obs_rms  # RunningMeanStd: updated with the observations acted on, which are stored normalized
        N = self.N = args.num_envs
        self.T = args.num_steps
        self.quota = None if args.variable_experience else self.T  # NoVER and sync: T steps from every env
        self.min_batch = args.inference_min_batch
        self.policy_step_time = 0.02  # running mean of one inference, for the adaptive wait
        self.storage = RolloutStorage((self.T + 2) * N, slots, agent.lstm_shape, device)
        self.state = agent.initial_state(N, device)  # recurrent state after each env's last action
        self.inflight = np.full(N, -1)  # stepping or arrived: the row of the env's step whose result is not read yet
        self.awaiting = np.full(N, -1)  # row of the env's last completed step that still needs V(next observation)
        self.episode_id = np.zeros(N, dtype=np.int64)
        self.episode_start = np.ones(N, dtype=bool)  # the env's current observation starts an episode
        self.arrived, self.completed, self.held = deque(), deque(), []
        self.ep_return, self.ep_len, self.ep_success = np.zeros(N), np.zeros(N, dtype=np.int64), np.zeros(N, dtype=bool)
        self.last_arrival = np.full(N, -math.inf)
        self.view = {name: slot.numpy() for name, slot in vars(slots).items()}  # numpy views of the shared slots

    def collect(self, stop_early: Optional[Callable[[int, float], bool]] = None) -> None:
        """One rollout: T x N steps, fewer if `stop_early(steps so far, seconds in)` preempts it (Sec. 2.3)."""
        self.collected = 0  # env steps completed in this rollout
        self.steps_in_rollout = np.zeros(self.N, dtype=np.int64)
        self.interval_sum, self.interval_count = np.zeros(self.N), np.zeros(self.N)
        self.env_busy, self.batch_sizes, self.episodes = 0.0, [], []  # episodes: (return, length, success_once, at_end)
        self.rollout_start = self.clock()
        self.completed.extend(self.held)  # held envs (NoVER) are ready for an action again
        self.held = []
        while True:
            self.wait_for_requests(poll_at_most=0.005 if stop_early and self.min_batch < self.N else math.inf)
            self.complete_arrived()
            if self.collected == self.T * self.N:
                break
            if stop_early is not None and stop_early(self.collected, self.clock() - self.rollout_start):
                break
            self.act()
        # V (this policy) of the observations waiting for an action bootstraps their envs' last steps (an env with an
        # action in flight has it already: the value of that step's observation)
        envs = np.flatnonzero(self.awaiting >= 0)
        if len(envs) > 0:
            self.bootstrap(self.awaiting[envs], envs, self.slots.obs)
        self.awaiting[envs] = -1

    def wait_for_requests(self, poll_at_most: float = math.inf) -> None:
        """Dynamic batching (Sec. 2.1, footnote 2): returns once min_batch envs have arrived or completed, or every
        stepping env has, or the first of them has waited half a policy step (not in sync), or after poll_at_most."""
        start = self.clock()
        max_wait = math.inf if self.min_batch >= self.N else 0.5 * self.policy_step_time
        while True:
            ready = len(self.completed) + len(self.arrived)
            if ready >= self.min_batch or (ready > 0 and ready + len(self.held) == self.N):  # none is stepping
                return
            timeout = min(poll_at_most, max_wait if ready > 0 else math.inf) - (self.clock() - start)
            if timeout <= 0:
                return
            arrived = self.workers.poll(timeout)
            now = self.clock()
            for e in arrived:  # stepping -> arrived; the times between arrivals estimate Time(S) (Sec. 2.3)
                self.arrived.append(e)
                if self.last_arrival[e] >= self.rollout_start:
                    self.interval_sum[e] += now - self.last_arrival[e]
                    self.interval_count[e] += 1
                self.last_arrival[e] = now

    def complete_arrived(self) -> None:
        """Arrived -> completed (or held): results into their rows while the rollout needs steps; others carry over."""
        final_rows, final_envs = [], []
        while self.arrived and self.collected < self.T * self.N:
            e = self.arrived.popleft()
            row = self.inflight[e]
            self.inflight[e] = -1
            if row >= 0 and self.record_result(e, row):
                final_rows.append(row)
                final_envs.append(e)
            if self.quota is not None and self.steps_in_rollout[e] >= self.quota:
                self.held.append(e)
            else:
                self.completed.append(e)
        if final_rows:  # V(true last observation), from the state the env's own last step left (not zeros)
            self.bootstrap(np.array(final_rows), np.array(final_envs), self.slots.final_obs)

    def record_result(self, e: int, row: int) -> bool:
        """Env e's result completes the step at `row`; returns True if it needs V(true last observation)."""
        st, view = self.storage, self.view
        reward = float(view["reward"][e])
        terminated, truncated = bool(view["terminated"][e]), bool(view["truncated"][e])
        success = bool(view["success"][e])
        st.rewards[row], st.complete[row] = reward, True
        self.collected += 1
        self.steps_in_rollout[e] += 1
        self.env_busy += float(view["busy_time"][e])
        self.ep_return[e] += reward
        self.ep_len[e] += 1
        self.ep_success[e] |= success
        if not (terminated or truncated):
            self.awaiting[e] = row  # V(next observation): when the policy acts on it, or at the rollout's end
            return False
        self.episodes.append((self.ep_return[e], self.ep_len[e], self.ep_success[e], success))
        self.ep_return[e], self.ep_len[e], self.ep_success[e] = 0.0, 0, False
        self.episode_id[e] += 1
        self.episode_start[e] = True
        if terminated and self.args.bootstrap_at_done == "truncated":
            st.next_values[row] = 0.0
            return False
        return True

    def act(self) -> None:
        """Runs the policy on every completed env (acting), stores the steps, sends the actions (stepping)."""
        envs = np.array(self.completed, dtype=np.int64)
        self.completed.clear()
        if len(envs) == 0:
            return
        start = self.clock()
        idx = torch.as_tensor(envs)
        with torch.no_grad():
            raw_obs = self.slots.obs[idx].to(self.device)
            self.obs_rms.update(raw_obs)
            obs = self.obs_rms.normalize(raw_obs)  # what the policy sees and the storage keeps
            state = self.state_of(envs, reset=self.episode_start[envs])
            dist, value, next_state = self.agent.step(obs, state)
            action = dist.sample()
            logprob = dist.log_prob(action)
        st = self.storage
        rows = np.arange(st.size, st.size + len(envs))
        st.size += len(envs)
        rows_t = torch.as_tensor(rows, device=self.device)
        st.obs[rows_t], st.actions[rows_t], st.logprobs[rows_t], st.values[rows_t] = obs, action, logprob, value
        if state is not None:  # the state the policy acted from, before this step
            st.hidden[rows_t] = torch.stack(state).permute(2, 0, 1, 3)
            dev_idx = idx.to(self.device)
            self.state[0][:, dev_idx], self.state[1][:, dev_idx] = next_state
        st.env_ids[rows], st.episode_ids[rows] = envs, self.episode_id[envs]
        waiting = self.awaiting[envs] >= 0  # V of this observation bootstraps the env's previous step
        awaiting_rows = torch.as_tensor(self.awaiting[envs][waiting], device=self.device)
        st.next_values[awaiting_rows] = value[torch.as_tensor(waiting, device=self.device)]
        self.awaiting[envs] = -1
        self.inflight[envs] = rows
        self.episode_start[envs] = False
        self.slots.action[idx] = action.to("cpu")
        self.workers.send_step(envs)
        self.policy_step_time = 0.9 * self.policy_step_time + 0.1 * (self.clock() - start)
        self.batch_sizes.append(len(envs))

    def bootstrap(self, rows: np.ndarray, envs: np.ndarray, observations: torch.Tensor) -> None:
        """V(s_{t+1}) of the steps at `rows`: V of `envs`' normalized `observations`, from their last step's state."""
        with torch.no_grad():
            obs = self.obs_rms.normalize(observations[torch.as_tensor(envs)].to(self.device))
            values = self.agent.step(obs, self.state_of(envs))[1]
        self.storage.next_values[torch.as_tensor(rows, device=self.device)] = values

    def start_next_rollout(self) -> int:
        """After the update: the steps in flight go on into the next rollout ("Inflight actions"); returns how many."""
        envs = np.flatnonzero(self.inflight >= 0)
        self.storage.keep(self.inflight[envs])
        self.inflight[envs] = np.arange(len(envs))
        return len(envs)

    def state_of(self, envs: np.ndarray, reset: Optional[np.ndarray] = None):
        """The recurrent state of `envs` after their last step (zeros where `reset`), or None for the MLP."""
        if self.state is None:
            return None
        idx = torch.as_tensor(envs, device=self.device)
        h, c = self.state[0][:, idx], self.state[1][:, idx]
        if reset is not None:
            keep = torch.as_tensor(~reset, device=self.device, dtype=h.dtype).view(1, -1, 1)
            h, c = h * keep, c * keep
        return h, c

    def mean_step_times(self) -> np.ndarray:
        """Sec. 2.3's Time(S): each env's mean time per step in the last rollout (the whole rollout if < 2 steps)."""
        duration = max(self.clock() - self.rollout_start, 1e-3)
        return np.where(self.interval_count > 0, self.interval_sum / np.maximum(self.interval_count, 1), duration)


# ---- DD-PPO (Sec. 2.3): every rank collects and learns; gradients are all-reduced; stragglers are preempted -----------
def all_reduce_named(values: dict, device) -> dict:
    """Named numbers summed over the ranks (NCCL on GPUs, gloo on CPU) as one vector, named back at once."""
    vector = torch.tensor([float(value) for value in values.values()], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(vector)
    return dict(zip(values, vector.tolist()))


def allreduce_gradients(parameters) -> None:
    """DD-PPO: average the gradients of all ranks."""
    for p in parameters:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def ver_stop_rule(gathered: np.ndarray, rank_cap: int, env_cap: Optional[int]) -> tuple[Callable, float]:
    """Sec. 2.3: the rollout time t* maximizing S / (Time(S) + LT) over all ranks' envs, from each env's mean step
    time in the previous rollout and the mean learning time LT (gathered[r] = (rank r's step times..., its LT)); every
    rank stops t* seconds into its rollout unless all fill their batch by then. Returns (the rule for collect, t*)."""
    t_star, _, t_full = optimal_preemption_time(gathered[:, :-1], rank_cap, env_cap, float(gathered[:, -1].mean()))
    stop_after = t_star if t_star < t_full else math.inf
    return (lambda steps, elapsed: elapsed >= stop_after), t_star


def ddppo_stop_rule(store: dist.Store, args: Args, iteration: int) -> Callable:
    """DD-PPO's preemption (Wijmans et al. 2020, the --sync baseline): a rank stops collecting once a fraction
    --sync-frac of the ranks have finished their rollout, if it has at least a quarter of its own."""
    key = f"done_{iteration}"
    return lambda steps, elapsed: steps >= args.batch_size / 4 and store.add(key, 0) >= args.sync_frac * args.world_size


# ---- PPO update (Sec. 2.2, 4) -----------------------------------------------------------------------------------------
def ppo_loss(agent: Agent, minibatch: dict, args: Args) -> tuple[torch.Tensor, dict]:
    """The loss of one VER minibatch, every term weighted by the truncated importance weights w (Sec. 4):
    mean(w * clipped surrogate) + vf_coef * mean(w * value loss) - [alpha]_sg * mean(w * entropy), plus, with
    --learned-ent-coef, alpha * ([unweighted mean entropy]_sg - target). Returns (loss, detached statistics)."""
    newlogprob, entropy, newvalue = agent.evaluate(
        minibatch["obs"], minibatch["actions"], minibatch["state0"], minibatch["piece_lengths"]
    )
    logratio = newlogprob - minibatch["logprobs"]
    ratio = logratio.exp()
    advantages = minibatch["advantages"]
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    weights = minibatch["weights"]
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef))
    value_error = (newvalue - minibatch["returns"]).square()  # not clipped (CleanRL and habitat-lab clip it)
    pg_loss, v_loss = (weights * pg).mean(), 0.5 * (weights * value_error).mean()
    alpha = agent.log_ent_coef.exp()
    loss = pg_loss + args.vf_coef * v_loss - alpha.detach() * (weights * entropy).mean()
    if args.learned_ent_coef:
        loss = loss + alpha * (entropy.mean().detach() - args.target_entropy)
    stats = {
        "policy_loss": pg_loss,
        "value_loss": v_loss,
        "entropy": entropy.mean(),
        "old_approx_kl": (-logratio).mean(),
        "approx_kl": ((ratio - 1) - logratio).mean(),
        "clipfrac": ((ratio - 1.0).abs() > args.clip_coef).float().mean(),
    }
    return loss, {name: value.detach() for name, value in stats.items()}


def ppo_update(
    args: Args, agent: Agent, optimizer: torch.optim.Optimizer, batch: dict, rng: np.random.Generator
) -> dict:
    """PPO epochs over VER minibatches (Sec. 2.2) with ppo_loss; gradients are averaged over the ranks (DD-PPO) and
    alpha is kept in [1e-4, 1] as habitat-lab does. Returns the mean of each statistic over the minibatches."""
    device = batch["obs"].device
    policy_params = [p for name, p in agent.named_parameters() if name != "log_ent_coef"]
    totals, updates = {}, 0
    for epoch in range(args.update_epochs):
        for mb_idx, piece_lengths in make_minibatches(batch["lengths"], args.num_minibatches, rng):
            idx = torch.as_tensor(mb_idx, device=device)
            minibatch = {key: batch[key][idx] for key in ("obs", "actions", "logprobs", "advantages", "returns")}
            minibatch.update(weights=batch["weights"][idx], piece_lengths=piece_lengths, state0=None)
            if agent.recurrent:  # each piece starts from the stored state of its first step
                first = torch.as_tensor(mb_idx[sequence_starts(piece_lengths)], device=device)
                minibatch["state0"] = batch["hidden"][first].permute(1, 2, 0, 3)  # (h, c): (layers, pieces, hidden)
            loss, stats = ppo_loss(agent, minibatch, args)
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
            if all_reduce_named(stats, device)["approx_kl"] / args.world_size > args.target_kl:
                break
    means = dict(zip(totals, (torch.stack(list(totals.values())) / max(updates, 1)).tolist()))  # one device sync
    means["ent_coef"] = float(agent.log_ent_coef.detach().exp())
    means["explained_variance"] = float(1 - (batch["returns"] - batch["values"]).var() / batch["returns"].var())
    return means


# ---- Checkpoints, evaluation ------------------------------------------------------------------------------------------
def save_checkpoint(path: Path, agent, optimizer, obs_rms: RunningMeanStd, global_step: int, iteration: int) -> None:
    """What resuming needs, in CONVENTIONS.md's layout (iteration: the updates made), written to a temporary file and
    renamed, so that a save interrupted by Ctrl-C never leaves a half-written checkpoint."""
    state = {
        "model": agent.state_dict(),
        "optimizer": optimizer.state_dict(),
        "global_step": global_step,
        "iteration": iteration,
        "obs_rms": {"mean": obs_rms.mean, "var": obs_rms.var, "count": obs_rms.count},
    }
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@torch.no_grad()
def evaluate(agent: Agent, env, obs_rms: RunningMeanStd, num_episodes: int, seed: int, device) -> dict:
    """Deterministic policy on observations normalized by obs_rms (no update), `num_episodes` episodes one after another
    on one env, in the main process. Returns the means of eval/return, episode_len, success_once and success_at_end."""
    totals = np.zeros(4)
    obs = env.reset(seed=seed)  # (then an ended episode resets the env itself: step() returns the next one's start)
    for episode in range(num_episodes):
        state = agent.initial_state(1, device)
        episode_return, length, success_once, done = 0.0, 0, False, False
        while not done:
            dist, _, state = agent.step(obs_rms.normalize(torch.as_tensor(obs, device=device).unsqueeze(0)), state)
            action = (dist.mean if agent.continuous else dist.probs.argmax(-1))[0].cpu().numpy()
            obs, reward, terminated, truncated, _, success = env.step(action)
            episode_return += reward
            length += 1
            success_once |= success
            done = terminated or truncated
        totals += (episode_return, length, success_once, success)
    names = ("eval/return", "eval/episode_len", "eval/success_once", "eval/success_at_end")
    return dict(zip(names, totals / num_episodes))


# ---- Training loop ----------------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    args = resolve_args(args)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM (e.g. from torchrun) is handled as Ctrl-C
    rank, distributed = int(os.environ.get("RANK", "0")), args.world_size > 1
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    synchronize = torch.cuda.synchronize if use_cuda else (lambda: None)  # queued GPU work, before a timer is read
    if distributed:  # torchrun: NCCL on GPUs, gloo on CPU, one GPU per local rank; a store counts the ranks done
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        store = dist.PrefixStore(
            "ppo_ver",
            dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), args.world_size, is_master=False),
        )
    if device.type == "cpu":
        torch.set_num_threads(1)  # leave the cores to the env workers
    torch.manual_seed(args.seed)  # DD-PPO: the same initial weights on every rank (or the same checkpoint)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # The run directory (rank 0 logs, evaluates and saves).
    writer, last, run_dir = None, {}, None
    if rank == 0:
        run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
        run_dir = Path(args.output_dir) / run_name
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))
        if args.track:
            import wandb

            wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=asdict(args),
                name=run_name,
                save_code=True,
            )
        writer = SummaryWriter(str(run_dir))

    def log(metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            last[name] = float(value)
            writer.add_scalar(name, float(value), step)

    summary: dict = {"run_dir": str(run_dir), "interrupted": False}
    env_busy_time, global_step, iteration = 0.0, 0, 0  # iteration = updates made
    start_time, start_step, workers, eval_env = time.time(), 0, None, None  # the finally below needs them
    try:  # from here on (env construction included), Ctrl-C or an error still writes summary.json
        # The evaluation env (rank 0's) tells the spaces: the shared slots, the network; then the checkpoint.
        eval_env = make_env(args, evaluation=True)
        slots = SharedSlots.allocate(args.num_envs, eval_env)
        agent = Agent(
            eval_env.observation_space, eval_env.action_space, args.recurrent, args.ent_coef, args.learned_ent_coef
        ).to(device)
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
        obs_rms = RunningMeanStd(slots.obs.shape[1:], device, enabled=slots.obs.is_floating_point())  # Box (float) only
        if args.checkpoint:
            ckpt = torch.load(args.checkpoint, map_location=device, weights_only=True)
            agent.load_state_dict(ckpt["model"])
            obs_rms.mean, obs_rms.var, obs_rms.count = (ckpt["obs_rms"][key] for key in ("mean", "var", "count"))
            obs_rms.merged = obs_rms.totals()  # (every rank loads the same)
            global_step, iteration = ckpt["global_step"], ckpt["iteration"]
            start_step = global_step  # SPS counts the steps of this run
            if not args.evaluate:
                optimizer.load_state_dict(ckpt["optimizer"])
                print(f"resuming from {args.checkpoint} at iteration {iteration}, global step {global_step}")
        torch.manual_seed(args.seed + 1000 * rank + iteration)  # per-rank action sampling
        rng = np.random.default_rng(args.seed + 7919 * rank + iteration)
        if args.evaluate:
            metrics = evaluate(agent, eval_env, obs_rms, args.num_eval_episodes, args.seed + 10_000 + iteration, device)
            log(metrics, global_step)
            print(" ".join(f"{k}={v:.4f}" for k, v in last.items()))
            return summary
        workers = EnvWorkers(args, slots, rank)
        collector = Collector(args, workers, slots, agent, obs_rms, device)
        if args.env_kind == "toy":
            targets = draw_target_actions(args.toy).to(device)
        previous, update_time = None, 0.0
        train_start = time.time()
        while global_step < args.total_timesteps:
            iteration += 1

            # 1. Collect T x N steps (Sec. 2.1, 2.2); under torchrun, preempt stragglers among the ranks (Sec. 2.3).
            stop_early, t_star = None, math.nan
            if distributed and previous is not None:
                if args.sync:
                    stop_early = ddppo_stop_rule(store, args, iteration)
                else:
                    gathered = [None] * args.world_size  # every rank computes the same t* from the same numbers
                    dist.all_gather_object(gathered, [*collector.mean_step_times(), update_time])  # (rank r's row)
                    stop_early, t_star = ver_stop_rule(np.array(gathered), args.batch_size, collector.quota)
            rollout_start = time.perf_counter()
            collector.collect(stop_early)
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
            episodes = np.array(collector.episodes, dtype=np.float64).reshape(-1, 4)
            counts = {
                "env_steps": collector.collected,
                "env_busy_time": collector.env_busy,
                "episodes": len(episodes),
                "return": episodes[:, 0].sum(),
                "length": episodes[:, 1].sum(),
                "success": episodes[:, 2].sum(),
                "preempted_ranks": float(fresh < args.batch_size),
            }
            counts = all_reduce_named(counts, device)
            global_step += int(counts["env_steps"])
            env_busy_time += counts["env_busy_time"]
            summary["iteration"], summary["global_step"] = iteration, global_step
            if rank > 0:
                continue
            metrics = {
                "charts/SPS": (global_step - start_step) / (time.time() - train_start),
                "charts/learning_rate": args.learning_rate,  # constant: CleanRL anneals it, VER a cosine (Sec. 4)
                **{f"losses/{name}": value for name, value in losses.items()},
                "ver/steps_per_env_min": collector.steps_in_rollout.min(),
                "ver/steps_per_env_max": collector.steps_in_rollout.max(),
                "ver/importance_weight_min": batch["weights"].min(),
                "ver/inference_batch_size_mean": np.mean(collector.batch_sizes or [0]),
                "ver/inflight_carried": carried,
                "ver/env_utilization": collector.env_busy / (args.num_envs * rollout_time),
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
            log(metrics, global_step)
            if args.eval_freq and iteration % args.eval_freq == 0 and global_step < args.total_timesteps:
                eval_start = time.perf_counter()
                metrics = evaluate(
                    agent, eval_env, obs_rms, args.num_eval_episodes, args.seed + 10_000 + iteration, device
                )
                log({**metrics, "time/eval": time.perf_counter() - eval_start}, global_step)
                if args.save_model:
                    save_checkpoint(
                        run_dir / f"ckpt_{global_step}.pt", agent, optimizer, obs_rms, global_step, iteration
                    )
        if distributed:  # DD-PPO keeps the ranks' weights (and obs_rms) identical: check it (summary.json)
            weights = torch.cat([tensor.detach().reshape(-1) for tensor in [*agent.parameters(), obs_rms.totals()]])
            rank0_weights = weights.clone()
            dist.broadcast(rank0_weights, src=0)
            difference = (weights - rank0_weights).abs().max()
            dist.all_reduce(difference, op=dist.ReduceOp.MAX)
            summary["ddp/max_weight_difference"] = float(difference)
        if rank == 0:
            metrics = evaluate(agent, eval_env, obs_rms, args.num_eval_episodes, args.seed + 10_000 + iteration, device)
            log(metrics, global_step)
            if args.save_model:
                save_checkpoint(run_dir / "final_ckpt.pt", agent, optimizer, obs_rms, global_step, iteration)
    except WorkerError as error:
        summary["error"] = str(error)
        raise
    except KeyboardInterrupt:
        summary["interrupted"] = True
        if rank == 0 and args.save_model and "iteration" in summary:
            print("interrupted: writing summary.json and a checkpoint", file=sys.stderr)
            save_checkpoint(run_dir / "final_ckpt.pt", agent, optimizer, obs_rms, global_step, summary["iteration"])
        raise
    finally:
        if workers is not None:
            workers.close()
        if eval_env is not None:
            eval_env.close()
        if rank == 0:
            wall = time.time() - start_time
            summary.update(global_step=global_step, wall_time_s=wall, sps=(global_step - start_step) / wall)
            summary["env_busy_time_s"] = env_busy_time
            summary.update(last)
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
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
