"""PPO mini-batches by rollout and the cap on optimizer steps per training step (issue 4).

The planner (:mod:`agl_trainer.algorithm.minibatch`) is checked on its own; :class:`CpuBackend` on a tiny randomly
initialized Llama (1 layer, hidden 16, vocab 64) saved to a temporary directory, fp32 (no bf16 autocast)
so that losses and gradients compare exactly. Nothing is downloaded.
"""

from __future__ import annotations

import math

import pytest
import torch
from agl_trainer.algorithm.aggregate import Row
from agl_trainer.algorithm.loss import per_rollout_token_weights, ppo_loss
from agl_trainer.algorithm.minibatch import plan_mini_batches

# rollout id → rows: (prompt length, response length, context positions); "r1" and "r3" have 2 rows
SHAPES = {"r0": [(3, 5, ())], "r1": [(2, 4, (1,)), (4, 3, ())], "r2": [(3, 6, (2, 3))],
          "r3": [(2, 2, ()), (5, 4, (0,))], "r4": [(3, 3, ())]}
ADV = {"r0": 1.0, "r1": -0.5, "r2": 0.7, "r3": -1.2, "r4": 0.3}


def make_rows(seed: int = 0) -> tuple[list[Row], list[float]]:
    gen = torch.Generator().manual_seed(seed)
    rows, adv = [], []
    for rid, shapes in SHAPES.items():
        for p, n, ctx in shapes:
            ids = torch.randint(1, 64, (p + n,), generator=gen).tolist()
            mask = [0 if t in ctx else 1 for t in range(n)]
            old = (-torch.rand(n, generator=gen) * 3).tolist()
            rows.append(Row(rid, ids[:p], ids[p:], mask, [o if m else 0.0 for o, m in zip(old, mask)], n_calls=1))
            adv.append(ADV[rid])
    return rows, adv


# ------------------------------------------------------------------------------------- the planner
def _rows_of(rollout_of_row):
    out: dict[str, list[int]] = {}
    for i, rid in enumerate(rollout_of_row):
        out.setdefault(rid, []).append(i)
    return out


@pytest.mark.parametrize("n_rollouts,per_batch,cap", [(5, 2, None), (5, 2, 2), (5, 2, 1), (5, 1, None), (5, 1, 3),
                                                      (5, 5, None), (5, 9, 2), (8, 3, None), (8, 3, 2), (5, None, 3)])
def test_plan_counts_and_keeps_rollouts_whole(n_rollouts, per_batch, cap):
    # rollout k has 1 + k % 3 rows, rows of different rollouts interleaved
    rollout_of_row = [f"x{k}" for j in range(3) for k in range(n_rollouts) if j <= k % 3]
    plan = plan_mini_batches(rollout_of_row, per_batch, cap, seed=3)
    n_batches = 1 if per_batch is None else math.ceil(n_rollouts / per_batch)
    expected = n_batches if cap is None else min(n_batches, cap)
    assert len(plan.batches) == expected
    rows_of = _rows_of(rollout_of_row)
    seen = [rid for b in plan.batches for rid in dict.fromkeys(rollout_of_row[i] for i in b)]
    assert len(seen) == len(set(seen))  # every rollout in at most one mini-batch ...
    for b in plan.batches:
        assert b == sorted(b)
        for rid in {rollout_of_row[i] for i in b}:
            assert set(rows_of[rid]) <= set(b)  # ... with all of its rows
        if per_batch is not None:
            assert len({rollout_of_row[i] for i in b}) <= per_batch
    dropped_ids = set(rows_of) - set(seen)
    assert plan.dropped_rollouts == len(dropped_ids) == n_rollouts - len(seen)
    assert plan.dropped_rows == len(plan.dropped) == sum(len(rows_of[r]) for r in dropped_ids)
    assert sorted(plan.kept + plan.dropped) == list(range(len(rollout_of_row)))
    if cap is None or n_batches <= cap:
        assert plan.dropped_rollouts == plan.dropped_rows == 0
    else:  # only the last mini-batches are dropped: every kept one is full
        assert all(len({rollout_of_row[i] for i in b}) == per_batch for b in plan.batches)
    # deterministic: the same rows and seed give the same plan
    assert plan == plan_mini_batches(rollout_of_row, per_batch, cap, seed=3)


def test_plan_without_options_is_one_batch_of_everything():
    rollout_of_row = ["b", "a", "b", "c"]
    for per_batch, cap in [(None, None), (3, None), (None, 1), (10, 1)]:
        plan = plan_mini_batches(rollout_of_row, per_batch, cap)
        assert plan.batches == [[0, 1, 2, 3]] and plan.dropped_rollouts == plan.dropped_rows == 0
    assert plan_mini_batches([], 2, 1).batches == []


def test_plan_order_is_seeded_shuffle():
    ids = [f"r{k:02d}" for k in range(12)]
    first = [[ids[i] for i in b] for b in plan_mini_batches(ids, 4, None, seed=0).batches]
    assert first != [ids[0:4], ids[4:8], ids[8:12]]  # shuffled, not cut in id order (this seed)
    others = {tuple(map(tuple, ([ids[i] for i in b] for b in plan_mini_batches(ids, 4, None, seed=s).batches)))
              for s in range(5)}
    assert len(others) > 1  # the seed changes the split
    # the input order of the rows does not matter, only the rollout ids and the seed
    rev = list(reversed(ids))
    assert {frozenset(rev[i] for i in b) for b in plan_mini_batches(rev, 4, None, seed=0).batches} == \
        {frozenset(b) for b in first}


def test_plan_rejects_non_positive():
    with pytest.raises(ValueError, match="rollouts_per_batch"):
        plan_mini_batches(["a"], 0)
    with pytest.raises(ValueError, match="max_updates"):
        plan_mini_batches(["a"], 1, 0)


# ------------------------------------------------------------------------------- the CPU backend
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def backend(tiny_model, tmp_path, **kw):
    from agl_trainer.backends.cpu import CpuBackend

    # lr large enough that a step visibly changes the next mini-batch's logprobs; LoRA B starts at 0,
    # so the first step's gradient reaches only B
    b = CpuBackend(tiny_model, tmp_path, lora_rank=4, lora_alpha=8, lr=1e-2, bf16=False, seed=0, **kw)
    b.steps = 0
    step = b.optimizer.step

    def counting_step(*a, **k):
        b.steps += 1
        return step(*a, **k)

    b.optimizer.step = counting_step
    return b


def lora(b) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in b.model.named_parameters() if p.requires_grad}


def reference_loss(b, rows: list[Row], adv: list[float]) -> tuple[float, dict[str, torch.Tensor]]:
    """The per-rollout PPO loss over ``rows`` in one forward pass, and its LoRA gradients."""
    b.model.train()
    b.model.zero_grad(set_to_none=True)
    lp, mask, _ = b._response_logprobs(rows)
    old = torch.zeros_like(lp)
    for j, r in enumerate(rows):
        old[j, : len(r.old_logprobs)] = torch.tensor(r.old_logprobs)
    ids = sorted({r.rollout_id for r in rows})
    weights = per_rollout_token_weights(mask, torch.tensor([ids.index(r.rollout_id) for r in rows]))
    loss, _ = ppo_loss(lp, old, torch.tensor(adv), weights, **b.clip)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in b.model.named_parameters() if p.requires_grad}


def test_default_update_is_one_step_over_the_whole_batch(tiny_model, tmp_path):
    rows, adv = make_rows()
    ref_loss, ref_grad = reference_loss(backend(tiny_model, tmp_path), rows, adv)
    b = backend(tiny_model, tmp_path)
    b.micro_batch_tokens = 40  # several micro-batches: accumulation must give the one-pass gradient
    stats = b.update(rows, adv)
    assert b.steps == 1 and stats["updates"] == 1
    assert stats["dropped_rollouts"] == 0 and stats["dropped_rows"] == 0
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert stats["train_tokens"] == sum(sum(r.response_mask) for r in rows)
    for name, g in ref_grad.items():  # p.grad still holds the step's gradient
        torch.testing.assert_close(dict(b.model.named_parameters())[name].grad, g, rtol=1e-4, atol=1e-7)
    assert stats["grad_norm"] > 0
    # a mini-batch at least as large as the batch, or a cap alone, is the same single step
    for kw in ({"ppo_mini_batch_rollouts": len(SHAPES)}, {"ppo_mini_batch_rollouts": 50, "max_updates_per_step": 1},
               {"max_updates_per_step": 4}):
        other = backend(tiny_model, tmp_path, **kw)
        other.micro_batch_tokens = 40
        st = other.update(rows, adv)
        assert other.steps == 1 and st["loss"] == pytest.approx(stats["loss"], rel=1e-6)
        for name, p in lora(other).items():
            torch.testing.assert_close(p, lora(b)[name], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("per_batch,cap", [(2, None), (2, 2), (1, 2), (3, 1), (1, None)])
def test_updates_and_dropped_counts(tiny_model, tmp_path, per_batch, cap):
    rows, adv = make_rows()
    b = backend(tiny_model, tmp_path, ppo_mini_batch_rollouts=per_batch, max_updates_per_step=cap)
    before = lora(b)
    stats = b.update(rows, adv)
    n = math.ceil(len(SHAPES) / per_batch)
    expected = n if cap is None else min(n, cap)
    assert b.steps == stats["updates"] == expected
    plan = plan_mini_batches([r.rollout_id for r in rows], per_batch, cap, seed=0)
    assert stats["dropped_rollouts"] == plan.dropped_rollouts == len(SHAPES) - min(len(SHAPES), expected * per_batch)
    assert stats["dropped_rows"] == plan.dropped_rows == len(plan.dropped)
    assert stats["train_tokens"] == sum(sum(rows[i].response_mask) for i in plan.kept)
    assert all(math.isfinite(stats[k]) for k in ("loss", "grad_norm", "clip_frac", "ratio_mean"))
    assert any(not torch.equal(p, before[k]) for k, p in lora(b).items())


def test_each_mini_batch_is_normalized_over_its_own_rollouts(tiny_model, tmp_path):
    """With a cap of 1 only the first mini-batch trains; its loss is the per-rollout mean over its rollouts."""
    rows, adv = make_rows()
    plan = plan_mini_batches([r.rollout_id for r in rows], 2, 1, seed=0)
    first = plan.batches[0]
    assert len({rows[i].rollout_id for i in first}) == 2
    sub_rows, sub_adv = [rows[i] for i in first], [adv[i] for i in first]
    ref_loss, ref_grad = reference_loss(backend(tiny_model, tmp_path), sub_rows, sub_adv)
    b = backend(tiny_model, tmp_path, ppo_mini_batch_rollouts=2, max_updates_per_step=1)
    stats = b.update(rows, adv)
    assert stats["updates"] == 1 and stats["dropped_rollouts"] == len(SHAPES) - 2
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    for name, g in ref_grad.items():
        torch.testing.assert_close(dict(b.model.named_parameters())[name].grad, g, rtol=1e-4, atol=1e-7)
    # whole-batch weights would have scaled the same rows by 2/5 (R = 5 rollouts instead of 2)
    assert abs(ref_loss) > 1e-3


def test_old_policy_is_fixed_across_mini_batches(tiny_model, tmp_path):
    """With ``tis_cap`` the ratio is against the trainer's policy before the update, for every mini-batch:
    exactly 1 in a single step, not 1 in the second of two (the first step moved the LoRA)."""
    rows, adv = make_rows()
    one = backend(tiny_model, tmp_path, tis_cap=2.0).update(rows, adv)
    assert one["updates"] == 1 and one["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    b = backend(tiny_model, tmp_path, ppo_mini_batch_rollouts=3, tis_cap=2.0)
    two = b.update(rows, adv)  # one micro-batch per mini-batch: ratio_mean = mean of the 2 steps' ratios
    assert two["updates"] == b.steps == 2 and two["dropped_rows"] == 0
    assert abs(two["ratio_mean"] - 1.0) > 1e-4


def test_backend_rejects_non_positive(tiny_model, tmp_path):
    from agl_trainer.backends.cpu import CpuBackend

    with pytest.raises(ValueError):
        CpuBackend(tiny_model, tmp_path, bf16=False, ppo_mini_batch_rollouts=0)


def test_logprobs_of_a_mixed_batch_match_one_full_forward_per_row(tiny_model, tmp_path):
    """The LM head runs only from the shortest prompt on (``logits_to_keep``): each row's response logprobs
    must still be those of its own full forward pass, whatever the other rows' prompt lengths."""
    rows, _ = make_rows(seed=3)
    assert len({len(r.prompt_ids) for r in rows}) > 2
    b = backend(tiny_model, tmp_path)
    got = b.logprobs(rows)  # one micro-batch of every row, prompts of 2 to 5 tokens
    b.model.eval()
    with torch.no_grad():
        for r, lp in zip(rows, got):
            ids = torch.tensor([r.full_ids()])
            logits = b.model(input_ids=ids).logits[0, :-1]
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)[len(r.prompt_ids) - 1:]
            assert len(lp) == len(r.response_ids)
            torch.testing.assert_close(torch.tensor(lp), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_weights_are_the_policy_as_plain_weights(tiny_model, tmp_path, dtype):
    """``merged`` serving: after an update (LoRA B no longer 0), the base model loaded with
    ``merged_weights()`` gives the PEFT policy's logprobs, in the engine's dtype; the policy is unchanged."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    b = backend(tiny_model, tmp_path, engine_dtype=dtype)
    rows, adv = make_rows()
    b.update(rows, adv)
    assert any(float(p.abs().sum()) > 0 for n, p in b.model.named_parameters() if "lora_B" in n)
    before = b.logprobs(rows)
    path = b.save_merged(1)
    sd = load_file(str(path / "model.safetensors"))
    assert all(t.dtype == getattr(torch, dtype) for t in sd.values()) and not any("lora" in k for k in sd)
    plain = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or plain.config.tie_word_embeddings)
    merged = plain_logprobs(plain, b)
    tol = 1e-5 if dtype == "float32" else 5e-2
    for lp_a, lp_b in zip(before, merged):
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < tol
    assert b.logprobs(rows) == before  # merging did not touch the policy
    import asyncio

    asyncio.run(b.retire(1))
    assert not path.exists()


def plain_logprobs(model, b) -> list[list[float]]:
    """Per-token logprobs of ``b``'s rows' responses under a plain ``model`` (one forward per row, fp32)."""
    rows, _ = make_rows()
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r.full_ids()])
            logits = model(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
            p = len(r.prompt_ids)
            out.append(lp[p - 1: p - 1 + len(r.response_ids)].tolist())
    return out
