"""cleanba_ppo.py: App. A batch sizes, the actor/learner schedule of Table 1, GAE and the PPO loss against hand-worked
values, EnvPool's autoreset as the script consumes it, gradient accumulation, and smoke runs as a user runs the script
(ToyChain concurrent and synchronous, Breakout-v5, torchrun with gloo, --save-model then --evaluate and resume),
including the paper's reproducibility claim: a slower learner gives bit-identical per-update losses and returns."""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import DEVICES, ROOT

import cleanba_ppo as cp

SCRIPT = os.path.join(ROOT, "cleanba_ppo.py")
TOY_BASE = ["--env-id", "ToyChain-v0", "--toy.horizon", "20", "--num-steps", "5", "--num-eval-episodes", "4",
            "--no-progress-bar"]
TOY = TOY_BASE + ["--local-num-envs", "8"]


# ----------------------------------------------------------------------------------------------------------------------
# App. A sizes and the Table 1 schedule
# ----------------------------------------------------------------------------------------------------------------------
def test_app_a_options_1_and_2_give_the_same_global_sizes():
    # App. A table: option 1 (world_size 1, 120 envs) and option 2 (world_size 2, 60 envs each), 128 steps, 4 mb.
    one = cp.derive_batch_sizes(120, 128, 4, world_size=1)
    two = cp.derive_batch_sizes(60, 128, 4, world_size=2)
    assert one == dict(num_envs=120, local_batch_size=15360, batch_size=15360, local_minibatch_size=3840,
                       minibatch_size=3840)
    assert two == dict(num_envs=120, local_batch_size=7680, batch_size=15360, local_minibatch_size=1920,
                       minibatch_size=3840)


def test_resolve_args_fills_table_2_and_keeps_actor_threads_out_of_the_batch():
    a = cp.resolve_args(cp.Args(env_id="Breakout-v5"))
    assert (a.local_num_envs, a.num_steps, a.num_minibatches, a.update_epochs) == (128, 128, 4, 4)
    assert (a.learning_rate, a.clip_coef, a.gamma, a.gae_lambda, a.max_grad_norm) == (2.5e-4, 0.1, 0.99, 0.95, 0.5)
    assert (a.ent_coef, a.vf_coef, a.anneal_lr) == (0.01, 0.5, True)
    assert (a.batch_size, a.minibatch_size, a.num_updates, a.envs_per_thread) == (16384, 4096, 3051, 64)
    one_thread = cp.resolve_args(cp.Args(env_id="Breakout-v5", num_actor_threads=1))
    assert one_thread.batch_size == a.batch_size and one_thread.envs_per_thread == 128
    two_learners = cp.resolve_args(cp.Args(env_id="Breakout-v5", num_envs=128), world_size=2)
    assert (two_learners.local_num_envs, two_learners.batch_size, two_learners.minibatch_size) == (64, 16384, 4096)


def test_concurrent_schedule_is_table_1():
    # The actor gets params before every rollout except the second: rollouts use pi_1, pi_1, pi_2, pi_3, ...
    actor_versions, version = [], 0
    for iteration in range(1, 7):
        if cp.should_get_params(iteration, concurrency=True):
            version += 1
        actor_versions.append(version)
    assert actor_versions == [1, 1, 2, 3, 4, 5]
    assert [cp.expected_data_version(u, True) for u in range(1, 7)] == actor_versions
    assert [cp.expected_data_version(u, False) for u in range(1, 7)] == [1, 2, 3, 4, 5, 6]
    assert all(cp.should_get_params(i, concurrency=False) for i in range(1, 7))


# ----------------------------------------------------------------------------------------------------------------------
# GAE, PPO loss, advantage normalization, sampling
# ----------------------------------------------------------------------------------------------------------------------
def col(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype).view(-1, 1)


def test_gae_next_step_autoreset_hand_worked():
    # EnvPool (next-step): s0 -a0-> s1 (terminates); row 2 is the stale reset row (obs s1, reward 0, action ignored);
    # s0' -a3-> s1' truncated (time limit): row 4 is stale, its obs s1' is the true last one, V(s1') = 4.0.
    gamma, lam = 0.9, 0.8
    rewards = col(1.0, 2.0, 0.0, 3.0, 0.0)
    values = col(0.5, 1.0, 7.0, 1.5, 4.0)  # row 2 holds V(s1 terminal) = 7: must never be used
    terms = col(0, 1, 0, 0, 0, dtype=torch.bool)
    truncs = col(0, 0, 0, 1, 0, dtype=torch.bool)
    last_value = torch.tensor([9.0])
    no_final = torch.zeros(5, 1, dtype=torch.bool)
    next_values = cp.bootstrap_values(values, last_value, torch.zeros(5, 1), no_final)
    adv, ret = cp.compute_gae(rewards, values, next_values, terms, terms | truncs, gamma, lam)
    # deltas: row0 1 + .9*1 - .5 = 1.4 | row1 2 - 1 = 1 (terminal) | row3 3 + .9*4 - 1.5 = 5.1 (truncated: V(s1'))
    # A1 = 1, A0 = 1.4 + .72 * 1 = 2.12, A3 = 5.1 (episode end; row 4 never flows back)
    valid = torch.tensor([True, True, False, True, False])
    np.testing.assert_allclose(adv.view(-1)[valid].numpy(), [2.12, 1.0, 5.1], rtol=1e-6)
    np.testing.assert_allclose(ret.view(-1)[valid].numpy(), [2.62, 2.0, 6.6], rtol=1e-6)


def test_gae_same_step_truncation_bootstraps_the_final_observation():
    rewards, values = col(1.0, 2.0), col(0.5, 1.0)
    terms, truncs = col(0, 0, dtype=torch.bool), col(1, 0, dtype=torch.bool)
    final_values, final_mask = col(3.0, 0.0), col(1, 0, dtype=torch.bool)  # V(final_obs of row 0) = 3
    next_values = cp.bootstrap_values(values, torch.tensor([2.0]), final_values, final_mask)
    assert next_values.view(-1).tolist() == [3.0, 2.0]
    adv, _ = cp.compute_gae(rewards, values, next_values, terms, terms | truncs, 0.9, 0.8)
    np.testing.assert_allclose(adv.view(-1).numpy(), [1 + 0.9 * 3 - 0.5, 2 + 0.9 * 2 - 1.0], rtol=1e-6)


def test_ppo_loss_terms_hand_worked():
    # ratio = e^{0.2} = 1.2214 (clipped at 1.1) with A = +2; ratio = e^{-0.3} = 0.7408 (clipped at 0.9) with A = -1.
    new, old = torch.tensor([0.2, -0.3]), torch.zeros(2)
    adv, returns, newvalue = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])
    t = cp.ppo_loss_terms(new, old, torch.tensor([1.0, 2.0]), newvalue, adv, returns, clip_coef=0.1)
    r0, r1 = np.exp(0.2), np.exp(-0.3)
    # pg = max(-A r, -A clip(r)): row 0 max(-2.4428, -2.2) = -2.2; row 1 max(0.7408, 0.9) = 0.9
    np.testing.assert_allclose(t["policy_loss"].numpy(), [-2.2, 0.9], rtol=1e-6)
    np.testing.assert_allclose(t["value_loss"].numpy(), [0.125, 0.125], rtol=1e-6)
    np.testing.assert_allclose(t["approx_kl"].numpy(), [(r0 - 1) - 0.2, (r1 - 1) + 0.3], rtol=1e-5)
    np.testing.assert_allclose(t["old_approx_kl"].numpy(), [-0.2, 0.3], rtol=1e-6)
    assert t["clipfrac"].tolist() == [1.0, 1.0]
    t = cp.ppo_loss_terms(torch.tensor([0.05]), torch.zeros(1), torch.ones(1), torch.zeros(1), torch.ones(1),
                          torch.zeros(1), clip_coef=0.1)
    assert t["clipfrac"].tolist() == [0.0] and t["policy_loss"].item() == pytest.approx(-np.exp(0.05))


def test_normalize_advantages_uses_the_valid_entries_only():
    adv = torch.tensor([1.0, 2.0, 3.0, 100.0])
    valid = torch.tensor([True, True, True, False])
    v = adv[valid]
    out = cp.normalize_advantages(adv, valid, 3.0, float(v.sum()), float(v.square().sum()))
    np.testing.assert_allclose(out[:3].numpy(), ((v - v.mean()) / (v.std() + 1e-8)).numpy(), rtol=1e-6)
    assert out[3] == 0.0


def test_gumbel_max_samples_the_softmax():
    logits = torch.log(torch.tensor([0.1, 0.2, 0.7])).expand(200_000, 3)
    actions = cp.sample_actions(logits, torch.rand(200_000, 3, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(actions, minlength=3).float() / 200_000
    np.testing.assert_allclose(freq.numpy(), [0.1, 0.2, 0.7], atol=0.005)


def test_impala_resnet_shapes_and_size():
    agent = cp.AtariAgent(18)
    logits, value = agent(torch.zeros(3, 4, 84, 84, dtype=torch.uint8))
    assert logits.shape == (3, 18) and value.shape == (3,)
    # Same layers as Cleanba's flax network (reference notes: 1,094,115 parameters with 18 actions).
    assert sum(p.numel() for p in agent.parameters()) == 1_094_115


# ----------------------------------------------------------------------------------------------------------------------
# EnvPool's autoreset (1.2.x), as the script consumes it
# ----------------------------------------------------------------------------------------------------------------------
ATARI_PROTOCOL = dict(repeat_action_probability=0.25, full_action_space=True, episodic_life=False, img_height=84,
                      img_width=84, gray_scale=True, stack_num=4, frame_skip=4, reward_clip=True, max_episode_steps=10)


def test_envpool_atari_is_next_step_autoreset_with_time_limit_truncation():
    assert cp.Args().max_episode_steps == 27000  # 108,000 frames (Sec. 5); 10 here to see a truncation
    args = cp.resolve_args(cp.Args(env_id="Breakout-v5", max_episode_steps=10, local_num_envs=2, num_actor_threads=1))
    pool = cp.make_env(args, 2, rank=0, first_env=0, start_update=1)
    try:
        pool.async_reset()
        step = pool.recv()
        assert step.obs.shape == (2, 4, 84, 84) and step.obs.dtype == torch.uint8 and pool.num_actions == 18
        # Sec. 5's protocol (Machado et al. 2018) as EnvPool was configured: sticky actions, full action space, no
        # life-loss signal, 84x84 grey, 4 stacked frames, frame skip 4, clipped rewards for learning
        assert {k: pool.pool.config[k] for k in ATARI_PROTOCOL} == ATARI_PROTOCOL
        flags = []
        for _ in range(12):
            pool.send(np.zeros(2, dtype=np.int64))
            step = pool.recv()
            flags.append((bool(step.truncated[0]), bool(step.terminated[0]), float(step.reward[0])))
        # step 10 ends the episode by its time limit (a truncation, not a termination) ...
        assert flags[9][:2] == (True, False) and not any(f[0] for f in flags[:9])
        # ... and the next step only resets the env: no flags, reward 0 (this row is masked by the actor)
        assert flags[10] == (False, False, 0.0)
    finally:
        pool.close()


def test_env_seeds_do_not_depend_on_how_envs_are_split_over_threads():
    whole = cp.env_seeds(1, rank=0, first_env=0, num_envs=8, start_update=1)
    halves = cp.env_seeds(1, 0, 0, 4, 1) + cp.env_seeds(1, 0, 4, 4, 1)
    assert whole == halves and len(set(whole)) == 8
    assert cp.env_seeds(1, rank=1, first_env=0, num_envs=8, start_update=1) != whole
    assert cp.env_seeds(2, rank=0, first_env=0, num_envs=8, start_update=1) != whole


# ----------------------------------------------------------------------------------------------------------------------
# Learner: gradient accumulation gives the same step
# ----------------------------------------------------------------------------------------------------------------------
def test_gradient_accumulation_gives_the_same_update():
    torch.manual_seed(0)
    B, nb = 32, 5
    obs = torch.randint(0, nb, (B,))
    actions = torch.randint(0, 4, (B,))
    old_logprobs, advantages, returns = -torch.rand(B), torch.randn(B), torch.randn(B)
    valid = torch.rand(B) > 0.2
    results = []
    for k in (1, 4):
        torch.manual_seed(1)
        agent = cp.ChainAgent(nb, 4)
        args = SimpleNamespace(world_size=1, norm_adv=True, local_minibatch_size=B, gradient_accumulation_steps=k,
                               clip_coef=0.1, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, learning_rate=1e-3)
        learner = cp.Learner(args, agent, torch.device("cpu"), rank=0)
        stats = learner.minibatch_step(obs, actions, old_logprobs, advantages, returns, valid)
        results.append((torch.cat([p.detach().flatten() for p in agent.parameters()]), stats))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------------
# Argument validation
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(env_id="NoSuchGame-v5"), "--env-id"),
    (dict(env_id="ToyChain-v0", local_num_envs=9, num_actor_threads=2), "--local-num-envs 9 does not split"),
    (dict(env_id="ToyChain-v0", local_num_envs=6, num_steps=1, num_minibatches=4), "--num-minibatches 4"),
    (dict(env_id="ToyChain-v0", local_num_envs=8, num_steps=2, gradient_accumulation_steps=3),
     "--gradient-accumulation-steps 3"),
    (dict(env_id="ToyChain-v0", total_timesteps=10), "--total-timesteps 10 is less than one batch"),
    (dict(env_id="ToyChain-v0", num_envs=16, local_num_envs=8), "give only one of them"),
    (dict(env_id="ToyChain-v0", evaluate=True), "--evaluate needs --checkpoint"),
    (dict(env_id="ToyChain-v0", checkpoint="/no/such/file.pt"), "no such file"),
    (dict(env_id="ToyChain-v0", capture_video=True), "--capture-video"),
    (dict(env_id="ToyChain-v0", cuda=False, actor_device_ids=[0]), "--actor-device-ids"),
    (dict(env_id="ToyChain-v0", debug_learner_delay=-1.0), "--debug-learner-delay"),
])
def test_bad_input_is_rejected_with_the_flag_named(kwargs, message):
    with pytest.raises(cp.ArgsError, match=message.replace("-", r"\-")):
        cp.resolve_args(cp.Args(**kwargs))


def test_num_envs_must_split_over_learners():
    with pytest.raises(cp.ArgsError, match="does not split over 3 learner processes"):
        cp.resolve_args(cp.Args(env_id="ToyChain-v0", num_envs=8), world_size=3)


# ----------------------------------------------------------------------------------------------------------------------
# Smoke runs, as a user runs the script
# ----------------------------------------------------------------------------------------------------------------------
def run_script(args, out, timeout=600, check=True, launcher=None, script=SCRIPT):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = (launcher or [sys.executable]) + [script, "--output-dir", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def only_run_dir(path, pattern="*"):
    dirs = [d for d in glob.glob(os.path.join(str(path), pattern)) if os.path.isdir(d)]
    assert len(dirs) == 1, dirs
    return dirs[0]


def read_run(run_dir):
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "updates.jsonl"))]
    return summary, rows


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def without_timing(rows):
    return [{k: v for k, v in row.items() if k != "time"} for row in rows]


@pytest.mark.parametrize("concurrency", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_toy_chain_smoke_in_both_autoreset_modes_and_the_data_version_invariant(tmp_path, concurrency, device):
    mode = "next_step" if concurrency else "same_step"  # EnvPool's mode, and ToyChain's other one
    args = TOY + ["--total-timesteps", "800", "--concurrency" if concurrency else "--no-concurrency",
                  "--toy.autoreset-mode", mode]
    run_script(args + (["--no-cuda"] if device == "cpu" else []), tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary, rows = read_run(run_dir)
    assert summary["global_step"] == 800 and summary["update"] == 20 and summary["sps"] > 0
    # Table 1: update i trains on data of pi_{i-1} (Cleanba's architecture) or pi_i (synchronous).
    assert [r["data_policy_version"] for r in rows] == [cp.expected_data_version(i, concurrency) for i in range(1, 21)]
    assert [r["learner_policy_version"] for r in rows] == list(range(1, 21))
    for key in ("charts/episodic_return", "charts/success_rate", "losses/policy_loss", "losses/value_loss",
                "losses/approx_kl", "eval/return", "eval/success_at_end", "toy/accuracy",
                "cleanba/rollout_queue_get_time", "cleanba/params_queue_get_time", "time/env_send", "time/env_recv",
                "time/inference", "time/storage", "time/update", "time/rollout"):
        assert key in summary, key
    assert summary["eval/episodes"] == 4 and summary["charts/episodic_length"] == 20
    s = scalars(run_dir)
    assert [step for step, _ in s["charts/SPS"]] == [40 * i for i in range(1, 21)]
    assert [v for _, v in s["cleanba/policy_lag"]] == [0.0] + [1.0 if concurrency else 0.0] * 19
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert (config["batch_size"], config["minibatch_size"], config["envs_per_thread"]) == (40, 10, 4)


def test_a_slower_learner_gives_bit_identical_losses_and_returns(tmp_path):
    """Sec. 3-4: the learner sleeping after each update changes the wall clock only (both architectures)."""
    for mode in ("--concurrency", "--no-concurrency"):
        runs = {}
        for delay in ("0", "0.25"):
            out = tmp_path / f"{mode}_{delay}"
            run_script(TOY + ["--total-timesteps", "480", "--no-cuda", mode, "--debug-learner-delay", delay,
                              "--toy.progression-prob", "0.3"], out)
            runs[delay] = read_run(only_run_dir(out))
        fast, slow = runs["0"], runs["0.25"]
        assert without_timing(fast[1]) == without_timing(slow[1])  # every per-update loss, return, version
        assert any("episodic_return" in r for r in fast[1])
        assert fast[0]["eval/return"] == slow[0]["eval/return"]
        # the delay took effect: the actors waited longer for the slow learner, for its params (synchronous) or
        # for room in the rollout queue (concurrent: the learner takes the next batch only after its sleep)
        def actor_wait(rows):
            return np.mean([r["time"]["params_queue_get"] + r["time"]["rollout_queue_put"] for r in rows[3:]])

        assert actor_wait(slow[1]) > actor_wait(fast[1]) + 0.1


def test_breakout_smoke(tmp_path):
    """Breakout-v5 with the paper's protocol for a few hundred steps on the CPU; a short time limit makes episodes
    end (truncations) so that returns are logged."""
    args = ["--env-id", "Breakout-v5", "--local-num-envs", "4", "--num-steps", "32", "--total-timesteps", "256",
            "--max-episode-steps", "40", "--update-epochs", "1", "--num-eval-episodes", "2", "--no-cuda",
            "--no-progress-bar", "--capture-video"]
    run_script(args, tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary, rows = read_run(run_dir)
    assert summary["global_step"] == 256 and [r["data_policy_version"] for r in rows] == [1, 1]
    assert summary["charts/episodic_length"] == 40 and "charts/episodic_return" in summary
    assert summary["eval/episode_len"] == 40 and summary["eval/episodes"] == 2
    assert all(np.isfinite(r["value_loss"]) for r in rows) and summary["time/env_recv"] > 0
    assert os.path.getsize(os.path.join(run_dir, "eval.mp4")) > 1000  # the first evaluation episode
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["repeat_action_probability"] == 0.25 and config["full_action_space"] and not config["episodic_life"]


def test_torchrun_two_learners_with_gloo(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = TOY_BASE + ["--num-envs", "16", "--total-timesteps", "800", "--no-cuda", "--gradient-accumulation-steps", "2"]
    run_script(args, tmp_path, launcher=launcher)
    run_dir = only_run_dir(tmp_path)  # only rank 0 writes
    summary, rows = read_run(run_dir)
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert summary["world_size"] == 2 and config["world_size"] == 2
    # App. A: 2 learners x 8 envs x 5 steps = a global batch of 80 (10 updates of 800 steps)
    assert (config["local_num_envs"], config["num_envs"], config["batch_size"], config["minibatch_size"]) == (8, 16, 80, 20)
    assert summary["global_step"] == 800 and len(rows) == 10
    assert summary["params_max_abs_diff_across_learners"] == 0.0  # the gradient all-reduce keeps them identical
    assert [r["data_policy_version"] for r in rows] == [cp.expected_data_version(i, True) for i in range(1, 11)]


def test_save_model_then_evaluate_then_resume(tmp_path):
    first = tmp_path / "first"
    run_script(TOY + ["--total-timesteps", "400", "--save-model", "--checkpoint-freq", "5", "--no-cuda"], first)
    run_dir = only_run_dir(first)
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.pt"))) == \
        ["ckpt_200.pt", "ckpt_400.pt", "final_ckpt.pt"]
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=False)
    assert ckpt["update"] == 10 and ckpt["global_step"] == 400 and ckpt["optimizer"]["state"]

    second = tmp_path / "second"
    run_script(TOY + ["--evaluate", "--checkpoint", os.path.join(run_dir, "final_ckpt.pt"), "--no-cuda"], second)
    evaluated = json.load(open(os.path.join(only_run_dir(second), "summary.json")))
    assert evaluated["eval/episodes"] == 4 and evaluated["eval/episode_len"] == 20 and "eval/return" in evaluated

    third = tmp_path / "third"
    proc = run_script(TOY + ["--total-timesteps", "800", "--checkpoint", os.path.join(run_dir, "ckpt_200.pt"),
                             "--no-cuda"], third)
    assert "resuming from" in proc.stdout
    summary, rows = read_run(only_run_dir(third))
    assert summary["global_step"] == 800 and [r["update"] for r in rows] == list(range(6, 21))
    # after resuming, pi_6 collects the first two rollouts, then the second-latest policy as always
    assert [r["data_policy_version"] for r in rows][:4] == [6, 6, 7, 8]


def test_bad_flag_exits_early_with_a_message_and_writes_nothing(tmp_path):
    proc = run_script(["--env-id", "ToyChain-v0", "--local-num-envs", "7"], tmp_path, check=False)
    assert proc.returncode == 2 and "error: --local-num-envs 7 does not split over 2 actor threads" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_a_failing_actor_ends_the_run_with_its_error(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_recv = cp.ToyChainPool.recv

    def failing_recv(self):
        calls["n"] += 1
        if calls["n"] > 30:
            raise RuntimeError("simulated env crash")
        return real_recv(self)

    monkeypatch.setattr(cp.ToyChainPool, "recv", failing_recv)
    args = cp.Args(env_id="ToyChain-v0", output_dir=str(tmp_path), local_num_envs=4, num_steps=5,
                   total_timesteps=10_000, num_actor_threads=1, num_eval_episodes=0, progress_bar=False, cuda=False)
    try:
        with pytest.raises(RuntimeError, match="simulated env crash"):
            cp.main(args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert json.load(open(os.path.join(only_run_dir(tmp_path), "summary.json")))["update"] >= 1


def test_ctrl_c_writes_the_summary_and_a_checkpoint(tmp_path):
    # A background job ignores SIGINT and its children inherit that, so the child restores Python's handler itself
    # before running the script as __main__ (a preexec_fn would fork this multithreaded process: JAX is loaded).
    launcher = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", launcher, SCRIPT, "--output-dir", str(tmp_path), "--save-model",
                             "--no-cuda", "--checkpoint-freq", "5", *TOY, "--total-timesteps", str(10**8)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not glob.glob(os.path.join(str(tmp_path), "*", "ckpt_*.pt")):
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    run_dir = only_run_dir(tmp_path)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["interrupted"] is True and summary["global_step"] > 0
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=False)
    assert ckpt["global_step"] == summary["global_step"] and ckpt["update"] == summary["update"]
    assert not glob.glob(os.path.join(run_dir, "*.tmp"))
