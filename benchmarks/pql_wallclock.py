"""Wall-clock time to a return threshold: PQL's three processes vs the paper's baseline DDPG(n) (--ddpg-n: one
process, 8 x (critic update, actor update, soft update) per env step, live networks) and vs the ablation
--sequential (PQL's own schedule, p:v 1:2 with lagged networks, run serially), side by side, several seeds, medians.

Paper (Li et al. 2023, Sec. 4.2, Fig. 3; six Isaac Gym tasks, 4096 envs, one RTX 3090 workstation): "PQL, PQL-D
achieve the fastest policy learning in five out of six tasks", and "the faster learning of PQL than DDPG(n)
demonstrates the advantage of using a parallel scheme for data collection and network updates". The paper gives
these results as curves only (return vs wall-clock minutes), no table of times.

Suites
  toy        ToyChainContinuous-v0 on the CPU (H = 50, 10 blocks, 64 envs): eval/return >= --threshold (default 20
             of at most 25). Runs: PQL (three processes sharing the cores), --ddpg-n and --sequential (one process,
             all cores).
  maniskill  PickCube-v1 and PushCube-v1 with 4096 GPU-simulated envs (Table B.1 settings), all three processes on
             one GPU: eval/success_once >= --threshold (default 0.8). Needs CUDA. --fasttd3 adds a third run with
             FastTD3's published IsaacLab-manipulation settings (batch 32768, tau 0.1, noise std in [0.001, 0.4],
             distributional critic), as far as pql.py has them (51 atoms, not 101; a 512-256-128 critic, not
             1024-512-256; target noise clip 0.2, not 0.5; no AdamW weight decay, no torch.compile / AMP). --smoke
             checks this suite end to end on CPU simulation (tiny settings).
Every run is a subprocess (python pql.py ...); time to threshold is the TensorBoard event's wall time of the first
evaluation at or above the threshold minus the moment the run was launched (start-up, warm-up and evaluations
included, the same for every variant). --max-time ends a run with Ctrl-C (SIGINT: pql.py stops cleanly and writes
summary.json). Variants are interleaved per seed, in an order that alternates from seed to seed, so that slow
drifts of a shared machine do not favour one of them. Run it alone on the machine (here:
under `flock /tmp/cpu-heavy.lock`).

Writes benchmarks/results/pql_{suite}.md, .json and .png.

  python benchmarks/pql_wallclock.py --suite toy --seeds 5          # about 40 minutes on 2 CPU cores
  python benchmarks/pql_wallclock.py --suite maniskill --seeds 3    # GPU: 2 tasks x 2 variants x 3 seeds x --max-time
  python benchmarks/pql_wallclock.py --suite maniskill --smoke      # CPU: checks the GPU suite's plumbing
"""

from __future__ import annotations

import json
import os
import platform
import signal
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
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "pql.py"


@dataclass
class Options:
    suite: Literal["toy", "maniskill"] = "toy"
    """toy: ToyChainContinuous-v0 on the CPU; maniskill: PickCube-v1 / PushCube-v1 on a GPU"""
    seeds: int = 3
    """seeds per variant (and task)"""
    threshold: Optional[float] = None
    """level of the metric to reach (default: eval/return 20 on the toy chain, eval/success_once 0.8 on ManiSkill)"""
    env_ids: tuple[str, ...] = ("PickCube-v1", "PushCube-v1")
    """ManiSkill tasks of the maniskill suite"""
    total_timesteps: Optional[int] = None
    """env steps per run (default: 64 * 600 toy chain, 50M ManiSkill)"""
    max_time: Optional[float] = None
    """seconds per run, then SIGINT ends it (default: none toy chain, 1800 ManiSkill)"""
    fasttd3: bool = False
    """maniskill: also run PQL with FastTD3's published manipulation settings"""
    smoke: bool = False
    """maniskill: a tiny CPU-simulation run of every variant, to check this script end to end"""
    extra: list[str] = field(default_factory=list)
    """more flags for every pql.py run (e.g. --extra=--num-envs --extra=2048)"""
    output: str = str(RESULTS)
    """where pql_{suite}.md / .json / .png go"""


def variants(options: Options) -> dict[str, list[str]]:
    if options.suite == "toy":
        return {
            "PQL (3 processes)": [],
            "DDPG(n), the paper's baseline: --ddpg-n": ["--ddpg-n"],
            "ablation, PQL's schedule serially: --sequential": ["--sequential"],
        }
    out = {
        "PQL (3 processes, 1 GPU)": [],
        "DDPG(n), the paper's baseline: --ddpg-n": ["--ddpg-n"],
        "ablation, PQL's schedule serially: --sequential": ["--sequential"],
    }
    if options.fasttd3:
        out["PQL, FastTD3 settings"] = [
            "--batch-size",
            "32768",
            "--tau",
            "0.1",
            "--sigma-min",
            "0.001",
            "--sigma-max",
            "0.4",
            "--distributional",
            "--learning-rate",
            "3e-4",
            "--target-noise-std",
            "0.001",
        ]
    return out


def settings(options: Options) -> tuple[str, float, list[tuple[str, list[str]]]]:
    """(metric, threshold, [(task, common flags)])."""
    if options.suite == "toy":
        common = [
            "--env-id",
            "ToyChainContinuous-v0",
            "--toy.horizon",
            "50",
            "--eval-freq",
            "5",
            "--no-cuda",
            "--total-timesteps",
            str(options.total_timesteps or 64 * 600),
        ]
        return (
            "eval/return",
            options.threshold if options.threshold is not None else 20.0,
            [("ToyChainContinuous-v0", common + options.extra)],
        )
    tasks = []
    for env_id in options.env_ids:
        if options.smoke:
            common = [
                "--env-id",
                env_id,
                "--no-cuda",
                "--num-envs",
                "2",
                "--num-eval-envs",
                "1",
                "--horizon",
                "20",
                "--total-timesteps",
                "100",
                "--warm-up-steps",
                "10",
                "--batch-size",
                "32",
                "--eval-freq",
                "20",
            ]
        else:
            common = [
                "--env-id",
                env_id,
                "--eval-freq",
                "50",
                "--total-timesteps",
                str(options.total_timesteps or 50_000_000),
            ]
        tasks.append((env_id, common + options.extra))
    threshold = options.threshold if options.threshold is not None else 0.8
    return "eval/success_once", threshold, tasks


def read_scalars(run_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run_one(
    flags: list[str], seed: int, name: str, metric: str, threshold: float, workdir: str, max_time: Optional[float]
) -> dict:
    out_dir = tempfile.mkdtemp(dir=workdir)
    launched = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *flags, "--seed", str(seed), "--output-dir", out_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        _, stderr = proc.communicate(timeout=max_time)
    except subprocess.TimeoutExpired:  # the time budget: Ctrl-C, pql.py writes summary.json and exits 130
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    total = time.time() - launched
    if proc.returncode not in (0, 130):
        raise RuntimeError(f"{name} seed {seed} failed:\n{stderr[-3000:]}")
    run_dir = os.path.join(out_dir, os.listdir(out_dir)[0])
    scalars = read_scalars(run_dir)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    curve = [(wall - launched, step, value) for wall, step, value in scalars[metric]]
    hit = next(((t, s) for t, s, v in curve if v >= threshold), None)
    return {
        "variant": name,
        "seed": seed,
        "launch_to_end_s": total,
        "time_to_threshold_s": hit[0] if hit else None,
        "steps_to_threshold": hit[1] if hit else None,
        "final": curve[-1][2],
        "curve": curve,
        "v_updates": summary.get("pql/v_updates"),
        "train_wall_s": summary["wall_time_s"],
        "v_updates_per_s": summary.get("pql/v_updates", 0) / max(summary["wall_time_s"], 1e-9),
        "ratio_a_v": summary.get("pql/ratio_a_v"),
        "ratio_p_v": summary.get("pql/ratio_p_v"),
    }


def median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_report(options: Options, metric: str, threshold: float, results: dict, wall: float, out: Path) -> None:
    names = list(variants(options))
    lines = [
        f"# PQL vs DDPG(n) (--ddpg-n) and the serial ablation (--sequential): wall-clock time to {metric} >= {threshold:g}",
        "",
    ]
    lines += [
        f"Produced by `python benchmarks/pql_wallclock.py {' '.join(sys.argv[1:])}` in {wall / 60:.1f} min "
        f"on {platform.machine()} ({os.cpu_count()} CPU cores visible), run alone on the machine. "
        f"Medians over seeds; time from launching the run (process start-up, warm-up and evaluations "
        f"included, the same for every variant) to the first evaluation at or above the threshold.",
        "",
    ]
    lines += [
        "Paper (Sec. 4.2, Fig. 3, Isaac Gym, RTX 3090, 4096 envs): PQL learns faster in wall-clock time than "
        "DDPG(n) on 5 of 6 tasks; the paper gives curves, not times.",
        "",
    ]
    for task, runs in results.items():
        lines += [
            f"## {task}",
            "",
            "| variant | reached | time to threshold (s) | env steps to threshold | final metric | "
            "V-updates/s | measured beta_a:v, beta_p:v |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in names:
            rs = [r for r in runs if r["variant"] == name]
            reached = sum(r["time_to_threshold_s"] is not None for r in rs)
            ratios = (
                f"1:{1 / median([r['ratio_a_v'] for r in rs]):.2f}, 1:{1 / median([r['ratio_p_v'] for r in rs]):.2f}"
                if median([r["ratio_a_v"] for r in rs])
                else "-"
            )
            lines.append(
                f"| {name} | {reached}/{len(rs)} | {fmt(median([r['time_to_threshold_s'] for r in rs]))} | "
                f"{fmt(median([r['steps_to_threshold'] for r in rs]), 0)} | "
                f"{fmt(median([r['final'] for r in rs]), 2)} | "
                f"{fmt(median([r['v_updates_per_s'] for r in rs]))} | {ratios} |"
            )
        base, others = names[0], names[1:]
        for other in others:
            pairs = [
                (a["time_to_threshold_s"], b["time_to_threshold_s"])
                for a in runs
                if a["variant"] == base
                for b in runs
                if b["variant"] == other and b["seed"] == a["seed"]
            ]
            speedups = [b / a for a, b in pairs if a is not None and b is not None]
            if speedups:
                lines.append(
                    f"\n{other} / {base}, per seed (time to threshold): "
                    + ", ".join(f"{s:.2f}" for s in speedups)
                    + f"; median {np.median(speedups):.2f}"
                )
        lines.append("")
    (out / f"pql_{options.suite}.md").write_text("\n".join(lines) + "\n")


def plot(results: dict, metric: str, threshold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for row, (task, runs) in enumerate(results.items()):
        names = list(dict.fromkeys(r["variant"] for r in runs))
        for k, name in enumerate(names):
            color = f"C{k}"
            for i, r in enumerate(r for r in runs if r["variant"] == name):
                t, s, v = zip(*r["curve"])
                label = name if i == 0 else None
                axes[row, 0].plot(t, v, color=color, alpha=0.8, label=label)
                axes[row, 1].plot(s, v, color=color, alpha=0.8, label=label)
        for col, xlabel in enumerate(("seconds since launch", "env steps")):
            axes[row, col].axhline(threshold, color="gray", ls="--", lw=1)
            axes[row, col].set_xlabel(xlabel)
            axes[row, col].set_ylabel(metric)
            axes[row, col].set_title(task)
        axes[row, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(options: Options) -> None:
    if options.suite == "maniskill" and not options.smoke:
        import torch

        if not torch.cuda.is_available():
            sys.exit(
                "error: --suite maniskill needs a CUDA GPU (4096 GPU-simulated envs); --smoke checks it on the CPU"
            )
    metric, threshold, tasks = settings(options)
    out = Path(options.output)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results: dict[str, list[dict]] = {}
    names = list(variants(options).items())
    with tempfile.TemporaryDirectory() as workdir:
        for task, common in tasks:
            results[task] = []
            for seed in range(1, options.seeds + 1):
                order = names if seed % 2 == 1 else names[::-1]  # alternate who runs first
                for name, flags in order:
                    max_time = options.max_time or (None if options.suite == "toy" or options.smoke else 1800)
                    r = run_one(common + flags, seed, name, metric, threshold, workdir, max_time)
                    print(
                        f"{task} {name} seed {seed}: time to threshold {fmt(r['time_to_threshold_s'])} s, "
                        f"steps {r['steps_to_threshold']}, final {r['final']:.3f}, "
                        f"{r['v_updates_per_s']:.1f} V-updates/s",
                        flush=True,
                    )
                    results[task].append(r)
    wall = time.time() - start
    with open(out / f"pql_{options.suite}.json", "w") as f:
        json.dump(
            {"options": vars(options), "metric": metric, "threshold": threshold, "wall_s": wall, "results": results},
            f,
            indent=1,
        )
    write_report(options, metric, threshold, results, wall, out)
    plot(results, metric, threshold, out / f"pql_{options.suite}.png")
    print((out / f"pql_{options.suite}.md").read_text())


if __name__ == "__main__":
    main(tyro.cli(Options))
