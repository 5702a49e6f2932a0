#!/usr/bin/env python
"""GPU smoke test of AGL on verl 0.9.1: a random-initialized tiny Llama, the tiny tokenizer shipped in
``agl_trainer/assets/tiny-tokenizer``, a few steps; no network, no downloaded weights. < 10 minutes.

Run it with the Python of an environment that has verl 0.9.1 and a CUDA torch (see docs/verl.md), from
the repository root::

    python scripts/gpu_smoke.py actor            # ~1 min: AGL rows -> DataProto -> agl_per_rollout on CUDA
    python scripts/gpu_smoke.py ppo              # ~5-8 min: verl's own GRPO trainer (Ray, FSDP, vLLM
                                                 #   rollout with sleep/wake and weight sync), 2 steps,
                                                 #   actor loss = agl_per_rollout from verl's registry
    python scripts/gpu_smoke.py all --out DIR    # both; a JSON summary in DIR/gpu_smoke.json

Stages:

- ``actor``: builds the model from a config, samples 12 rollouts in 3 groups from it (some with two
  calls merged into one row with context tokens, some split into two rows), per-rollout GRPO
  advantages, ``rows_to_batch`` -> ``to_dataproto``, then 3 optimizer steps with the loss fetched from
  verl's registry (``get_policy_loss_fn("agl_per_rollout")``). Checks: the first step is on-policy
  (ratio 1 to 1e-4), losses are finite, the weights move. ``--device cpu`` runs it without a GPU.
- ``ppo``: writes a tiny parquet data set and a reward function, saves the model, and runs
  ``python -m verl.trainer.main_ppo`` (TaskRunnerV1) for 2 steps with ``adv_estimator=grpo``,
  ``policy_loss.loss_mode=agl_per_rollout`` (registered in every Ray worker through
  ``VERL_USE_EXTERNAL_MODULES``), vLLM rollout with ``load_format=dummy`` (so the first weight sync is
  what makes the engine serve the actor's weights). Checks: exit code 0 and two logged steps.

``build-tokenizer SRC_DIR`` (maintainers only) rebuilds the shipped tokenizer from SmolLM2's
``tokenizer.json``: the first 2048 ids of its byte-level BPE and the merges among them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER_SRC = ROOT / "packages" / "trainer" / "src"
TOKENIZER_DIR = TRAINER_SRC / "agl_trainer" / "assets" / "tiny-tokenizer"
sys.path.insert(0, str(TRAINER_SRC))  # agl_trainer's advantage, loss and backends.verl need only torch

QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?", "What is 5 + 6?", "What is 9 - 1?"]
CHECK_TURN = "\n<|im_start|>user\nCheck your work.<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------ tokenizer
def build_tokenizer(src: Path, dst: Path, n: int = 2048) -> None:
    """SmolLM2's byte-level BPE cut to its first ``n`` ids (special tokens 0-16 included)."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = {s: i for s, i in tok["model"]["vocab"].items() if i < n}
    merges = [m for m in tok["model"]["merges"] if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    tok["model"]["vocab"], tok["model"]["merges"] = vocab, merges
    tok["added_tokens"] = [a for a in tok["added_tokens"] if a["id"] < n]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("is_local", None)
    cfg["local_files_only"] = True
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "chat_template.jinja").write_text((src / "chat_template.jinja").read_text())
    print(f"tokenizer: {len(vocab)} ids, {len(merges)} merges -> {dst}")


# -------------------------------------------------------------------------------------------- model
def make_model(device: str, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(config).to(device)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def response_logprobs(model, t: dict):
    """Logprobs of ``responses`` under ``model`` for a verl-layout batch (left-padded prompts)."""
    import torch

    out = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"])
    P, T = t["prompts"].shape[1], t["responses"].shape[1]
    logits = out.logits[:, P - 1:P + T - 1].float()
    return logits.gather(-1, t["responses"].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _generate(model, tok, prompt_ids: list[int], device: str, max_new: int = 12) -> list[int]:
    import torch

    ids = torch.tensor([prompt_ids], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                         max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
    resp = out[0, len(prompt_ids):].tolist()
    if tok.eos_token_id in resp:
        resp = resp[:resp.index(tok.eos_token_id) + 1]
    return resp or [tok.eos_token_id]


def _row(rollout_id, prompt_ids, response_ids, response_mask):
    """An ``agl_trainer.aggregate.Row``-like object (aggregate itself needs agl_common, not installed here)."""
    from types import SimpleNamespace

    return SimpleNamespace(rollout_id=rollout_id, prompt_ids=list(prompt_ids), response_ids=list(response_ids),
                           response_mask=list(response_mask), old_logprobs=[0.0] * len(response_ids),
                           has_logprobs=True)


def _sample_rollouts(model, tok, device: str, groups: int = 3, n: int = 4):
    import torch
    from agl_trainer.advantage import grpo_advantages
    from agl_trainer.backends.verl import rows_to_batch

    ctx = tok(CHECK_TURN, add_special_tokens=False)["input_ids"]
    rows, rollout_rows, rewards, group_of = [], [], [], {}
    model.eval()
    with torch.no_grad():
        for g in range(groups):
            msgs = [{"role": "user", "content": QUESTIONS[g % len(QUESTIONS)]}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            for i in range(n):
                rid = f"g{g}-{i}"
                group_of[rid] = f"g{g}"
                k = g * n + i
                r1 = _generate(model, tok, prompt, device)
                mine = []
                if k % 3 == 0:
                    mine.append(_row(rid, prompt, r1, [1] * len(r1)))
                else:
                    p2 = prompt + r1 + ctx
                    r2 = _generate(model, tok, p2, device)
                    if k % 3 == 1:
                        mine.append(_row(rid, prompt, r1 + ctx + r2, [1] * len(r1) + [0] * len(ctx) + [1] * len(r2)))
                    else:
                        mine += [_row(rid, prompt, r1, [1] * len(r1)), _row(rid, p2, r2, [1] * len(r2))]
                sampled = [t for row in mine for t, m in zip(row.response_ids, row.response_mask) if m]
                rewards.append(len(set(sampled)) / len(sampled))  # any reward with spread within groups
                rows += mine
                rollout_rows.append(len(mine))
        adv = grpo_advantages(torch.tensor(rewards), torch.tensor([k // n for k in range(groups * n)]))
        row_adv = [float(a) for a, m in zip(adv, rollout_rows) for _ in range(m)]
        # the engine's logprobs: the sampling model's own, token by token
        batch = rows_to_batch(rows, row_adv, group_of, pad_id=tok.pad_token_id)
        t = {k: v.to(device) for k, v in batch["tensors"].items()}
        lp = response_logprobs(model, t).cpu() * batch["tensors"]["response_mask"]
        batch["tensors"]["old_log_probs"] = lp
        batch["tensors"]["rollout_log_probs"] = lp.clone()
    return batch, {"rollouts": len(rewards), "rows": len(rows), "reward_mean": sum(rewards) / len(rewards)}


# ----------------------------------------------------------------------------------------- stages
def stage_actor(device: str, steps: int = 3) -> dict:
    import torch
    from agl_trainer.backends.verl import VERL_LOSS_NAME, register_verl_loss, to_dataproto
    from verl.workers.config import ActorConfig

    t0 = time.perf_counter()
    model, tok = make_model(device)
    batch, info = _sample_rollouts(model, tok, device)
    proto = to_dataproto(batch)
    loss_fn = register_verl_loss()
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    assert get_policy_loss_fn(VERL_LOSS_NAME) is loss_fn
    cfg = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=len(proto), clip_ratio=0.2,
                      clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_torch_compile=False)
    t = {k: v.to(device) for k, v in proto.batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    history = []
    model.train()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        lp = response_logprobs(model, t)
        loss, metrics = loss_fn(old_log_prob=t["old_log_probs"], log_prob=lp, advantages=t["advantages"],
                                response_mask=t["response_mask"], loss_agg_mode="token-mean", config=cfg,
                                rollout_is_weights=t["rollout_is_weights"])
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        history.append({"step": step + 1, "loss": float(loss.detach()), "grad_norm": grad_norm, **metrics})
        print(f"actor step {step + 1}: {history[-1]}")
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history), history
    assert abs(history[0]["actor/agl_ratio_mean"] - 1.0) < 1e-4, "first step is not on-policy"
    assert moved > 0, "weights did not change"
    return {"stage": "actor", "device": device, **info, "steps": history, "max_weight_change": moved,
            "seconds": time.perf_counter() - t0}


REWARD_PY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Any reward with spread: 1 if the answer appears, else the share of distinct characters."""
    if ground_truth and ground_truth in solution_str:
        return 1.0
    return len(set(solution_str)) / max(1, len(solution_str))
'''

PLUGIN_PY = '''
import sys
sys.path.insert(0, {src!r})
from agl_trainer.backends.verl import register_verl_loss
register_verl_loss()
'''


def stage_ppo(work: Path, timeout_s: int = 480) -> dict:
    import pandas as pd

    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    model, tok = make_model("cpu")
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    records = [{"data_source": "agl_smoke", "prompt": [{"role": "user", "content": q}],
                "reward_model": {"style": "rule", "ground_truth": str(eval(q[8:-1]))},
                "extra_info": {"index": i}} for i, q in enumerate(QUESTIONS * 4)]
    pd.DataFrame(records).to_parquet(work / "train.parquet")
    pd.DataFrame(records[:4]).to_parquet(work / "val.parquet")
    (work / "reward.py").write_text(REWARD_PY)
    (work / "agl_verl_plugin.py").write_text(PLUGIN_PY.format(src=str(TRAINER_SRC)))
    overrides = [
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true", "algorithm.use_kl_in_reward=false",
        f"data.train_files={work / 'train.parquet'}", f"data.val_files={work / 'val.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=32",
        "data.dataloader_num_workers=0", "data.shuffle=false",
        f"actor_rollout_ref.model.path={work / 'model'}", "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.policy_loss.loss_mode=agl_per_rollout",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.load_format=dummy", "actor_rollout_ref.rollout.max_num_seqs=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        f"reward.custom_reward_function.path={work / 'reward.py'}", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console]",
        "trainer.project_name=agl", "trainer.experiment_name=gpu-smoke", f"trainer.default_local_dir={work / 'ckpt'}",
    ]
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "agl_verl_plugin",
           "PYTHONPATH": os.pathsep.join([str(work), str(TRAINER_SRC), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    log = work / "main_ppo.log"
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], stdout=f,
                              stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=work)
    text = log.read_text(errors="replace")
    steps = [line for line in text.splitlines() if "step:" in line and "actor/pg_loss" in line]
    print("\n".join(text.splitlines()[-40:]))
    ok = proc.returncode == 0 and len(steps) >= 2
    return {"stage": "ppo", "ok": ok, "returncode": proc.returncode, "logged_steps": len(steps),
            "log": str(log), "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["actor", "ppo", "all", "build-tokenizer"])
    ap.add_argument("src", nargs="?", help="build-tokenizer: SmolLM2 directory with tokenizer.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu_smoke")))
    args = ap.parse_args()
    if args.stage == "build-tokenizer":
        build_tokenizer(Path(args.src or Path.home() / ".cache/agl/smollm2-135m-instruct"), TOKENIZER_DIR)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or `actor --device cpu` for a dry run", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        if args.stage in ("actor", "all"):
            results.append(stage_actor(args.device))
        if args.stage in ("ppo", "all"):
            results.append(stage_ppo(args.out / "ppo"))
    finally:
        (args.out / "gpu_smoke.json").write_text(json.dumps(results, indent=2, default=str))
    ok = all(r.get("ok", True) for r in results)
    print(json.dumps({"ok": ok, "stages": [r["stage"] for r in results]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
