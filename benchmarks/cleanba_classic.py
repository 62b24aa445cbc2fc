"""cleanba_ppo.py and cleanba_impala.py on EnvPool classic control (CartPole-v1, Acrobot-v1), run as a user runs them
(subprocesses), with CleanRL's published ppo.py numbers beside ours.

Two claims are checked:
  learning         median final return over seeds and env steps until the return first reaches 475 (CartPole-v1) or
                   -100 (Acrobot-v1), per script, task and architecture (synchronous, concurrent); the final return of
                   a run is the mean charts/episodic_return over its last 5% of iterations.
  reproducibility  Cleanba Sec. 3 and Table 1: the same seed gives the same learning curve with 1 or 2 actor threads
                   and with the learner slowed down (--debug-learner-delay): whether the per-iteration return and
                   losses of those runs are bit-identical, else where and by how much they first differ.
Each run uses the script's classic-control preset (cleanba_ppo.py: CleanRL's ppo.py settings, 4 envs x 128 steps;
cleanba_impala.py: 16 envs x 20 steps), 500k steps. CleanRL's ppo.py numbers: docs/rl-algorithms/ppo.md in
vwxyzjn/cleanrl since its commit 35896b1f (2023; unchanged at fe8d8a03, 2026): average episodic return of 3 seeds,
500k steps, CartPole-v1 490.04 +- 6.12, Acrobot-v1 -86.36 +- 1.32.

CleanRL's ppo.py itself runs beside ours (--cleanrl-seeds seeds, default 1, same 500k steps) when its file is at
--cleanrl (default .cleanrl/ppo.py, a folder git ignores: never commit it; `git show fe8d8a03:cleanrl/ppo.py` in a
clone of vwxyzjn/cleanrl). It runs unmodified through a launcher that gives it Gymnasium 0.29's vector-env behaviour
(same-step autoreset, per-env final_info), which the installed Gymnasium 1.x changed.

Writes benchmarks/results/cleanba_classic.md, cleanba_classic.json.gz (every run's per-update rows, gzipped: 38 MB as
plain json) and cleanba_classic.png (return against env steps and against wall-clock time). The json is rewritten
after every run; --resume keeps the runs it already holds. --quick runs every code path once with 1 seed and 20k steps and writes *_quick.* files (a
check of the benchmark itself, not a result).

  python benchmarks/cleanba_classic.py             # 2 scripts x 2 tasks x 2 architectures x 3 seeds, seed 1 also
                                                   # with 1 actor thread and with a slow learner, CleanRL's ppo.py
                                                   # on both tasks, 3 seeds: about 95 minutes on 2 CPU cores
  python benchmarks/cleanba_classic.py --quick     # a few minutes
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRIPTS = {"ppo": ROOT / "cleanba_ppo.py", "impala": ROOT / "cleanba_impala.py"}
TASKS = {"CartPole-v1": 475.0, "Acrobot-v1": -100.0}  # the task's solved threshold (gymnasium's reward_threshold)
# CleanRL's ppo.py, docs/rl-algorithms/ppo.md (vwxyzjn/cleanrl at fe8d8a03): average episodic return, 3 seeds, 500k steps
CLEANRL_PPO = {"CartPole-v1": (490.04, 6.12), "Acrobot-v1": (-86.36, 1.32)}
ARCHITECTURES = {"synchronous": "--no-concurrency", "concurrent": "--concurrency"}
COMPARED = ("charts/episodic_return", "losses/policy_loss", "losses/value_loss", "losses/entropy")


@dataclass
class Options:
    seeds: int = 3
    """seeds 1..seeds of every configuration"""
    total_timesteps: int = 500_000
    """env steps of every run (the presets' value)"""
    thread_seeds: int = 1
    """seeds 1..thread_seeds also run with 1 actor thread, to compare with 2 (the same seed must give the same run)"""
    learner_delay: float = 0.02
    """seconds of --debug-learner-delay in the slow-learner runs (seed 1, 2 actor threads)"""
    quick: bool = False
    """1 seed and 20k steps, results written to *_quick.* (checks the benchmark runs, measures nothing)"""
    output: str = str(RESULTS)
    """where the results go"""
    replot: bool = False
    """only rewrite the table and the figure from the saved json"""
    resume: bool = False
    """keep the runs the saved json already holds (same steps), run the rest"""
    cleanrl: str = str(ROOT / ".cleanrl" / "ppo.py")
    """CleanRL's ppo.py (not part of this project: a git-ignored copy); skipped if absent"""
    cleanrl_seeds: int = 3
    """seeds 1..cleanrl_seeds of CleanRL's ppo.py on each task"""


# CleanRL's ppo.py was written for Gymnasium 0.29: same-step autoreset and infos["final_info"] an array of per-env
# dicts. Gymnasium 1.x resets next-step by default and batches final_info into one dict. This launcher runs the file
# unmodified with a SyncVectorEnv that resets same-step and hands the episode statistics over in the old layout.
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


gym.vector.SyncVectorEnv = SameStepSyncVectorEnv
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def launch(command: list[str], cwd, name: str) -> None:
    """Runs a training script to its end with one torch thread; raises with the end of its stderr if it fails."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(command[2:])} failed:\n{proc.stderr[-3000:]}")


def run_cleanrl(path: Path, task: str, seed: int, total_timesteps: int) -> dict:
    """One run of CleanRL's ppo.py; its episodic returns averaged per iteration (4 envs x 128 steps), as our rows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as out:
        start = time.time()
        args = ["--env-id", task, "--seed", str(seed), "--total-timesteps", str(total_timesteps), "--no-cuda"]
        launch([sys.executable, "-c", CLEANRL_LAUNCHER, str(path.resolve()), *args], out, "CleanRL ppo.py")
        accumulator = EventAccumulator(str(next(Path(out, "runs").iterdir())), size_guidance={"scalars": 0})
        accumulator.Reload()
        episodes = accumulator.Scalars("charts/episodic_return")
    batch = 4 * 128  # ppo.py's defaults: --num-envs 4 --num-steps 128
    by_iteration: dict[int, list] = {}
    for event in episodes:
        by_iteration.setdefault(-(-event.step // batch), []).append(event)
    rows = [
        {
            "global_step": iteration * batch,
            "charts/episodic_return": float(np.mean([event.value for event in events])),
            "charts/SPS": iteration * batch / max(events[-1].wall_time - start, 1e-9),
        }
        for iteration, events in sorted(by_iteration.items())
    ]
    return {"rows": rows, "summary": {}, "wall": time.time() - start}


def run(script: Path, args: list[str]) -> dict:
    """One run of a script; returns its per-iteration rows, summary and wall time."""
    with tempfile.TemporaryDirectory() as out:
        start = time.time()
        launch([sys.executable, str(script), "--output-dir", out, "--no-cuda", *args], ROOT, script.name)
        run_dir = next(path for path in Path(out).iterdir() if path.is_dir())
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = (run_dir / "updates.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return {
        "rows": [row for row in rows if "cleanba/data_policy_version" in row],
        "summary": summary,
        "wall": time.time() - start,
    }


def commit() -> str:
    """The commit the scripts were run at (with "+ changes" when the work tree's scripts differ from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    changed = subprocess.run(["git", "status", "--porcelain", "--", "*.py"], capture_output=True, text=True, cwd=ROOT)
    return head.strip() + (" + changes" if changed.stdout.strip() else "")


def run_key(algo: str, task: str, architecture: str, threads: int, seed: int, delay: float = 0.0) -> str:
    return f"{algo}|{task}|{architecture}|{threads}|{seed}|{delay}"


def load(saved: Path) -> dict:
    with gzip.open(saved, "rt") as f:
        return json.loads(f.read())


def run_all(options: Options, saved: Path) -> dict:
    """Every run, task by task; the json is rewritten after each (a stopped benchmark goes on with --resume)."""
    runs = load(saved) if options.resume and saved.exists() else {}
    runs = {key: value for key, value in runs.items() if value.get("total_timesteps") == options.total_timesteps}
    seeds = range(1, 2 if options.quick else options.seeds + 1)

    def record(key: str, make_run) -> None:
        if key not in runs:
            runs[key] = {**make_run(), "total_timesteps": options.total_timesteps, "commit": commit()}
            partial = saved.with_name(saved.name + ".partial")  # a stop while writing leaves the last file whole
            with gzip.open(partial, "wt", compresslevel=6) as f:
                f.write(json.dumps(runs))
            partial.replace(saved)
        print(f"{key}: final return {final_return(runs[key]['rows']):.1f}, {runs[key]['wall']:.0f} s", flush=True)

    def ours(algo: str, task: str, architecture: str, threads: int, seed: int, delay: float = 0.0) -> None:
        args = ["--env-id", task, "--seed", str(seed), "--total-timesteps", str(options.total_timesteps)]
        args += [ARCHITECTURES[architecture], "--num-actor-threads", str(threads), "--debug-learner-delay", str(delay)]
        record(run_key(algo, task, architecture, threads, seed, delay), partial(run, SCRIPTS[algo], args))

    for task in TASKS:  # the learning runs of both scripts, CleanRL's ppo.py, then the reproducibility runs
        for algo, architecture, seed in itertools.product(("impala", "ppo"), ARCHITECTURES, seeds):
            ours(algo, task, architecture, 2, seed)
        for seed in range(1, options.cleanrl_seeds + 1) if Path(options.cleanrl).exists() else ():
            cleanrl = partial(run_cleanrl, Path(options.cleanrl), task, seed, options.total_timesteps)
            record(run_key("cleanrl", task, "-", 0, seed), cleanrl)
        for algo, architecture in itertools.product(("impala", "ppo"), ARCHITECTURES):
            for seed in seeds[: options.thread_seeds]:
                ours(algo, task, architecture, 1, seed)
            ours(algo, task, architecture, 2, 1, options.learner_delay)
    return runs


def returns_curve(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(env steps, seconds since the start, episodic return) of the iterations that ended episodes."""
    rows = [row for row in rows if "charts/episodic_return" in row]
    steps = np.array([row["global_step"] for row in rows], dtype=float)
    seconds = steps / np.array([row["charts/SPS"] for row in rows])
    return steps, seconds, np.array([row["charts/episodic_return"] for row in rows])


def final_return(rows: list[dict]) -> float:
    _, _, returns = returns_curve(rows)
    return float(np.mean(returns[-max(1, len(returns) // 20) :]))


def steps_to(rows: list[dict], threshold: float) -> float:
    """Env steps until the return, averaged over 5 iterations, first reaches the threshold (nan: never)."""
    steps, _, returns = returns_curve(rows)
    smooth = np.convolve(returns, np.ones(5) / 5, mode="valid")
    reached = np.nonzero(smooth >= threshold)[0]
    return float(steps[reached[0] + 4]) if len(reached) else float("nan")


def compare(rows_a: list[dict], rows_b: list[dict]) -> str:
    """Whether two runs of one seed are bit-identical in the compared per-iteration values; else where they first
    differ, by how much (relative), and their final returns."""
    for iteration, (row_a, row_b) in enumerate(zip(rows_a, rows_b), start=1):
        for key in COMPARED:
            value_a, value_b = row_a.get(key), row_b.get(key)
            if value_a != value_b:
                both = value_a is not None and value_b is not None
                size = abs(value_a - value_b) / max(abs(value_a), abs(value_b), 1e-12) if both else float("inf")
                finals = f"{final_return(rows_a):.1f} vs {final_return(rows_b):.1f}"
                return f"first differs at iteration {iteration} ({key}, relative {size:.1g}); final return {finals}"
    return "bit-identical" if len(rows_a) == len(rows_b) else "identical rows, different lengths"


def report(runs: dict, options: Options, suffix: str) -> None:
    seeds = sorted({int(key.split("|")[4]) for key in runs if not key.startswith("cleanrl|")})
    lines = [
        "# Cleanba scripts on EnvPool classic control"
        + (" (--quick: a check of the benchmark, not a result)" if options.quick else ""),
        "",
        f"Written by `benchmarks/cleanba_classic.py` on {platform.node()} ({platform.processor() or platform.machine()}), "
        f"{os.cpu_count()} CPUs, seeds {seeds}, {options.total_timesteps} env steps per run, scripts at commit "
        + "; ".join(f"{c} ({n} runs)" for c, n in Counter(run.get("commit", "?") for run in runs.values()).items())
        + ". Final return: mean "
        "charts/episodic_return over the last 5% of iterations; steps to threshold: first iteration whose 5-iteration "
        "mean reaches it (475 CartPole-v1, -100 Acrobot-v1).",
        "",
        "## Learning (2 actor threads)",
        "",
        "| task | script | architecture | final return: median (per seed) | steps to threshold: median | CleanRL ppo.py (500k) |",
        "|---|---|---|---|---|---|",
    ]
    for task, threshold in TASKS.items():  # CleanRL's ppo.py run here, where its file was present
        chosen = [value["rows"] for key, value in sorted(runs.items()) if key.startswith(f"cleanrl|{task}|")]
        if chosen:
            finals = [final_return(rows) for rows in chosen]
            reach = [steps_to(rows, threshold) for rows in chosen]
            published = "{:.2f} +- {:.2f} (published)".format(*CLEANRL_PPO[task])
            lines.append(
                f"| {task} | CleanRL ppo.py, run here | - | {np.median(finals):.1f} "
                f"({', '.join(f'{value:.1f}' for value in finals)}) | "
                f"{np.nanmedian(reach) if not np.isnan(reach).all() else float('nan'):.0f} | {published} |"
            )
    for task, threshold in TASKS.items():
        for algo in SCRIPTS:
            for architecture in ARCHITECTURES:
                keys = [run_key(algo, task, architecture, 2, seed) for seed in seeds]
                chosen = [runs[key]["rows"] for key in keys if key in runs]
                if not chosen:  # (a benchmark stopped early: --resume runs the rest)
                    continue
                finals = [final_return(rows) for rows in chosen]
                reach = [steps_to(rows, threshold) for rows in chosen]
                cleanrl = "{:.2f} +- {:.2f}".format(*CLEANRL_PPO[task])
                per_seed = ", ".join(f"{value:.1f}" for value in finals)
                lines.append(
                    f"| {task} | cleanba_{algo}.py | {architecture} | {np.median(finals):.1f} ({per_seed}) | "
                    f"{np.nanmedian(reach) if not np.isnan(reach).all() else float('nan'):.0f} | {cleanrl} |"
                )
    lines += [
        "",
        "## Reproducibility (Sec. 3, Table 1): per-iteration return and losses of the same seed",
        "",
        "| task | script | architecture | 1 vs 2 actor threads (each seed) | slow learner vs not (seed 1) |",
        "|---|---|---|---|---|",
    ]
    for task in TASKS:
        for algo in SCRIPTS:
            for architecture in ARCHITECTURES:

                def difference(key_a: str, key_b: str) -> str:
                    both = key_a in runs and key_b in runs
                    return compare(runs[key_a]["rows"], runs[key_b]["rows"]) if both else "not run"

                threads = [
                    difference(run_key(algo, task, architecture, 1, seed), run_key(algo, task, architecture, 2, seed))
                    for seed in seeds[: options.thread_seeds]
                ]
                slow = difference(
                    run_key(algo, task, architecture, 2, 1),
                    run_key(algo, task, architecture, 2, 1, options.learner_delay),
                )
                lines.append(f"| {task} | cleanba_{algo}.py | {architecture} | {', '.join(threads)} | {slow} |")
    (Path(options.output) / f"cleanba_classic{suffix}.md").write_text("\n".join(lines) + "\n")
    plot(runs, options, seeds, suffix)


def plot(runs: dict, options: Options, seeds: list[int], suffix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(TASKS), figsize=(6 * len(TASKS), 8))
    for column, task in enumerate(TASKS):
        for algo in SCRIPTS:
            for architecture, style in zip(ARCHITECTURES, ("-", "--")):
                for seed in seeds:
                    if run_key(algo, task, architecture, 2, seed) not in runs:
                        continue
                    steps, seconds, returns = returns_curve(runs[run_key(algo, task, architecture, 2, seed)]["rows"])
                    label = f"cleanba_{algo}.py, {architecture}" if seed == seeds[0] else None
                    color = "C0" if algo == "ppo" else "C1"
                    axes[0, column].plot(steps, returns, style, color=color, alpha=0.6, label=label)
                    axes[1, column].plot(seconds, returns, style, color=color, alpha=0.6, label=label)
        cleanrl = [value["rows"] for key, value in sorted(runs.items()) if key.startswith(f"cleanrl|{task}|")]
        for index, rows in enumerate(cleanrl):
            steps, seconds, returns = returns_curve(rows)
            label = "CleanRL ppo.py, run here" if index == 0 else None
            axes[0, column].plot(steps, returns, color="k", alpha=0.6, label=label)
            axes[1, column].plot(seconds, returns, color="k", alpha=0.6, label=label)
        mean, spread = CLEANRL_PPO[task]
        for row in range(2):
            axes[row, column].axhline(
                mean, color="k", linestyle=":", label=f"CleanRL ppo.py at 500k: {mean} +- {spread}"
            )
            axes[row, column].set_ylabel("episodic return")
            axes[row, column].set_title(f"{task} (seeds {seeds}, 2 actor threads)")
        axes[0, column].set_xlabel("env steps")
        axes[1, column].set_xlabel("wall-clock seconds (2 CPU cores)")
        axes[0, column].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(Path(options.output) / f"cleanba_classic{suffix}.png", dpi=110)


def main(options: Options) -> None:
    if options.quick:
        options.total_timesteps = 20_000
    suffix = "_quick" if options.quick else ""
    Path(options.output).mkdir(parents=True, exist_ok=True)
    saved = Path(options.output) / f"cleanba_classic{suffix}.json.gz"
    if options.replot:
        runs = load(saved)
    else:
        runs = run_all(options, saved)
    report(runs, options, suffix)
    print(f"wrote {Path(options.output) / f'cleanba_classic{suffix}.md'} and .png")


if __name__ == "__main__":
    main(tyro.cli(Options))
