"""Rollout-level vs sample-level credit (issue 27): the advantage level and the loss normalization modes,
each hand-computed, then through the batch builder and the CPU backend (a tiny random Llama, fp32), and the
policy entropy the backend reports."""

from __future__ import annotations

import math

import pytest
import torch
from agl_common.schemas import Rollout, RolloutStatus
from agl_trainer.algorithm.advantage import row_advantages
from agl_trainer.config import TrainConfig
from agl_trainer.algorithm.batch import build_batch
from agl_trainer.algorithm.loss import ppo_loss, token_weights
from pydantic import ValidationError

from test_algorithm import call
from test_ppo_minibatch import backend, make_rows, tiny_model  # noqa: F401 - the fixture

# one group: rollout 0 (reward 1) broke into 2 rows, rollout 1 (reward 0) is one row
REWARDS, GROUPS, N_ROWS = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([2, 1])


def test_rollout_level_counts_each_rollout_once():
    # mean .5, unbiased std sqrt(.5): +-.5/.7071 for each rollout, repeated for its rows
    a = row_advantages(REWARDS, GROUPS, N_ROWS, "rollout")
    assert a.tolist() == pytest.approx([0.7071068, 0.7071068, -0.7071068], rel=1e-5)


def test_row_level_counts_each_row_as_a_sample():
    # rows carry rewards [1, 1, 0]: mean 2/3, unbiased std sqrt(1/3); (1/3)/.57735 = .57735, (-2/3)/.57735 = -1.1547
    a = row_advantages(REWARDS, GROUPS, N_ROWS, "row")
    assert a.tolist() == pytest.approx([1 / 3 ** 0.5, 1 / 3 ** 0.5, -2 / 3 ** 0.5], rel=1e-5)
    # RLOO at row level: row 0's baseline is the mean of the other two rows (1, 0) = .5
    assert row_advantages(REWARDS, GROUPS, N_ROWS, "row", "rloo").tolist() == pytest.approx([0.5, 0.5, -1.0])
    # one row per rollout: the two levels agree
    ones = torch.tensor([1, 1])
    assert torch.equal(row_advantages(REWARDS, GROUPS, ones, "row"), row_advantages(REWARDS, GROUPS, ones, "rollout"))


def test_row_advantages_bad_input():
    with pytest.raises(ValueError, match="unknown advantage level"):
        row_advantages(REWARDS, GROUPS, N_ROWS, "episode")
    with pytest.raises(ValueError, match="row counts"):
        row_advantages(REWARDS, GROUPS, torch.tensor([1]))
    with pytest.raises(ValidationError):
        TrainConfig(advantage_level="sample")
    with pytest.raises(ValidationError):
        TrainConfig(loss_agg_mode="seq-mean-token-sum")


# rollout 0: rows 0 (3 sampled tokens) and 1 (1 token); rollout 1: row 2 (2 tokens); row 3 has none (rollout 2)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
RINDEX = torch.tensor([0, 0, 1, 2])


def test_rollout_mean_weights():
    w = token_weights(MASK, RINDEX, "rollout-mean")  # 2 rollouts with tokens, 1/2 each: 1/8 a token, 1/4 a token
    assert w[0].tolist() == pytest.approx([1 / 8] * 3 + [0]) and w[1, 0].item() == pytest.approx(1 / 8)
    assert w[2].tolist() == pytest.approx([1 / 4, 1 / 4, 0, 0]) and w[3].sum().item() == 0


def test_token_mean_weights():
    w = token_weights(MASK, RINDEX, "token-mean")  # 6 sampled tokens
    assert w.sum().item() == pytest.approx(1.0)
    assert torch.allclose(w, MASK / 6.0)


def test_seq_mean_token_mean_weights():
    w = token_weights(MASK, RINDEX, "seq-mean-token-mean")  # 3 rows with tokens, 1/3 each
    assert w[0].tolist() == pytest.approx([1 / 9] * 3 + [0])
    assert w[1].tolist() == pytest.approx([1 / 3, 0, 0, 0]) and w[2].tolist() == pytest.approx([1 / 6, 1 / 6, 0, 0])
    assert w[3].sum().item() == 0 and w.sum().item() == pytest.approx(1.0)


def test_weights_of_an_empty_batch_and_an_unknown_mode():
    for mode in ("rollout-mean", "token-mean", "seq-mean-token-mean"):
        w = token_weights(torch.zeros(2, 3), torch.tensor([0, 1]), mode)
        assert w.sum().item() == 0 and not torch.isnan(w).any()
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        token_weights(MASK, RINDEX, "seq-mean-token-sum")


def test_build_batch_at_row_level():
    calls = {"a": [call(0, [1, 2], [3], rid="a"), call(1, [7, 7], [4, 4, 4], rid="a")],  # breaks → 2 rows
             "b": [call(0, [1, 2], [5, 5], rid="b")]}
    rollouts = [Rollout(rollout_id=r, status=RolloutStatus.succeeded, reward=v, group_id="g")
                for r, v in {"a": 1.0, "b": 0.0}.items()]
    rows, adv, _, stats = build_batch(rollouts, calls, TrainConfig(advantage_level="row"))
    assert [r.rollout_id for r in rows] == ["a", "a", "b"]
    assert adv == pytest.approx([1 / 3 ** 0.5, 1 / 3 ** 0.5, -2 / 3 ** 0.5], rel=1e-5)
    assert stats["adv_abs_mean"] == pytest.approx((1 / 3 ** 0.5 + 2 / 3 ** 0.5) / 2, rel=1e-5)  # per rollout
    assert stats["rollouts_trained"] == 2 and stats["multi_row_rollouts"] == 1
    _, adv, _, _ = build_batch(rollouts, calls, TrainConfig())
    assert adv == pytest.approx([0.7071068, 0.7071068, -0.7071068], rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cpu_backend_update_uses_the_loss_agg_mode(tiny_model, tmp_path, mode):  # noqa: F811
    rows, adv = make_rows()
    ref = backend(tiny_model, tmp_path)
    ref.model.train()
    lp, mask, _ = ref._response_logprobs(rows)
    old = torch.zeros_like(lp)
    for j, r in enumerate(rows):
        old[j, : len(r.old_logprobs)] = torch.tensor(r.old_logprobs)
    ids = sorted({r.rollout_id for r in rows})
    rindex = torch.tensor([ids.index(r.rollout_id) for r in rows])
    want, _ = ppo_loss(lp, old, torch.tensor(adv), token_weights(mask, rindex, mode), **ref.clip)
    per_rollout, _ = ppo_loss(lp, old, torch.tensor(adv), token_weights(mask, rindex), **ref.clip)
    assert abs(float(want.detach()) - float(per_rollout.detach())) > 1e-4  # the shapes make the modes differ
    b = backend(tiny_model, tmp_path, loss_agg_mode=mode)
    b.micro_batch_tokens = 40
    assert b.update(rows, adv)["loss"] == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        backend(tiny_model, tmp_path, loss_agg_mode="sum")


def test_cpu_backend_reports_the_policy_entropy_on_sampled_tokens(tiny_model, tmp_path):  # noqa: F811
    rows, adv = make_rows()
    b = backend(tiny_model, tmp_path)
    # reference: each row alone, full softmax at the positions that predict its sampled (mask 1) tokens
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            logits = b.model(input_ids=torch.tensor([r.full_ids()])).logits[0].float()
            p = len(r.prompt_ids)
            for t, m in enumerate(r.response_mask):
                if m:
                    probs = torch.softmax(logits[p - 1 + t], dim=-1)
                    total += float(-(probs * probs.log()).sum())
                    count += 1
    stats = b.update(rows, adv)  # one optimizer step: every micro-batch sees the policy before it
    assert stats["entropy"] == pytest.approx(total / count, rel=1e-4)
    assert 0 < stats["entropy"] < math.log(64)

