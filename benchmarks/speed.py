"""What ppo_staggered.py costs on top of its environments, measured side by side in one run (medians of repeats).

  1. ToyChain, 512 envs: one env.step (random actions) vs one policy forward pass (action + value): the env must
     never be the bottleneck.
  2. ToyChain, Table 2 settings (N = 512, K = 5): raw env steps/s (random actions, no learning) vs training
     steps/s of ppo_staggered (rollout + PPO update), staggered and naive.
  3. StackCube-v1, CPU simulation (physx_cpu, one worker process per env): raw env steps/s vs training steps/s at
     the same N, staggered.
With --scaling N1 N2 ... instead: ToyChain training steps/s (K = 5) at each N on the CPU, on CUDA eagerly and with
--cudagraphs, side by side (speed_scaling_{gpu}_{date}.md and .json).
Each on the CPU, and on CUDA as well for 1-2 when a GPU is present. Training steps/s are N*K / (rollout + update
time) per iteration, the first iteration left out (warm-up); evaluation time is not counted.

Writes benchmarks/results/speed.md and speed.json.

  python benchmarks/speed.py                 # about 5 minutes on 2 CPU cores
  python benchmarks/speed.py --maniskill-envs 2 4
  python benchmarks/speed.py --scaling 512 4096 32768   # on a GPU machine (gpu_checks.sh run)
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

import ppo_staggered as ppo  # noqa: E402
from toy_chain_env import ToyChainConfig, ToyChainVectorEnv  # noqa: E402


@dataclass
class Options:
    repeats: int = 5
    """repeats of each measurement (the median is reported)"""
    maniskill_envs: list[int] = field(default_factory=lambda: [2])
    """numbers of CPU-simulated StackCube-v1 envs (worker processes) to measure"""
    skip_maniskill: bool = False
    """leave out the StackCube-v1 measurements"""
    scaling: list[int] = field(default_factory=list)
    """measure only ToyChain training at these numbers of envs: CPU vs eager CUDA vs --cudagraphs"""
    iterations: int = 20
    """--scaling: iterations of each run (the median of all but the first is reported)"""
    output: str = str(RESULTS)
    """where speed.md and speed.json go"""


def timed(fn, reps: int, device: str) -> float:
    """Seconds per call of fn, over `reps` calls (synchronizing CUDA)."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def env_vs_forward(device: str, repeats: int) -> dict:
    envs = ToyChainVectorEnv(512, ToyChainConfig(), device=device)
    obs, _ = envs.reset(seed=0)
    agent = ppo.ChainAgent(envs.num_blocks, envs.config.num_actions).to(device)
    actions = torch.randint(0, 20, (512,), device=device)

    def forward():
        with torch.no_grad():
            agent.get_action_and_value(obs)

    step = lambda: envs.step(actions)  # noqa: E731
    for fn in (step, forward):
        timed(fn, 50, device)  # warm-up
    step_s = [timed(step, 200, device) for _ in range(repeats)]
    forward_s = [timed(forward, 200, device) for _ in range(repeats)]
    return {
        "device": device,
        "env_step_us": 1e6 * float(np.median(step_s)),
        "policy_forward_us": 1e6 * float(np.median(forward_s)),
        "ratio_forward_over_step": float(np.median(forward_s) / np.median(step_s)),
    }


def training_sps(args: ppo.Args, raw_env_sps: float) -> dict:
    """Median per-iteration training steps/s (rollout + update) of one ppo_staggered run, and its time split. The
    script times the rollout as a whole (a timer per env step would sync CUDA twice a step), so the env's share of
    the rollout is estimated from the raw env speed measured beside it: N*K / raw_env_sps over time/rollout."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = ppo.main(replace(args, quiet=True))
    acc = EventAccumulator(summary["run_dir"], size_guidance={"scalars": 0})
    acc.Reload()
    get = lambda tag: np.array([e.value for e in acc.Scalars(tag)])[1:]  # noqa: E731  (skip the warm-up iteration)
    rollout, update = get("time/rollout"), get("time/update")
    batch = ppo.resolve_args(args).batch_size
    return {
        "train_sps": float(np.median(batch / (rollout + update))),
        "env_share_of_rollout": float(np.median(batch / raw_env_sps / rollout)),
        "update_share": float(np.median(update / (rollout + update))),
    }


def raw_toy_sps(device: str, repeats: int) -> float:
    envs = ToyChainVectorEnv(512, ToyChainConfig(), device=device)
    envs.reset(seed=0)

    def run():
        for _ in range(100):
            envs.step(torch.randint(0, 20, (512,), device=device))

    run()
    return float(np.median([512 * 100 / (timed(run, 1, device)) for _ in range(repeats)]))


def raw_maniskill_sps(num_envs: int, repeats: int) -> float:
    args = ppo.resolve_args(ppo.Args(env_id="StackCube-v1", cuda=False, num_envs=num_envs, num_minibatches=1))
    envs = ppo.make_env(args, num_envs, torch.device("cpu"), evaluation=False)  # as the training run builds it
    try:
        envs.reset(seed=0)
        low, high = (torch.as_tensor(x) for x in (envs.single_action_space.low, envs.single_action_space.high))

        def run():
            for _ in range(100):
                envs.step(torch.rand(num_envs, *low.shape) * (high - low) + low)

        run()
        return float(np.median([num_envs * 100 / timed(run, 1, "cpu") for _ in range(repeats)]))
    finally:
        envs.close()


def scaling(options: Options, out: Path) -> None:
    """ToyChain (Table 2's K = 5) at each N of --scaling: training steps/s on the CPU, on CUDA and with --cudagraphs."""
    tmp = tempfile.mkdtemp(prefix="speed_scaling_")
    modes = {"cpu": (False, False), "cuda": (True, False), "cudagraphs": (True, True)}
    if not torch.cuda.is_available():
        modes = {"cpu": (False, False)}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    date = time.strftime("%Y-%m-%d")
    results = {"gpu": gpu, "date": date, "machine": f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}"}
    results["rows"] = []
    for num_envs in options.scaling:
        row = {"num_envs": num_envs}
        for mode, (cuda, cudagraphs) in modes.items():
            args = ppo.Args(env_id="ToyChain-v0", cuda=cuda, cudagraphs=cudagraphs, num_envs=num_envs, output_dir=tmp)
            args = replace(args, total_timesteps=num_envs * 5 * options.iterations, eval_freq=10**6)
            measured = training_sps(args, float("nan"))
            row[f"{mode}_sps"] = measured["train_sps"]
            row[f"{mode}_update_share"] = measured["update_share"]
        results["rows"].append(row)
        print(row, flush=True)
    name = f"speed_scaling_{gpu.replace(' ', '_')}_{date}"
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# ppo_staggered on ToyChain (K = 5): CPU vs CUDA vs --cudagraphs ({gpu}, {date})",
        "",
        f"`python benchmarks/speed.py --scaling ...`; {results['machine']}. Training steps/s = N*K / (rollout + update "
        f"time), the median of {options.iterations - 1} iterations after the first; evaluation excluded.",
        "",
        "| N | CPU | CUDA (eager) | CUDA --cudagraphs | cudagraphs / eager | update share (eager, graphs) |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        eager, graphs = row.get("cuda_sps", float("nan")), row.get("cudagraphs_sps", float("nan"))
        shares = (
            f"{row.get('cuda_update_share', float('nan')):.0%}, {row.get('cudagraphs_update_share', float('nan')):.0%}"
        )
        lines.append(
            f"| {row['num_envs']:,} | {row['cpu_sps']:,.0f} | {eager:,.0f} | {graphs:,.0f} | {graphs / eager:.1f}x "
            f"| {shares} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines + [""]))
    print((out / f"{name}.md").read_text())


def main(options: Options):
    out = Path(options.output)
    out.mkdir(parents=True, exist_ok=True)
    if options.scaling:
        return scaling(options, out)
    tmp = tempfile.mkdtemp(prefix="speed_")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch "
        f"threads, torch {torch.__version__}",
        "env_vs_forward": [],
        "toy": [],
        "maniskill": [],
    }
    for device in devices:
        r = env_vs_forward(device, options.repeats)
        results["env_vs_forward"].append(r)
        print(r, flush=True)
        raw = raw_toy_sps(device, options.repeats)
        for stagger in (True, False):
            runs = [
                training_sps(
                    ppo.Args(
                        env_id="ToyChain-v0",
                        cuda=device == "cuda",
                        stagger=stagger,
                        seed=seed,
                        total_timesteps=512 * 5 * 30,
                        eval_freq=10**6,
                        output_dir=tmp,
                    ),
                    raw,
                )
                for seed in range(1, options.repeats + 1)
            ]
            row = {
                "device": device,
                "stagger": stagger,
                "raw_env_sps": raw,
                **{k: float(np.median([r[k] for r in runs])) for k in runs[0]},
            }
            row["overhead_x"] = raw / row["train_sps"]
            results["toy"].append(row)
            print(row, flush=True)
    if not options.skip_maniskill:
        for n in options.maniskill_envs:
            raw = raw_maniskill_sps(n, options.repeats)
            run = training_sps(
                ppo.Args(
                    env_id="StackCube-v1",
                    cuda=False,
                    num_envs=n,
                    num_eval_envs=1,
                    total_timesteps=n * 8 * 25,
                    eval_freq=10**6,
                    output_dir=tmp,
                    num_minibatches=2,
                ),
                raw,
            )
            row = {"num_envs": n, "raw_env_sps": raw, **run, "overhead_x": raw / run["train_sps"]}
            results["maniskill"].append(row)
            print(row, flush=True)
    (out / "speed.json").write_text(json.dumps(results, indent=1))
    write_report(results, out / "speed.md")
    print((out / "speed.md").read_text())


def write_report(results: dict, path: Path) -> None:
    lines = [
        "# Speed of ppo_staggered.py against its environments",
        "",
        f"`python benchmarks/speed.py`; machine: {results['machine']}. Medians of repeats, measured side by "
        "side in one run. Training steps/s = N*K / (rollout + update time) per iteration (evaluation excluded). "
        "Env share of rollout: N*K at the raw env speed over the rollout time.",
        "",
        "## ToyChain env step vs policy forward pass (512 envs)",
        "",
        "| device | env.step (µs) | policy forward (µs) | forward / step |",
        "|---|---|---|---|",
    ]
    for r in results["env_vs_forward"]:
        lines.append(
            f"| {r['device']} | {r['env_step_us']:.0f} | {r['policy_forward_us']:.0f} | "
            f"{r['ratio_forward_over_step']:.1f}x |"
        )
    lines += [
        "",
        "## ToyChain: raw env vs training (N=512, K=5, Table 2)",
        "",
        "| device | resets | raw env steps/s | training steps/s | raw / training | env share of rollout | "
        "update share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["toy"]:
        lines.append(
            f"| {r['device']} | {'staggered' if r['stagger'] else 'naive'} | {r['raw_env_sps']:,.0f} | "
            f"{r['train_sps']:,.0f} | {r['overhead_x']:.1f}x | {r['env_share_of_rollout']:.0%} | "
            f"{r['update_share']:.0%} |"
        )
    if results["maniskill"]:
        lines += [
            "",
            "## StackCube-v1, CPU simulation (physx_cpu, one process per env), staggered, K=8",
            "",
            "| envs | raw env steps/s | training steps/s | raw / training | env share of rollout | update share |",
            "|---|---|---|---|---|---|",
        ]
        for r in results["maniskill"]:
            lines.append(
                f"| {r['num_envs']} | {r['raw_env_sps']:,.1f} | {r['train_sps']:,.1f} | "
                f"{r['overhead_x']:.2f}x | {r['env_share_of_rollout']:.0%} | {r['update_share']:.0%} |"
            )
    lines.append("")
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main(tyro.cli(Options))
