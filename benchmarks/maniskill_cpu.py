"""ppo_staggered.py, ppo_ver.py and pql.py learning a real simulated task, PushCube-v1 on ManiSkill3's CPU simulation
(physx_cpu, one process per env), each beside the baseline its paper ran, run as a user runs them (subprocesses).

Arms (--scripts picks the scripts; the first two arms of a script are its headline pair, run with --seeds seeds; the
third arm runs with seed 1 only):
  ppo_staggered.py  staggered resets (Sec. 3.3) | naive synchronous resets (--no-stagger) | random-start
                    (--reset-scheme random-start, legged_gym's init_at_random_ep_len)
  ppo_ver.py        VER (Sec. 2.2) | NoVER (--no-variable-experience) | SyncOnRL, DD-PPO's collection (--sync);
                    the env workers simulate for real (physx_cpu), VER's own setting; env utilization reported
  pql.py            PQL (three processes, Sec. 3) | DDPG(n) (--ddpg-n, Sec. 4.1)
Evaluation is ManiSkill's protocol in every script: deterministic policy, no partial resets (a success does not end
an evaluation episode), the scene reconfigured at every evaluation reset, at least 8 eval episodes, eval/success_once
and eval/success_at_end. Per arm: env steps and minutes from launch to the first evaluation with eval/success_once >=
0.9 (median over seeds; "not reached" is a result) and the final evaluation's success. Env steps are the scripts'
global_step (trained on); ppo_staggered.py's staggered advance, (N_B - 1) x S x N env steps before training that it
leaves out, has a column of its own and is added to them in another.

Writes benchmarks/results/maniskill_cpu.md, maniskill_cpu.json (every run's curves) and maniskill_cpu_{script}.png
(success_once and success_at_end against env steps and against minutes). --quick runs the headline pair of the first
script with one seed and fewer steps and writes *_quick.* files instead.

  python benchmarks/maniskill_cpu.py            # 20 runs: 108 minutes on an idle 2-core machine
  python benchmarks/maniskill_cpu.py --quick    # ppo_staggered.py, staggered vs naive, seed 1: about 5 minutes idle
  python benchmarks/maniskill_cpu.py --resume   # after a stop: keeps the runs the JSON has, runs the rest
  python benchmarks/maniskill_cpu.py --scripts ppo_ver pql --seeds 2
  python benchmarks/maniskill_cpu.py --env-id PickCube-v1 --scripts ppo_staggered --arms 1 --seeds 1 --steps 360000
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.stagger_schedule import advance_env_steps  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ENV_ID = "PushCube-v1"
THRESHOLD = 0.9  # eval/success_once
ScriptName = Literal["ppo_staggered", "ppo_ver", "pql"]
# Per script: (flags of every run, env steps of a full run, env steps of a --quick run). 8 training envs and at least 8
# eval episodes everywhere; evaluations every ~2-2.5k env steps. The step budgets keep the whole benchmark within 2
# hours on 2 cores (measured on an idle machine, start-up and evaluations included: ppo_staggered 4.6-5.1 minutes a
# run, ppo_ver 4.0-4.4, pql 6 and DDPG(n) 9; 108 minutes in all); longer single runs are in README.md.
COMMON: dict[str, tuple[list[str], int, int]] = {
    # K = 16 (ManiSkill's PPO for tasks without a Table 3 row): one iteration is 128 env steps, eval every 2,560
    "ppo_staggered": (["--num-envs", "8", "--num-eval-envs", "8", "--eval-freq", "20"], 100_000, 40_000),
    # T = 16: one iteration is 128 env steps, eval every 2,048; 16 eval episodes one after another
    "ppo_ver": (["--num-envs", "8", "--num-eval-episodes", "16", "--eval-freq", "16"], 60_000, 30_000),
    # one Actor step is 8 env steps, eval every 2,000; pql.py's CPU preset: batch 256, 4 V-updates (2 P-updates) per
    # Actor step, gamma 0.8 (with 0.99, the paper's Isaac Gym value, no seed succeeded in 32k steps: README.md)
    "pql": (["--num-envs", "8", "--num-eval-envs", "8", "--eval-freq", "250"], 32_000, 16_000),
}
# Per script: (arm name, its flags); the first two are the headline pair.
ARMS: dict[str, list[tuple[str, list[str]]]] = {
    "ppo_staggered": [
        ("staggered", []),
        ("naive (--no-stagger)", ["--no-stagger"]),
        ("random-start", ["--reset-scheme", "random-start"]),
    ],
    "ppo_ver": [
        ("VER", []),
        ("NoVER (--no-variable-experience)", ["--no-variable-experience"]),
        ("SyncOnRL (--sync)", ["--sync"]),
    ],
    "pql": [("PQL", []), ("DDPG(n) (--ddpg-n)", ["--ddpg-n"])],
}
CURVES = ("eval/success_once", "eval/success_at_end")


@dataclass
class Options:
    scripts: tuple[ScriptName, ...] = ("ppo_staggered", "ppo_ver", "pql")
    """scripts to run, in this order"""
    seeds: int = 3
    """seeds 1..seeds of each script's headline pair (the third arm: seed 1)"""
    env_id: str = ENV_ID
    """the ManiSkill3 task; another than PushCube-v1 writes maniskill_cpu_{env_id}* files (e.g. PickCube-v1 with
    --scripts ppo_staggered --arms 1 --seeds 1 --steps 360000: one arm, where the curve of a harder task goes)"""
    arms: int = 3
    """the first ARMS of each script (1: the paper's method only; 2: the headline pair)"""
    quick: bool = False
    """the headline pair of the first of --scripts, seed 1, fewer steps; writes *_quick.* files (not the result)"""
    steps: Optional[int] = None
    """env steps of every run (default: each script's budget; a small value checks the benchmark end to end)"""
    out: str = str(RESULTS)
    """where the markdown, JSON and PNGs go"""
    replot: bool = False
    """only rewrite the tables and figures from the saved JSON"""
    resume: bool = False
    """keep the runs the saved JSON already has (same script, arm, seed and steps) and run only the others"""
    commit: tyro.conf.Suppress[str] = ""
    argv: tyro.conf.Suppress[list[str]] = field(default_factory=lambda: sys.argv[1:])
    load: tyro.conf.Suppress[Optional[float]] = None


def read_scalars(run_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """{tag: [(wall time, step, value), ...]} of a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.wall_time, e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def command_line(env_id: str, script: str, flags: list[str], total_timesteps: int) -> list[str]:
    """The run's command, seed and output directory left out."""
    command = [f"{script}.py", "--env-id", env_id, "--no-cuda", "--total-timesteps", str(total_timesteps)]
    return command + [*COMMON[script][0], *flags]


def run_one(env_id: str, script: str, flags: list[str], seed: int, total_timesteps: int) -> dict:
    """One run of `script` as a user runs it; its evaluation curves against env steps and minutes since launch."""
    command = command_line(env_id, script, flags, total_timesteps)
    with tempfile.TemporaryDirectory() as out:
        launched = time.time()
        proc = subprocess.run(
            [sys.executable, *command, "--seed", str(seed), "--output-dir", out],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
        )
        wall = time.time() - launched
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} --seed {seed} failed:\n{proc.stderr[-3000:]}")
        run_dir = next(path for path in Path(out).iterdir() if path.is_dir())
        scalars = read_scalars(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
    curves = {
        tag: {
            "steps": [step for _, step, _ in scalars[tag]],
            "minutes": [(wall_time - launched) / 60 for wall_time, _, _ in scalars[tag]],
            "values": [value for _, _, value in scalars[tag]],
        }
        for tag in CURVES
    }
    utilization = [value for _, _, value in scalars.get("ver/env_utilization", [])]
    trained_on = [value for _, _, value in scalars.get("stagger/valid_fraction", [])]  # ppo_staggered.py
    return {
        "command": "python " + " ".join(command),
        "seed": seed,
        "curves": curves,
        "wall_s": wall,
        "sps": summary.get("sps"),
        "global_step": summary.get("global_step"),
        "env_utilization": float(np.mean(utilization)) if utilization else None,
        "trained_on_fraction": float(np.mean(trained_on)) if trained_on else None,
        "advance_env_steps": summary.get("advance_env_steps", 0),  # ppo_staggered.py's (not in global_step); else 0
    }


def run_advance(run: dict) -> int:
    """The env steps of a run's staggered advance, which its env steps (global_step, training) leave out: as the run
    recorded it, or, for runs saved before they did, advance_env_steps of its command's N (--num-envs) and K and H
    (--num-steps, --horizon, else ppo_staggered.py's preset for the task and the task's registered time limit); 0
    for ppo_ver.py, pql.py and ppo_staggered.py's naive and random-start runs."""
    if run.get("advance_env_steps") is not None:
        return run["advance_env_steps"]
    words = run["command"].split()

    def flag(name: str, default=None):
        return words[words.index(name) + 1] if name in words else default

    if words[1] != "ppo_staggered.py" or "--no-stagger" in words or flag("--reset-scheme", "staggered") != "staggered":
        return 0
    from mani_skill.utils.registration import REGISTERED_ENVS

    import ppo_staggered as ppo

    env_id = flag("--env-id")
    preset = ppo.PRESETS.get(env_id, ppo.MANISKILL_OTHER)
    num_envs = int(flag("--num-envs", ppo.MANISKILL_CPU_TRIAL["num_envs"]))
    horizon = int(flag("--horizon", preset.get("horizon") or REGISTERED_ENVS[env_id].max_episode_steps))
    return advance_env_steps(num_envs, horizon, int(flag("--num-steps", preset["num_steps"])))


def to_threshold(run: dict) -> tuple[float, float]:
    """(env steps, minutes since launch) of the first evaluation with success_once >= 0.9; nan, nan if none."""
    curve = run["curves"]["eval/success_once"]
    for step, minutes, value in zip(curve["steps"], curve["minutes"], curve["values"]):
        if value >= THRESHOLD:
            return float(step), float(minutes)
    return float("nan"), float("nan")


def plan(options: Options) -> list[tuple[str, str, list[str], int, int]]:
    """(script, arm, flags, seed, total steps) of every run: arms interleaved per seed, their order alternating from
    seed to seed, so that a drift of a shared machine does not favour one arm."""
    runs = []
    scripts = options.scripts[:1] if options.quick else options.scripts
    seeds = range(1, 2 if options.quick else options.seeds + 1)
    for script in scripts:
        _, full_steps, quick_steps = COMMON[script]
        arms = ARMS[script][: 2 if options.quick else options.arms]
        for seed in seeds:
            chosen = [(name, flags) for index, (name, flags) in enumerate(arms) if index < 2 or seed == 1]
            for name, flags in chosen if seed % 2 == 1 else chosen[::-1]:
                runs.append(
                    (script, name, flags, seed, options.steps or (quick_steps if options.quick else full_steps))
                )
    return runs


def run_all(options: Options, saved: Path) -> dict:
    """Every run of the plan; the JSON is rewritten after each run, so that a stopped benchmark keeps what it ran."""
    results: dict[str, dict[str, list[dict]]] = {}
    earlier, start = (json.loads(saved.read_text()) if options.resume and saved.exists() else {}), time.time()
    for script, arm, flags, seed, steps in plan(options):
        command = "python " + " ".join(command_line(options.env_id, script, flags, steps))
        kept = [
            dict(run, commit=run.get("commit", earlier.get("commit")))
            for run in earlier.get("results", {}).get(script, {}).get(arm, [])
            if run["seed"] == seed and run["command"] == command
        ]
        if kept:  # the same command and seed: a run of a scripts' commit that may be older than this one
            results.setdefault(script, {}).setdefault(arm, []).append(kept[0])
            continue
        run = dict(run_one(options.env_id, script, flags, seed, steps), commit=options.commit)
        results.setdefault(script, {}).setdefault(arm, []).append(run)
        reached_steps, reached_minutes = to_threshold(run)
        final = run["curves"]["eval/success_once"]["values"][-1]
        print(
            f"{script} {arm} seed {seed}: success_once >= {THRESHOLD} at {fmt(reached_steps)} steps "
            f"({fmt(reached_minutes, 1)} min), final {final:.2f}, {run['wall_s'] / 60:.1f} min",
            flush=True,
        )
        record = {
            "wall_s": earlier.get("wall_s", 0) + time.time() - start,
            "commit": options.commit,
            "argv": sys.argv[1:],
            "load": options.load,
        }
        saved.write_text(json.dumps({**record, "results": results}))
    return results


def late_mean(run: dict) -> float:
    """Mean eval/success_once over the last quarter of a run's evaluations: where a run ends up, less swayed than its
    final evaluation by the 8 eval episodes' coin flips."""
    values = run["curves"]["eval/success_once"]["values"]
    return float(np.mean(values[-max(1, len(values) // 4) :]))


def commit() -> str:
    """The commit the scripts were run at (with "+ changes" when the work tree differs from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    changed = subprocess.run(["git", "status", "--porcelain", "--", "*.py"], capture_output=True, text=True, cwd=ROOT)
    return head.strip() + (" + changes" if changed.stdout.strip() else "")


def at_commits(results: dict, default: str) -> str:
    """The commits the runs measured, per script when they differ (a --resume keeps older runs)."""
    commits = {
        s: sorted({run.get("commit") or default for runs in arms.values() for run in runs})
        for s, arms in results.items()
    }
    if len({c for cs in commits.values() for c in cs}) == 1:
        return next(iter(commits.values()))[0]
    return "; ".join(f"{script}.py {', '.join(cs)}" for script, cs in commits.items())


def fmt(value: float, digits: int = 0) -> str:
    return "not reached" if np.isnan(value) else f"{value:,.{digits}f}"


def report(results: dict, options: Options, wall_s: float, suffix: str, header: list[str] = ()) -> str:
    with_baselines = any(len(arms) > 1 for arms in results.values())
    lines = [
        f"# ManiSkill3 {options.env_id} on CPU simulation: "
        + ", ".join(f"{script}.py" for script in results)
        + (" beside their baselines" if with_baselines else ", the paper's method")
        + (" (--quick: a check of the benchmark, not the result)" if options.quick else ""),
        "",
        *header,
        *([""] if header else []),
        f"Written by `python benchmarks/maniskill_cpu.py {' '.join(options.argv)}` on {platform.node()} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, no GPU) in {wall_s / 60:.0f} min, "
        f"scripts at commit {at_commits(results, options.commit)}, "
        + (f"load average {options.load:.1f} at the start. " if options.load is not None else "load not recorded. ")
        + "physx_cpu simulation, one process per env, 8 training envs. Evaluation (ManiSkill's protocol): "
        "deterministic policy, no partial resets, the scene reconfigured at every evaluation reset, 8 eval envs "
        "(ppo_ver.py: 16 "
        f"episodes one after another). Steps and minutes to {THRESHOLD}: the first evaluation with eval/success_once "
        f">= {THRESHOLD}, minutes from launching the process (start-up, ppo_staggered.py's advance and evaluations "
        "included); median over the seeds that reached it, and how many did. Env steps, trained on: the script's "
        "global_step. Advance: ppo_staggered.py's staggered advance before training, (N_B - 1) x S x N env steps "
        "with N_B = min(ceil(H / K), N) groups S = max(K, floor(H / N_B)) steps apart, not trained on and not in "
        "global_step (the other arms have none); advance included: the two added, every env step the simulator "
        "took. Final: the last evaluation; best: the highest; last quarter: the "
        "mean of the last quarter of the evaluations. Minutes depend on what else ran on the machine; env steps do "
        "not. Trained-on fraction (ppo_staggered.py): the share of env steps not masked out of the loss (an env "
        "waiting for a reset gate), mean over the run's updates (-: a run recorded before this column).",
        "",
        "| script | arm | seeds reached 0.9 | env steps to 0.9, trained on: median (per seed) | advance (env steps) "
        "| env steps to 0.9, advance included: median (per seed) | minutes to 0.9: median "
        "| final success_once (per seed) | final success_at_end (per seed) | best success_once (per seed) "
        "| success_once, mean of the last quarter (per seed) | steps/s | env utilization | trained-on fraction |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for script, arms in results.items():
        for arm, runs in arms.items():
            reached = [to_threshold(run) for run in runs]
            steps = np.array([step for step, _ in reached])
            advances = [run_advance(run) for run in runs]
            simulated = steps + np.array(advances)
            minutes = np.array([minute for _, minute in reached])
            hits = ~np.isnan(steps)
            finals = {tag: [run["curves"][tag]["values"][-1] for run in runs] for tag in CURVES}
            best = [max(run["curves"][CURVES[0]]["values"]) for run in runs]
            late = [late_mean(run) for run in runs]
            utilization = [run["env_utilization"] for run in runs if run["env_utilization"] is not None]
            trained_on = [run.get("trained_on_fraction") for run in runs]
            lines.append(
                f"| {script}.py | {arm} | {hits.sum()}/{len(runs)} | "
                f"{fmt(np.median(steps[hits]) if hits.any() else np.nan)} ({', '.join(fmt(s) for s in steps)}) | "
                f"{', '.join(f'{a:,}' for a in sorted(set(advances)))} | "
                f"{fmt(np.median(simulated[hits]) if hits.any() else np.nan)} "
                f"({', '.join(fmt(s) for s in simulated)}) | "
                f"{fmt(np.median(minutes[hits]) if hits.any() else np.nan, 1)} | "
                f"{np.median(finals[CURVES[0]]):.2f} ({', '.join(f'{v:.2f}' for v in finals[CURVES[0]])}) | "
                f"{np.median(finals[CURVES[1]]):.2f} ({', '.join(f'{v:.2f}' for v in finals[CURVES[1]])}) | "
                f"{np.median(best):.2f} ({', '.join(f'{v:.2f}' for v in best)}) | "
                f"{np.median(late):.2f} ({', '.join(f'{v:.2f}' for v in late)}) | "
                f"{np.median([run['sps'] or np.nan for run in runs]):.0f} | "
                f"{f'{np.mean(utilization):.2f}' if utilization else '-'} | "
                f"{', '.join('-' if value is None else f'{value:.2f}' for value in trained_on)} |"
            )
    lines += ["", "Commands (each run adds `--seed S --output-dir DIR`):", ""]
    for script, arms in results.items():
        for arm, runs in arms.items():
            lines.append(f"- {script}.py, {arm}: `{runs[0]['command']}`")
    text = "\n".join(lines) + "\n"
    (Path(options.out) / f"maniskill_cpu{suffix}.md").write_text(text)
    return text


def plot(results: dict, options: Options, suffix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for script, arms in results.items():
        figure, axes = plt.subplots(2, 2, figsize=(11, 7), squeeze=False)
        for color, (arm, runs) in enumerate(arms.items()):
            for index, run in enumerate(runs):
                for row, tag in enumerate(CURVES):
                    curve = run["curves"][tag]
                    label = arm if index == 0 else None
                    steps = np.array(curve["steps"]) + run_advance(run)  # every env step simulated by then
                    axes[row, 0].plot(steps, curve["values"], color=f"C{color}", alpha=0.7, label=label)
                    axes[row, 1].plot(curve["minutes"], curve["values"], color=f"C{color}", alpha=0.7, label=label)
        for row, tag in enumerate(CURVES):
            steps_label = "env steps (staggered: the advance included)" if script == "ppo_staggered" else "env steps"
            for column, xlabel in enumerate((steps_label, "minutes since launch (2 CPU cores)")):
                axes[row, column].axhline(THRESHOLD, color="gray", linestyle="--", linewidth=1)
                axes[row, column].set_xlabel(xlabel)
                axes[row, column].set_ylabel(tag)
                axes[row, column].set_ylim(-0.05, 1.05)
        axes[0, 0].legend(fontsize=8)
        figure.suptitle(f"{script}.py on {options.env_id}, physx_cpu, 8 envs (one line per seed)")
        figure.tight_layout()
        figure.savefig(Path(options.out) / f"maniskill_cpu_{script}{suffix}.png", dpi=100)
        plt.close(figure)


def main(options: Options) -> None:
    suffix = ("" if options.env_id == ENV_ID else f"_{options.env_id}") + ("_quick" if options.quick else "")
    options.commit = commit()  # what the runs measure (a --replot takes the saved one)
    options.load = os.getloadavg()[0]  # what else ran: the minutes depend on it
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / f"maniskill_cpu{suffix}.json"
    header = []
    if options.replot:
        stored = json.loads(saved.read_text())
        results, wall_s = stored["results"], stored["wall_s"]
        header.append(
            f"Tables regenerated from the saved json on {time.strftime('%Y-%m-%d')} at commit {options.commit}, "
            f"ppo_staggered.py's advance counted (`python benchmarks/maniskill_cpu.py {' '.join(options.argv)}`; no "
            "run repeated). The runs: as below."
        )
        options.commit, options.argv = stored.get("commit", options.commit), stored.get("argv", options.argv)
        options.load = stored.get("load")
    else:
        results = run_all(options, saved)
        wall_s = json.loads(saved.read_text())["wall_s"]
    print(report(results, options, wall_s, suffix, header))
    plot(results, options, suffix)


if __name__ == "__main__":
    main(tyro.cli(Options))
