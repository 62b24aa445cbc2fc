"""cleanba_impala.py: V-trace against rlax (random inputs with episode ends inside the sequence) and a hand-worked
case, truncations, the time alignment of rows on a small deterministic env, the learner (gradient accumulation,
Table 3), and smoke runs as a user runs the script (ToyChain concurrent and synchronous, Breakout-v5, torchrun with
gloo, --save-model then --evaluate), including the reproducibility claim: a slower learner changes nothing."""

import glob
import json
import os
import sys

import numpy as np
import pytest
import torch
from conftest import DEVICES, ROOT

import cleanba_impala as ci

# Test-only dependencies, installed by requirements.txt (never skipped): rlax is the independent V-trace reference.
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import rlax  # noqa: E402

SCRIPT = os.path.join(ROOT, "cleanba_impala.py")
TOY_BASE = ["--env-id", "ToyChain-v0", "--toy.horizon", "20", "--num-steps", "5", "--num-eval-episodes", "4",
            "--no-progress-bar"]
TOY = TOY_BASE + ["--local-num-envs", "8"]
GAMMA = 0.9


# ----------------------------------------------------------------------------------------------------------------------
# V-trace
# ----------------------------------------------------------------------------------------------------------------------
def rlax_vtrace(values, next_values, rewards, discounts, log_rhos, lam):
    """rlax.vtrace_td_error_and_advantage on each env column: returns (vs, pg_advantages) as numpy (T, N)."""
    vs, adv = [], []
    for i in range(values.shape[1]):
        out = rlax.vtrace_td_error_and_advantage(
            jnp.asarray(values[:, i]), jnp.asarray(next_values[:, i]), jnp.asarray(rewards[:, i]),
            jnp.asarray(discounts[:, i]), jnp.exp(jnp.asarray(log_rhos[:, i])), lambda_=lam)
        vs.append(np.asarray(out.errors) + values[:, i])
        adv.append(np.asarray(out.pg_advantage))
    return np.stack(vs, 1), np.stack(adv, 1)


def random_rollout(seed, T=12, N=6, p_end=0.15):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(T, N))
    last = rng.normal(size=N)
    next_values = np.concatenate([values[1:], last[None]], 0)  # V(x_{t+1}), bootstrap V(x_T) for the last row
    rewards = rng.normal(size=(T, N))
    terminations = rng.random((T, N)) < p_end  # episode ends inside the sequence
    log_rhos = rng.normal(scale=0.5, size=(T, N))  # ratios both below and above rho-bar = 1
    return values, next_values, rewards, terminations, log_rhos


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lam", [1.0, 0.9])
def test_vtrace_matches_rlax_with_episode_ends_inside_the_sequence(seed, lam):
    values, next_values, rewards, terms, log_rhos = random_rollout(seed)
    assert terms.any() and (np.exp(log_rhos) > 1).any() and (np.exp(log_rhos) < 1).any()
    t = lambda x: torch.as_tensor(x)  # noqa: E731
    vs, adv = ci.vtrace(t(values), t(next_values), t(rewards), t(terms), t(terms), t(log_rhos), GAMMA, lam)
    ref_vs, ref_adv = rlax_vtrace(values, next_values, rewards, GAMMA * (1.0 - terms), log_rhos, lam)
    np.testing.assert_allclose(vs.numpy(), ref_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_truncation_equals_rlax_on_the_two_episodes_separately(seed):
    """A time-limit end at row k bootstraps V(true last state) but cuts the trace: the same as running rlax on rows
    0..k (bootstrapping next_values[k]) and on rows k+1.. separately."""
    values, next_values, rewards, _, log_rhos = random_rollout(seed, T=10, N=1)
    k = 4
    next_values[k] = 3.7  # V of the truncated episode's last state (not the next row's state)
    truncs = np.zeros((10, 1), dtype=bool)
    truncs[k] = True
    t = lambda x: torch.as_tensor(x)  # noqa: E731
    no_terms = np.zeros_like(truncs)
    vs, adv = ci.vtrace(t(values), t(next_values), t(rewards), t(no_terms), t(truncs), t(log_rhos), GAMMA, 1.0)
    disc = np.full((10, 1), GAMMA)
    head = rlax_vtrace(values[:k + 1], next_values[:k + 1], rewards[:k + 1], disc[:k + 1], log_rhos[:k + 1], 1.0)
    tail = rlax_vtrace(values[k + 1:], next_values[k + 1:], rewards[k + 1:], disc[k + 1:], log_rhos[k + 1:], 1.0)
    np.testing.assert_allclose(vs.numpy(), np.concatenate([head[0], tail[0]]), rtol=1e-10)
    np.testing.assert_allclose(adv.numpy(), np.concatenate([head[1], tail[1]]), rtol=1e-10)


def test_vtrace_hand_worked():
    # One env, T = 3, gamma 0.9, lambda 1, rho-bar = c-bar = 1. Row 1 terminates.
    # values 1, 2, 3; next_values 2, (unused: terminal) 9, 4 (bootstrap); rewards 1, 1, 1
    # rhos: 0.5, 2.0 (clipped to 1), 1.0
    values = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    next_values = torch.tensor([[2.0], [9.0], [4.0]], dtype=torch.float64)
    rewards = torch.ones(3, 1, dtype=torch.float64)
    terms = torch.tensor([[False], [True], [False]])
    log_rhos = torch.log(torch.tensor([[0.5], [2.0], [1.0]], dtype=torch.float64))
    vs, adv = ci.vtrace(values, next_values, rewards, terms, terms, log_rhos, 0.9, 1.0)
    # deltas: row0 0.5 (1 + .9*2 - 1) = 0.9 | row1 1 (1 + 0 - 2) = -1 | row2 1 (1 + .9*4 - 3) = 1.6
    # errors: row2 1.6 | row1 -1 (terminal: no trace from row 2) | row0 0.9 + .9 * 0.5 * (-1) = 0.45
    np.testing.assert_allclose(vs.view(-1).numpy(), [1.45, 1.0, 4.6])
    # q: row0 1 + .9 * vs_1 = 1.9 | row1 1 (terminal) | row2 1 + .9 * 4 = 4.6
    # pg_adv = min(1, rho) (q - V): 0.5 * 0.9 = 0.45 | 1 * (1 - 2) = -1 | 1 * 1.6 = 1.6
    np.testing.assert_allclose(adv.view(-1).numpy(), [0.45, -1.0, 1.6])


def test_impala_loss_terms_hand_worked():
    t = ci.impala_loss_terms(torch.tensor([-1.0, -2.0]), torch.tensor([0.5, 0.7]), torch.tensor([1.0, 2.0]),
                             torch.tensor([2.0, 0.0]), torch.tensor([3.0, -1.0]))
    assert t["policy_loss"].tolist() == [3.0, -2.0]  # -log pi(a) x pg_adv
    assert t["value_loss"].tolist() == [0.5, 2.0]  # 0.5 (v_s - V)^2
    assert t["entropy"].tolist() == pytest.approx([0.5, 0.7])


# ----------------------------------------------------------------------------------------------------------------------
# Row alignment on a deterministic env: r_t and the flags of row t belong to a_t taken at o_t
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["next_step", "same_step"])
def test_rollout_rows_pair_each_action_with_its_own_reward_and_episode_end(mode):
    import threading

    H = 5
    args = ci.resolve_args(ci.Args(env_id="ToyChain-v0", local_num_envs=4, num_steps=14, num_actor_threads=1,
                                   num_minibatches=1, total_timesteps=56, cuda=False,
                                   toy=ci.ToyChainConfig(horizon=H, block_length=1, progression_prob=1.0,
                                                         autoreset_mode=mode)))
    torch.manual_seed(0)
    agent = ci.ChainAgent(args.toy.num_blocks, args.toy.num_actions)
    actor = ci.ActorThread(args, 0, torch.device("cpu"), rank=0, start_update=1, num_iterations=1, template=agent,
                           stop=threading.Event(), pin_memory=False)
    target = actor.envs.env.target_actions.clone()
    actor.params_queue.put((1, agent.state_dict()))
    actor.run()
    assert actor.error is None
    r = actor.rollout_queue.get_nowait()
    assert r.policy_version == 1
    valid = r.valid
    # With p_prog = 1 and L = 1 the agent moves one block per step: o_t is the episode step. The reward in row t is
    # +0.5 exactly when a_t was o_t's target action.
    expected = torch.where(r.actions == target[r.obs], 0.5, -0.5)
    assert torch.equal(r.rewards[valid], expected[valid])
    # Episodes last H real steps: the row whose action was the H-th of its episode carries the truncation.
    assert torch.equal(r.truncations[valid], (r.obs == H - 1)[valid] & True)
    if mode == "next_step":  # the row after each episode end is the stale reset row, masked; its reward is 0
        stale = torch.zeros_like(valid)
        stale[1:] = r.truncations[:-1]
        assert torch.equal(~valid, stale) and (r.rewards[~valid] == 0).all()
    else:  # same-step: every row is a transition; the truncated rows keep the true last observation
        assert valid.all() and torch.equal(r.final_mask, r.truncations)
        assert (r.final_obs[r.final_mask] == H - 1).all()
    assert torch.equal(r.next_obs, actor.envs.env.block)  # o_T bootstraps the last row


# ----------------------------------------------------------------------------------------------------------------------
# Learner and arguments
# ----------------------------------------------------------------------------------------------------------------------
def test_resolve_args_fills_table_3():
    a = ci.resolve_args(ci.Args(env_id="Breakout-v5"))
    assert (a.local_num_envs, a.num_steps, a.num_minibatches, a.learning_rate, a.max_grad_norm) == (128, 20, 4, 6e-4,
                                                                                                    40.0)
    assert (a.rmsprop_eps, a.rmsprop_alpha, a.vtrace_lambda, a.clip_rho_threshold, a.clip_pg_rho_threshold) == (
        0.01, 0.99, 1.0, 1.0, 1.0)
    assert (a.gamma, a.ent_coef, a.vf_coef, a.anneal_lr, a.concurrency) == (0.99, 0.01, 0.5, True, True)
    assert (a.batch_size, a.minibatch_size, a.num_updates) == (2560, 640, 19531)
    learner = ci.Learner(a, ci.ChainAgent(4, 3), torch.device("cpu"), rank=0)
    group = learner.optimizer.param_groups[0]
    assert isinstance(learner.optimizer, torch.optim.RMSprop)
    assert (group["eps"], group["alpha"], group["momentum"], group["centered"]) == (0.01, 0.99, 0, False)
    assert learner.learning_rate(1) == 6e-4 and learner.learning_rate(a.num_updates + 1) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(env_id="ToyChain-v0", local_num_envs=6, num_actor_threads=1, num_minibatches=4), "--num-minibatches 4"),
    (dict(env_id="ToyChain-v0", local_num_envs=8, num_minibatches=4, gradient_accumulation_steps=4),
     "--gradient-accumulation-steps 4"),
    (dict(env_id="ToyChain-v0", vtrace_lambda=1.5), "--vtrace-lambda"),
    (dict(env_id="ToyChain-v0", clip_rho_threshold=0.0), "--clip-rho-threshold"),
])
def test_bad_input_is_rejected_with_the_flag_named(kwargs, message):
    with pytest.raises(ci.ArgsError, match=message.replace("-", r"\-")):
        ci.resolve_args(ci.Args(**kwargs))


def test_gradient_accumulation_gives_the_same_update():
    torch.manual_seed(0)
    T, N, nb, A = 6, 8, 5, 4
    batch = dict(obs=torch.randint(0, nb, (T, N)), next_obs=torch.randint(0, nb, (N,)),
                 actions=torch.randint(0, A, (T, N)), logprobs=-torch.rand(T, N) - 1.0, rewards=torch.randn(T, N),
                 terminations=torch.rand(T, N) < 0.1, truncations=torch.rand(T, N) < 0.1,
                 valid=torch.rand(T, N) > 0.1, final_obs=torch.zeros(0, dtype=torch.long),
                 final_mask=torch.zeros(T, N, dtype=torch.bool))
    results = []
    for k in (1, 4):
        torch.manual_seed(1)
        agent = ci.ChainAgent(nb, A)
        args = ci.resolve_args(ci.Args(env_id="ToyChain-v0", local_num_envs=N, num_steps=T, num_minibatches=1,
                                       gradient_accumulation_steps=k, cuda=False))
        learner = ci.Learner(args, agent, torch.device("cpu"), rank=0)
        stats = learner.minibatch_step(batch, slice(0, N))
        results.append((torch.cat([p.detach().flatten() for p in agent.parameters()]), stats))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Smoke runs, as a user runs the script
# ----------------------------------------------------------------------------------------------------------------------
from test_cleanba_ppo import only_run_dir, read_run, scalars, without_timing  # noqa: E402
from test_cleanba_ppo import run_script as _run_script  # noqa: E402


def run_script(args, out, **kwargs):
    return _run_script(args, out, script=SCRIPT, **kwargs)


@pytest.mark.parametrize("concurrency", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_toy_chain_smoke_in_both_autoreset_modes_and_the_data_version_invariant(tmp_path, concurrency, device):
    mode = "next_step" if concurrency else "same_step"
    args = TOY + ["--total-timesteps", "800", "--concurrency" if concurrency else "--no-concurrency",
                  "--toy.autoreset-mode", mode, "--num-minibatches", "2"]
    run_script(args + (["--no-cuda"] if device == "cpu" else []), tmp_path)
    run_dir = only_run_dir(tmp_path)
    summary, rows = read_run(run_dir)
    assert summary["global_step"] == 800 and summary["update"] == 20
    assert [r["data_policy_version"] for r in rows] == [ci.expected_data_version(i, concurrency) for i in range(1, 21)]
    for key in ("charts/episodic_return", "losses/policy_loss", "losses/value_loss", "losses/entropy",
                "losses/grad_norm", "cleanba/rho_mean", "cleanba/rho_clipfrac", "eval/return",
                "cleanba/rollout_queue_get_time", "cleanba/params_queue_get_time", "time/env_send", "time/env_recv",
                "time/inference", "time/storage", "time/update"):
        assert key in summary, key
    assert summary["charts/episodic_length"] == 20
    # The first update starts on-policy (rho = 1 up to rounding; its second minibatch is one small step off).
    assert abs(rows[0]["rho_mean"] - 1.0) < 1e-2
    s = scalars(run_dir)
    assert [v for _, v in s["cleanba/policy_lag"]] == [0.0] + [1.0 if concurrency else 0.0] * 19


@pytest.mark.parametrize("concurrency", [True, False])
def test_a_slower_learner_gives_bit_identical_losses_and_returns(tmp_path, concurrency):
    """Sec. 3-4: the learner sleeping after each update changes the wall clock only, in both architectures."""
    runs = {}
    for delay in ("0", "0.25"):
        out = tmp_path / delay
        run_script(TOY + ["--total-timesteps", "480", "--no-cuda", "--debug-learner-delay", delay,
                          "--toy.progression-prob", "0.3", "--concurrency" if concurrency else "--no-concurrency"],
                   out)
        runs[delay] = read_run(only_run_dir(out))
    fast, slow = runs["0"][1], runs["0.25"][1]
    assert without_timing(fast) == without_timing(slow)  # every per-update loss, return, version
    assert any("episodic_return" in r for r in fast)
    assert runs["0"][0]["eval/return"] == runs["0.25"][0]["eval/return"]
    assert [r["data_policy_version"] for r in slow] == [ci.expected_data_version(i, concurrency) for i in range(1, 13)]

    def actor_wait(rows):  # the delay took effect: the actors waited for the slow learner
        return np.mean([r["time"]["params_queue_get"] + r["time"]["rollout_queue_put"] for r in rows[3:]])

    assert actor_wait(slow) > actor_wait(fast) + 0.1


def test_envpool_atari_protocol():
    """Sec. 5's protocol (Machado et al. 2018) as EnvPool is configured by this script's own make_env."""
    from test_cleanba_ppo import ATARI_PROTOCOL

    args = ci.resolve_args(ci.Args(env_id="Breakout-v5", max_episode_steps=10, local_num_envs=2, num_actor_threads=1,
                                   num_minibatches=1))
    assert ci.Args().max_episode_steps == 27000
    pool = ci.make_env(args, 2, rank=0, first_env=0, start_update=1)
    try:
        assert {k: pool.pool.config[k] for k in ATARI_PROTOCOL} == ATARI_PROTOCOL and pool.num_actions == 18
        pool.async_reset()
        step = pool.recv()
        assert step.obs.shape == (2, 4, 84, 84) and step.obs.dtype == torch.uint8
    finally:
        pool.close()


def test_breakout_smoke(tmp_path):
    """Breakout-v5 through EnvPool's send/recv API, a few hundred steps on the CPU."""
    args = ["--env-id", "Breakout-v5", "--local-num-envs", "4", "--num-steps", "20", "--total-timesteps", "240",
            "--max-episode-steps", "30", "--num-minibatches", "2", "--num-eval-episodes", "2", "--no-cuda",
            "--no-progress-bar"]
    run_script(args, tmp_path)
    summary, rows = read_run(only_run_dir(tmp_path))
    assert summary["global_step"] == 240 and [r["data_policy_version"] for r in rows] == [1, 1, 2]
    assert summary["charts/episodic_length"] == 30 and summary["eval/episode_len"] == 30
    assert all(np.isfinite(r["value_loss"]) and np.isfinite(r["policy_loss"]) for r in rows)
    assert summary["time/env_recv"] > 0 and summary["time/env_send"] > 0


def test_torchrun_two_learners_with_gloo(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = TOY_BASE + ["--num-envs", "16", "--total-timesteps", "800", "--no-cuda", "--num-minibatches", "2",
                       "--gradient-accumulation-steps", "2"]
    run_script(args, tmp_path, launcher=launcher)
    run_dir = only_run_dir(tmp_path)
    summary, rows = read_run(run_dir)
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert (config["world_size"], config["local_num_envs"], config["batch_size"], config["minibatch_size"]) == (
        2, 8, 80, 40)
    assert summary["global_step"] == 800 and len(rows) == 10
    assert summary["params_max_abs_diff_across_learners"] == 0.0


def test_save_model_then_evaluate(tmp_path):
    first = tmp_path / "first"
    run_script(TOY + ["--total-timesteps", "400", "--save-model", "--checkpoint-freq", "5", "--no-cuda"], first)
    run_dir = only_run_dir(first)
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "*.pt"))) == \
        ["ckpt_200.pt", "ckpt_400.pt", "final_ckpt.pt"]
    ckpt = torch.load(os.path.join(run_dir, "final_ckpt.pt"), weights_only=False)
    assert ckpt["update"] == 10 and ckpt["optimizer"]["state"]  # RMSprop's square averages
    second = tmp_path / "second"
    run_script(TOY + ["--evaluate", "--eval-deterministic", "--checkpoint", os.path.join(run_dir, "final_ckpt.pt"),
                      "--no-cuda"], second)
    evaluated = json.load(open(os.path.join(only_run_dir(second), "summary.json")))
    assert evaluated["eval/episodes"] == 4 and "eval/success_at_end" in evaluated
