"""benchmarks/toy_sweeps.py --experiment scaling at a tiny size: what it writes (md, json, png) and what they say."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_the_scaling_sweep_writes_its_table_json_and_figure(tmp_path):
    """Two N, 6 updates, 1 seed, both arms, one worker. With threshold 0 every run reaches it at its first
    evaluation (update 0): the md's table has a row per N and arm, and the json every run's evaluations."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "toy_sweeps.py"), "--experiment", "scaling"]
    command += ["--num-envs", "8", "16", "--updates", "6", "--seeds", "1", "--workers", "1", "--threshold", "0"]
    proc = subprocess.run([*command, "--output", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "toy_scaling.json").read_text())
    runs = record["runs"]
    assert sorted((run["num_envs"], run["scheme"]) for run in runs) == [
        (8, "naive"),
        (8, "staggered"),
        (16, "naive"),
        (16, "staggered"),
    ]
    for run in runs:
        assert [row["updates"] for row in run["evals"]] == [0, 5, 6]  # every 5 updates and at the end
        assert [row["env_steps"] for row in run["evals"]] == [0, 5 * run["num_envs"] * 5, 6 * run["num_envs"] * 5]
        assert run["updates_to_threshold"] == 0 and run["env_steps_to_threshold"] == 0
        assert 0 < run["seconds_to_threshold"] < run["wall_s"] and run["final_success"] == run["evals"][-1]["success"]
    md = (tmp_path / "toy_scaling.md").read_text()
    assert md.startswith("# ToyChain at scale") and "- Command: `python benchmarks/toy_sweeps.py --experiment" in md
    assert "- Machine: " in md and "- Date: " in md and "commit" in md
    rows = [line for line in md.splitlines() if line.startswith("| 8 |") or line.startswith("| 16 |")]
    assert len(rows) == 4 and all("| 0 (1/1: 0) |" in row for row in rows)
    # the advance (not in the env steps to the threshold, which count training): N_B = N groups S = floor(200 / N)
    # apart at N = 8 and 16 (< ceil(H / K) = 40), as the runs recorded it; naive has none
    advances = {(run["num_envs"], run["scheme"]): run["advance_env_steps"] for run in runs}
    assert advances == {
        (8, "staggered"): 7 * 25 * 8,
        (8, "naive"): 0,
        (16, "staggered"): 15 * 12 * 16,
        (16, "naive"): 0,
    }
    assert "| 8 | staggered | 0 (1/1: 0) | 0 (1/1: 0) | 1,400 | 1,400 (1/1: 1,400) |" in md
    assert "| 16 | naive | 0 (1/1: 0) | 0 (1/1: 0) | 0 | 0 (1/1: 0) |" in md
    assert (tmp_path / "toy_scaling.png").stat().st_size > 10_000
    # --replot: the same tables from the json, and a line that says so; the runs' own lines stay
    replot = subprocess.run([*command, "--output", str(tmp_path), "--replot"], capture_output=True, text=True, cwd=ROOT)
    assert replot.returncode == 0, replot.stderr[-3000:]
    again = (tmp_path / "toy_scaling.md").read_text()
    assert "- Tables regenerated from the saved json on " in again and "staggered's advance counted" in again
    assert [line for line in again.splitlines() if line.startswith("|")] == [
        line for line in md.splitlines() if line.startswith("|")
    ]
    assert md.split("\n")[2:5] == again.split("\n")[2:5]  # command, machine, date and commit of the runs
