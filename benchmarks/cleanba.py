"""Cleanba benchmarks for cleanba_ppo.py and cleanba_impala.py (paper: Huang et al., ICLR 2024), run as a user runs
the scripts (subprocesses), with the paper's numbers beside ours.

  throughput       Breakout-v5: steps/s of Cleanba's architecture (concurrent actor and learner) vs the synchronous
                   one (--no-concurrency), for both scripts, with the Sec. 4.2 queue waits that show which side is
                   the bottleneck (learner waiting on the rollout queue, actors waiting on the params queue).
                   Steady-state SPS = steps between the 3rd and the last update / their wall time; medians of repeats.
  reproducibility  Sec. 3-4: learning curves of runs that differ only in hardware speed or layout:
                   (a) --debug-learner-delay 0 vs a slow learner: must be one curve (bit-identical numbers);
                   (b) 1, 2 and 4 actor threads with the same App. A settings (local_num_envs, num_steps): one curve
                   on Breakout-v5 (EnvPool seeds each env, the sampling noise is drawn per env); on ToyChain, whose
                   envs share one generator per pool, statistically the same curve.
Writes benchmarks/results/cleanba.md, cleanba.json, cleanba_reproducibility.png and cleanba_breakdown.png.

  python benchmarks/cleanba.py                                  # both, about 30 minutes on 2 CPU cores
  python benchmarks/cleanba.py --experiment throughput --repeats 1
  python benchmarks/cleanba.py --experiment throughput --device cuda   # on a GPU: Table 2/3 sizes, 128 envs
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRIPTS = {"ppo": ROOT / "cleanba_ppo.py", "impala": ROOT / "cleanba_impala.py"}

# Paper numbers (Cleanba's published runtimes, static/cleanba/*_runtimes.csv in its repository, converted to steps/s
# = 50M / minutes / 60; the paper's Sec. 5.2): mean over 57 Atari games.
PAPER = {
    ("ppo", "concurrent"): ("8 A100, 46 CPU", 29_000),
    ("ppo", "synchronous"): ("8 A100, 46 CPU", 22_700),
    ("impala", "concurrent"): ("1 A100, 10 CPU (8 A100, 46 CPU: ~38k)", 6_100),
    ("impala", "synchronous"): ("8 A100, 46 CPU", 24_000),
}


@dataclass
class Options:
    experiment: Literal["throughput", "reproducibility", "all"] = "all"
    """which benchmark to run"""
    repeats: int = 3
    """repeats of each throughput measurement (medians are reported)"""
    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: small settings that fit 2 cores; cuda: the paper's sizes (Table 2/3, 128 envs) on GPU 0"""
    updates: int = 8
    """learner updates per throughput run (the first two are left out as warm-up)"""
    output: str = str(RESULTS)
    """where the results go"""
    replot: bool = False
    """only rewrite cleanba.md and the figures from the saved cleanba.json"""


def throughput_settings(algo: str, device: str, updates: int) -> list[str]:
    if (
        device == "cuda"
    ):  # Table 2 / Table 3: 128 envs (2 actor threads x 64), 128 or 20 steps, actor and learner on GPU 0
        envs, steps = 128, (128 if algo == "ppo" else 20)
        extra = ["--actor-device-ids", "0"]
    else:  # small enough for 2 CPU cores: the IMPALA ResNet costs ~0.1 GFLOP per frame and pass
        envs, steps = (8, 16) if algo == "ppo" else (16, 20)
        extra = ["--no-cuda"]
    return [
        "--env-id",
        "Breakout-v5",
        "--local-num-envs",
        str(envs),
        "--num-steps",
        str(steps),
        "--num-actor-threads",
        "2",
        "--total-timesteps",
        str(envs * steps * updates),
        "--num-eval-episodes",
        "0",
        *extra,
    ]


def run(script: Path, args: list[str], out: Path) -> tuple[dict, list[dict], float]:
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(script), "--output-dir", str(out), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    run_dir = next(d for d in out.iterdir() if d.is_dir())
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "updates.jsonl").read_text().splitlines()]
    return summary, rows, time.time() - start


def steady_sps(rows: list[dict], skip: int = 2) -> float:
    """charts/SPS is global_step / seconds since training started, so the elapsed time of a row is their ratio."""
    a, b = rows[skip - 1], rows[-1]
    elapsed = [row["global_step"] / row["charts/SPS"] for row in (a, b)]
    return (b["global_step"] - a["global_step"]) / (elapsed[1] - elapsed[0])


# the Sec. 4.2 timers the scripts log: the learner waiting for data, the actors waiting for params
TIMING_KEYS = ("cleanba/rollout_queue_get_time", "cleanba/params_queue_get_time")


def throughput(opts: Options) -> dict:
    """Concurrent and synchronous runs alternate (side by side), so that a slow spell of the machine hits both."""
    sps: dict = {}
    timings: dict = {}
    for r in range(opts.repeats):
        for algo in ("ppo", "impala"):
            for mode in ("concurrent", "synchronous"):
                flag = "--concurrency" if mode == "concurrent" else "--no-concurrency"
                with tempfile.TemporaryDirectory() as tmp:
                    args = throughput_settings(algo, opts.device, opts.updates) + [flag, "--seed", str(r + 1)]
                    _, rows, wall = run(SCRIPTS[algo], args, Path(tmp))
                key = f"{algo}/{mode}"
                sps.setdefault(key, []).append(steady_sps(rows))
                timings.setdefault(key, []).append(
                    {k: float(np.median([row[k] for row in rows[2:]])) for k in TIMING_KEYS}
                )
                print(f"[throughput] {key} repeat {r + 1}: {sps[key][-1]:.1f} SPS ({wall:.0f} s)", flush=True)
    results: dict = {}
    for key in sps:
        algo = key.split("/")[0]
        results[key] = {
            "sps_median": float(np.median(sps[key])),
            "sps": sps[key],
            "timing_median_s": {k: float(np.median([t[k] for t in timings[key]])) for k in TIMING_KEYS},
            "settings": throughput_settings(algo, opts.device, opts.updates),
        }
    for algo in ("ppo", "impala"):
        # ratio of the repeats' paired runs (same repeat, back to back), then the median
        pairs = [c / s for c, s in zip(sps[f"{algo}/concurrent"], sps[f"{algo}/synchronous"])]
        results[f"{algo}/speedup"] = float(np.median(pairs))
        results[f"{algo}/speedup_pairs"] = pairs
    return results


def curve(rows: list[dict]) -> tuple[list[int], list[float]]:
    pts = [(r["global_step"], r["charts/episodic_return"]) for r in rows if "charts/episodic_return" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def deterministic_part(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in TIMING_KEYS + ("charts/SPS",) and not k.startswith("time/")}
        for r in rows
    ]


def reproducibility(opts: Options) -> dict:
    toy = [
        "--env-id",
        "ToyChain-v0",
        "--toy.horizon",
        "50",
        "--toy.progression-prob",
        "0.3",
        "--local-num-envs",
        "32",
        "--num-steps",
        "10",
        "--total-timesteps",
        "64000",
        "--num-eval-episodes",
        "0",
        "--no-cuda",
    ]
    breakout = [
        "--env-id",
        "Breakout-v5",
        "--local-num-envs",
        "8",
        "--num-steps",
        "16",
        "--total-timesteps",
        "1280",
        "--max-episode-steps",
        "100",
        "--num-minibatches",
        "2",
        "--num-eval-episodes",
        "0",
        "--no-cuda",
    ]
    out: dict = {}
    for algo in ("ppo", "impala"):
        runs = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name, extra in (
                ("toy delay 0", ["--debug-learner-delay", "0"]),
                ("toy delay 0.05 s", ["--debug-learner-delay", "0.05"]),
                ("toy 1 thread", ["--num-actor-threads", "1"]),
                ("toy 2 threads", ["--num-actor-threads", "2"]),
                ("toy 4 threads", ["--num-actor-threads", "4"]),
                ("breakout 1 thread", ["--num-actor-threads", "1"]),
                ("breakout 2 threads", ["--num-actor-threads", "2"]),
                ("breakout 4 threads", ["--num-actor-threads", "4"]),
            ):
                base = toy if name.startswith("toy") else breakout + (["--update-epochs", "1"] if algo == "ppo" else [])
                d = Path(tmp) / name.replace(" ", "_")
                summary, rows, wall = run(SCRIPTS[algo], base + extra, d)
                runs[name] = {"rows": rows, "wall_s": wall, "sps": summary["sps"]}
                print(f"[reproducibility] {algo} {name}: {wall:.0f} s", flush=True)

        def same(a, b):
            return deterministic_part(runs[a]["rows"]) == deterministic_part(runs[b]["rows"])

        def max_rel_loss_diff(a, b):
            keys = ("losses/policy_loss", "losses/value_loss", "losses/entropy")
            return max(
                abs(x[k] - y[k]) / max(abs(x[k]), 1e-12) for x, y in zip(runs[a]["rows"], runs[b]["rows"]) for k in keys
            )

        def same_returns(a, b):
            return curve(runs[a]["rows"]) == curve(runs[b]["rows"])

        out[algo] = {
            "curves": {name: curve(r["rows"]) for name, r in runs.items()},
            "value_loss_curves": {
                name: ([row["global_step"] for row in r["rows"]], [row["losses/value_loss"] for row in r["rows"]])
                for name, r in runs.items()
            },
            "wall_s": {name: r["wall_s"] for name, r in runs.items()},
            "delay_identical": same("toy delay 0", "toy delay 0.05 s"),
            "breakout_threads": {
                f"1 vs {n}": {
                    "identical": same("breakout 1 thread", f"breakout {n}"),
                    "same_returns": same_returns("breakout 1 thread", f"breakout {n}"),
                    "max_rel_loss_diff": max_rel_loss_diff("breakout 1 thread", f"breakout {n}"),
                }
                for n in ("2 threads", "4 threads")
            },
            "toy_final_return": {
                name: float(np.mean(curve(r["rows"])[1][-10:])) for name, r in runs.items() if name.startswith("toy")
            },
        }
    return out


def plot(results: dict, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "reproducibility" in results:
        rep = results["reproducibility"]
        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        for i, algo in enumerate(("ppo", "impala")):
            curves = rep[algo]["curves"]
            panels = (
                ("learner speed (ToyChain)", ["toy delay 0", "toy delay 0.05 s"], ["-", "--"]),
                ("actor threads (ToyChain)", ["toy 1 thread", "toy 2 threads", "toy 4 threads"], ["-"] * 3),
                (
                    "actor threads (Breakout-v5)",
                    ["breakout 1 thread", "breakout 2 threads", "breakout 4 threads"],
                    ["-", "--", ":"],
                ),
            )
            for ax, (title, names, styles) in zip(axes[i], panels):
                breakout = names[0].startswith("breakout")  # too short for episodes: the per-update value loss
                for name, style in zip(names, styles):
                    x, y = (rep[algo]["value_loss_curves"] if breakout else curves)[name]
                    ax.plot(x, y, style, label=name, alpha=0.8, linewidth=2 if style != "-" else 1.5)
                ax.set_title(f"cleanba_{algo}.py: {title}")
                ax.set_xlabel("global step")
                ax.set_ylabel("value loss" if breakout else "episodic return")
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(output / "cleanba_reproducibility.png", dpi=90)
        plt.close(fig)
    if "throughput" in results:
        tp = results["throughput"]
        keys = TIMING_KEYS
        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [f"{a}\n{m}" for a in ("ppo", "impala") for m in ("concurrent", "synchronous")]
        x = np.arange(len(labels))
        width = 0.3
        for j, k in enumerate(keys):
            vals = [
                tp[f"{a}/{m}"]["timing_median_s"][k] for a in ("ppo", "impala") for m in ("concurrent", "synchronous")
            ]
            ax.bar(x + (j - len(keys) / 2) * width, vals, width, label=k)
        ax.set_xticks(x, labels)
        ax.set_ylabel("seconds per update (median)")
        ax.set_title("Breakout-v5: seconds per update waiting on each queue (Sec. 4.2)")
        ax.legend(fontsize=8, ncol=4)
        fig.tight_layout()
        fig.savefig(output / "cleanba_breakdown.png", dpi=90)
        plt.close(fig)


def write_markdown(results: dict, output: Path, opts: Options, minutes: float) -> None:
    cpu = platform.processor() or platform.machine()
    lines = [
        "# Cleanba: throughput and reproducibility (cleanba_ppo.py, cleanba_impala.py)",
        "",
        f"Produced by `python benchmarks/cleanba.py --experiment {opts.experiment}` on {cpu}, "
        f"{os.cpu_count()} CPU cores, device {opts.device}, in {minutes:.1f} min. "
        f"Medians of {opts.repeats} repeat(s). The CPU of this machine is shared with other jobs: absolute "
        f"numbers are noisy, ratios measured side by side less so.",
        "",
    ]
    if "throughput" in results:
        tp = results["throughput"]
        lines += [
            "## Throughput on Breakout-v5: Cleanba's architecture vs synchronous",
            "",
            "Steady-state steps/s (3rd to last update). Settings: "
            + "; ".join(f"{a}: `{' '.join(tp[f'{a}/concurrent']['settings'])}`" for a in ("ppo", "impala")),
            "",
            "| script | architecture | ours: SPS (median) | ours: concurrent / sync (median of paired runs) | paper: setting | paper: SPS |",
            "|---|---|---|---|---|---|",
        ]
        for a in ("ppo", "impala"):
            for m in ("concurrent", "synchronous"):
                setting, paper_sps = PAPER[(a, m)]
                ratio = (
                    f"{tp[f'{a}/speedup']:.2f}x (pairs: "
                    + ", ".join(f"{x:.2f}" for x in tp[f"{a}/speedup_pairs"])
                    + ")"
                    if m == "concurrent"
                    else ""
                )
                lines.append(
                    f"| cleanba_{a}.py | {m} | {tp[f'{a}/{m}']['sps_median']:.0f} | {ratio} | {setting} | "
                    f"~{paper_sps:,} |"
                )
        lines += [
            "",
            "Paper ratios: PPO concurrent / sync 29k / 22.7k = 1.28x (8 A100); IMPALA 38k / 24k = 1.58x "
            "(8 A100). 1 A100 + 10 CPU: IMPALA ~6.1k, PPO (sync) ~3.9k SPS.",
            "",
            "Queue waits, seconds per update (medians; params_queue_get is per actor thread and rollout):",
            "",
            "| script | architecture | " + " | ".join(TIMING_KEYS) + " |",
            "|---|---|" + "---|" * len(TIMING_KEYS),
        ]
        for a in ("ppo", "impala"):
            for m in ("concurrent", "synchronous"):
                t = tp[f"{a}/{m}"]["timing_median_s"]
                lines.append(f"| {a} | {m} | " + " | ".join(f"{t[k]:.3f}" for k in TIMING_KEYS) + " |")
        lines += ["", "![breakdown](cleanba_breakdown.png)", ""]
    if "reproducibility" in results:
        rep = results["reproducibility"]
        lines += [
            "## Reproducibility (Sec. 3-4, Table 1)",
            "",
            "| script | slow learner (0.05 s sleep per update): bit-identical per-update numbers | Breakout-v5, "
            "1 vs 2 actor threads: bit-identical / same returns / max rel. loss diff. | 1 vs 4 actor threads: "
            "bit-identical / same returns / max rel. loss diff. | ToyChain final return (last 10 updates): "
            "delay 0 / delay / 1 / 2 / 4 threads |",
            "|---|---|---|---|---|",
        ]
        for a in ("ppo", "impala"):
            f = rep[a]["toy_final_return"]
            finals = " / ".join(
                f"{f[k]:.2f}"
                for k in ("toy delay 0", "toy delay 0.05 s", "toy 1 thread", "toy 2 threads", "toy 4 threads")
            )
            th = [rep[a]["breakout_threads"][k] for k in ("1 vs 2 threads", "1 vs 4 threads")]
            cells = [f"{t['identical']} / {t['same_returns']} / {t['max_rel_loss_diff']:.1e}" for t in th]
            lines.append(f"| cleanba_{a}.py | {rep[a]['delay_identical']} | {cells[0]} | {cells[1]} | {finals} |")
        lines += [
            "",
            "Paper (Fig. 2, Sec. 3): in monobeast's IMPALA a 1 s learner delay changes the learning curves; "
            "with Cleanba's architecture the data behind every update is fixed (Table 1), so the delayed run "
            "is the same run. ToyChain's envs share one random generator per actor thread, so different thread "
            "counts give different (statistically equivalent) ToyChain curves. EnvPool seeds every env and the "
            "scripts draw the sampling noise per env, so on Breakout-v5 the thread count leaves the data the "
            "same; only the actors' forward passes on fewer rows can round differently on the CPU (the stored "
            "log-probabilities and values then differ in the last bits), which moves the losses slightly "
            "(the max. relative difference over the run's updates is in the table).",
            "",
            "![reproducibility](cleanba_reproducibility.png)",
            "",
        ]
    (output / "cleanba.md").write_text("\n".join(lines))


def main(opts: Options) -> None:
    output = Path(opts.output)
    output.mkdir(parents=True, exist_ok=True)
    if opts.replot:
        saved = json.loads((output / "cleanba.json").read_text())
        results = {k: saved[k] for k in ("throughput", "reproducibility") if k in saved}
        opts.repeats, opts.experiment = saved["options"]["repeats"], saved["options"]["experiment"]
        plot(results, output)
        write_markdown(results, output, opts, saved["minutes"])
        return
    start = time.time()
    results: dict = {}
    previous = output / "cleanba.json"  # keep the other experiment's results when only one is re-run
    if opts.experiment != "all" and previous.exists():
        old = json.loads(previous.read_text())
        results = {k: old[k] for k in ("throughput", "reproducibility") if k in old}
    for name, fn in (("throughput", throughput), ("reproducibility", reproducibility)):
        if opts.experiment in (name, "all"):
            results[name] = fn(opts)
            minutes = (time.time() - start) / 60  # saved after each experiment
            (output / "cleanba.json").write_text(
                json.dumps({"options": vars(opts), "minutes": minutes, **results}, indent=1)
            )
    minutes = (time.time() - start) / 60
    plot(results, output)
    write_markdown(results, output, opts, minutes)
    print((output / "cleanba.md").read_text())


if __name__ == "__main__":
    main(tyro.cli(Options))
