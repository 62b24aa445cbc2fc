"""ppo_staggered.py on MuJoCo locomotion (Gymnasium's HalfCheetah-v5 and Hopper-v5, CPU), H = 1000 and K = 8 (H/K = 125):
the staggered-resets paper's two claims about real simulators, measured at N = 64 to 1,024 envs.

Claims (Bharthulwar, Tao, Su 2025, arXiv:2511.21011):
  Sec. 3, 5.2   with many envs and K << H, synchronous resets make every batch one narrow slice of the episode;
                staggering fixes it (stagger/stage_coverage says how much of the horizon a batch covers);
  Sec. 5.4      the gain grows with N: naive PPO saturates while staggered PPO keeps improving (Fig. 5).

Arms (every run: ppo_staggered.py's MuJoCo preset, K = 8, H = 1000, gamma 0.99, lambda 0.95, observation
normalization and reward scaling; the same --total-timesteps for every arm; nothing tuned per arm):
  scaling     HalfCheetah-v5 (no early terminations: naive envs stay in lockstep), staggered vs naive, N = 64, 256, 1024
  schemes     N = 256: random-start (legged_gym's init_at_random_ep_len) beside the two, on HalfCheetah-v5 and Hopper-v5
              (a fallen Hopper terminates: early terminations desynchronize naive envs by themselves)
  regime      HalfCheetah-v5, N = 256, staggered vs naive with K = 64 (Table 3's MS-HumanoidWalk rollout: 16 groups)
  ablation    HalfCheetah-v5, N = 256, staggered: the advance's actions and the normalizer's data changed one at a time
              (ABLATION: the gates cannot matter on a task that never terminates)
  reference   CleanRL's own ppo_continuous_action.py (vwxyzjn/cleanrl at fe8d8a03; N = 1, K = 2048, its defaults) on
              HalfCheetah-v5, 1M steps: what users would run instead. A git-ignored copy at
              .cleanrl/ppo_continuous_action.py (`git show fe8d8a03:cleanrl/ppo_continuous_action.py` in a clone of
              vwxyzjn/cleanrl; never commit it), run unmodified through CLEANRL_LAUNCHER (Gymnasium 0.29 behaviour
              under the installed Gymnasium 1.x). It does not evaluate (its eval needs --save-model and cleanrl_utils):
              its row gives the return of its training episodes (stochastic policy), beside ours of the same kind.

Evaluation (ppo_staggered.py's evaluate): 8 envs, deterministic policy, one episode each to its 1000 steps or a fall,
every --eval-every env steps (the same env steps at every N). Final return: the mean eval/return of the last 10% of a
run's evaluations. Threshold, fixed before any run: eval/return 2,000 on both tasks. A MuJoCo return over 1000 steps
is about 1000 x the mean forward speed (m/s) plus, on Hopper, 1 a step for staying up. HalfCheetah 2,000: running at
2 m/s on average, far beyond a random policy (about -300) and a cheetah that shuffles or flips, yet reachable by PPO
in 2M steps, so that env steps to it separate the arms (gymnasium's reward_threshold, 4,800, is a "solved" level
beyond this budget). Hopper 2,000: standing still for 1000 steps earns 1,000, so 2,000 needs hopping forward (1 m/s).
Updates to the threshold: PPO iterations (one N x K batch each) before the evaluation that reached it. The staggered
advance ((N_B - 1) x S x N env steps before training, none trained on: 60k at N = 64, 254k at 256, 1.0M at 1024) is not
in the training budget (ppo_staggered.py's global_step), but the simulator takes those steps: the table counts them in
"env steps to threshold, advance included" and "env steps simulated". Training return: charts/episodic_return at one
step common to the arms it compares (a naive HalfCheetah episode ends only at multiples of H x N env steps, so a naive
run's last training return can be from mid-run).

Posture: a HalfCheetah can learn to run on its back (a local optimum near 2,000), and a staggered advance with random
actions flips some cheetahs before training (benchmarks/stagger_advance.py). Each HalfCheetah run's final policy
(--save-model's final_ckpt.pt) is run deterministically for 1000 steps in 8 envs: "time on back" is the fraction of
steps with |rooty| > pi/2.

Writes benchmarks/results/mujoco_scaling.md, .json (every run's per-evaluation rows, its training-return curve and its
diagnostics' means) and .png (return against env steps per N; final return against N per scheme, Fig. 5's shape).
The json is rewritten after every run; --resume keeps the runs it holds (same command) and runs the rest. Runs go
--jobs at a time (subprocesses, one torch thread each), seed by seed: a stopped benchmark has every arm on its first
seeds. --quick runs every arm once (seed 1, N = 8/16/32, 4,096 steps, H = 100, evaluations every ~1k steps) into *_quick.* files: a check of the
benchmark itself, not a result.

  python benchmarks/mujoco_scaling.py              # 39 runs, 2M steps each (CleanRL 1M): 9-22 min a run, two at
                                                   # a time: about 4.5 hours on 2 cores (--resume goes on after a stop)
  python benchmarks/mujoco_scaling.py --quick      # every code path, a few minutes
  python benchmarks/mujoco_scaling.py --resume     # after a stop: keeps the runs the json has, runs the rest
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "ppo_staggered.py"
SCALING_TASK = "HalfCheetah-v5"
THRESHOLDS = {"HalfCheetah-v5": 2000.0, "Hopper-v5": 2000.0}  # eval/return; fixed before running (docstring)
SCHEMES = ("staggered", "naive", "random-start")
DIAGNOSTICS = ("stagger/stage_coverage", "stagger/value_mse", "stagger/policy_kl", "stagger/valid_fraction")
K = 8  # the MuJoCo preset's rollout length
CLEANRL_BATCH = 2048  # ppo_continuous_action.py's defaults: --num-envs 1 --num-steps 2048


@dataclass
class Options:
    seeds: int = 3
    """seeds 1..seeds of every arm"""
    total_timesteps: int = 2_000_000
    """env steps of every ppo_staggered.py run (the staggered advance not counted)"""
    num_envs: tuple[int, ...] = (64, 256, 1024)
    """N of the scaling arm (HalfCheetah-v5, staggered vs naive)"""
    schemes_num_envs: int = 256
    """N of the schemes arm (three schemes, HalfCheetah-v5 and Hopper-v5)"""
    schemes_tasks: tuple[str, ...] = ("HalfCheetah-v5", "Hopper-v5")
    """tasks of the schemes arm"""
    regime_num_steps: int = 64
    """K of the regime arm: HalfCheetah-v5 at the schemes arm's N, staggered vs naive, with Table 3's MS-HumanoidWalk
    rollout (K = 64, H = 1000: 16 groups); 0: no such arm"""
    ablation_num_envs: int = 256
    """N of the ablation arm: HalfCheetah-v5, staggered, the advance's actions and the normalizer's data changed one
    at a time (ABLATION); 0: no such arm"""
    eval_every: int = 50_000
    """env steps between evaluations (--eval-freq is this over N x K, at least 1)"""
    cleanrl: str = str(ROOT / ".cleanrl" / "ppo_continuous_action.py")
    """CleanRL's ppo_continuous_action.py (a git-ignored copy, not part of this project); skipped if absent"""
    cleanrl_timesteps: int = 1_000_000
    """env steps of every CleanRL run"""
    cleanrl_seeds: int = 3
    """seeds 1..cleanrl_seeds of CleanRL's script"""
    jobs: int = 2
    """runs at a time (one CPU core each)"""
    quick: bool = False
    """every arm once: seed 1, N = 8/16/32 (schemes 16), 4,096 steps, H = 100; *_quick.* files (not a result)"""
    output: str = str(RESULTS)
    """where the md, json and png go"""
    replot: bool = False
    """only rewrite the md and png from the saved json"""
    resume: bool = False
    """keep the runs the saved json holds (same command and seed), run the rest"""


# CleanRL's ppo_continuous_action.py was written for Gymnasium 0.29: same-step autoreset, infos["final_info"] an array
# of per-env dicts, and TransformObservation(env, func) keeping the env's observation space. Gymnasium 1.x resets
# next-step by default, batches final_info into one dict and requires the space argument. This launcher runs the file
# unmodified with those three behaviours restored.
CLEANRL_LAUNCHER = """
import runpy, sys
import gymnasium as gym
import numpy as np


class SameStepSyncVectorEnv(gym.vector.SyncVectorEnv):
    def __init__(self, env_fns, **kwargs):
        super().__init__(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, **kwargs)

    def step(self, actions):
        obs, rewards, terminations, truncations, infos = super().step(actions)
        if "final_info" in infos:
            per_env, episode = np.full(self.num_envs, None, dtype=object), infos["final_info"]["episode"]
            for env in np.flatnonzero(infos["final_info"]["_episode"]):
                per_env[env] = {"episode": {"r": float(episode["r"][env]), "l": int(episode["l"][env])}}
            infos = {**infos, "final_info": per_env}
        return obs, rewards, terminations, truncations, infos


class TransformObservation(gym.wrappers.TransformObservation):
    def __init__(self, env, func, observation_space=None):
        super().__init__(env, func, observation_space)


gym.vector.SyncVectorEnv = SameStepSyncVectorEnv
gym.wrappers.TransformObservation = TransformObservation
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# The ablation arm splits what changed together in the staggered rows (the gates cannot matter on HalfCheetah-v5, which
# never terminates): the advance's actions (--advance-actions policy: the initial policy's mean; random: uniform in the
# bounds) and the data the observation normalizer learns from before training (the observations trained on, as
# ppo_staggered.py does; or every observation of the advance, as it did before). Variant: (advance actions, normalizer).
ABLATION = {
    "advance only": ("policy", "every observation"),
    "normalizer only": ("random", "trained-on only"),
    "neither": ("random", "every observation"),
}
# Runs ppo_staggered.py's main with the normalizer of the earlier code: it also learns from the first reset's
# observations and from those of every advance step (partial resets included), once per step, as that code did. The
# observations the advance ends on are left to main, which adds them as the earlier code's last advance step did.
EVERY_OBSERVATION_LAUNCHER = """
import sys
import tyro

sys.path.insert(0, sys.argv[1])
import ppo_staggered

advance = ppo_staggered.stagger_advance


class EveryObservation:
    def __init__(self, envs, obs_rms):
        self.envs, self.obs_rms, self.pending = envs, obs_rms, None

    def __getattr__(self, name):
        return getattr(self.envs, name)

    def reset(self, *, seed=None, options=None):
        obs, info = self.envs.reset(seed=seed, options=options)
        if options is None:
            self.obs_rms.update(obs)
        else:
            self.pending = obs
        return obs, info

    def step(self, actions):
        if self.pending is not None:
            self.obs_rms.update(self.pending)
        result = self.envs.step(actions)
        self.pending = result[0]
        return result


def advance_feeding_every_observation(envs, resets, agent, obs_rms, args, seed):
    return advance(EveryObservation(envs, obs_rms), resets, agent, obs_rms, args, seed)


ppo_staggered.stagger_advance = advance_feeding_every_observation
sys.argv = sys.argv[2:]
ppo_staggered.main(tyro.cli(ppo_staggered.Args))
"""


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def launch(command: list[str], cwd) -> None:
    """Runs a training script to its end with one torch thread; raises with the end of its stderr if it fails."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")


def thinned(points: list[tuple[int, float]], count: int = 200) -> list[list[float]]:
    """At most `count` (step, value) points, each the mean of a run of consecutive ones (a curve for the json)."""
    if not points:
        return []
    chunks = np.array_split(np.array(points, dtype=float), min(count, len(points)))
    return [[float(chunk[-1, 0]), float(chunk[:, 1].mean())] for chunk in chunks]


def run_ours(flags: list[str], seed: int, every_observation: bool = False) -> dict:
    """One run of ppo_staggered.py as a user runs it: its evaluations, training-return curve, diagnostics' means.
    every_observation: through EVERY_OBSERVATION_LAUNCHER (the ablation's earlier normalizer)."""
    with tempfile.TemporaryDirectory() as out:
        start = time.time()
        script = (
            [sys.executable, "-c", EVERY_OBSERVATION_LAUNCHER, str(ROOT)] if every_observation else [sys.executable]
        )
        command = [*script, str(SCRIPT), *flags, "--seed", str(seed), "--output-dir", out, "--save-model"]
        launch(command, out)  # (cwd: MuJoCo writes MUJOCO_LOG.TXT there)
        wall = time.time() - start
        run_dir = next(path for path in Path(out).iterdir() if path.is_dir())
        scalars = read_scalars(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        task = flags[flags.index("--env-id") + 1]
        on_back = time_on_back(run_dir / "final_ckpt.pt", seed) if task == SCALING_TASK else None
    evals = [
        {"global_step": step, "eval/return": value, "eval/episode_len": length}
        for (step, value), (_, length) in zip(scalars["eval/return"], scalars["eval/episode_len"])
    ]
    return {
        "evals": evals,
        "episodic_return": thinned(scalars.get("charts/episodic_return", [])),
        "diagnostics": {tag: float(np.mean([value for _, value in scalars[tag]])) for tag in DIAGNOSTICS},
        "advance_env_steps": summary.get("advance_env_steps", 0),
        "global_step": summary["global_step"],
        "sps": summary["sps"],
        "wall_s": wall,
        "time_on_back": on_back,
    }


def time_on_back(checkpoint: Path, seed: int) -> float:
    """HalfCheetah: the fraction of a deterministic evaluation's env steps (8 envs, 1000 steps each) that the final
    policy spends on its back (|rooty| > pi/2; rooty is observation 1). A cheetah can learn to run either way up; the
    staggered advance's random actions flip some before training begins (the md's table gives the fraction)."""
    sys.path.insert(0, str(ROOT))
    import torch

    import ppo_staggered

    args = ppo_staggered.resolve_args(ppo_staggered.Args(env_id=SCALING_TASK, cuda=False, seed=seed))
    device = torch.device("cpu")
    envs = ppo_staggered.make_env(args, 8, device, evaluation=True)
    agent = ppo_staggered.make_agent(envs)
    optimizer = torch.optim.Adam(agent.parameters())
    obs_rms = ppo_staggered.RunningMeanStd(envs.single_observation_space.shape, device)
    normalizers = {"obs_rms": obs_rms, "reward_rms": ppo_staggered.RunningMeanStd((), device)}
    ppo_staggered.load_checkpoint(ppo_staggered.read_checkpoint(str(checkpoint)), agent, optimizer, normalizers, device)
    obs, _ = envs.reset(seed=seed)
    steps_on_back = []
    with torch.no_grad():
        for _ in range(1000):
            obs, _, _, _, _ = envs.step(agent.deterministic_action(obs_rms.normalize(obs)))
            steps_on_back.append((obs[:, 1].abs() > np.pi / 2).float().mean().item())
    envs.close()
    return float(np.mean(steps_on_back))


def run_cleanrl(path: Path, seed: int, total_timesteps: int) -> dict:
    """One run of CleanRL's ppo_continuous_action.py on HalfCheetah-v5: its training episodes' returns."""
    with tempfile.TemporaryDirectory() as out:
        start = time.time()
        args = ["--env-id", SCALING_TASK, "--seed", str(seed), "--total-timesteps", str(total_timesteps), "--no-cuda"]
        launch([sys.executable, "-c", CLEANRL_LAUNCHER, str(path.resolve()), *args], out)
        wall = time.time() - start
        scalars = read_scalars(next(Path(out, "runs").iterdir()))
    episodes = scalars["charts/episodic_return"]
    return {
        "episodes": [[float(step), float(value)] for step, value in episodes],
        "episodic_return": thinned(episodes),
        "global_step": total_timesteps // CLEANRL_BATCH * CLEANRL_BATCH,
        "sps": float(scalars["charts/SPS"][-1][1]),
        "wall_s": wall,
    }


def commit() -> str:
    """The commit the scripts were run at (with "+ changes" when the work tree's scripts differ from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    changed = subprocess.run(["git", "status", "--porcelain", "--", "*.py"], capture_output=True, text=True, cwd=ROOT)
    return head.strip() + (" + changes" if changed.stdout.strip() else "")


def sizes(options: Options) -> tuple[tuple[int, ...], int, int, int]:
    """(scaling N, schemes N, steps of our runs, steps of CleanRL's runs); --quick's are small (and it evaluates about
    every 1,024 env steps)."""
    if options.quick:
        return (8, 16, 32), 16, 4096, 4096
    return options.num_envs, options.schemes_num_envs, options.total_timesteps, options.cleanrl_timesteps


def planned_run(task: str, scheme: str, n: int, k: int, seed: int, steps: int, options: Options) -> dict:
    """One ppo_staggered.py run of the plan: its flags, and its key in the json (with K where not the preset's)."""
    eval_freq = max(1, round((1024 if options.quick else options.eval_every) / (n * k)))
    flags = ["--env-id", task, "--reset-scheme", scheme, "--num-envs", str(n), "--no-cuda"]
    flags += ["--total-timesteps", str(steps), "--eval-freq", str(eval_freq)]
    flags += [] if k == K else ["--num-steps", str(k)]
    flags += ["--horizon", "100"] if options.quick else []
    key = f"{task}|{scheme}|{n}|{seed}" if k == K else f"{task}|{scheme}|{n}|K{k}|{seed}"
    return {"key": key, "task": task, "scheme": scheme, "num_envs": n, "num_steps": k, "seed": seed, "flags": flags}


def plan(options: Options) -> list[dict]:
    """Every run, seed by seed (each seed: every arm, the order alternating from seed to seed, so that a drift of a
    shared machine favours no arm): a stopped benchmark has every arm on its first seeds."""
    scaling_n, schemes_n, steps, cleanrl_steps = sizes(options)
    seeds = range(1, 2 if options.quick else max(options.seeds, options.cleanrl_seeds) + 1)
    runs = []
    for seed in seeds:
        chosen = []
        if seed <= options.seeds:
            configurations = [(SCALING_TASK, scheme, n) for n in scaling_n for scheme in SCHEMES[:2]]
            configurations += [(task, scheme, schemes_n) for task in options.schemes_tasks for scheme in SCHEMES]
            for task, scheme, n in dict.fromkeys(configurations):  # (HalfCheetah at schemes N is in both arms)
                chosen.append(planned_run(task, scheme, n, K, seed, steps, options))
            if options.regime_num_steps:
                for scheme in SCHEMES[:2]:
                    chosen.append(
                        planned_run(SCALING_TASK, scheme, schemes_n, options.regime_num_steps, seed, steps, options)
                    )
        if seed <= options.seeds and options.ablation_num_envs:
            ablation_n = 16 if options.quick else options.ablation_num_envs
            for variant, (actions, _) in ABLATION.items():
                run = planned_run(SCALING_TASK, "staggered", ablation_n, K, seed, steps, options)
                run["flags"] += ["--advance-actions", actions]
                run["key"] = f"{SCALING_TASK}|staggered|{ablation_n}|{variant}|{seed}"
                chosen.append({**run, "variant": variant})
        if seed <= (1 if options.quick else options.cleanrl_seeds) and Path(options.cleanrl).exists():
            flags = ["--env-id", SCALING_TASK, "--total-timesteps", str(cleanrl_steps)]
            key = f"{SCALING_TASK}|cleanrl|1|{seed}"
            chosen.append({"key": key, "task": SCALING_TASK, "scheme": "cleanrl", "num_envs": 1, "seed": seed})
            chosen[-1]["flags"] = flags
        runs += chosen if seed % 2 == 1 else chosen[::-1]
    return runs


def run_all(options: Options, saved: Path) -> dict:
    """Every run of the plan, --jobs at a time; the json is rewritten after each run (a stop keeps what ran)."""
    stored = json.loads(saved.read_text()) if options.resume and saved.exists() else {}
    runs = {key: run for key, run in stored.get("runs", {}).items()}
    todo = [item for item in plan(options) if runs.get(item["key"], {}).get("flags") != item["flags"]]
    header = {"commit": commit(), "argv": sys.argv[1:], "machine": machine(), "thresholds": THRESHOLDS}
    header["date"] = time.strftime("%Y-%m-%d %H:%M %Z")
    started = time.time()
    _, _, _, cleanrl_steps = sizes(options)

    def one(item: dict) -> dict:
        if item["scheme"] == "cleanrl":
            return run_cleanrl(Path(options.cleanrl), item["seed"], cleanrl_steps)
        every_observation = ABLATION.get(item.get("variant"), ("", ""))[1] == "every observation"
        return run_ours(item["flags"], item["seed"], every_observation)

    print(f"{len(todo)} runs to go, {options.jobs} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        futures = {pool.submit(one, item): item for item in todo}
        try:
            for future in as_completed(futures):
                item = futures[future]
                runs[item["key"]] = {**item, **future.result(), "commit": header["commit"]}
                record = {**stored, **header, "wall_s": stored.get("wall_s", 0) + time.time() - started, "runs": runs}
                partial = saved.with_name(saved.name + ".partial")  # a stop while writing leaves the last file whole
                partial.write_text(json.dumps(record))
                partial.replace(saved)
                run = runs[item["key"]]
                print(f"{item['key']}: final return {final_return(run):.0f}, {run['wall_s'] / 60:.1f} min", flush=True)
        except BaseException:  # a failed run or Ctrl-C (the running children get it too): start no other run
            for future in futures:
                future.cancel()
            raise
    return json.loads(saved.read_text()) if saved.exists() else {**header, "wall_s": 0, "runs": runs}


def machine() -> str:
    load = os.getloadavg()[0]
    return f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f})"


def final_return(run: dict) -> float:
    """Mean eval/return over the last 10% of the evaluations (CleanRL: of its training episodes)."""
    values = [row["eval/return"] for row in run["evals"]] if "evals" in run else [v for _, v in run["episodes"]]
    return float(np.mean(values[-max(1, len(values) // 10) :]))


def training_return_at(run: dict, step: float) -> float:
    """charts/episodic_return at the run's last curve point at or before `step` (a point is the mean of the episodes
    of a stretch of the run when the curve was thinned); nan if none."""
    values = [value for point_step, value in run["episodic_return"] if point_step <= step]
    return float(values[-1]) if values else float("nan")


def last_training_step(runs: list[dict]) -> float:
    """The step of the last training return that every run of `runs` logged (the common step of their comparison)."""
    return min((run["episodic_return"][-1][0] if run["episodic_return"] else 0.0) for run in runs)


def advance_steps(run: dict) -> float:
    """The env steps of the run's stagger advance (0 for other schemes and CleanRL)."""
    return float(run.get("advance_env_steps", 0))


def to_threshold(run: dict, threshold: float) -> tuple[float, float]:
    """(env steps, updates) before the first evaluation with eval/return >= threshold; CleanRL: the first iteration
    whose training episodes average >= threshold. nan, nan if never."""
    if "evals" in run:
        for row in run["evals"]:
            if row["eval/return"] >= threshold:
                return float(row["global_step"]), float(
                    row["global_step"] // (run["num_envs"] * run.get("num_steps", K))
                )
        return float("nan"), float("nan")
    by_iteration: dict[int, list[float]] = {}
    for step, value in run["episodes"]:
        by_iteration.setdefault(-(-int(step) // CLEANRL_BATCH), []).append(value)
    for iteration, values in sorted(by_iteration.items()):
        if np.mean(values) >= threshold:
            return float(iteration * CLEANRL_BATCH), float(iteration - 1)
    return float("nan"), float("nan")


def fmt(value: float, digits: int = 0) -> str:
    return "not reached" if np.isnan(value) else f"{value:,.{digits}f}"


def per_seed(values: list[float], digits: int = 0) -> str:
    finite = [value for value in values if not np.isnan(value)]
    middle = fmt(float(np.mean(finite)), digits) if finite else "-"
    return f"{middle} ({', '.join(fmt(value, digits) for value in values)})"


def table_row(runs: list[dict], arm: str, common_step: float) -> str:
    """One configuration's row; common_step: where its training return is read (shared with the arms beside it)."""
    first = runs[0]
    threshold = THRESHOLDS[first["task"]]
    reached = [to_threshold(run, threshold) for run in runs]
    steps = np.array([step for step, _ in reached])
    updates = np.array([update for _, update in reached])
    hits = ~np.isnan(steps)
    with_advance = steps + np.array([advance_steps(run) for run in runs])
    cleanrl = first["scheme"] == "cleanrl"
    name = "CleanRL ppo_continuous_action.py" if cleanrl else first["scheme"]
    if first.get("variant"):
        actions, normalizer = ABLATION[first["variant"]]
        name = f"staggered, {first['variant']} (advance: {actions}; normalizer: {normalizer})"
    elif arm == "ablation":
        name = "staggered, both (advance: policy; normalizer: trained-on only)"
    diagnostics = [np.mean([run["diagnostics"][tag] for run in runs]) for tag in DIAGNOSTICS] if not cleanrl else []
    cells = [
        arm,
        first["task"],
        name,
        str(first["num_envs"]),
        str(CLEANRL_BATCH if cleanrl else first.get("num_steps", K)),
        str(len(runs)),
        "-" if cleanrl else per_seed([final_return(run) for run in runs]),
        f"{common_step:,.0f}: " + per_seed([training_return_at(run, common_step) for run in runs]),
        f"{hits.sum()}/{len(runs)}",
        f"{fmt(np.median(steps[hits]) if hits.any() else np.nan)} ({', '.join(fmt(s) for s in steps)})",
        f"{fmt(np.median(with_advance[hits]) if hits.any() else np.nan)} ({', '.join(fmt(s) for s in with_advance)})",
        f"{fmt(np.median(updates[hits]) if hits.any() else np.nan)} ({', '.join(fmt(u) for u in updates)})",
        f"{np.mean([advance_steps(run) for run in runs]):,.0f}",
        f"{np.mean([run['global_step'] + advance_steps(run) for run in runs]):,.0f}",
        f"{np.mean([run['wall_s'] for run in runs]) / 60:.1f}",
        f"{np.mean([run['sps'] for run in runs]):,.0f}",
        *(f"{value:.3g}" for value in diagnostics),
        *(["-"] * (len(DIAGNOSTICS) - len(diagnostics))),
        on_back_cell(runs),
    ]
    return "| " + " | ".join(cells) + " |"


def on_back_cell(runs: list[dict]) -> str:
    """Mean and per-seed time on back (HalfCheetah's runs since it was added; "?" for a run before it)."""
    values = [run.get("time_on_back") for run in runs]
    if all(value is None for value in values):
        return "-"
    known = [value for value in values if value is not None]
    return f"{np.mean(known):.2f} ({', '.join('?' if value is None else f'{value:.2f}' for value in values)})"


def group(
    record: dict, task: str, scheme: str, num_envs: int, num_steps: int = K, variant: Optional[str] = None
) -> list[dict]:
    """The runs of one configuration, by seed (the runs before K was recorded had the preset's); variant: the ablation
    arm's (None: the runs of the other arms)."""
    configuration = (task, scheme, num_envs, num_steps, variant)
    chosen = [
        run
        for run in record["runs"].values()
        if (run["task"], run["scheme"], run["num_envs"], run.get("num_steps", K), run.get("variant")) == configuration
    ]
    return sorted(chosen, key=lambda run: run["seed"])


def report(record: dict, options: Options, suffix: str) -> None:
    scaling_n, schemes_n, steps, cleanrl_steps = sizes(options)
    commits = sorted({run.get("commit", "?") for run in record["runs"].values()})
    lines = [
        "# ppo_staggered.py on MuJoCo locomotion: staggered vs naive resets at N = "
        + ", ".join(str(n) for n in scaling_n)
        + (" (--quick: a check of the benchmark, not a result)" if options.quick else ""),
        "",
        f"- Command: `python benchmarks/mujoco_scaling.py {' '.join(record.get('argv', []))}`",
        f"- Machine: {record.get('machine', machine())}",
        f"- Date: {record.get('date', '?')}; {record.get('wall_s', 0) / 60:.0f} min of benchmark time over all its starts",
        f"- Commit: {', '.join(commits)}",
        "",
        f"Every ppo_staggered.py run: its MuJoCo preset (K = {K}, H = {100 if options.quick else 1000}, gamma 0.99, "
        f"lambda 0.95, 8 minibatches, 4 epochs, observation normalization, reward scaling), {steps:,} env steps, an "
        f"evaluation "
        f"(8 envs, deterministic, one episode each) about every {1024 if options.quick else options.eval_every:,} env "
        "steps. Final eval return: "
        "mean eval/return over the last 10% of evaluations, mean over seeds (per seed); training return: "
        "charts/episodic_return (stochastic policy, whole episodes begun in training) at the step given, the last one "
        "at which every run of the arms compared in the row's group had logged one (a naive HalfCheetah episode ends "
        "only at multiples of H x N env steps). Threshold: eval/return "
        + ", ".join(f"{value:,.0f} ({task})" for task, value in THRESHOLDS.items())
        + ", fixed before running; steps and updates to it: before the first evaluation that reached it, median "
        "over the seeds that did (per seed), without and with the stagger advance's env steps (the initial policy's "
        "mean action, or uniform random actions in the ablation's random arms; not trained on, not in the training "
        "budget, but simulated). Env steps simulated: training plus advance. Minutes: launch to exit of one run, start-up and evaluations included, while --jobs runs shared "
        "the machine. Diagnostics: means over every update of the run, then over seeds (trained-on fraction: "
        "stagger/valid_fraction, the steps not waiting for a reset gate). Time on back (HalfCheetah): the "
        "fraction of a deterministic 1000-step evaluation of the final policy (8 envs) spent with |rooty| > pi/2.",
        "",
        "| arm | task | scheme | N | K | seeds | final eval return (per seed) | training return at a common step "
        "(per seed) | seeds reached | training env steps to threshold (per seed) | env steps to threshold, advance "
        "included (per seed) | updates to threshold (per seed) | advance env steps | env steps simulated "
        "| minutes / run | steps/s | stage coverage | value MSE | policy KL | trained-on fraction "
        "| time on back (per seed) |",
        "|" + "---|" * 21,
    ]
    for n in scaling_n:
        lines += table_group(record, "scaling", [(SCALING_TASK, scheme, n, K, None) for scheme in SCHEMES[:2]])
    for task in options.schemes_tasks:
        lines += table_group(record, "schemes", [(task, scheme, schemes_n, K, None) for scheme in SCHEMES])
    regime = [(SCALING_TASK, scheme, schemes_n, options.regime_num_steps, None) for scheme in SCHEMES[:2]]
    lines += table_group(record, "regime", regime)
    ablation_n = 16 if options.quick else options.ablation_num_envs
    ablation = [(SCALING_TASK, "staggered", ablation_n, K, None)]
    ablation += [(SCALING_TASK, "staggered", ablation_n, K, variant) for variant in ABLATION]
    lines += table_group(record, "ablation", ablation)
    lines += table_group(record, f"reference ({cleanrl_steps:,} steps)", [(SCALING_TASK, "cleanrl", 1, K, None)])
    if not group(record, SCALING_TASK, "cleanrl", 1):
        lines.append(f"| reference | {SCALING_TASK} | CleanRL: not run ({options.cleanrl} absent) |" + " - |" * 18)
    markdown = Path(options.output) / f"mujoco_scaling{suffix}.md"
    lines += [
        "",
        "CleanRL's ppo_continuous_action.py does not evaluate (only with --save-model and cleanrl_utils): its "
        "threshold and final return are those of its training episodes (mean per 2,048-step iteration), comparable to "
        "the training-return column, not to the eval column; its updates are iterations of 10 epochs x 32 minibatches.",
        "",
        *written_prose(markdown),
        "Commands (each run adds `--seed S --output-dir DIR`; the ablation's every-observation normalizer runs "
        "ppo_staggered.py through EVERY_OBSERVATION_LAUNCHER):",
        "",
    ]
    seen = set()
    for run in sorted(record["runs"].values(), key=lambda run: run["key"]):
        script = "CleanRL ppo_continuous_action.py" if run["scheme"] == "cleanrl" else "ppo_staggered.py"
        command = f"{script} {' '.join(run['flags'])}"
        if command not in seen:
            seen.add(command)
            lines.append(f"- `{command}`")
    markdown.write_text("\n".join(lines) + "\n")


def table_group(record: dict, arm: str, configurations: list[tuple]) -> list[str]:
    """The rows of configurations compared with each other (task, scheme, N, K, ablation variant), their training
    returns read at one common step."""
    groups = [runs for runs in (group(record, *configuration) for configuration in configurations) if runs]
    if not groups:
        return []
    common_step = last_training_step([run for runs in groups for run in runs])
    return [table_row(runs, arm, common_step) for runs in groups]


def written_prose(markdown: Path) -> list[str]:
    """The md's hand-written "What the numbers say" section, kept by a --replot (a placeholder in a new md)."""
    text = markdown.read_text() if markdown.exists() else ""
    start, end = text.find("## What the numbers say"), text.find("Commands (each run adds")
    if start < 0 or end < start:
        return ["## What the numbers say", "", "(to be written from the numbers above)", ""]
    return text[start:end].rstrip("\n").split("\n") + [""]


def plot(record: dict, options: Options, suffix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling_n, schemes_n, _, _ = sizes(options)
    colors = {"staggered": "C0", "naive": "C1", "random-start": "C2", "cleanrl": "k"}
    panels = [(SCALING_TASK, n, K, SCHEMES if n == schemes_n else SCHEMES[:2]) for n in scaling_n]
    panels += [(task, schemes_n, K, SCHEMES) for task in options.schemes_tasks if task != SCALING_TASK]
    panels += [(SCALING_TASK, schemes_n, options.regime_num_steps, SCHEMES[:2])] if options.regime_num_steps else []
    columns = max(5, len(panels))  # (the bottom row has five panels)
    figure, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 9), squeeze=False)
    for column in range(len(panels), columns):
        axes[0, column].axis("off")
    for column, (task, n, k, schemes) in enumerate(panels):  # top row: eval return against env steps, per N and K
        axis = axes[0, column]
        for scheme in schemes:
            for index, run in enumerate(group(record, task, scheme, n, k)):
                steps = [row["global_step"] for row in run["evals"]]
                values = [row["eval/return"] for row in run["evals"]]
                axis.plot(steps, values, color=colors[scheme], alpha=0.7, label=scheme if index == 0 else None)
        axis.axhline(THRESHOLDS[task], color="gray", linestyle="--", linewidth=1)
        axis.set_title(f"{task}, N = {n}, K = {k} (one line per seed)")
        axis.set_xlabel("env steps")
        axis.set_ylabel("eval/return (deterministic)")
        axis.legend(fontsize=8)
    axis = axes[1, 0]  # bottom left: final return against N per scheme (Fig. 5's shape)
    for scheme in SCHEMES:
        ns = [n for n in sorted(set(scaling_n) | {schemes_n}) if group(record, SCALING_TASK, scheme, n)]
        finals = [[final_return(run) for run in group(record, SCALING_TASK, scheme, n)] for n in ns]
        if ns:
            axis.plot(ns, [np.mean(values) for values in finals], "o-", color=colors[scheme], label=scheme)
            for n, values in zip(ns, finals):
                axis.scatter([n] * len(values), values, color=colors[scheme], alpha=0.4, s=12)
    axis.set_xscale("log", base=2)
    axis.set_title(f"{SCALING_TASK}: final return against N (Fig. 5's shape)")
    axis.set_xlabel("parallel envs N")
    axis.set_ylabel("final eval/return (last 10% of evals; dots: seeds)")
    axis.legend(fontsize=8)
    axis = axes[1, 1]  # bottom middle: training returns beside CleanRL's (the same kind of number)
    for scheme in SCHEMES:
        for index, run in enumerate(group(record, SCALING_TASK, scheme, schemes_n)):
            curve = np.array(run["episodic_return"]).reshape(-1, 2)
            label = f"ppo_staggered {scheme}, N = {schemes_n}" if index == 0 else None
            axis.plot(curve[:, 0], curve[:, 1], color=colors[scheme], alpha=0.6, label=label)
    for index, run in enumerate(group(record, SCALING_TASK, "cleanrl", 1)):
        curve = np.array(run["episodic_return"]).reshape(-1, 2)
        label = "CleanRL ppo_continuous_action.py (N = 1, K = 2048)" if index == 0 else None
        axis.plot(curve[:, 0], curve[:, 1], color=colors["cleanrl"], alpha=0.6, label=label)
    axis.set_title(f"{SCALING_TASK}: training episodes' return (stochastic policy)")
    axis.set_xlabel("env steps")
    axis.set_ylabel("charts/episodic_return")
    axis.legend(fontsize=8)
    axis = axes[1, 2]  # bottom right: stage coverage per N and scheme (Sec. 3.2: how much of H a batch covers)
    labels, coverage = [], []
    for n in scaling_n:
        for scheme in SCHEMES[:2]:
            runs = group(record, SCALING_TASK, scheme, n)
            if runs:
                labels.append(f"{scheme}\nN={n}")
                coverage.append(np.mean([run["diagnostics"]["stagger/stage_coverage"] for run in runs]))
    axis.bar(range(len(coverage)), coverage, color=[colors[label.split("\n")[0]] for label in labels])
    axis.set_xticks(range(len(coverage)), labels, fontsize=7)
    axis.set_title(f"{SCALING_TASK}: mean stage coverage of a batch")
    axis.set_ylabel("stagger/stage_coverage")
    ablation_n = 16 if options.quick else options.ablation_num_envs
    variants = {"both": None, **{variant: variant for variant in ABLATION}}
    variant_colors = {"both": "C0", "advance only": "C4", "normalizer only": "C5", "neither": "C3"}
    finals = {}
    for name, variant in variants.items():  # bottom, 4th: the ablation's eval return against env steps
        runs = group(record, SCALING_TASK, "staggered", ablation_n, K, variant)
        for index, run in enumerate(runs):
            steps = [row["global_step"] for row in run["evals"]]
            values = [row["eval/return"] for row in run["evals"]]
            label = name if index == 0 else None
            axes[1, 3].plot(steps, values, color=variant_colors[name], alpha=0.7, label=label)
        if runs:
            finals[name] = [final_return(run) for run in runs]
    axes[1, 3].set_title(f"{SCALING_TASK}, N = {ablation_n}, staggered: ablation (one line per seed)")
    axes[1, 3].set_xlabel("env steps (training)")
    axes[1, 3].set_ylabel("eval/return (deterministic)")
    axes[1, 3].legend(fontsize=8)
    for index, (name, values) in enumerate(finals.items()):  # bottom, 5th: the ablation's final returns
        axes[1, 4].bar(index, np.mean(values), color=variant_colors[name], alpha=0.5)
        axes[1, 4].scatter([index] * len(values), values, color=variant_colors[name], s=14)
    labels = [f"{name}\n{dict(both=('policy', 'trained-on only'), **ABLATION)[name][0]} advance" for name in finals]
    axes[1, 4].set_xticks(range(len(finals)), labels, fontsize=7)
    axes[1, 4].set_title("ablation: final eval return (bars: mean; dots: seeds)")
    axes[1, 4].set_ylabel("final eval/return (last 10% of evals)")
    for column in range(5, axes.shape[1]):
        axes[1, column].axis("off")
    figure.tight_layout()
    figure.savefig(Path(options.output) / f"mujoco_scaling{suffix}.png", dpi=100)
    plt.close(figure)


def main(options: Options) -> None:
    suffix = "_quick" if options.quick else ""
    Path(options.output).mkdir(parents=True, exist_ok=True)
    saved = Path(options.output) / f"mujoco_scaling{suffix}.json"
    record = json.loads(saved.read_text()) if options.replot else run_all(options, saved)
    report(record, options, suffix)
    plot(record, options, suffix)
    print(f"wrote {Path(options.output) / f'mujoco_scaling{suffix}.md'}, .json and .png")


if __name__ == "__main__":
    main(tyro.cli(Options))
