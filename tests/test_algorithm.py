"""Merging, advantages and the per-rollout loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from agl_common.schemas import CallRecord, Rollout, RolloutStatus
from agl_trainer.algorithm.advantage import grpo_advantages, rloo_advantages, rollout_advantages
from agl_trainer.algorithm.aggregate import AggregateStats, build_rows
from agl_trainer.config import TrainConfig
from agl_trainer.algorithm.batch import build_batch
from agl_trainer.algorithm.loss import per_rollout_token_weights, ppo_loss


def call(seq, prompt, response, logprobs=None, rid="r", status="ok"):
    return CallRecord(rollout_id=rid, attempt_id="0", seq=seq, route="chat", request={}, response={},
                      prompt_token_ids=prompt, response_token_ids=response,
                      response_logprobs=logprobs if logprobs is not None else [-0.5] * len(response), status=status)


def test_trajectory_merges_exact_prefix_and_masks_context():
    # turn 1: prompt [1,2,3], response [4,5]; turn 2 prompt = [1,2,3,4,5] + [9,9] (template newline + user turn)
    calls = [call(0, [1, 2, 3], [4, 5], [-0.1, -0.2]), call(1, [1, 2, 3, 4, 5, 9, 9], [6], [-0.3])]
    stats = AggregateStats()
    rows = build_rows(calls, "trajectory", stats)
    assert len(rows) == 1 and stats.merge_breaks == 0 and stats.rows == 1
    row = rows[0]
    assert row.prompt_ids == [1, 2, 3]
    assert row.response_ids == [4, 5, 9, 9, 6]
    assert row.response_mask == [1, 1, 0, 0, 1]
    assert row.old_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert row.n_calls == 2


def test_trajectory_breaks_on_mismatch_and_counts():
    # turn 2's prompt re-renders turn 1's response differently ([4,7] instead of [4,5]): no merge
    calls = [call(0, [1, 2, 3], [4, 5]), call(1, [1, 2, 3, 4, 7, 9], [6]), call(2, [1, 2, 3, 4, 7, 9, 6, 8], [2])]
    stats = AggregateStats()
    rows = build_rows(calls, "trajectory", stats)
    assert stats.merge_breaks == 1
    assert [r.prompt_ids for r in rows] == [[1, 2, 3], [1, 2, 3, 4, 7, 9]]
    assert rows[1].response_ids == [6, 8, 2] and rows[1].response_mask == [1, 0, 1]


def test_transition_mode_and_skipped_calls():
    calls = [call(0, [1], [2]), call(1, [1, 2, 3], [4]), call(2, [1], [5], status="error"), call(3, [], [])]
    stats = AggregateStats()
    rows = build_rows(calls, "transition", stats)
    assert len(rows) == 2 and stats.merge_breaks == 0
    assert stats.skipped_calls == {"error": 1, "no_token_ids": 1}
    with pytest.raises(ValueError):
        build_rows(calls, "bogus")


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    # group 0: mean .25, unbiased std sqrt(.75/3 * 4/ ... ) = sqrt(((.75)^2 + 3*(.25)^2)/3) = 0.5
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert adv[4:6].tolist() == [0.0, 0.0]  # equal rewards: no signal
    assert adv[6].item() == 0.0  # group of one
    raw = grpo_advantages(rewards, groups, norm_by_std=False)
    assert raw[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 5.0, 0.2, 0.8, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])
    adv = rloo_advantages(rewards, groups)
    # group 0: r_0 - mean(0, 0, 0) = 1; r_1 - mean(1, 0, 0) = -1/3 (x3)
    assert adv[:4].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert adv[4:6].tolist() == [0.0, 0.0]  # equal rewards: no signal
    assert adv[6].item() == 0.0  # group of one: no other rollout to form a baseline
    # group 3: 0.2 - (0.8 + 0.5) / 2 = -0.45; 0.8 - 0.35 = 0.45; 0.5 - 0.5 = 0
    assert adv[7:].tolist() == pytest.approx([-0.45, 0.45, 0.0], abs=1e-6)
    # = n/(n-1) * (r - mean): the GRPO-centered value scaled by n/(n-1), never std-normalized
    raw = grpo_advantages(rewards, groups, norm_by_std=False)
    assert adv[:4].tolist() == pytest.approx((raw[:4] * 4 / 3).tolist())
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)  # zero-mean per group


def test_rollout_advantages_dispatch():
    rewards, groups = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0])
    assert torch.equal(rollout_advantages(rewards, groups, "rloo"), rloo_advantages(rewards, groups))
    assert torch.equal(rollout_advantages(rewards, groups, "rloo", norm_by_std=False), rloo_advantages(rewards, groups))
    assert torch.equal(rollout_advantages(rewards, groups), grpo_advantages(rewards, groups))
    assert torch.equal(rollout_advantages(rewards, groups, "grpo", norm_by_std=False),
                       grpo_advantages(rewards, groups, norm_by_std=False))
    with pytest.raises(ValueError, match="estimator"):
        rollout_advantages(rewards, groups, "ppo")


def test_per_rollout_weights_do_not_grow_with_rows():
    # rollout 0 has two rows (3 + 1 masked tokens), rollout 1 one row (2 masked tokens)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    w = per_rollout_token_weights(mask, torch.tensor([0, 0, 1]))
    assert w.sum().item() == pytest.approx(1.0)
    # each rollout weighs 1/2 in total, spread evenly over its masked tokens
    assert w[:2].sum().item() == pytest.approx(0.5) and w[2].sum().item() == pytest.approx(0.5)
    assert w[0, 0].item() == pytest.approx(0.5 / 4) and w[2, 0].item() == pytest.approx(0.25)
    assert w[0, 3].item() == 0.0


def test_ppo_loss_hand_computed_with_clip_and_dual_clip():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 against old logp 0
    old = torch.zeros(1, 3)
    w = torch.tensor([[1 / 3, 1 / 3, 1 / 3]])
    # A = +1: pg = max(-r, -clip(r)) = [-1.2, -0.5, -1.0] → mean -0.9
    loss, st = ppo_loss(logp, old, torch.tensor([1.0]), w)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.0) / 3)
    assert st["clip_frac"] == pytest.approx(1 / 3)
    # A = -1 with a huge ratio: pg = max(10, 1.2) = 10, dual clip caps it at 3
    loss, _ = ppo_loss(torch.log(torch.tensor([[10.0]])), torch.zeros(1, 1), torch.tensor([-1.0]),
                       torch.ones(1, 1), clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    loss, _ = ppo_loss(torch.log(torch.tensor([[10.0]])), torch.zeros(1, 1), torch.tensor([-1.0]),
                       torch.ones(1, 1), clip_c=None)
    assert loss.item() == pytest.approx(10.0)


def test_multi_row_rollout_counts_once_in_group_and_loss():
    """A rollout split into 2 rows has the same total weight as a one-row rollout (issue 4 case 4)."""
    calls_a = [call(0, [1, 2], [3], rid="a"), call(1, [7, 7], [4, 4, 4], rid="a")]  # breaks → 2 rows
    calls_b = [call(0, [1, 2], [5, 5], rid="b")]
    rows = build_rows(calls_a) + build_rows(calls_b)
    assert len(rows) == 3
    T = max(len(r.response_ids) for r in rows)
    mask = torch.tensor([r.response_mask + [0] * (T - len(r.response_mask)) for r in rows])
    w = per_rollout_token_weights(mask, torch.tensor([0, 0, 1]))
    assert w[:2].sum().item() == pytest.approx(w[2].sum().item())
    assert not math.isnan(w.sum().item())



@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_build_batch_advantage_per_rollout_broadcast_to_rows(estimator):
    """``cfg.advantage`` picks the baseline; a 2-row rollout still counts once in its group."""
    calls = {"a": [call(0, [1, 2], [3], rid="a"), call(1, [7, 7], [4, 4, 4], rid="a")],  # breaks → 2 rows
             "b": [call(0, [1, 2], [5, 5], rid="b")], "c": [call(0, [1, 2], [6], rid="c")],
             "d": [call(0, [1], [6], rid="d")], "e": [call(0, [1], [8], rid="e")]}
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.0, "e": 1.0}
    rollouts = [Rollout(rollout_id=r, status=RolloutStatus.succeeded, reward=v, group_id="g1" if r < "d" else "g2")
                for r, v in rewards.items()]
    cfg = TrainConfig(advantage=estimator)
    rows, row_adv, _, adv_stats = build_batch(rollouts, calls, cfg)
    assert [r.rollout_id for r in rows] == ["a", "a", "b", "c", "d", "e"]
    if estimator == "rloo":  # 3 rollouts in g1 (not 4 rows): a: 1 - (0 + .5)/2, b: 0 - .75, c: .5 - .5
        expected = [0.75, 0.75, -0.75, 0.0, -1.0, 1.0]
    else:  # mean .5, unbiased std .5 over the 3 rollouts; g2: mean .5, std sqrt(.5)
        expected = [1.0, 1.0, -1.0, 0.0, -0.5 / 0.5 ** 0.5, 0.5 / 0.5 ** 0.5]
    assert row_adv == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert adv_stats["adv_abs_mean"] == pytest.approx(sum(abs(x) for x in expected[1:]) / 5, rel=1e-5)
    with pytest.raises(ValueError):
        TrainConfig(advantage="ppo")
