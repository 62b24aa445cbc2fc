"""benchmarks/stagger_schedule.advance_env_steps, the advance the benchmarks' reports count, against the schedule
ppo_staggered.resolve_args sets (N_B = num_stagger_groups, S = stagger_step) and the steps stagger_advance takes."""

import pytest

import ppo_staggered as ppo
from benchmarks.stagger_schedule import advance_env_steps
from toy_chain_env import ToyChainConfig


@pytest.mark.parametrize(
    "num_envs, horizon, num_steps",
    [
        (512, 200, 5),  # Table 2: N_B = 40, S = 5
        (32768, 200, 5),  # the scaling sweep's largest N
        (512, 500, 5),  # Fig. 2a's longest horizon
        (8, 200, 5),  # N < ceil(H / K) = 40: N_B = N = 8, S = floor(200 / 8) = 25
        (8, 50, 16),  # H not a multiple of K (the ManiSkill CPU runs' shape): N_B = 4, S = K = 16 > floor(50 / 4)
        (3, 50, 16),  # N < ceil(50 / 16) = 4: N_B = 3, S = 16
        (64, 1000, 8),  # N < 125: N_B = 64, S = floor(1000 / 64) = 15
        (1, 50, 5),  # one env, one group: no advance
        (4, 10, 10),  # K = H: one group, no advance
    ],
)
def test_the_advance_is_resolve_args_schedule(num_envs, horizon, num_steps):
    args = ppo.resolve_args(
        ppo.Args(
            env_id="ToyChain-v0",
            cuda=False,
            num_envs=num_envs,
            num_steps=num_steps,
            num_minibatches=1,
            total_timesteps=num_envs * num_steps,
            toy=ToyChainConfig(horizon=horizon),
        )
    )
    groups, step = args.num_stagger_groups, args.stagger_step
    assert advance_env_steps(num_envs, horizon, num_steps) == (groups - 1) * step * num_envs
    # what stagger_advance steps: until group 0 starts, every env
    assert advance_env_steps(num_envs, horizon, num_steps) == ppo.stagger_start_steps(groups, step)[0] * num_envs


def test_the_advance_counts_every_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ppo.resolve_args(ppo.Args(env_id="ToyChain-v0", cuda=False, num_envs=16))
    expected = (args.num_stagger_groups - 1) * args.stagger_step * 16 * 2  # ppo_staggered's summary: all ranks
    assert args.world_size == 2 and advance_env_steps(16, 200, 5, world_size=2) == expected == 15 * 12 * 32


def test_the_maniskill_and_mujoco_presets():
    """The tasks' own H and K (PushCube-v1: H = 50 registered, K = 16, N = 8 on the CPU; Hopper-v5: H = 1000, K = 8)."""
    push = ppo.resolve_args(ppo.Args(env_id="PushCube-v1", cuda=False))
    assert (push.num_envs, push.horizon, push.num_steps) == (8, 50, 16)
    assert advance_env_steps(8, 50, 16) == (push.num_stagger_groups - 1) * push.stagger_step * 8 == 384
    hopper = ppo.resolve_args(ppo.Args(env_id="Hopper-v5", cuda=False, num_envs=64))
    assert advance_env_steps(64, 1000, 8) == (hopper.num_stagger_groups - 1) * hopper.stagger_step * 64 == 63 * 15 * 64


def test_the_reports_count_the_advance_of_runs_saved_without_it():
    """Runs saved before the benchmarks recorded ppo_staggered's summary["advance_env_steps"]: the reports derive it
    from what the json holds (the toy sweeps: N, H and the scheme; maniskill_cpu: the command), 0 for other arms."""
    from benchmarks import maniskill_cpu, toy_sweeps

    assert toy_sweeps.run_advance({"num_envs": 32768, "scheme": "staggered"}) == 195 * 32768 == 6_389_760
    assert toy_sweeps.run_advance({"num_envs": 32768, "scheme": "naive"}) == 0
    assert toy_sweeps.run_advance({"setting": [300, 0.5, 0.0, False], "scheme": "staggered"}) == 295 * 512
    assert toy_sweeps.run_advance({"setting": [500, 0.5, 0.0, False], "stagger": True}) == 253_440  # older runs
    assert toy_sweeps.run_advance({"setting": [500, 0.5, 0.0, False], "scheme": "random-start"}) == 0
    assert toy_sweeps.run_advance({"num_envs": 8, "scheme": "staggered", "advance_env_steps": 7}) == 7  # recorded
    command = "python ppo_staggered.py --env-id PushCube-v1 --no-cuda --total-timesteps 100000 --num-envs 8"
    assert maniskill_cpu.run_advance({"command": command}) == 3 * 16 * 8  # H = 50, K = 16: N_B = 4, S = 16
    assert maniskill_cpu.run_advance({"command": command + " --num-steps 5"}) == 7 * 6 * 8  # N_B = 8, S = 6
    assert maniskill_cpu.run_advance({"command": command + " --no-stagger"}) == 0
    assert maniskill_cpu.run_advance({"command": command + " --reset-scheme random-start"}) == 0
    assert maniskill_cpu.run_advance({"command": "python ppo_ver.py --env-id PushCube-v1 --num-envs 8"}) == 0
    assert maniskill_cpu.run_advance({"command": command, "advance_env_steps": 5}) == 5


def test_stackcube_gpu_reports_the_env_steps_with_the_advance(tmp_path):
    """Table 1's comparison: staggered's env steps to 75% beside the same with its advance (12 x 8 x 4,096 at Table 3's
    N, H and K), naive's with none."""
    from benchmarks import stackcube_gpu

    def row(stagger, steps, advance):
        return {"seed": 1, "stagger": stagger, "steps": steps, "advance_env_steps": advance, "minutes": 10.0}

    learn = [row(True, 16_000_000, advance_env_steps(4096, 100, 8)), row(False, 35_000_000, 0)]
    stackcube_gpu.write_report(stackcube_gpu.Options(), learn, [], tmp_path / "report.md")
    text = (tmp_path / "report.md").read_text()
    assert advance_env_steps(4096, 100, 8) == 12 * 8 * 4096 == 393_216
    assert "| staggered | 16.0 ± 0.0 | 0.39 | 16.4 ± 0.0 | 10.0 ± 0.0 | 1/1 |" in text
    assert "| naive | 35.0 ± 0.0 | 0.00 | 35.0 ± 0.0 | 10.0 ± 0.0 | 1/1 |" in text
