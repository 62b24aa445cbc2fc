"""cleanba_ppo.py and cleanba_impala.py on EnvPool classic control (CartPole-v1, Acrobot-v1), run as a user runs them
(subprocesses), with CleanRL's published ppo.py numbers beside ours.

Two claims are checked:
  learning         each script, task and architecture on 10 seeds (1-5, on which the presets were chosen, and 11-15,
                   on which they were not): how many runs hold the task's threshold (475 CartPole-v1, -100 Acrobot-v1)
                   at the end, by their final eval/return (what the script prints after training) and by their mean
                   training return over the last 10% of iterations; the median and the worst final return; the env
                   steps until the return first reaches the threshold. CleanRL's ppo.py runs beside them on the same
                   seeds (counted by its last tenth: it has no evaluation).
  reproducibility  (--reproducibility) Cleanba Sec. 3 and Table 1: the first seed with 1 and 2 actor threads and with
                   the learner slowed down (--debug-learner-delay): whether the per-iteration return and losses are
                   bit-identical, else where and by how much they first differ.
Each run uses the script's classic-control preset (cleanba_ppo.py: CleanRL's ppo.py settings, 4 envs x 128 steps;
cleanba_impala.py: 16 envs x 20 steps), 500k steps, one actor thread (on 2 CPU cores twice as fast as 2; the same
algorithm), two runs at a time. CleanRL's ppo.py numbers: docs/rl-algorithms/ppo.md in vwxyzjn/cleanrl since its
commit 35896b1f (2023; unchanged at fe8d8a03, 2026): average episodic return of 3 seeds, 500k steps, CartPole-v1
490.04 +- 6.12, Acrobot-v1 -86.36 +- 1.32.

CleanRL's ppo.py runs when its file is at --cleanrl (default .cleanrl/ppo.py, a folder git ignores: never commit it;
`git show fe8d8a03:cleanrl/ppo.py` in a clone of vwxyzjn/cleanrl). It runs unmodified through a launcher that gives it
Gymnasium 0.29's vector-env behaviour (same-step autoreset, per-env final_info), which the installed Gymnasium 1.x
changed.

Writes benchmarks/results/cleanba_classic.md, cleanba_classic.json.gz (every run's per-update rows, gzipped) and
cleanba_classic.png (return against env steps and against wall-clock time). The json is rewritten after every run;
--resume keeps the runs it already holds. --quick runs every code path once with 1 seed and 20k steps and writes
*_quick.* files (a check of the benchmark itself, not a result).

  python benchmarks/cleanba_classic.py             # 2 scripts x 2 tasks x 2 architectures x 10 seeds and CleanRL's
                                                   # ppo.py on both tasks: about 100 runs of 2-4 minutes, 2 at a time
  python benchmarks/cleanba_classic.py --quick     # a few minutes
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
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
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5, 11, 12, 13, 14, 15)
    """the seeds of every configuration (1-5, on which the presets were chosen, and 11-15, which they were not)"""
    total_timesteps: int = 500_000
    """env steps of every run (the presets' value)"""
    actor_threads: int = 1
    """actor threads of the learning runs (1 runs twice as fast as 2 on 2 CPU cores; the algorithm is the same)"""
    scripts: tuple[str, ...] = ("impala", "ppo")
    """which scripts to run (impala, ppo); CleanRL's ppo.py runs with either"""
    jobs: int = 2
    """runs at once, each with one torch thread"""
    reproducibility: bool = False
    """also run the first seed with 1 and 2 actor threads and with a slow learner, and compare them"""
    learner_delay: float = 0.02
    """seconds of --debug-learner-delay in the slow-learner run"""
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
    cleanrl_runs: bool = True
    """run CleanRL's ppo.py on the same seeds (when its file is at --cleanrl)"""


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
    """Every run, options.jobs at a time, task by task; the json is rewritten after each (a stopped benchmark goes on
    with --resume)."""
    runs = load(saved) if options.resume and saved.exists() else {}
    runs = {key: value for key, value in runs.items() if value.get("total_timesteps") == options.total_timesteps}
    seeds = options.seeds[:1] if options.quick else options.seeds
    lock = threading.Lock()
    pending = []  # (key, a function that makes the run), in the order they start

    def record(key: str, make_run) -> None:
        result = {**make_run(), "total_timesteps": options.total_timesteps, "commit": commit()}
        with lock:
            runs[key] = result
            partial_file = saved.with_name(saved.name + ".partial")  # a stop while writing leaves the last file whole
            with gzip.open(partial_file, "wt", compresslevel=6) as f:
                f.write(json.dumps(runs))
            partial_file.replace(saved)
            print(f"{key}: {describe(result, key)}, {result['wall']:.0f} s", flush=True)

    def ours(algo: str, task: str, architecture: str, threads: int, seed: int, delay: float = 0.0) -> None:
        args = ["--env-id", task, "--seed", str(seed), "--total-timesteps", str(options.total_timesteps)]
        args += [ARCHITECTURES[architecture], "--num-actor-threads", str(threads), "--debug-learner-delay", str(delay)]
        pending.append((run_key(algo, task, architecture, threads, seed, delay), partial(run, SCRIPTS[algo], args)))

    cleanrl = Path(options.cleanrl)
    for task in TASKS:  # seed by seed (a stopped benchmark has every arm on its first seeds), then reproducibility
        for seed in seeds:
            for algo, architecture in itertools.product(options.scripts, ARCHITECTURES):
                ours(algo, task, architecture, options.actor_threads, seed)
            if options.cleanrl_runs and cleanrl.exists():
                cleanrl_run = partial(run_cleanrl, cleanrl, task, seed, options.total_timesteps)
                pending.append((run_key("cleanrl", task, "-", 0, seed), cleanrl_run))
        for algo, architecture in itertools.product(options.scripts, ARCHITECTURES):
            if options.reproducibility:
                ours(algo, task, architecture, 1, seeds[0])
                ours(algo, task, architecture, 2, seeds[0])
                ours(algo, task, architecture, 2, seeds[0], options.learner_delay)
    todo = []
    for key, make_run in pending:
        if key not in runs and key not in [queued for queued, _ in todo]:
            todo.append((key, make_run))
    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        for done in [pool.submit(record, key, make_run) for key, make_run in todo]:
            done.result()
    return runs


def returns_curve(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(env steps, seconds since the start, episodic return) of the iterations that ended episodes."""
    rows = [row for row in rows if "charts/episodic_return" in row]
    steps = np.array([row["global_step"] for row in rows], dtype=float)
    seconds = steps / np.array([row["charts/SPS"] for row in rows])
    return steps, seconds, np.array([row["charts/episodic_return"] for row in rows])


def last_tenth_return(rows: list[dict]) -> float:
    """The mean training episodic return over the last 10% of the iterations that ended episodes."""
    _, _, returns = returns_curve(rows)
    return float(np.mean(returns[-max(1, len(returns) // 10) :]))


def describe(run: dict, key: str) -> str:
    text = f"last-tenth training return {last_tenth_return(run['rows']):.1f}"
    if "eval/return" in run["summary"]:
        text = f"final eval/return {run['summary']['eval/return']:.1f}, " + text
    return text


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
                finals = f"{last_tenth_return(rows_a):.1f} vs {last_tenth_return(rows_b):.1f}"
                return f"first differs at iteration {iteration} ({key}, relative {size:.1g}); final return {finals}"
    return "bit-identical" if len(rows_a) == len(rows_b) else "identical rows, different lengths"


def median_text(values: list[float]) -> str:
    finite = [value for value in values if not np.isnan(value)]
    return f"{np.median(finite):.0f}" if finite else "never"


def command_line() -> str:
    """The benchmark's command as it was run (a --replot only redraws: left out)."""
    return shlex.join(["python", "benchmarks/cleanba_classic.py", *(arg for arg in sys.argv[1:] if arg != "--replot")])


def report(runs: dict, options: Options, suffix: str) -> None:
    seeds = list(options.seeds[:1] if options.quick else options.seeds)
    threads = options.actor_threads
    commits = Counter(run.get("commit", "?") for run in runs.values())
    lines = [
        "# Cleanba scripts on EnvPool classic control"
        + (" (--quick: a check of the benchmark, not a result)" if options.quick else ""),
        "",
        f"Command: `{command_line()}`. Machine: "
        f"{platform.node()} ({platform.processor() or platform.machine()}), {os.cpu_count()} CPUs, {options.jobs} runs "
        f"at once. Date: {time.strftime('%Y-%m-%d')}. Scripts at commit "
        + "; ".join(f"{commit_name} ({count} runs)" for commit_name, count in commits.items())
        + ".",
        "",
        f"Seeds {seeds}, {options.total_timesteps} env steps per run, {threads} actor thread(s), each script's "
        "classic-control preset. A run holds when its final eval/return (what the script prints at the end: the "
        "stochastic policy, one episode per eval env) reaches the task's threshold (475 CartPole-v1, -100 Acrobot-v1); "
        "last tenth: the mean training episodic return over the last 10% of the iterations, the measure CleanRL's "
        "ppo.py (which has no evaluation) is counted by. Steps to threshold: the first iteration whose 5-iteration "
        "mean training return reaches it.",
        "",
        "| task | script | architecture | runs holding: final eval (last tenth) | final eval/return: median, worst "
        "| seed: final eval (last tenth) | steps to threshold: median |",
        "|---|---|---|---|---|---|---|",
    ]
    arms = [("cleanrl", "-")] + [(algo, architecture) for algo in SCRIPTS for architecture in ARCHITECTURES]
    for task, threshold in TASKS.items():
        for algo, architecture in arms:
            keys = [run_key(algo, task, architecture, 0 if algo == "cleanrl" else threads, seed) for seed in seeds]
            chosen = [runs[key] for key in keys if key in runs]
            ran = [seed for seed, key in zip(seeds, keys) if key in runs]
            if not chosen:  # (not run, or a benchmark stopped early: --resume runs the rest)
                continue
            tenths = [last_tenth_return(run["rows"]) for run in chosen]
            evals = [run["summary"].get("eval/return", float("nan")) for run in chosen]
            reach = [steps_to(run["rows"], threshold) for run in chosen]
            held_tenth = sum(value >= threshold for value in tenths)
            if algo == "cleanrl":
                name = "CleanRL ppo.py (fe8d8a03), run here"
                holding = f"- ({held_tenth}/{len(chosen)})"
                finals = "-"
                per_seed = ", ".join(f"{seed}: - ({tenth:.0f})" for seed, tenth in zip(ran, tenths))
            else:
                name = f"cleanba_{algo}.py"
                holding = f"**{sum(value >= threshold for value in evals)}/{len(chosen)}** ({held_tenth}/{len(chosen)})"
                finals = f"{np.median(evals):.1f}, {min(evals):.1f}"
                per_seed = ", ".join(
                    f"{seed}: {value:.0f} ({tenth:.0f})" for seed, value, tenth in zip(ran, evals, tenths)
                )
            lines.append(
                f"| {task} | {name} | {architecture} | {holding} | {finals} | {per_seed} | {median_text(reach)} |"
            )
    lines += [
        "",
        "CleanRL's published ppo.py numbers (docs/rl-algorithms/ppo.md, 3 seeds, 500k steps): CartPole-v1 "
        "{:.2f} +- {:.2f}, Acrobot-v1 {:.2f} +- {:.2f}.".format(
            *CLEANRL_PPO["CartPole-v1"], *CLEANRL_PPO["Acrobot-v1"]
        ),
    ]
    if options.reproducibility:
        lines += [
            "",
            f"## Reproducibility (Sec. 3, Table 1): per-iteration return and losses of seed {seeds[0]}",
            "",
            "| task | script | architecture | 1 vs 2 actor threads | slow learner vs not (2 threads) |",
            "|---|---|---|---|---|",
        ]
        for task in TASKS:
            for algo in SCRIPTS:
                for architecture in ARCHITECTURES:

                    def difference(key_a: str, key_b: str) -> str:
                        both = key_a in runs and key_b in runs
                        return compare(runs[key_a]["rows"], runs[key_b]["rows"]) if both else "not run"

                    two = run_key(algo, task, architecture, 2, seeds[0])
                    one = difference(run_key(algo, task, architecture, 1, seeds[0]), two)
                    slow = difference(two, run_key(algo, task, architecture, 2, seeds[0], options.learner_delay))
                    lines.append(f"| {task} | cleanba_{algo}.py | {architecture} | {one} | {slow} |")
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
                    key = run_key(algo, task, architecture, options.actor_threads, seed)
                    if key not in runs:
                        continue
                    steps, seconds, returns = returns_curve(runs[key]["rows"])
                    label = f"cleanba_{algo}.py, {architecture}" if seed == seeds[0] else None
                    color = "C0" if algo == "ppo" else "C1"
                    axes[0, column].plot(steps, returns, style, color=color, alpha=0.6, label=label)
                    axes[1, column].plot(seconds, returns, style, color=color, alpha=0.6, label=label)
        cleanrl = [
            runs[run_key("cleanrl", task, "-", 0, seed)]["rows"]
            for seed in seeds
            if run_key("cleanrl", task, "-", 0, seed) in runs
        ]
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
            axes[row, column].set_title(f"{task} (seeds {seeds}, {options.actor_threads} actor thread(s))")
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
