"""StackCube-v1 on a GPU: staggered vs naive PPO (paper Sec. 5, App. A Table 1, K = 8 column), and training speed
side by side with ManiSkill's own PPO baselines at the same settings.

Paper (RTX 4090, Table 3 settings: N = 4096, K = 8, H = 100, gamma 0.8, lambda 0.9; 3 seeds):
  env steps to > 75% success   staggered 16.2 ± 0.2 M     naive 35.8 ± 4.5 M
  minutes to > 75% success     staggered 16.6 ± 3.2       naive 26.2 ± 2.1
Success is eval/success_once of the separate evaluation envs (128, deterministic, no partial resets). Env steps are
ppo_staggered.py's global_step (trained on) and, beside them, with the staggered advance added ((N_B - 1) x S x N env
steps before training, not in global_step: 12 x 8 x 4096 = 0.39M here); minutes count from launching the run
(start-up and the advance included).

The speed part runs ppo_staggered.py (eager and --cudagraphs) and, if --maniskill-ppo-dir points at a ManiSkill
checkout's examples/baselines/ppo, its ppo.py and ppo_fast.py --cudagraphs as they are (they are not copied into
this project), each for the same number of steps with the same N and K, and compares their training steps/s.

Writes benchmarks/results/stackcube_gpu.md and stackcube_gpu.json. Needs a CUDA GPU, except with --smoke (a tiny
CPU-simulation run that checks this script end to end).

  python benchmarks/stackcube_gpu.py --seeds 3 --total-timesteps 50_000_000
  python benchmarks/stackcube_gpu.py --skip-learning --maniskill-ppo-dir ~/ManiSkill/examples/baselines/ppo
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAPER = {"steps_M": {True: (16.2, 0.2), False: (35.8, 4.5)}, "minutes": {True: (16.6, 3.2), False: (26.2, 2.1)}}


@dataclass
class Options:
    seeds: int = 3
    """seeds per method"""
    total_timesteps: int = 50_000_000
    """training steps per learning run (the paper's staggered runs pass 75% near 16M, naive near 36M)"""
    eval_freq: int = 10
    """evaluate every this many iterations (10 x 4096 x 8 = 328k steps)"""
    threshold: float = 0.75
    """success threshold (Table 1: > 75%)"""
    speed_timesteps: int = 5_000_000
    """steps per speed run"""
    skip_learning: bool = False
    """only the speed comparison"""
    maniskill_ppo_dir: Optional[str] = None
    """a ManiSkill checkout's examples/baselines/ppo, to time its ppo.py and ppo_fast.py beside ours"""
    smoke: bool = False
    """a tiny CPU-simulation run of this script (2 envs, a few hundred steps) to check it end to end"""
    output: str = str(RESULTS)
    """where stackcube_gpu.md / .json go"""


def scalars(run_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def first_crossing(series, threshold: float, start_time: float):
    """(env steps, minutes) at the first evaluation with success >= threshold, or (None, None)."""
    for step, wall, value in series:
        if value >= threshold:
            return step, (wall - start_time) / 60.0
    return None, None


def run_ours(extra: list[str], out_dir: str, name: str) -> str:
    """One ppo_staggered.py run on StackCube-v1; its run directory (TensorBoard events, summary.json)."""
    cmd = [
        sys.executable,
        str(ROOT / "ppo_staggered.py"),
        "--env-id",
        "StackCube-v1",
        "--output-dir",
        out_dir,
        "--exp-name",
        name,
        *extra,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    dirs = [d for d in Path(out_dir).glob(f"StackCube-v1__{name}__*") if d.is_dir()]
    return str(max(dirs, key=os.path.getmtime))


def median_train_sps(s: dict, batch: int) -> float:
    rollout = np.array([v for _, _, v in s["time/rollout"]])[1:]
    update = np.array([v for _, _, v in s["time/update"]])[1:]
    return float(np.median(batch / (rollout + update)))


def learning(options: Options, tmp: str, size: list[str]) -> list[dict]:
    rows = []
    for seed in range(1, options.seeds + 1):
        for stagger in (True, False):
            name = f"{'stag' if stagger else 'naive'}_s{seed}"
            launched = time.time()
            run_dir = run_ours(
                size
                + [
                    "--seed",
                    str(seed),
                    "--total-timesteps",
                    str(options.total_timesteps),
                    "--eval-freq",
                    str(options.eval_freq),
                    "--stagger" if stagger else "--no-stagger",
                ],
                tmp,
                name,
            )
            s = scalars(run_dir)
            steps, minutes = first_crossing(s["eval/success_once"], options.threshold, launched)
            summary = json.loads((Path(run_dir) / "summary.json").read_text())
            rows.append(
                {
                    "seed": seed,
                    "stagger": stagger,
                    "steps": steps,
                    "advance_env_steps": summary["advance_env_steps"],  # (not in steps, which count training)
                    "minutes": minutes,
                    "final_success_once": s["eval/success_once"][-1][2],
                    "final_success_at_end": s["eval/success_at_end"][-1][2],
                }
            )
            print(rows[-1], flush=True)
    return rows


def speed(options: Options, tmp: str, size: list[str], batch: int) -> list[dict]:
    rows = []
    modes = [("ppo_staggered.py (eager)", [])] + (
        [] if options.smoke else [("ppo_staggered.py --cudagraphs", ["--cudagraphs"])]
    )
    for label, flags in modes:
        run_dir = run_ours(
            size + ["--total-timesteps", str(options.speed_timesteps), "--eval-freq", "100000"] + flags,
            tmp,
            "speed" + "_".join(flags).replace("-", ""),
        )
        rows.append({"script": label, "train_sps": median_train_sps(scalars(run_dir), batch)})
        print(rows[-1], flush=True)
    if options.maniskill_ppo_dir:
        common = [
            "--env_id",
            "StackCube-v1",
            "--num_envs",
            "4096",
            "--num_steps",
            "8",
            "--update_epochs",
            "4",
            "--num_minibatches",
            "32",
            "--gamma",
            "0.8",
            "--gae_lambda",
            "0.9",
            "--total_timesteps",
            str(options.speed_timesteps),
            "--eval_freq",
            "100000",
            "--no-capture-video",
            "--no-save-model",
        ]
        for script, flags in (("ppo.py", []), ("ppo_fast.py", []), ("ppo_fast.py", ["--cudagraphs"])):
            if not (Path(options.maniskill_ppo_dir) / script).exists():
                print(f"(no {script} in {options.maniskill_ppo_dir}: skipped)", flush=True)
                continue
            work = tempfile.mkdtemp(dir=tmp)
            cmd = [sys.executable, str(Path(options.maniskill_ppo_dir) / script), *common, *flags]
            print("$", " ".join(cmd), flush=True)
            if subprocess.run(cmd, cwd=work).returncode != 0:
                print(f"(ManiSkill {script} failed: no row)", flush=True)
                continue
            run_dir = next(p.parent for p in Path(work).rglob("events.out.tfevents.*"))
            s = scalars(str(run_dir))
            rollout = np.array([v for _, _, v in s["time/rollout_time"]])[1:]
            update = np.array([v for _, _, v in s["time/update_time"]])[1:]
            rows.append(
                {
                    "script": f"ManiSkill {script} {' '.join(flags)}".strip(),
                    "train_sps": float(np.median(batch / (rollout + update))),
                    "note": "median of batch / (time/rollout_time + time/update_time), as for ours",
                }
            )
            print(rows[-1], flush=True)
    return rows


def write_report(options: Options, learn: list[dict], fast: list[dict], path: Path) -> None:
    lines = [
        "# StackCube-v1 on a GPU: staggered vs naive PPO, and speed beside ManiSkill's PPO",
        "",
        "`python benchmarks/stackcube_gpu.py" + (" --smoke" if options.smoke else "") + "`",
        "",
    ]
    if learn:
        lines += [
            f"## Env steps and minutes to eval success_once >= {options.threshold}",
            "",
            "| resets | env steps (M), ours, trained on | advance (M env steps) | env steps (M), ours, advance included "
            "| minutes, ours (from launch) | reached | env steps (M), paper | minutes, paper |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for stagger in (True, False):
            runs = [r for r in learn if r["stagger"] == stagger]
            hit = [r for r in runs if r["steps"] is not None]
            advance = sorted({r.get("advance_env_steps", 0) / 1e6 for r in runs})
            steps, simulated = (
                f"{np.mean(values) / 1e6:.1f} ± {np.std(values) / 1e6:.1f}" if hit else "DNC"
                for values in (
                    [r["steps"] for r in hit],
                    [r["steps"] + r.get("advance_env_steps", 0) for r in hit],
                )
            )
            mins = (
                f"{np.mean([r['minutes'] for r in hit]):.1f} ± {np.std([r['minutes'] for r in hit]):.1f}"
                if hit
                else "DNC"
            )
            ps, pm = PAPER["steps_M"][stagger], PAPER["minutes"][stagger]
            lines.append(
                f"| {'staggered' if stagger else 'naive'} | {steps} | {', '.join(f'{a:.2f}' for a in advance)} "
                f"| {simulated} | {mins} | {len(hit)}/{len(runs)} | "
                f"{ps[0]} ± {ps[1]} | {pm[0]} ± {pm[1]} |"
            )
        lines.append("")
    if fast:
        settings = "tiny CPU smoke settings" if options.smoke else "N=4096, K=8, 4 epochs x 32 minibatches"
        lines += [f"## Training steps/s at the same settings ({settings})", "", "| script | steps/s |", "|---|---|"]
        lines += [f"| {r['script']} | {r['train_sps']:,.0f} |" for r in fast]
        lines.append("")
    path.write_text("\n".join(lines))


def main(options: Options):
    import torch

    if not options.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/stackcube_gpu.py needs a CUDA GPU (or --smoke for a tiny CPU check)")
    out = Path(options.output)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="stackcube_gpu_")
    if options.smoke:
        size, batch = (
            [
                "--num-envs",
                "2",
                "--num-eval-envs",
                "1",
                "--horizon",
                "20",
                "--num-steps",
                "4",
                "--num-minibatches",
                "2",
                "--no-cuda",
            ],
            8,
        )
        options.total_timesteps, options.speed_timesteps, options.eval_freq, options.seeds = 80, 80, 5, 1
    else:
        size, batch = ["--num-envs", "4096", "--num-steps", "8"], 4096 * 8
    learn = [] if options.skip_learning else learning(options, tmp, size)
    fast = speed(options, tmp, size, batch)
    stem = "stackcube_gpu_smoke" if options.smoke else "stackcube_gpu"
    (out / f"{stem}.json").write_text(json.dumps({"learning": learn, "speed": fast}, indent=1))
    write_report(options, learn, fast, out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main(tyro.cli(Options))
