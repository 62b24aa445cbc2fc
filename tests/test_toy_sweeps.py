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
    assert (tmp_path / "toy_scaling.png").stat().st_size > 10_000
