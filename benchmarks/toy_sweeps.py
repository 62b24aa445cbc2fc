"""ToyChain reproduction of the staggered-resets paper's toy experiments, staggered vs naive PPO side by side.

  Fig. 2a  horizon sweep        H in {50, 100, 200, 300, 400, 500}, p_prog = 0.5, lambda_R = 0      (App. B.2.2)
  Fig. 2b  reset stochasticity  lambda_R in {0.0, 0.1, ..., 1.0}, H = 50, p_prog = 1.0
  Fig. 2c  skill gating         p_prog in {0.0, 0.1, ..., 1.0}, H = 200, lambda_R = 0
  App. C   Fig. 6               H = 200, p_prog = 0.5: accuracy curves and block-occupancy heatmaps
  App. E   Figs. 12/13          H = 200, p_prog = 0.1: value-error spikes, policy KL, forgetting; run twice: with
                                the horizon as a time-limit truncation (our env's default) and as a termination
                                (App. B.2.1's wording, --toy.terminal-horizon), which is what makes the value spikes
  schemes  Fig. 2a's horizons   staggered vs naive vs random-start (legged_gym's init_at_random_ep_len: each env's
                                first episode cut after U[1, H] steps), which the paper cites but does not compare
  scaling  Sec. 5.4, Fig. 5     App. C's setting (H = 200, p_prog = 0.5) at N = 128 ... 32,768: updates, env steps and
                                seconds to eval success 0.9, staggered vs naive (does naive stop improving with N?)
Every table counts staggered's advance ((N_B - 1) x S x N env steps before training, not trained on, not in the
script's global_step: stagger_schedule.advance_env_steps): in a column of its own beside the trained-on env steps,
and added to them where env steps to a threshold are compared.
All with Table 2's PPO (N = 512, K = 5, L = 5, A_c = 20, k_mastery = 3, 150 updates) and several seeds; each point
is one call of ppo_staggered.main, on the CPU, one thread per worker process. Identical settings are run once.

Outputs (benchmarks/results/): toy_sweeps.md (tables, with the paper's findings beside ours), toy_sweeps.json
(every run's numbers), toy_fig2.png, toy_fig6.png, toy_appE.png, toy_appE_terminal.png. The quick comparison
(--experiment compare) writes toy_compare.md and its figures to runs/toy_compare/ instead; --experiment schemes
writes toy_schemes.md, toy_schemes.json and toy_schemes.png to benchmarks/results/; --experiment scaling writes
toy_scaling.md, .json and .png (with --device cuda: toy_scaling_{GPU}_{date}.*).

  python benchmarks/toy_sweeps.py                        # everything, 3 seeds (about 35 minutes on 2 cores)
  python benchmarks/toy_sweeps.py --experiment compare   # App. C/E setting only, 1 seed (about a minute)
  python benchmarks/toy_sweeps.py --experiment schemes   # the three reset schemes at Fig. 2a's horizons, 3 seeds
  python benchmarks/toy_sweeps.py --experiment scaling   # N = 128 ... 32,768, 5 seeds (about 50 minutes on 2 cores)
  python benchmarks/toy_sweeps.py --experiment scaling --device cuda --cudagraphs --workers 1 \
      --num-envs 128 512 2048 8192 32768 131072                        # on a GPU: the paper's own axis, seconds
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.stagger_schedule import advance_env_steps  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class Options:
    experiment: str = "all"
    """all | compare (App. C/E only) | fig2a | fig2b | fig2c | schemes (three reset schemes, Fig. 2a) | scaling"""
    seeds: int | None = None
    """seeds per setting and method (default: 3; compare: 1; scaling: 5)"""
    workers: int = 2
    """worker processes (one torch thread each)"""
    replot: bool = False
    """redraw the figures, rewrite the report from the saved json (toy_sweeps.json; scaling: its own); run nothing"""
    output: str = ""
    """where the markdown, JSON and PNGs go (default: benchmarks/results; compare: runs/toy_compare)"""
    num_envs: tuple[int, ...] = (128, 512, 2048, 8192, 32768)
    """scaling: the numbers N of parallel envs"""
    updates: int = 400
    """scaling: PPO updates of every run (N x K x updates env steps), enough that the best arm converges at every N"""
    threshold: float = 0.9
    """scaling: the eval success (eval/success_at_end) that counts as converged, fixed before running"""
    device: str = "cpu"
    """scaling: cpu or cuda"""
    cudagraphs: bool = False
    """scaling: ppo_staggered's --cudagraphs (with --device cuda)"""


# App. B.2.2 / Table 2 / App. C / App. E settings: (horizon, progression_prob, reset_lambda, terminal_horizon).
FIG2A = [(h, 0.5, 0.0, False) for h in (50, 100, 200, 300, 400, 500)]
FIG2B = [(50, 1.0, round(0.1 * i, 1), False) for i in range(11)]
FIG2C = [(200, round(0.1 * i, 1), 0.0, False) for i in range(11)]
APPC = (200, 0.5, 0.0, False)
APPE = (200, 0.1, 0.0, False)
APPE_TERMINAL = (200, 0.1, 0.0, True)


SCHEMES = ("staggered", "naive", "random-start")  # ppo_staggered.py --reset-scheme
SCALING = APPC  # the scaling sweep's task: App. C's setting (H = 200, K = 5, p_prog = 0.5, lambda_R = 0)
K = 5  # Table 2's rollout length
TABLE2_NUM_ENVS = 512  # Table 2's N: every experiment but the scaling sweep (run_one leaves the preset's N)
TABLE2_UPDATES = 150  # Table 2's updates: N x K x 150 = 384,000 env steps trained on a run
EVAL_EVERY = 5  # scaling: updates between evaluations (the resolution of "updates to the threshold")


def settings_for(experiment: str) -> list[tuple]:
    chosen = {"fig2a": FIG2A, "fig2b": FIG2B, "fig2c": FIG2C, "compare": [APPC, APPE, APPE_TERMINAL], "schemes": FIG2A}
    if experiment == "all":
        return list(dict.fromkeys(FIG2A + FIG2B + FIG2C + [APPC, APPE, APPE_TERMINAL]))
    return chosen[experiment]


def run_one(job: dict) -> dict:
    """One ppo_staggered.py run (Table 2 settings); returns its headline numbers and per-update series."""
    import torch

    torch.set_num_threads(1)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import ppo_staggered as ppo
    from toy_chain_env import ToyChainConfig

    horizon, p_prog, lam, terminal = job["setting"]
    args = ppo.Args(
        env_id="ToyChain-v0",
        seed=job["seed"],
        reset_scheme=job["scheme"],
        cuda=False,
        output_dir=job["tmp"],
        quiet=True,  # (no progress lines from the worker processes)
        eval_freq=50,
        num_eval_envs=256,
        exp_name=f"H{horizon}_p{p_prog}_l{lam}{'_term' if terminal else ''}_{job['scheme']}",
        toy=ToyChainConfig(horizon=horizon, progression_prob=p_prog, reset_lambda=lam, terminal_horizon=terminal),
    )
    start = time.time()
    summary = ppo.main(args)
    run_dir = summary["run_dir"]
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    series = {
        tag: [e.value for e in acc.Scalars(tag)]
        for tag in ("toy/accuracy", "stagger/value_mse", "stagger/policy_kl", "toy/forgetting_mean")
    }
    diag = np.load(os.path.join(run_dir, "toy_diagnostics.npz"))
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        **job,
        "setting": list(job["setting"]),
        "wall_s": time.time() - start,
        "eval_success": summary["eval/success_at_end"],
        "train_accuracy": float(np.mean(series["toy/accuracy"][-10:])),  # App. C's rolling training accuracy
        "forgetting": summary["toy/forgetting_mean_overall"],
        "value_mse_max": float(np.max(series["stagger/value_mse"])),
        "policy_kl_mean": float(np.mean(series["stagger/policy_kl"])),
        "advance_env_steps": summary["advance_env_steps"],  # (staggered: not in the 150 updates' env steps)
        "series": series,
        "occupancy": diag["occupancy"].tolist(),
        "accuracy_matrix": diag["accuracy"].tolist(),
    }


def run_scaling(job: dict) -> dict:
    """One ppo_staggered.py run of the scaling sweep: N envs, a fixed number of updates, an evaluation every
    EVAL_EVERY updates; when it first reached the threshold (updates, env steps, seconds from the start of main:
    building the envs and the stagger advance included), and App. E's diagnostics over the run."""
    import torch

    torch.set_num_threads(1)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import ppo_staggered as ppo
    from toy_chain_env import ToyChainConfig

    horizon, p_prog, lam, terminal = SCALING
    n = job["num_envs"]
    args = ppo.Args(
        env_id="ToyChain-v0",
        seed=job["seed"],
        reset_scheme=job["scheme"],
        cuda=job["device"] == "cuda",
        cudagraphs=job["cudagraphs"],
        output_dir=job["tmp"],
        quiet=True,  # (no progress lines from the worker processes)
        num_envs=n,
        total_timesteps=job["updates"] * n * K,
        eval_freq=EVAL_EVERY,
        num_eval_envs=256,
        exp_name=f"scaling_N{n}_{job['scheme']}",
        toy=ToyChainConfig(horizon=horizon, progression_prob=p_prog, reset_lambda=lam, terminal_horizon=terminal),
    )
    start = time.time()
    summary = ppo.main(args)
    wall = time.time() - start
    accumulator = EventAccumulator(summary["run_dir"], size_guidance={"scalars": 0})
    accumulator.Reload()
    evals = [
        {
            "updates": event.step // (n * K),
            "env_steps": event.step,
            "success": event.value,
            "seconds": event.wall_time - start,
        }
        for event in accumulator.Scalars("eval/success_at_end")
    ]
    reached = next((row for row in evals if row["success"] >= job["threshold"]), None)
    shutil.rmtree(summary["run_dir"], ignore_errors=True)
    return {
        **{key: job[key] for key in ("num_envs", "seed", "scheme", "updates", "threshold", "device", "cudagraphs")},
        "evals": evals,
        "final_success": evals[-1]["success"],
        "updates_to_threshold": reached["updates"] if reached else None,
        "env_steps_to_threshold": reached["env_steps"] if reached else None,
        "seconds_to_threshold": reached["seconds"] if reached else None,
        "wall_s": wall,
        "advance_env_steps": summary["advance_env_steps"],  # (staggered: not in env_steps, which count training)
        "policy_kl_mean": float(np.mean([event.value for event in accumulator.Scalars("stagger/policy_kl")])),
        "value_mse_mean": float(np.mean([event.value for event in accumulator.Scalars("stagger/value_mse")])),
    }


def median_and_seeds(values: list, digits: int = 0) -> str:
    """The median over the seeds that reached the threshold, how many did, and each seed's value."""
    reached = [value for value in values if value is not None]
    cells = ", ".join("-" if value is None else f"{value:,.{digits}f}" for value in values)
    if not reached:
        return f"not reached (0/{len(values)})"
    return f"{np.median(reached):,.{digits}f} ({len(reached)}/{len(values)}: {cells})"


def current_commit() -> str:
    """The checkout's commit, with "+ changes" when a script differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    changed = subprocess.run(["git", "status", "--porcelain", "--", "*.py"], capture_output=True, text=True, cwd=ROOT)
    return head.strip() + (" + changes" if changed.stdout.strip() else "")


def provenance(command: str) -> list[str]:
    """The opening lines of a results file: its command, machine, date and commit."""
    load = os.getloadavg()[0]
    machine = f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f} at the start)"
    return [
        f"- Command: `{command}`",
        f"- Machine: {machine}",
        f"- Date: {time.strftime('%Y-%m-%d')}; commit {current_commit()}",
    ]


def regenerated() -> str:
    """The opening line a --replot adds: the runs stay those of the lines above; the tables are this commit's."""
    command = "python benchmarks/toy_sweeps.py " + " ".join(sys.argv[1:])
    return (
        f"- Tables regenerated from the saved json on {time.strftime('%Y-%m-%d')} at commit {current_commit()}, "
        f"staggered's advance counted (`{command}`; no run repeated)"
    )


def run_advance(run: dict) -> int:
    """The env steps of a run's staggered advance, which its env steps (global_step, training) leave out: as the run
    recorded it, or, for runs saved before they did, from its N, H and K (the scaling sweep: the run's N, H = 200;
    the other experiments: Table 2's N = 512 and the setting's H; K = 5 in all); 0 for naive and random-start."""
    if run.get("advance_env_steps") is not None:
        return run["advance_env_steps"]
    if scheme_of(run) != "staggered":
        return 0
    horizon = run["setting"][0] if "setting" in run else SCALING[0]
    return advance_env_steps(run.get("num_envs", TABLE2_NUM_ENVS), horizon, K)


def with_advance(run: dict) -> int | None:
    """A scaling run's env steps to the threshold with its advance: every step the simulator took (None: not reached)."""
    steps = run["env_steps_to_threshold"]
    return None if steps is None else steps + run_advance(run)


def steps_cell(values: list[int]) -> str:
    """Env steps of a group of runs: one number when they agree (the advance: N, H and K fix it), else each run's."""
    return f"{values[0]:,}" if len(set(values)) == 1 else ", ".join(f"{value:,}" for value in values)


def scaling_report(results: list[dict], options: Options, wall: float, out: Path, stem: str, header: list[str]) -> None:
    """toy_scaling.md: per N and arm, updates, env steps (trained on; the advance; both) and seconds to the threshold,
    the final success, minutes and App. E's diagnostics; toy_scaling.png: Fig. 5's shape (to the threshold against
    N) and success curves."""
    arms = SCHEMES[:2]
    lines = [
        "# ToyChain at scale: staggered vs naive resets from "
        f"N = {min(options.num_envs):,} to {max(options.num_envs):,} (Sec. 5.4, Fig. 5)",
        "",
        *header,
        "",
        f"App. C's task (H = 200, L = 5, p_prog = 0.5, lambda_R = 0, A_c = 20, k_mastery = 3) with Table 2's PPO "
        f"(K = 5, 4 minibatches, 4 epochs, lr 3e-4, entropy 0.01) at every N, {options.updates} updates a run "
        f"(N x 5 x {options.updates} env steps), {options.seeds} seeds per N and arm, on {options.device}"
        f"{' with --cudagraphs' if options.cudagraphs else ''}, {options.workers} run(s) at a time, "
        f"{wall / 60:.0f} minutes in all. An evaluation (256 envs, deterministic, one episode each) every "
        f"{EVAL_EVERY} updates. Threshold, fixed before running: eval success (eval/success_at_end) >= "
        f"{options.threshold}. To the threshold: at the first evaluation that reached it; median over the seeds "
        "that did (how many, each seed's). Env steps, trained on: the script's global_step at that evaluation "
        "(N x 5 per update). Advance: the env steps of staggered's advance before training, (N_B - 1) x S x N "
        f"with N_B = min(ceil(H / K), N) groups S = max(K, floor(H / N_B)) steps apart ({SCALING[0] - K} N here: "
        f"N_B = {SCALING[0] // K}, S = {K}), not trained on and not in global_step; naive has none. Advance "
        "included: the two added, every env step the simulator took. Seconds: from the start of the run (envs "
        "built, the stagger advance included) to that evaluation. Final: the last evaluation's success. Policy KL "
        "and value MSE: App. E's stagger/policy_kl and stagger/value_mse, means over the run's updates, then over "
        "seeds.",
        "",
        "| N | arm | updates to threshold | env steps to threshold, trained on | advance (env steps) "
        "| env steps to threshold, advance included | seconds to threshold (advance included) "
        "| final success (mean, per seed) | minutes / run | policy KL | value MSE |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in options.num_envs:
        for arm in arms:
            runs = sorted((r for r in results if r["num_envs"] == n and r["scheme"] == arm), key=lambda r: r["seed"])
            if not runs:
                continue
            finals = [r["final_success"] for r in runs]
            lines.append(
                f"| {n:,} | {arm} | {median_and_seeds([r['updates_to_threshold'] for r in runs])} "
                f"| {median_and_seeds([r['env_steps_to_threshold'] for r in runs])} "
                f"| {steps_cell([run_advance(r) for r in runs])} "
                f"| {median_and_seeds([with_advance(r) for r in runs])} "
                f"| {median_and_seeds([r['seconds_to_threshold'] for r in runs], 1)} "
                f"| {np.mean(finals):.2f} ({', '.join(f'{value:.2f}' for value in finals)}) "
                f"| {np.mean([r['wall_s'] for r in runs]) / 60:.1f} "
                f"| {np.mean([r['policy_kl_mean'] for r in runs]):.3g} "
                f"| {np.mean([r['value_mse_mean'] for r in runs]):.3g} |"
            )
    lines += ["", "## What the numbers say", "", "(written from the numbers above)", ""]
    lines += [f"Figures: `{stem}.png` (to the threshold against N, Fig. 5's shape; success against updates per N)."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot_scaling(results, options, out / f"{stem}.png")


def plot_scaling(results: list[dict], options: Options, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"staggered": "tab:red", "naive": "tab:blue"}
    columns = max(3, len(options.num_envs))
    fig, axes = plt.subplots(2, columns, figsize=(4.5 * columns, 8), squeeze=False)
    trained_on = {"staggered, advance left out": ("staggered", "tab:red", "--", 0.15)}
    for axis, getter, label, extra in (
        (axes[0, 0], lambda r: r["updates_to_threshold"], "updates to the threshold", {}),
        (axes[0, 1], lambda r: r["seconds_to_threshold"], "seconds to the threshold", {}),
        (axes[0, 2], with_advance, "env steps to the threshold (advance included)", trained_on),
    ):
        series = {arm: (arm, color, "o-", 0.35) for arm, color in colors.items()} | extra
        for name, (arm, color, style, alpha) in series.items():
            ns, medians = [], []
            get = (lambda r: r["env_steps_to_threshold"]) if name in extra else getter
            for n in options.num_envs:
                values = [get(r) for r in results if r["num_envs"] == n and r["scheme"] == arm]
                reached = [value for value in values if value is not None]
                axis.scatter([n] * len(reached), reached, color=color, alpha=alpha, s=14)
                if reached:
                    ns.append(n)
                    medians.append(np.median(reached))
            axis.plot(ns, medians, style, color=color, label=f"{name} (median; dots: seeds)")
        if any(getter(r) for r in results):  # (log scales need values above 0)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
        axis.set_xlabel("parallel envs N")
        axis.set_ylabel(label)
        axis.set_title(label)
        axis.legend(fontsize=8)
    for column in range(3, columns):
        axes[0, column].axis("off")
    for axis, n in zip(axes[1], options.num_envs):  # success against updates, one panel per N
        for arm, color in colors.items():
            for index, run in enumerate(r for r in results if r["num_envs"] == n and r["scheme"] == arm):
                updates = [row["updates"] for row in run["evals"]]
                success = [row["success"] for row in run["evals"]]
                axis.plot(updates, success, color=color, alpha=0.6, label=arm if index == 0 else None)
        axis.axhline(options.threshold, color="gray", linestyle="--", linewidth=1)
        axis.set_title(f"N = {n:,}")
        axis.set_xlabel("PPO updates")
        axis.set_ylabel("eval success")
        axis.set_ylim(-0.05, 1.05)
        axis.legend(fontsize=8)
    for column in range(len(options.num_envs), columns):
        axes[1, column].axis("off")
    fig.suptitle(
        f"ToyChain (App. C setting), staggered vs naive resets against N, on {options.device}, to eval success >= "
        f"{options.threshold}; cf. Fig. 5"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_scaling_sweep(options: Options) -> None:
    """--experiment scaling: every N, arm and seed; the md, json and png (the json after every run)."""
    out = Path(options.output) if options.output else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = "toy_scaling"
    if options.device == "cuda":
        import torch

        stem += f"_{torch.cuda.get_device_name(0).replace(' ', '_')}_{time.strftime('%Y-%m-%d')}"
    if options.replot:  # (the md and png of a saved json: a sweep stopped by a time limit keeps its runs there)
        record = json.loads((out / f"{stem}.json").read_text())
        header = [*record["header"], regenerated()]
        return scaling_report(record["runs"], options, record["wall_s"], out, stem, header)
    header = provenance("python benchmarks/toy_sweeps.py " + " ".join(sys.argv[1:]))
    tmp = tempfile.mkdtemp(prefix="toy_scaling_")
    jobs = [
        {"num_envs": n, "seed": seed, "scheme": scheme, "tmp": tmp, "updates": options.updates}
        | {"threshold": options.threshold, "device": options.device, "cudagraphs": options.cudagraphs}
        for n in options.num_envs
        for seed in range(1, options.seeds + 1)
        for scheme in SCHEMES[:2]
    ]
    jobs.sort(key=lambda job: (job["seed"], -job["num_envs"]))  # seed by seed, the longest first: a stop keeps seeds
    start = time.time()
    print(f"{len(jobs)} runs on {options.workers} worker(s)", flush=True)
    results = []
    with mp.get_context("spawn").Pool(options.workers) as pool:
        for index, result in enumerate(pool.imap_unordered(run_scaling, jobs), 1):
            results.append(result)
            record = {"header": header, "wall_s": time.time() - start, "options": vars(options), "runs": results}
            (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
            print(
                f"[{index}/{len(jobs)} {time.time() - start:.0f}s] N={result['num_envs']} {result['scheme']:9} "
                f"seed={result['seed']} final={result['final_success']:.2f} "
                f"updates to threshold={result['updates_to_threshold']} ({result['wall_s']:.0f} s)",
                flush=True,
            )
    shutil.rmtree(tmp, ignore_errors=True)
    scaling_report(results, options, time.time() - start, out, stem, header)
    print((out / f"{stem}.md").read_text())


def mean_std(values) -> str:
    """Mean ± std over seeds; a single run says "1 seed" (a ± 0.00 would read as a measured spread)."""
    if len(values) == 1:
        return f"{values[0]:.2f} (1 seed)"
    return f"{np.mean(values):.2f} ± {np.std(values):.2f}"


def scheme_of(run: dict) -> str:
    """The reset scheme of a run (runs saved before --reset-scheme existed say stagger: true/false)."""
    return run.get("scheme") or ("staggered" if run["stagger"] else "naive")


def group(results, setting, stagger, scheme=None):
    """The runs of one setting: staggered (stagger=True) or naive (False), or those of `scheme` if given."""
    scheme = scheme or ("staggered" if stagger else "naive")
    return [r for r in results if tuple(r["setting"]) == tuple(setting) and scheme_of(r) == scheme]


def sweep_table(results, settings, label, index) -> list[str]:
    rows = [
        f"| {label} | staggered: eval success | naive: eval success | staggered: train acc. | naive: train acc. "
        "| staggered: advance (env steps) |",
        "|---|---|---|---|---|---|",
    ]
    for s in settings:
        st, nv = group(results, s, True), group(results, s, False)
        if st and nv:
            rows.append(
                f"| {s[index]} | {mean_std([r['eval_success'] for r in st])} | "
                f"{mean_std([r['eval_success'] for r in nv])} | {mean_std([r['train_accuracy'] for r in st])} | "
                f"{mean_std([r['train_accuracy'] for r in nv])} | {steps_cell([run_advance(r) for r in st])} |"
            )
    return rows


def budget_note(without: str = "naive has none") -> str:
    """What the Table 2 runs simulate besides the updates they train on, and which steps naive's training accuracy
    covers (its envs start together and, with lambda_R = 0, reset together every H steps)."""
    trained = TABLE2_NUM_ENVS * K * TABLE2_UPDATES
    last = K * TABLE2_UPDATES - 10 * K  # the first training step of the last 10 batches
    windows = ", ".join(f"{last % h}-{last % h + 10 * K - 1}" for h, *_ in FIG2A if h > 10 * K)
    horizons = ", ".join(str(h) for h, *_ in FIG2A if h > 10 * K)
    return (
        f"Every run trains on the same budget, {TABLE2_UPDATES} x {TABLE2_NUM_ENVS} x {K} = {trained:,} env steps; "
        "staggered's runs also simulate their advance before training ((N_B - 1) x S x N env steps, N_B = H / K "
        f'groups S = K apart: (H - {K}) x {TABLE2_NUM_ENVS}), not trained on, in the column "staggered: advance '
        f'(env steps)" ({without}): the eval success and training accuracy are at equal trained-on steps, '
        "and staggered's simulator took that many more. Naive's training accuracy is of other states than "
        "staggered's: with lambda_R = 0 its envs reset together, so its last 10 batches are the same episode "
        f"steps of every env ({windows} at H = {horizons}; the whole episode at H = {10 * K}), where staggered's "
        "cover the horizon."
    )


def plot_fig2(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (FIG2A, 0, "horizon H", "(a) horizon"),
        (FIG2B, 2, "reset homogeneity 2 - lambda_R", "(b) reset"),
        (FIG2C, 1, "progression probability p_prog", "(c) skill gating"),
    ]
    metrics = (("eval_success", "eval success rate"), ("train_accuracy", "training accuracy (last 10 updates)"))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for row, (metric, ylabel) in enumerate(metrics):
        for ax, (settings, index, xlabel, title) in zip(axes[row], panels):
            for stagger, color, name in ((False, "tab:blue", "naive"), (True, "tab:red", "staggered")):
                xs, means, stds = [], [], []
                for s in settings:
                    runs = group(results, s, stagger)
                    if runs:
                        xs.append(2.0 - s[index] if index == 2 else s[index])
                        means.append(np.mean([r[metric] for r in runs]))
                        stds.append(np.std([r[metric] for r in runs]))
                if xs:
                    xs, means, stds = map(np.array, (xs, means, stds))
                    ax.plot(xs, means, "o-", color=color, label=name)
                    ax.fill_between(xs, means - stds, means + stds, color=color, alpha=0.2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(title)
            ax.legend()
    fig.suptitle("ToyChain, PPO with naive vs staggered resets (mean ± 1 std over seeds), cf. paper Fig. 2")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_runs(results, setting, path, kind):
    """Fig. 6 (accuracy + occupancy heatmaps) or App. E Figs. 12/13 (value MSE, KL, forgetting) for seed 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from toy_chain_env import forgetting_matrix

    runs = {st: min(group(results, setting, st), key=lambda r: r["seed"]) for st in (False, True)}
    fig, axes = plt.subplots(2, 3, figsize=(16, 7))
    for row, stagger in enumerate((False, True)):
        r, name = runs[stagger], "staggered" if stagger else "naive"
        if kind == "fig6":
            axes[row, 0].plot(r["series"]["toy/accuracy"])
            axes[row, 0].set_title(f"{name}: training accuracy")
            axes[row, 0].set_ylim(0, 1.02)
            im = axes[row, 1].imshow(np.array(r["occupancy"]).T, aspect="auto", origin="lower", cmap="viridis")
            axes[row, 1].set_title(f"{name}: mean envs per block")
            axes[row, 1].set_ylabel("block b")
            fig.colorbar(im, ax=axes[row, 1])
            axes[row, 2].plot(r["series"]["toy/forgetting_mean"])
            axes[row, 2].set_title(f"{name}: forgetting (mean over blocks)")
        else:
            axes[row, 0].plot(r["series"]["stagger/value_mse"])
            axes[row, 0].set_title(f"{name}: value MSE (max {max(r['series']['stagger/value_mse']):.2f})")
            axes[row, 1].plot(r["series"]["stagger/policy_kl"])
            axes[row, 1].set_title(f"{name}: policy KL between updates")
            im = axes[row, 2].imshow(
                forgetting_matrix(np.array(r["accuracy_matrix"])).T,
                aspect="auto",
                origin="lower",
                cmap="inferno",
                vmin=0,
                vmax=1,
            )
            axes[row, 2].set_title(f"{name}: forgetting matrix (mean {r['forgetting']:.3f})")
            axes[row, 2].set_ylabel("block b")
            fig.colorbar(im, ax=axes[row, 2])
        for ax in axes[row]:
            ax.set_xlabel("PPO update")
    horizon_kind = "terminal horizon" if setting[3] else "time-limit horizon"
    fig.suptitle(
        f"ToyChain H={setting[0]}, p_prog={setting[1]}, lambda_R={setting[2]}, {horizon_kind} "
        f"(seed {runs[True]['seed']}); " + ("cf. paper Fig. 6" if kind == "fig6" else "cf. paper Figs. 12/13")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(results, options, wall, out: Path, figures: list[str], header: list[str]):
    lines = [
        "# ToyChain: staggered vs naive resets (paper Sec. 4, App. C, App. E)",
        "",
        *header,
        "",
        f"Produced by `python benchmarks/toy_sweeps.py --experiment {options.experiment}` "
        f"({options.seeds} seed(s) per point, {len(results)} runs, {wall / 60:.1f} min on "
        f"{options.workers} CPU worker(s)). Table 2 PPO: N=512, K=5, 150 updates; L=5, A_c=20, k_mastery=3. "
        "Eval success = fraction of 256 deterministic evaluation episodes that end in the final block; train "
        "acc. = fraction of correct actions in the last 10 training batches (App. C's accuracy). Mean ± std "
        "over seeds. With p_prog = 1 every gate opens whatever the agent does, so eval success is 1 for any "
        "policy (Fig. 2b, right end of Fig. 2c): there training accuracy is the informative number.",
        "",
        budget_note(),
        "",
    ]
    if any(group(results, s, True) for s in FIG2A):
        lines += [
            "## Fig. 2a: horizon (K=5, p_prog=0.5, lambda_R=0)",
            "",
            "Paper: staggered stays robust as H grows; naive degrades with longer horizons.",
            "",
        ]
        lines += sweep_table(results, FIG2A, "H", 0) + [""]
    if any(group(results, s, True) for s in FIG2B):
        lines += [
            "## Fig. 2b: reset stochasticity (H=50, p_prog=1.0)",
            "",
            "Paper: naive deteriorates as resets become deterministic (lambda_R -> 0); some reset randomness "
            "helps it only marginally; staggered is consistently better.",
            "",
        ]
        lines += sweep_table(results, FIG2B, "lambda_R", 2) + [""]
    if any(group(results, s, True) for s in FIG2C):
        lines += [
            "## Fig. 2c: skill gating (H=200, lambda_R=0)",
            "",
            "Paper: staggered is robust at every p_prog; naive is best with hard gates (p_prog=0) and degrades "
            "as gates soften, so the gap widens with p_prog.",
            "",
        ]
        lines += sweep_table(results, FIG2C, "p_prog", 1) + [""]
    for setting, title in (
        (APPE, "App. E (H=200, p_prog=0.1), horizon = time-limit truncation (our default)"),
        (APPE_TERMINAL, "App. E (H=200, p_prog=0.1), horizon = termination (--toy.terminal-horizon)"),
        (APPC, "App. C (H=200, p_prog=0.5)"),
    ):
        st, nv = group(results, setting, True), group(results, setting, False)
        if not (st and nv):
            continue
        lines += [
            f"## {title}",
            "",
            "| metric | staggered (ours) | naive (ours) | staggered (paper) | naive (paper) |",
            "|---|---|---|---|---|",
        ]
        paper = {"value_mse_max": ("< 2.5", "> 80"), "forgetting": ("0.015", "0.21")} if setting[:3] == APPE[:3] else {}
        for key, label in (
            ("eval_success", "eval success"),
            ("train_accuracy", "train accuracy"),
            ("forgetting", "mean forgetting (App. E.0.1)"),
            ("value_mse_max", "max value MSE over updates"),
            ("policy_kl_mean", "mean policy KL between updates"),
        ):
            p_st, p_nv = paper.get(key, ("", ""))
            lines.append(
                f"| {label} | {mean_std([r[key] for r in st])} | {mean_std([r[key] for r in nv])} | {p_st} | {p_nv} |"
            )
        lines.append(
            f"| advance (env steps; both train on {TABLE2_NUM_ENVS * K * TABLE2_UPDATES:,}) "
            f"| {steps_cell([run_advance(r) for r in st])} | {steps_cell([run_advance(r) for r in nv])} |  |  |"
        )
        lines.append("")
    lines += [
        "Figures: " + ", ".join(f"`{name}` ({FIGURE_CAPTIONS[name]})" for name in figures) + ".",
        "",
        "Value MSE is App. E.0.1's (critic predictions vs. GAE returns on the batch, before the update). The "
        "paper's spikes above 80 at the mass resets appear when the end of the horizon is a termination: the "
        "observation carries no time, so the value of a block then depends on how far the episode is, and "
        "after a mass reset the critic, fitted to late-episode targets, meets early-episode ones. With the "
        "horizon as a time limit (bootstrapped, the correct model and our default) the value of a block does "
        "not depend on time and the spikes are much smaller; forgetting and the naive/staggered gap remain.",
        "",
    ]
    (out / "toy_sweeps.md").write_text("\n".join(lines))


FIGURE_CAPTIONS = {
    "toy_fig2.png": "Fig. 2",
    "toy_fig6.png": "App. C Fig. 6",
    "toy_appE.png": "App. E Figs. 12/13",
    "toy_appE_terminal.png": "App. E Figs. 12/13, terminal horizon",
}


def replot(options: Options, out: Path) -> None:
    """The md (and Fig. 2; schemes: its figure) of the experiment's saved json, with a line saying so; runs nothing."""
    stem = {"compare": "toy_compare", "schemes": "toy_schemes"}.get(options.experiment, "toy_sweeps")
    saved = json.loads((out / f"{stem}.json").read_text())
    results = saved["runs"]
    options.seeds = max(r["seed"] for r in results)
    header = [*saved.get("header", []), regenerated()]
    if options.experiment == "schemes":
        write_schemes_report(results, options, saved["wall_s"], out, header)
    else:
        if any(group(results, s, True) for s in FIG2A + FIG2B + FIG2C):
            plot_fig2(results, out / "toy_fig2.png")
        figures = [name for name in FIGURE_CAPTIONS if (out / name).exists()]
        write_report(results, options, saved["wall_s"], out, figures, header)
        if stem != "toy_sweeps":
            os.replace(out / "toy_sweeps.md", out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())


def write_schemes_report(results, options, wall, out: Path, header: list[str] = ()) -> None:
    """toy_schemes.md and toy_schemes.png: eval success and training accuracy of the three reset schemes over H, and
    staggered's advance (the others have none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("eval_success", "eval success"), ("train_accuracy", "train acc."), ("forgetting", "forgetting"))
    lines = [
        "# ToyChain: staggered vs naive vs random-start resets at Fig. 2a's horizons",
        "",
        *header,
        *([""] if header else []),
        f"Produced by `python benchmarks/toy_sweeps.py --experiment schemes` ({options.seeds} seed(s) per point, "
        f"{len(results)} runs, {wall / 60:.1f} min on {options.workers} CPU worker(s)). Table 2 PPO: N=512, K=5, "
        "150 updates; p_prog=0.5, lambda_R=0. random-start is legged_gym / rsl_rl / Isaac Lab's "
        "`init_at_random_ep_len`: each env's first episode is cut (a bootstrapped truncation) after U[1, H] steps, "
        "no advance phase, immediate partial resets. Mean ± std over seeds. "
        + budget_note("naive and random-start have none"),
        "",
        "| H | "
        + " | ".join(f"{scheme}: {label}" for label in (m[1] for m in metrics) for scheme in SCHEMES)
        + " | staggered: advance (env steps) |",
        "|---|" + "---|" * (len(SCHEMES) * len(metrics) + 1),
    ]
    for setting in FIG2A:
        cells = [
            mean_std([r[key] for r in group(results, setting, None, scheme)])
            for key, _ in metrics
            for scheme in SCHEMES
        ]
        advance = steps_cell([run_advance(r) for r in group(results, setting, True)])
        lines.append(f"| {setting[0]} | " + " | ".join(cells) + f" | {advance} |")
    lines += ["", "Figure: `toy_schemes.png` (eval success and training accuracy against H, mean ± std).", ""]
    (out / "toy_schemes.md").write_text("\n".join(lines))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, label) in zip(axes, metrics[:2]):
        for scheme, color in zip(SCHEMES, ("tab:red", "tab:blue", "tab:green")):
            values = [[r[key] for r in group(results, setting, None, scheme)] for setting in FIG2A]
            means, stds = np.array([np.mean(v) for v in values]), np.array([np.std(v) for v in values])
            horizons = [setting[0] for setting in FIG2A]
            ax.plot(horizons, means, "o-", color=color, label=scheme)
            ax.fill_between(horizons, means - stds, means + stds, color=color, alpha=0.2)
        ax.set_xlabel("horizon H")
        ax.set_ylabel(label)
        ax.set_ylim(-0.05, 1.05)
        ax.legend()
    fig.suptitle("ToyChain, PPO with three reset schemes (mean ± 1 std over seeds), cf. paper Fig. 2a")
    fig.tight_layout()
    fig.savefig(out / "toy_schemes.png", dpi=100)
    plt.close(fig)


def main(options: Options):
    if options.seeds is None:
        options.seeds = {"compare": 1, "scaling": 5}.get(options.experiment, 3)
    if options.experiment == "scaling":
        return run_scaling_sweep(options)
    default_out = ROOT / "runs" / "toy_compare" if options.experiment == "compare" else RESULTS
    out = Path(options.output) if options.output else default_out
    out.mkdir(parents=True, exist_ok=True)
    if options.replot:
        return replot(options, out)
    tmp = tempfile.mkdtemp(prefix="toy_sweeps_")
    schemes = SCHEMES if options.experiment == "schemes" else SCHEMES[:2]
    jobs = [
        {"setting": s, "seed": seed, "scheme": scheme, "stagger": scheme == "staggered", "tmp": tmp}
        for s in settings_for(options.experiment)
        for seed in range(1, options.seeds + 1)
        for scheme in schemes
    ]
    start = time.time()
    header = provenance("python benchmarks/toy_sweeps.py " + " ".join(sys.argv[1:]))
    print(f"{len(jobs)} runs on {options.workers} worker(s)", flush=True)
    results = []
    with mp.get_context("spawn").Pool(options.workers) as pool:
        for i, r in enumerate(pool.imap_unordered(run_one, jobs), 1):
            results.append(r)
            print(
                f"[{i}/{len(jobs)} {time.time() - start:.0f}s] H={r['setting'][0]} p={r['setting'][1]} "
                f"lambda={r['setting'][2]}{' terminal' if r['setting'][3] else ''} seed={r['seed']} {r['scheme']:12} "
                f"eval_success={r['eval_success']:.2f} forgetting={r['forgetting']:.3f}",
                flush=True,
            )
    wall = time.time() - start
    shutil.rmtree(tmp, ignore_errors=True)
    stem = {"compare": "toy_compare", "schemes": "toy_schemes"}.get(options.experiment, "toy_sweeps")
    slim = [{k: v for k, v in r.items() if k not in ("occupancy", "accuracy_matrix", "tmp")} for r in results]
    (out / f"{stem}.json").write_text(json.dumps({"header": header, "wall_s": wall, "runs": slim}, indent=1))
    if options.experiment == "schemes":
        write_schemes_report(results, options, wall, out, header)
        print((out / "toy_schemes.md").read_text())
        print(f"done in {wall / 60:.1f} min; results in {out}")
        return
    figures = []
    if options.experiment in ("all", "fig2a", "fig2b", "fig2c"):
        plot_fig2(results, out / "toy_fig2.png")
        figures.append("toy_fig2.png")
    for setting, name, kind in (
        (APPC, "toy_fig6.png", "fig6"),
        (APPE, "toy_appE.png", "appE"),
        (APPE_TERMINAL, "toy_appE_terminal.png", "appE"),
    ):
        if group(results, setting, True):
            plot_runs(results, setting, out / name, kind)
            figures.append(name)
    write_report(results, options, wall, out, figures, header)
    if stem != "toy_sweeps":
        os.replace(out / "toy_sweeps.md", out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())
    print(f"done in {wall / 60:.1f} min; results in {out}")


if __name__ == "__main__":
    main(tyro.cli(Options))
