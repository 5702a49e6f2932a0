"""verl's side of tests/test_verl_parity.py, run with .venv-verl/bin/python (verl 0.9.1 on CPU).

Usage: ``verl_parity_worker.py IN.pt OUT.pt``. IN holds the fixed tensors (see the test); OUT gets verl's
results: GRPO and RLOO advantages per case, vanilla policy losses and their gradients, the ``agl_per_rollout``
loss found through verl's registry, and a DataProto built from the adapter's batch. Only this process
imports verl; AGL's adapter is imported from the source tree (it needs only torch there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "trainer" / "src"))


def actor_config(clip_low: float, clip_high: float, clip_c: float):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=clip_low,
                       clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c,
                       loss_agg_mode="token-mean", use_torch_compile=False)


def loss_and_grad(fn, case: dict, weights: torch.Tensor | None, agg: str = "token-mean"):
    logp = case["logprobs"].clone().requires_grad_(True)
    cfg = actor_config(case["clip_low"], case["clip_high"], case["clip_c"])
    loss, metrics = fn(old_log_prob=case["old_logprobs"], log_prob=logp, advantages=case["advantages"],
                       response_mask=case["response_mask"], loss_agg_mode=agg, config=cfg,
                       rollout_is_weights=weights)
    loss.backward()
    return float(loss.detach()), logp.grad.clone(), {k: float(v) for k, v in metrics.items()}


def main(inp: str, out: str) -> None:
    import verl
    from verl.trainer.ppo import core_algos

    from agl_trainer.backends.verl import adapter

    data = torch.load(inp, weights_only=False)
    res: dict = {"verl_version": verl.__version__, "advantages": {}, "losses": {}}

    # GRPO: verl works per row, grouping rows by `index` (verl's uid)
    for name, case in data["advantage_cases"].items():
        index = np.array(case["index"], dtype=object)
        scores, returns = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=case["token_level_rewards"], response_mask=case["response_mask"], index=index,
            epsilon=1e-6, norm_adv_by_std_in_grpo=case["norm_by_std"])
        res["advantages"][name] = scores

    # RLOO: fetched by name, as verl's compute_advantage does for algorithm.adv_estimator=rloo (any
    # estimator other than GAE/GRPO), and called with the keyword arguments it passes there
    res["rloo"], res["rloo_registry"] = {}, {}
    for est in ("rloo", "rloo_vectorized"):
        res["rloo_registry"][est] = core_algos.get_adv_estimator_fn(est).__name__
    for name, case in data["rloo_cases"].items():
        res["rloo"][name] = {}
        for est in ("rloo", "rloo_vectorized"):
            scores, _ = core_algos.get_adv_estimator_fn(est)(
                token_level_rewards=case["token_level_rewards"].clone(), response_mask=case["response_mask"],
                config=None, index=np.array(case["index"], dtype=object))
            res["rloo"][name][est] = scores

    # policy loss: verl's vanilla (with and without per-rollout weights) and ours through the registry
    registered = adapter.register_verl_loss()
    res["registered_is_ours"] = registered is adapter.agl_per_rollout_loss
    res["registry_names"] = sorted(core_algos.POLICY_LOSS_REGISTRY)
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    for name, case in data["loss_cases"].items():
        ours = core_algos.get_policy_loss_fn(adapter.VERL_LOSS_NAME)
        out_case = {"vanilla": loss_and_grad(vanilla, case, None),
                    # a batch without AGL weights: every row its own rollout == verl's seq-mean-token-mean
                    "vanilla_seq_mean_token_mean": loss_and_grad(vanilla, case, None, "seq-mean-token-mean"),
                    "agl_per_rollout_no_weights": loss_and_grad(ours, case, None)}
        if case.get("rollout_is_weights") is not None:
            out_case["vanilla_weighted"] = loss_and_grad(vanilla, case, case["rollout_is_weights"])
            out_case["agl_per_rollout"] = loss_and_grad(ours, case, case["rollout_is_weights"])
        res["losses"][name] = out_case

    # the adapter's batch as a DataProto, and verl's GRPO on its fields
    proto = adapter.to_dataproto(data["batch"])
    res["proto"] = {"len": len(proto), "tensor_keys": sorted(proto.batch.keys()),
                    "non_tensor_keys": sorted(proto.non_tensor_batch.keys()),
                    "uid": list(proto.non_tensor_batch["uid"]),
                    "input_ids": proto.batch["input_ids"].clone(), "position_ids": proto.batch["position_ids"].clone()}
    chunks = proto.chunk(2) if len(proto) % 2 == 0 else [proto]
    res["proto"]["chunks"] = [len(c) for c in chunks]
    torch.save(res, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
