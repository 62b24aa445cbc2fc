"""The staggered advance of ppo_staggered.py on MuJoCo (App. B.1): what its actions do to the robots before training,
and what the observation normalizer would learn from it.

App. B.1 advances group j by j x S steps before training, "typically performed with random actions or the initial
policy". On HalfCheetah-v5 the advance is up to (N_B - 1) x S = 992 steps long (H = 1000, K = S = 8, N_B = 125), long
enough for actions to flip a cheetah onto its back, where it starts training (and may learn to run upside down). On
Hopper-v5 a hopper that falls terminates, and waits for the next reset gate (Sec. 3.3).

This runs ppo_staggered.stagger_advance itself (MuJoCo preset, N = 256, CPU) from a fresh agent, as a training run
would, with three kinds of actions:
  random          uniform in the action bounds (--advance-actions random)
  policy mean     the initial policy's mean action (--advance-actions policy)
  policy sample   the initial policy's sampled actions (a Gaussian around that mean, std exp(-0.5) = 0.61)
and reports, per task and kind, over seeds 1-3 (mean, per seed):
  on back at start   HalfCheetah: the share of envs with |rooty| > pi/2 when training starts
  ever flipped       HalfCheetah: the share of envs that were on their back at any step of the advance
  fell               Hopper: the share of envs that terminated (fell) at least once during the advance
  waiting at start   the share of envs waiting for a reset gate when training starts
  pitch std          the std of the pitch observation (rooty, observation 1) that the normalizer holds when training
                     starts: learned from every observation of the advance (as ppo_staggered.py did), or from the
                     observations trained on only (as it does now), and from reset states alone (a reference).

  python benchmarks/stagger_advance.py            # about 10 minutes on 2 cores
  python benchmarks/stagger_advance.py --quick    # N = 16, H = 100: a check of the benchmark (not a result)
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import ppo_staggered  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TASKS = ("HalfCheetah-v5", "Hopper-v5")
KINDS = ("random", "policy mean", "policy sample")


@dataclass
class Options:
    seeds: int = 3
    """seeds 1..seeds of every task and kind"""
    num_envs: int = 256
    """N (the MuJoCo preset's)"""
    quick: bool = False
    """N = 16, H = 100, one seed: a check of the benchmark, written to *_quick.* files"""
    output: str = str(RESULTS)
    """where the md and json go"""


def measure(task: str, kind: str, seed: int, options: Options) -> dict:
    """One staggered advance from a fresh agent, seeded as a training run is; what it left when training starts."""
    flags = dict(env_id=task, cuda=False, seed=seed, num_envs=16 if options.quick else options.num_envs)
    flags["advance_actions"] = "random" if kind == "random" else "policy"
    if options.quick:
        flags["horizon"] = 100
    args = ppo_staggered.resolve_args(ppo_staggered.Args(**flags))
    torch.manual_seed(seed)
    np.random.seed(seed)
    device = torch.device("cpu")
    envs = ppo_staggered.make_env(args, args.num_envs, device, evaluation=False)
    agent = ppo_staggered.make_agent(envs)
    obs_rms = ppo_staggered.RunningMeanStd(envs.single_observation_space.shape, device)
    every_obs_rms = ppo_staggered.RunningMeanStd(envs.single_observation_space.shape, device)  # the former normalizer
    reset_obs_rms = ppo_staggered.RunningMeanStd(envs.single_observation_space.shape, device)  # reset states only
    resets = ppo_staggered.ResetState(args.num_envs, device, next_step_mode=False)
    fell = torch.zeros(args.num_envs, dtype=torch.bool)
    flipped = torch.zeros(args.num_envs, dtype=torch.bool)
    step, reset = envs.step, envs.reset

    def recorded_step(actions):
        result = step(actions)
        raw_obs, _, terminated, _, _ = result
        every_obs_rms.update(raw_obs)
        fell.logical_or_(terminated)
        flipped.logical_or_(raw_obs[:, 1].abs() > math.pi / 2)
        return result

    def recorded_reset(**kwargs):
        raw_obs, info = reset(**kwargs)
        mask = (kwargs.get("options") or {}).get("reset_mask")
        reset_obs_rms.update(raw_obs, mask)
        if mask is None:
            every_obs_rms.update(raw_obs)
        return raw_obs, info

    envs.step, envs.reset = recorded_step, recorded_reset
    if kind == "policy sample":  # the third kind, measured here only: the policy samples where it takes its mean
        agent.deterministic_action = lambda obs: agent.get_action_and_value(obs)[0]
    try:
        start = time.time()
        raw_obs = ppo_staggered.stagger_advance(envs, resets, agent, obs_rms, args, seed)
        wall = time.time() - start
    finally:
        envs.close()
    obs_rms.update(raw_obs, resets.trained_on())  # what training's normalizer starts from
    return {
        "on_back_at_start": (raw_obs[:, 1].abs() > math.pi / 2).float().mean().item(),
        "ever_flipped": flipped.float().mean().item(),
        "fell": fell.float().mean().item(),
        "waiting_at_start": resets.waiting.float().mean().item(),
        "pitch_std_every_obs": every_obs_rms.var[1].sqrt().item(),
        "pitch_std_trained_on": obs_rms.var[1].sqrt().item(),
        "pitch_std_resets": reset_obs_rms.var[1].sqrt().item(),
        "advance_steps": args.num_stagger_groups * args.stagger_step - args.stagger_step,
        "wall_s": wall,
    }


def cell(runs: list[dict], key: str, digits: int = 2) -> str:
    values = [run[key] for run in runs]
    return f"{np.mean(values):.{digits}f} ({', '.join(f'{value:.{digits}f}' for value in values)})"


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    changed = subprocess.run(["git", "status", "--porcelain", "--", "*.py"], capture_output=True, text=True, cwd=ROOT)
    return head.strip() + (" + changes" if changed.stdout.strip() else "")


def main(options: Options) -> None:
    seeds = range(1, 2 if options.quick else options.seeds + 1)
    started = time.time()
    results = {
        f"{task}|{kind}": [measure(task, kind, seed, options) for seed in seeds] for task in TASKS for kind in KINDS
    }
    suffix = "_quick" if options.quick else ""
    header = {
        "command": "python benchmarks/stagger_advance.py" + (" --quick" if options.quick else ""),
        "machine": f"{platform.node()} ({platform.machine()}, CPU)",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "minutes": (time.time() - started) / 60,
    }
    Path(options.output, f"stagger_advance{suffix}.json").write_text(
        json.dumps({**header, "results": results}, indent=1)
    )
    lines = [
        "# The staggered advance on MuJoCo: what its actions do to the robots, and what the normalizer learns from it",
        "",
        f"- Command: `{header['command']}`",
        f"- Machine: {header['machine']}; {header['minutes']:.0f} minutes",
        f"- Date: {header['date']}; commit {header['commit']}",
        "",
        "ppo_staggered.stagger_advance from a fresh agent (MuJoCo preset, "
        f"N = {16 if options.quick else options.num_envs},"
        f" seeds {', '.join(map(str, seeds))}), mean (per seed). See the script's docstring for each column.",
        "",
        "| task | advance actions | advance steps | on back at start | ever flipped | fell | waiting at start "
        "| pitch std: every observation | pitch std: trained on | pitch std: reset states |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task in TASKS:
        for kind in KINDS:
            runs = results[f"{task}|{kind}"]
            cheetah = task == "HalfCheetah-v5"
            cells = [
                task,
                kind,
                str(runs[0]["advance_steps"]),
                cell(runs, "on_back_at_start") if cheetah else "-",
                cell(runs, "ever_flipped") if cheetah else "-",
                "-" if cheetah else cell(runs, "fell"),
                cell(runs, "waiting_at_start"),
                cell(runs, "pitch_std_every_obs", 3),
                cell(runs, "pitch_std_trained_on", 3),
                cell(runs, "pitch_std_resets", 3),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## What the numbers say", "", "(written from the numbers above)", ""]
    Path(options.output, f"stagger_advance{suffix}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Options))
