"""The one learner both topologies train with, on the tiny model and on hand-made rows.

Aspects under test:
- the policy's ``vocab_size`` (what the experience server checks token ids against) is the
  bound of the ids it can score;
- the old log-probs are computed with dropout off, even when the policy was left in train mode;
- ``kl_estimator: k1`` enters as a detached reward penalty (it moves the advantages, not the
  loss); k3 stays a loss term;
- an empty minibatch takes no optimizer step (Adam's moments would move the weights) and makes
  no policy version; a tightened staleness bound caps the optimizer steps of an update;
- ``seq-mean-token-sum-norm`` (Dr.GRPO) divides by ``max_tokens``, a constant, not by the
  longest response of the step;
- the policy-loss dispatch applies the dual clip to decoupled PPO and TIS too;
- two real gloo ranks: token-mean divides by the token count of both ranks (the DDP gradient
  equals one process training on both ranks' rows); colocated dynamic sampling runs the same
  number of rounds on every actor, so their prompt cursors stay aligned.

The two-rank part runs this file as a script in two processes (``gloo_ranks``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rljob_workers.config import (
    AlgorithmConfig,
    CheckpointConfig,
    ModelConfig,
    ProcessEnv,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    WorkerConfig,
)
from rljob_workers.learner import Experience, Learner, compute_policy_loss
from rljob_workers.policy import PolicyModel, build_sequence_batch
from rljob_workers.tinymodel import build_tiny_model
from tests.workers.gloo_ranks import run_two_ranks

PAD = 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _config(model, tmp_path, *, n: int = 2, max_tokens: int = 4, **algorithm) -> WorkerConfig:
    values = {
        "name": "grpo",
        "advantage_estimator": "grpo",
        "learning_rate": 1e-3,
        "group_size": n,
        "batch_size": 2,
        "mini_batch_size": 2,
        "max_grad_norm": 1e6,
    }
    values.update(algorithm)
    return WorkerConfig(
        job_name="learner-test",
        topology="colocated",
        algorithm=AlgorithmConfig(**values),
        model=ModelConfig(path=str(model)),
        task=TaskConfig(builtin="copy", num_prompts=16),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=n, max_tokens=max_tokens)),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=0),
        output_dir=str(tmp_path),
    )


def _rows(prompt: list[int], responses: list[list[int]], scores: list[float]) -> Experience:
    return Experience(
        [prompt] * len(responses),
        responses,
        [[0.0] * len(r) for r in responses],
        scores,
    )


def _join(*parts: Experience) -> Experience:
    return Experience(
        [p for e in parts for p in e.prompt_ids],
        [r for e in parts for r in e.response_ids],
        [b for e in parts for b in e.behaviour_logprobs],
        [s for e in parts for s in e.scores],
        None
        if any(e.versions_behind is None for e in parts)
        else [v for e in parts for v in e.versions_behind or ()],
    )


SHORT = _rows([1, 5, 6], [[8], [9]], [1.0, 0.0])
"""Rank 0's group: two one-token responses."""
LONG = _rows([1, 7], [[10, 11, 12], [13, 14, 15]], [0.0, 1.0])
"""Rank 1's group: two three-token responses."""


def _grads(policy: PolicyModel) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])


def _params(policy: PolicyModel) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in policy.parameters()])


# ------------------------------------------------------------------------------ preparation


def test_policy_vocab_size_bounds_the_token_ids_it_can_score(tiny_model):
    policy = PolicyModel.from_pretrained(tiny_model)
    last = policy.vocab_size - 1
    score = build_sequence_batch([[1, 2]], [[last]], pad_id=PAD)
    past = build_sequence_batch([[1, 2]], [[last + 1]], pad_id=PAD)

    with torch.no_grad():
        assert torch.isfinite(policy(score)[0]).all()
        with pytest.raises(IndexError):
            policy(past)


def test_learner_old_logprobs_computed_with_dropout_off(tiny_model, tmp_path):
    policy = PolicyModel.from_pretrained(tiny_model)
    for module in policy.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.9
    learner = Learner(_config(tiny_model, tmp_path), policy, pad_id=PAD)
    with torch.no_grad():
        policy.eval()
        expected, _ = policy(learner.prepare(LONG).batch)

    policy.train()  # where a training loop leaves it
    first = learner.prepare(LONG).old_logp
    policy.train()
    second = learner.prepare(LONG).old_logp

    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)


def _reference_apart(model) -> PolicyModel:
    reference = PolicyModel.from_pretrained(model)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    reference.requires_grad_(False)
    return reference


def test_learner_k1_kl_is_a_reward_penalty_that_moves_advantages(tiny_model, tmp_path):
    torch.manual_seed(0)
    equal_scores = _rows([1, 7], [[10, 11, 12], [13, 14]], [1.0, 1.0])
    reference = _reference_apart(tiny_model)
    k1 = Learner(
        _config(tiny_model, tmp_path, kl_coef=0.5, kl_estimator="k1"),
        PolicyModel.from_pretrained(tiny_model),
        pad_id=PAD,
        reference=reference,
    )
    k3 = Learner(
        _config(tiny_model, tmp_path, kl_coef=0.5, kl_estimator="k3"),
        PolicyModel.from_pretrained(tiny_model),
        pad_id=PAD,
        reference=reference,
    )

    with_k1 = k1.prepare(equal_scores)
    with_k3 = k3.prepare(equal_scores)

    mask = with_k1.batch.response_mask
    assert with_k1.ref_logp is not None
    penalty = (0.5 * (with_k1.old_logp - with_k1.ref_logp) * mask).sum(dim=1)
    # equal task scores: only the KL penalty separates the two responses, and the one further
    # from the reference gets the lower advantage
    assert bool((with_k1.sequence_advantages != 0).all())
    assert int(with_k1.sequence_advantages.argmin()) == int(penalty.argmax())
    assert bool((with_k3.sequence_advantages == 0).all())


def test_learner_k1_adds_no_kl_term_to_the_loss(tiny_model, tmp_path):
    # zero advantages (equal scores, k1 penalty off via equal reference): the loss is -0 * r
    # plus the KL term; with k1 there is none, so the first update has a zero gradient
    config = _config(tiny_model, tmp_path, kl_coef=0.5, kl_estimator="k1")
    policy = PolicyModel.from_pretrained(tiny_model)
    reference = PolicyModel.from_pretrained(tiny_model)
    reference.requires_grad_(False)
    learner = Learner(config, policy, pad_id=PAD, reference=reference)
    before = _params(policy)

    learner.update(_rows([1, 7], [[10, 11], [13, 14]], [1.0, 1.0]), seed=0)

    assert float(_grads(policy).abs().max()) == 0.0
    torch.testing.assert_close(_params(policy), before)


# ---------------------------------------------------------------------------------- update


def test_learner_empty_minibatch_takes_no_optimizer_step(tiny_model, tmp_path):
    # batch_size 4 prompts in 2 minibatches, but only one group arrived: one minibatch is empty
    split = Learner(
        _config(tiny_model, tmp_path, batch_size=4, mini_batch_size=2),
        PolicyModel.from_pretrained(tiny_model),
        pad_id=PAD,
    )
    whole = Learner(
        _config(tiny_model, tmp_path, batch_size=2, mini_batch_size=2),
        PolicyModel.from_pretrained(tiny_model),
        pad_id=PAD,
    )

    metrics = split.update(SHORT, seed=0)
    whole.update(SHORT, seed=0)

    assert split.minibatches == 2
    assert metrics["optimizer_steps"] == 1
    assert float(split.optimizer.state_dict()["state"][0]["step"]) == 1.0
    torch.testing.assert_close(_params(split.policy), _params(whole.policy), atol=0, rtol=0)


def test_learner_tightened_bound_caps_optimizer_steps(tiny_model, tmp_path):
    config = _config(tiny_model, tmp_path, batch_size=4, mini_batch_size=1, ppo_epochs=2)
    learner = Learner(config, PolicyModel.from_pretrained(tiny_model), pad_id=PAD)
    rows = _join(SHORT, LONG, SHORT, LONG)

    assert learner.schedule() == (2, 4)
    assert 1 <= learner.update(rows, seed=0, max_versions_behind=2)["optimizer_steps"] <= 3
    assert learner.update(rows, seed=0, max_versions_behind=0)["optimizer_steps"] == 1
    assert learner.update(rows, seed=0)["optimizer_steps"] == 8


def test_learner_sum_norm_divides_by_max_tokens_not_longest_response(tiny_model, tmp_path):
    config = _config(
        tiny_model,
        tmp_path,
        max_tokens=8,
        advantage_estimator="dr-grpo",
        loss_aggregation="seq-mean-token-sum-norm",
    )
    learner = Learner(config, PolicyModel.from_pretrained(tiny_model), pad_id=PAD)
    ragged = _rows([1, 7], [[10, 11, 12], [13]], [1.0, 0.0])
    prepared = learner.prepare(ragged)

    metrics = learner.update(ragged, seed=0)

    # first update: ratio 1, so the per-token loss is -A; rows 2, constant 8 (not T = 3)
    mask = prepared.batch.response_mask
    expected = float(-(prepared.advantages * mask).sum() / (2 * 8))
    assert metrics["policy_loss"] == pytest.approx(expected, abs=1e-6)
    assert expected != pytest.approx(float(-(prepared.advantages * mask).sum() / (2 * 3)))


def test_policy_loss_dispatch_applies_dual_clip_to_off_policy_losses():
    old = torch.tensor([[-2.0]], dtype=torch.float64)
    logp = old + torch.log(torch.tensor([[10.0]], dtype=torch.float64))
    advantages, mask = torch.tensor([[-1.0]], dtype=torch.float64), torch.ones(1, 1)
    for loss_name in ("ppo-clip", "decoupled-ppo", "tis"):
        algorithm = AlgorithmConfig(
            name="dapo", advantage_estimator="grpo", policy_loss=loss_name, dual_clip=3.0
        )
        loss, _ = compute_policy_loss(algorithm, logp, old, old, advantages, mask)
        assert float(loss[0, 0]) == pytest.approx(3.0), loss_name


# -------------------------------------------------------------------------- two gloo ranks


def _experience_for(rank: int) -> Experience:
    return SHORT if rank == 0 else LONG


def _versioned(experience: Experience, behind: int) -> Experience:
    """``experience`` with a behaviour log-prob per token and every row ``behind`` versions old."""
    logprobs = [[-1.0 - 0.5 * i for i in range(len(r))] for r in experience.response_ids]
    return Experience(
        experience.prompt_ids,
        experience.response_ids,
        logprobs,
        experience.scores,
        [behind] * len(experience),
    )


def _alternating_reward():
    count = [0]

    def reward(text: str, answer: str) -> float:
        count[0] += 1
        return float(count[0] % 2)

    return reward


def rank_main(out_dir: Path) -> None:
    from rljob_workers.colocated import build_colocated_runtime
    from rljob_workers.ddp import init_process_group_from_env, leave_process_group
    from rljob_workers.tasks import TaskData

    torch.set_num_threads(1)
    context = init_process_group_from_env("gloo", timeout_s=120)
    rank, model = context.rank, out_dir / "model"
    config = _config(model, out_dir)
    learner = Learner(
        config, PolicyModel.from_pretrained(model), pad_id=PAD, rank=rank, world_size=2
    )
    learner.update(_experience_for(rank), seed=0)
    results: dict[str, object] = {"grads": _grads(learner.policy)}
    # rank 0's rows were sampled at the learner's weights, rank 1's one version earlier
    results["metrics"] = Learner(
        config, PolicyModel.from_pretrained(model), pad_id=PAD, rank=rank, world_size=2
    ).update(_versioned(_experience_for(rank), rank), seed=0)

    # colocated DAPO dynamic sampling: rank 0's groups always have signal, rank 1's never do
    dapo = config.model_copy(
        update={
            "algorithm": config.algorithm.model_copy(
                update={"name": "dapo", "dynamic_sampling": True, "batch_size": 2}
            ),
            "rollout": RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=2)),
        }
    )
    env = ProcessEnv(role="actor", rank=rank, world_size=2, config_path=str(out_dir / "none.json"))
    runtime = build_colocated_runtime(dapo, env)
    task = runtime.task
    reward = _alternating_reward() if rank == 0 else (lambda text, answer: 0.0)
    runtime.task = TaskData(task.prompts, task.answers, reward)
    record = runtime.train_step()
    results["cursor"] = runtime.sampler.state_dict()
    results["rounds"] = record["sampling_rounds"]
    torch.save(results, out_dir / f"rank{rank}.pt")
    del learner, runtime  # what holds the group goes first (see leave_process_group)
    leave_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("learner-ranks")
    build_tiny_model(out_dir / "model", seed=0)
    return out_dir, run_two_ranks(__file__, out_dir, "learner")


def test_learner_two_ranks_token_mean_equals_one_process_on_both_ranks_rows(two_ranks, tmp_path):
    out_dir, results = two_ranks
    single = Learner(
        _config(out_dir / "model", tmp_path),
        PolicyModel.from_pretrained(out_dir / "model"),
        pad_id=PAD,
    )
    single.update(_join(SHORT, LONG), seed=0)

    torch.testing.assert_close(results[0]["grads"], results[1]["grads"])
    torch.testing.assert_close(results[0]["grads"], _grads(single.policy), atol=1e-6, rtol=1e-4)


def test_learner_two_ranks_report_the_whole_batch_metrics(two_ranks, tmp_path):
    """Review finding (issue 26 item 7): metrics were per rank. Both ranks now report the values
    one process training on both ranks' rows reports: means weighted by tokens, the advantage
    variance of all sequences, the largest mismatch, and the mismatch only over rows sampled at
    the learner's weights (rank 0's)."""
    out_dir, results = two_ranks
    single = Learner(
        _config(out_dir / "model", tmp_path),
        PolicyModel.from_pretrained(out_dir / "model"),
        pad_id=PAD,
    ).update(_join(_versioned(SHORT, 0), _versioned(LONG, 1)), seed=0)
    rank0, rank1 = results[0]["metrics"], results[1]["metrics"]
    assert rank0 == rank1
    assert rank0["logprob_mismatch_tokens"] == 2.0  # rank 0: two one-token responses
    assert rank0["tokens"] == 8.0
    keys = {
        "tokens", "advantage_var", "behaviour_logprob_gap", "entropy", "policy_loss", "kl", "loss",
        "logprob_mismatch_mean", "logprob_mismatch_max", "logprob_mismatch_kl", "grad_norm",
    }  # fmt: skip
    assert keys <= set(rank0)
    for key in keys:
        assert rank0[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key
    # one rank alone would have reported its own rows' token count and behaviour gap
    alone = Learner(
        _config(out_dir / "model", tmp_path),
        PolicyModel.from_pretrained(out_dir / "model"),
        pad_id=PAD,
    ).update(_versioned(LONG, 1), seed=0)
    assert alone["tokens"] == 6.0
    assert alone["behaviour_logprob_gap"] != pytest.approx(rank0["behaviour_logprob_gap"], rel=1e-3)
    assert "logprob_mismatch_mean" not in alone  # no row at the learner's weights


def test_learner_mismatch_is_measured_on_rows_at_the_learners_weights(tiny_model, tmp_path):
    learner = Learner(
        _config(tiny_model, tmp_path), PolicyModel.from_pretrained(tiny_model), pad_id=PAD
    )
    experience = _versioned(LONG, 0)
    prepared = learner.prepare(experience)
    assert prepared is not None
    mask = prepared.batch.response_mask
    delta = prepared.old_logp - prepared.behaviour_logp
    metrics = learner.update(experience, seed=0)
    assert metrics["logprob_mismatch_mean"] == pytest.approx(float(delta.abs().sum() / mask.sum()))
    assert metrics["logprob_mismatch_max"] == pytest.approx(float(delta.abs().max()))
    k3 = (torch.exp(delta) - 1 - delta).sum() / mask.sum()
    assert metrics["logprob_mismatch_kl"] == pytest.approx(float(k3), rel=1e-5)
    assert metrics["logprob_mismatch_tokens"] == 6.0


def test_colocated_dynamic_sampling_ranks_agree_on_rounds_and_cursor(two_ranks):
    _, results = two_ranks
    assert results[0]["rounds"] == results[1]["rounds"] > 1
    assert results[0]["cursor"] == results[1]["cursor"]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))


def test_update_starts_at_ratio_one_with_dropout_in_the_model_config(tmp_path):
    """A checkpoint whose config sets attention dropout: the update's forward (train mode) and
    the old log-probs (eval mode) must be the same function, so the first minibatch's ratio is
    1 (approx_kl 0, nothing clipped). RL trains without dropout (issue 26 item 7)."""
    import json

    model = build_tiny_model(tmp_path / "dropout", seed=2)
    config_path = model / "config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "attention_dropout": 0.5})
    )
    policy = PolicyModel.from_pretrained(model)
    learner = Learner(
        _config(model, tmp_path, n=4, batch_size=1, mini_batch_size=1), policy, pad_id=PAD
    )
    torch.manual_seed(0)

    metrics = learner.update(
        _rows([5, 6], [[7, 8, 9, 10]] * 2 + [[11, 12, 13, 14]] * 2, [1.0, 1.0, 0.0, 0.0]), seed=0
    )

    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["clip_fraction"] == 0.0


def test_naive_old_logprobs_clip_around_the_behaviour_and_keep_the_mismatch(tiny_model, tmp_path):
    """``old_logprobs: behaviour`` (AReaL's naive PPO, bench.corrections' baseline): the ratio is
    taken against the sampler's log-probs; the mismatch metric still compares the trainer's."""
    experience = _versioned(LONG, 0)
    naive = Learner(
        _config(tiny_model, tmp_path, old_logprobs="behaviour"),
        PolicyModel.from_pretrained(tiny_model),
        pad_id=PAD,
    )
    recompute = Learner(
        _config(tiny_model, tmp_path), PolicyModel.from_pretrained(tiny_model), pad_id=PAD
    )
    ours, theirs = naive.prepare(experience), recompute.prepare(experience)
    assert ours is not None and theirs is not None
    torch.testing.assert_close(ours.old_logp, ours.behaviour_logp)
    assert not torch.allclose(theirs.old_logp, theirs.behaviour_logp)
    first = naive.update(experience, seed=0)
    second = recompute.update(experience, seed=0)
    assert first["logprob_mismatch_mean"] == pytest.approx(second["logprob_mismatch_mean"])
    assert first["approx_kl"] > 0.1 > second["approx_kl"]  # ratios far from 1 vs. at 1
