"""VER vs NoVER vs SyncOnRL with ppo_ver.py on ToyChain with heterogeneous simulation time (VER paper, Table 1 and
Sec. 5), side by side in one run, every run a `python ppo_ver.py ...` subprocess as a user starts it.

  throughput  steps per second (SPS) of VER, NoVER (--no-variable-experience) and sync (--sync, DD-PPO's
              collection) at several levels of episode-level heterogeneity (--toy.step-time-spread, the lognormal
              sigma of a per-episode speed factor) with action-level jitter (--toy.step-time-jitter 0.3), next to
              the ideal: every env simulating all the time, i.e. total env busy time / number of workers
              (Table 1; paper, 1 GPU: VER 428, NoVER 327, DD-PPO 174 SPS)
  efficiency  sample efficiency: evaluation success vs env steps of VER and NoVER on ToyChain with heterogeneous
              step times, several seeds (Sec. 5.2: "VER has similar sample efficiency")
  gpu         for a machine with CUDA GPUs: the throughput grid with inference and learning on the GPU, and DD-PPO
              scaling with torchrun over 1, 2, ... GPUs (Table 1's rows); writes ver_gpu.md / ver_gpu.json

SPS is measured over the training loop (collection + learning, the first iteration left out as warm-up); medians
over repeats. Writes benchmarks/results/ver_throughput.md, ver_throughput.json, ver_throughput.png,
ver_efficiency.png (the gpu experiment: ver_gpu.md, ver_gpu.json).

  python benchmarks/ver_throughput.py                           # throughput + efficiency (about 30 min on 2 cores)
  python benchmarks/ver_throughput.py --experiment throughput   # about 18 minutes
  python benchmarks/ver_throughput.py --experiment efficiency   # about 11 minutes
  python benchmarks/ver_throughput.py --experiment gpu          # on a CUDA machine
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

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "ppo_ver.py"

# VER paper, Table 1, 1 GPU (mean SPS over 20M steps, Habitat 2.0 open-fridge, N = 16 per GPU).
PAPER_1GPU = {"ver": 428, "nover": 327, "sync": 174}
PAPER_TABLE1 = {  # GPUs: (DD-PPO, NoVER, VER) mean SPS
    1: (174, 327, 428),
    2: (283, 592, 716),
    4: (468, 1097, 1432),
    8: (1066, 2216, 2861),
}
MODES = {"ver": [], "nover": ["--no-variable-experience"], "sync": ["--sync"]}
LABELS = {"ver": "VER", "nover": "NoVER", "sync": "sync (DD-PPO)"}


@dataclass
class Options:
    experiment: str = "all"
    """all (throughput + efficiency) | throughput | efficiency | gpu"""
    spreads: list[float] = field(default_factory=lambda: [0.0, 0.75, 1.5])
    """episode-level heterogeneity levels (--toy.step-time-spread) of the throughput experiment"""
    repeats: int = 3
    """repeats of each throughput measurement (the median is reported)"""
    num_envs: int = 16
    """N env workers per rank (the paper uses 16 per GPU)"""
    num_steps: int = 32
    """T"""
    step_time_ms: float = 30.0
    """mean simulation time of one env step (--toy.step-time-mean), long enough that the envs, not the main
    process, are the bottleneck on a small machine"""
    jitter: float = 0.3
    """per-step jitter (--toy.step-time-jitter): action-level stragglers"""
    iterations: int = 12
    """rollouts per throughput run"""
    seeds: int = 3
    """seeds of the sample-efficiency experiment"""
    efficiency_steps: int = 80_000
    """env steps of each sample-efficiency run"""
    efficiency_horizon: int = 100
    """ToyChain horizon of the sample-efficiency experiment"""
    gpu_ranks: list[int] = field(default_factory=lambda: [1, 2])
    """torchrun process counts of the gpu experiment (one GPU each)"""
    output: str = str(RESULTS)
    """where the markdown, JSON and PNGs go"""


def run_ppo_ver(args: list[str], nproc: int = 1, timeout: int = 3600) -> str:
    """Runs ppo_ver.py (with torchrun when nproc > 1) into a temporary directory; returns its run directory."""
    out = tempfile.mkdtemp(prefix="ver_bench_")
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    )
    proc = subprocess.run(
        launcher + [str(SCRIPT), "--output-dir", out, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ppo_ver.py {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
    return run_dir


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def throughput_of(run_dir: str, num_envs_total: int) -> dict:
    """SPS over the training loop (iterations 2.., i.e. without start-up and the first rollout) and the ideal."""
    s = read_scalars(run_dir)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    steps = np.diff([0] + [step for step, _ in s["charts/SPS"]])
    loop_time = np.array([v for _, v in s["time/rollout"]]) + np.array([v for _, v in s["time/update"]])
    collect = np.array([v for _, v in s["time/rollout"]])
    return {
        "sps": float(steps[1:].sum() / loop_time[1:].sum()),
        "collect_sps": float(steps[1:].sum() / collect[1:].sum()),
        "ideal_sps": summary["global_step"] / (summary["env_busy_time_s"] / num_envs_total),
        "env_utilization": float(np.mean([v for _, v in s["ver/env_utilization"]][1:])),
        "learn_s": float(np.mean([v for _, v in s["time/update"]][1:])),
        "collect_s": float(collect[1:].mean()),
        "batch_size_mean": float(np.mean([v for _, v in s["ver/inference_batch_size_mean"]][1:])),
    }


def throughput_args(o: Options, mode: str, spread: float, seed: int, cuda: bool) -> list[str]:
    return [
        "--env-id",
        "ToyChain-v0",
        "--num-envs",
        str(o.num_envs),
        "--num-steps",
        str(o.num_steps),
        "--total-timesteps",
        str(o.iterations * o.num_envs * o.num_steps),
        "--seed",
        str(seed),
        "--toy.step-time-mean",
        str(o.step_time_ms / 1000),
        "--toy.step-time-spread",
        str(spread),
        "--toy.step-time-jitter",
        str(o.jitter),
        "--eval-freq",
        "0",
        "--num-eval-episodes",
        "1",
        "--cuda" if cuda else "--no-cuda",
        "--quiet",
        *MODES[mode],
    ]


def run_throughput(o: Options, cuda: bool = False) -> list[dict]:
    rows = []
    for spread in o.spreads:
        for repeat in range(o.repeats):
            for mode in MODES:  # the three modes side by side, interleaved, in each repeat
                start = time.time()
                run_dir = run_ppo_ver(throughput_args(o, mode, spread, seed=1 + repeat, cuda=cuda))
                row = {"mode": mode, "spread": spread, "repeat": repeat, **throughput_of(run_dir, o.num_envs)}
                rows.append(row)
                print(
                    f"[throughput] spread={spread} {mode:5s} repeat={repeat}: {row['sps']:.0f} SPS "
                    f"(ideal {row['ideal_sps']:.0f}, env utilization {row['env_utilization']:.2f}) "
                    f"{time.time() - start:.0f} s",
                    flush=True,
                )
    return rows


def efficiency_args(o: Options, mode: str, seed: int) -> list[str]:
    return [
        "--env-id",
        "ToyChain-v0",
        "--num-envs",
        str(o.num_envs),
        "--num-steps",
        str(o.num_steps),
        "--total-timesteps",
        str(o.efficiency_steps),
        "--seed",
        str(seed),
        "--toy.horizon",
        str(o.efficiency_horizon),
        "--toy.step-time-mean",
        "0.002",
        "--toy.step-time-spread",
        "1.0",
        "--toy.step-time-jitter",
        str(o.jitter),
        "--eval-freq",
        "5",
        "--num-eval-episodes",
        "32",
        "--no-cuda",
        "--quiet",
        *MODES[mode],
    ]


def run_efficiency(o: Options) -> list[dict]:
    rows = []
    for seed in range(1, o.seeds + 1):
        for mode in ("ver", "nover"):
            start = time.time()
            run_dir = run_ppo_ver(efficiency_args(o, mode, seed))
            s = read_scalars(run_dir)
            curve = [(step, v) for step, v in s["eval/success_at_end"]]
            rows.append(
                {
                    "mode": mode,
                    "seed": seed,
                    "curve": curve,
                    "importance_weight_min": float(np.mean([v for _, v in s["ver/importance_weight_min"]])),
                    "steps_per_env_spread": float(
                        np.mean(
                            [b - a for (_, a), (_, b) in zip(s["ver/steps_per_env_min"], s["ver/steps_per_env_max"])]
                        )
                    ),
                }
            )
            print(
                f"[efficiency] {mode:5s} seed={seed}: final success {curve[-1][1]:.2f} ({time.time() - start:.0f} s)",
                flush=True,
            )
    return rows


def steps_to_reach(curve: list, threshold: float) -> float:
    for step, value in curve:
        if value >= threshold:
            return step
    return float("nan")


def median(rows: list[dict], key: str, **match) -> float:
    values = [r[key] for r in rows if all(r[k] == v for k, v in match.items())]
    return float(np.median(values)) if values else float("nan")


def report_header(title: str, experiment: str, minutes: float) -> list[str]:
    return [
        f"# ppo_ver.py: {title}",
        "",
        f"Produced by `python benchmarks/ver_throughput.py --experiment {experiment}` in {minutes:.1f} min "
        f"on {os.cpu_count()} CPU core(s) ({platform.processor() or platform.machine()}), no GPU: envs, "
        f"inference and learning all on the CPU.",
    ]


def write_throughput_report(o: Options, throughput: list[dict], minutes: float) -> None:
    """benchmarks/results/ver_throughput.{md,json,png}."""
    out = Path(o.output)
    lines = report_header("VER vs NoVER vs SyncOnRL throughput (VER paper, Table 1)", "throughput", minutes)
    lines += [
        "",
        "## Throughput",
        "",
        f"ToyChain (H=200), N={o.num_envs} env workers, T={o.num_steps}, {o.iterations} rollouts per run, "
        f"mean simulation time {o.step_time_ms:g} ms per step (slept in the worker), per-step jitter "
        f"sigma={o.jitter} (action-level stragglers) and a per-episode speed factor with sigma = spread "
        f"(episode-level stragglers). SPS = env steps / (collection + learning time) over rollouts 2.., "
        f"median of {o.repeats} repeats; in brackets the run's ideal = every env simulating all the time: "
        f"total env busy time / N (learning time not counted, so no method can reach it; VER's is higher "
        f"because it takes more of the fast steps). Env utilization = busy time / (N x collection time).",
        "",
        "| spread (sigma) | VER SPS (ideal) | NoVER SPS (ideal) | sync SPS (ideal) | VER/NoVER | VER/sync | "
        "env utilization VER / NoVER / sync |",
        "|---|---|---|---|---|---|---|",
    ]
    for spread in o.spreads:
        sps = {m: median(throughput, "sps", mode=m, spread=spread) for m in MODES}
        ideal = {m: median(throughput, "ideal_sps", mode=m, spread=spread) for m in MODES}
        util = {m: median(throughput, "env_utilization", mode=m, spread=spread) for m in MODES}
        lines.append(
            f"| {spread:g} | "
            + " | ".join(f"{sps[m]:.0f} ({ideal[m]:.0f})" for m in MODES)
            + f" | {sps['ver'] / sps['nover']:.2f} | {sps['ver'] / sps['sync']:.2f} | "
            f"{util['ver']:.2f} / {util['nover']:.2f} / {util['sync']:.2f} |"
        )
    p = PAPER_1GPU
    lines.append(
        f"| paper, Table 1 (1 GPU, Habitat 2.0 open fridge; mean (max) SPS) | {p['ver']} (534) | "
        f"{p['nover']} (428) | {p['sync']} (442) | {p['ver'] / p['nover']:.2f} | "
        f"{p['ver'] / p['sync']:.2f} | |"
    )
    lines += [
        "",
        "Learning time per rollout (median, all modes): "
        f"{median(throughput, 'learn_s'):.2f} s; collection: VER {median(throughput, 'collect_s', mode='ver'):.2f} s, "
        f"NoVER {median(throughput, 'collect_s', mode='nover'):.2f} s, sync "
        f"{median(throughput, 'collect_s', mode='sync'):.2f} s. Mean inference batch: VER "
        f"{median(throughput, 'batch_size_mean', mode='ver'):.1f}, NoVER "
        f"{median(throughput, 'batch_size_mean', mode='nover'):.1f}, sync "
        f"{median(throughput, 'batch_size_mean', mode='sync'):.1f} envs.",
        "",
        "![throughput](ver_throughput.png)",
    ]
    plot_throughput(o, throughput, out / "ver_throughput.png")
    (out / "ver_throughput.md").write_text("\n".join(lines) + "\n")
    (out / "ver_throughput.json").write_text(
        json.dumps({"options": vars(o), "throughput": throughput, "minutes": minutes}, indent=1)
    )
    print("\n".join(lines))


def write_efficiency_report(o: Options, efficiency: list[dict], minutes: float) -> None:
    """benchmarks/results/ver_efficiency.{md,json,png}."""
    out = Path(o.output)
    lines = report_header("VER vs NoVER sample efficiency (VER paper, Sec. 5.2)", "efficiency", minutes)
    lines += [
        "",
        "## Sample efficiency",
        "",
        f"ToyChain H={o.efficiency_horizon} (p_prog=0.5), N={o.num_envs}, T={o.num_steps}, "
        f"{o.efficiency_steps} env steps, step time 2 ms with spread 1.0 and jitter {o.jitter}: VER collects "
        f"unevenly from the envs (importance weights < 1) where NoVER takes T steps from each. Evaluation "
        f"success (32 deterministic episodes) every 5 rollouts; {o.seeds} seeds. Paper (Sec. 5.2, Fig. 5): VER "
        f"has similar sample efficiency as DD-PPO (slightly worse on 1 GPU, the same on 2-4, better on 8).",
        "",
        "| method | env steps to success >= 0.9 (median over seeds) | final success (mean) | "
        "mean min. importance weight | mean (max - min) steps per env in a rollout |",
        "|---|---|---|---|---|",
    ]
    for mode in ("ver", "nover"):
        rows = [r for r in efficiency if r["mode"] == mode]
        reach = np.nanmedian([steps_to_reach(r["curve"], 0.9) for r in rows]) if rows else float("nan")
        final = np.mean([r["curve"][-1][1] for r in rows])
        lines.append(
            f"| {LABELS[mode]} | {reach:.0f} | {final:.2f} | "
            f"{np.mean([r['importance_weight_min'] for r in rows]):.2f} | "
            f"{np.mean([r['steps_per_env_spread'] for r in rows]):.1f} |"
        )
    lines += ["", "![sample efficiency](ver_efficiency.png)"]
    plot_efficiency(o, efficiency, out / "ver_efficiency.png")
    (out / "ver_efficiency.md").write_text("\n".join(lines) + "\n")
    (out / "ver_efficiency.json").write_text(
        json.dumps({"options": vars(o), "efficiency": efficiency, "minutes": minutes}, indent=1)
    )
    print("\n".join(lines))


def plot_throughput(o: Options, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        ax.plot(o.spreads, [median(rows, "sps", mode=mode, spread=s) for s in o.spreads], "o-", label=LABELS[mode])
    ax.plot(
        o.spreads,
        [median(rows, "ideal_sps", mode="ver", spread=s) for s in o.spreads],
        "k--",
        label="ideal of the VER runs (busy time / N)",
    )
    ax.set_xlabel("episode-level heterogeneity (step-time spread sigma)")
    ax.set_ylabel("steps per second")
    ax.set_title(f"ppo_ver.py on ToyChain, N={o.num_envs}, {o.step_time_ms:g} ms/step")
    ax.legend()
    x = np.arange(3)
    ax2.bar(x - 0.2, [PAPER_1GPU[m] for m in MODES], 0.4, label="paper Table 1 (1 GPU)")
    ax2.bar(
        x + 0.2,
        [median(rows, "sps", mode=m, spread=max(o.spreads)) for m in MODES],
        0.4,
        label=f"ours, spread {max(o.spreads):g}",
    )
    ax2.set_xticks(x, [LABELS[m] for m in MODES])
    ax2.set_ylabel("steps per second")
    ax2.set_title("side by side with the paper")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_efficiency(o: Options, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, color in (("ver", "C0"), ("nover", "C1")):
        curves = [r["curve"] for r in rows if r["mode"] == mode]
        for i, curve in enumerate(curves):
            ax.plot(*zip(*curve), color=color, alpha=0.35)
        length = min(len(c) for c in curves)
        steps = [c[i][0] for i, c in zip(range(length), [curves[0]] * length)]
        ax.plot(
            steps,
            np.mean([[v for _, v in c[:length]] for c in curves], axis=0),
            color=color,
            lw=2.5,
            label=f"{LABELS[mode]} (mean of {len(curves)} seeds)",
        )
    ax.set_xlabel("env steps")
    ax.set_ylabel("eval success")
    ax.set_title(f"ToyChain H={o.efficiency_horizon}, heterogeneous step times")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_gpu(o: Options) -> None:
    """Throughput on CUDA (inference and learning on the GPU, envs in CPU workers) and DD-PPO scaling."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the gpu experiment needs a CUDA GPU")
    start = time.time()
    rows = run_throughput(o, cuda=True)
    scaling = []
    for nproc in o.gpu_ranks:
        if nproc > torch.cuda.device_count():
            continue
        for mode in MODES:
            run_dir = run_ppo_ver(throughput_args(o, mode, max(o.spreads), seed=1, cuda=True), nproc=nproc)
            scaling.append({"mode": mode, "ranks": nproc, **throughput_of(run_dir, o.num_envs * nproc)})
            print(f"[gpu scaling] {nproc} rank(s) {mode}: {scaling[-1]['sps']:.0f} SPS", flush=True)
    lines = [
        "# ppo_ver.py on CUDA (VER paper, Table 1)",
        "",
        f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores; {time.time() - start:.0f} s.",
        "",
        "| spread | VER | NoVER | sync | ideal (median of the three runs') |",
        "|---|---|---|---|---|",
    ]
    for spread in o.spreads:
        lines.append(
            f"| {spread:g} | "
            + " | ".join(f"{median(rows, 'sps', mode=m, spread=spread):.0f}" for m in MODES)
            + f" | {median(rows, 'ideal_sps', spread=spread):.0f} |"
        )
    lines += [
        "",
        f"DD-PPO scaling (spread {max(o.spreads):g}, N={o.num_envs} per rank): SPS (paper Table 1: "
        "DD-PPO / NoVER / VER)",
        "",
        "| ranks | sync | NoVER | VER | paper |",
        "|---|---|---|---|---|",
    ]
    for nproc in o.gpu_ranks:
        if nproc > torch.cuda.device_count():
            lines.append(
                f"| {nproc} | not run: {nproc} ranks need {nproc} GPUs, this machine has "
                f"{torch.cuda.device_count()} | | | |"
            )
            continue
        got = {r["mode"]: r["sps"] for r in scaling if r["ranks"] == nproc}
        lines.append(
            f"| {nproc} | {got.get('sync', float('nan')):.0f} | {got.get('nover', float('nan')):.0f} | "
            f"{got.get('ver', float('nan')):.0f} | {PAPER_TABLE1.get(nproc, '')} |"
        )
    out = Path(o.output)
    (out / "ver_gpu.md").write_text("\n".join(lines) + "\n")
    (out / "ver_gpu.json").write_text(
        json.dumps({"options": vars(o), "throughput": rows, "scaling": scaling}, indent=1)
    )
    print("\n".join(lines))


def main(o: Options) -> None:
    Path(o.output).mkdir(parents=True, exist_ok=True)
    if o.experiment == "gpu":
        run_gpu(o)
        return
    if o.experiment not in ("all", "throughput", "efficiency"):
        raise SystemExit(f"--experiment must be all, throughput, efficiency or gpu, got {o.experiment!r}")
    if o.experiment in ("all", "throughput"):
        start = time.time()
        throughput = run_throughput(o)
        write_throughput_report(o, throughput, (time.time() - start) / 60)
    if o.experiment in ("all", "efficiency"):
        start = time.time()
        efficiency = run_efficiency(o)
        write_efficiency_report(o, efficiency, (time.time() - start) / 60)


if __name__ == "__main__":
    main(tyro.cli(Options))
