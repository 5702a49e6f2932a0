#!/usr/bin/env python
"""GPU smoke test of AGL on verl 0.9.1 (one CUDA GPU, < 10 minutes, no network, no downloaded weights).

Run it from the repository root with the Python of an environment that has verl 0.9.1 with vLLM and a CUDA
torch, plus AGL's services (see docs/verl.md, "Install and run on a GPU")::

    python scripts/gpu_smoke.py all --out runs/gpu_smoke      # env, maths, actor, loop; JSON in runs/gpu_smoke

Each stage is recorded in ``gpu_smoke.json`` as ok / failed (with the error) / skipped (with what was
missing), with its timings; the script goes on after a failure and exits 1 if any stage failed:

- ``env``: CUDA visible, device names, free memory, versions of torch, transformers, peft, verl, vllm, ray,
  redis, litellm and AGL's gateway (missing ones listed).
- ``maths``: AGL's own update maths on the device, no verl: a random tiny Llama (the tokenizer shipped in
  ``agl_trainer/assets/tiny-tokenizer``), 12 sampled rollouts, per-rollout GRPO advantages, ``ppo_loss``
  with per-rollout weights, 3 AdamW steps; first ratio 1, finite loss, weights move. Runs where only
  PyTorch, transformers and peft are installed.
- ``actor``: the same through verl: ``rows_to_batch`` → ``DataProto`` → ``agl_per_rollout`` from verl's
  policy-loss registry (needs verl).
- ``loop``: AGL's run loop driving verl's ``RayPPOTrainer`` with verl's vLLM rollout through AGL's gateway
  (``python -m agl_trainer.backends.verl.main --gpu``), 2 steps of 2 groups × 2 rollouts on a tiny random
  model (``--model DIR`` for a real one). Checks: chat calls answered through the gateway and recorded with
  token ids and logprobs; ``sleep_replicas`` frees GPU memory; the first PPO ratio within 1e-2 of 1; the
  engine's logprobs of an earlier call change after ``update_weights(1)``; calls after the resume recorded
  with version 1. Needs verl, vLLM, Ray, Redis (``redis-server`` on PATH or ``AGL_REDIS_URL``), AGL's gateway.
- ``ppo`` (not in ``all``): verl's own ``main_ppo`` GRPO for 2 steps with ``agl_per_rollout``.

``--device cpu`` runs ``maths`` and ``actor`` without a GPU (a dry run of the script itself).
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
    """An ``agl_trainer.algorithm.aggregate.Row``-like object (aggregate itself needs agl_common, not installed here)."""
    from types import SimpleNamespace

    return SimpleNamespace(rollout_id=rollout_id, prompt_ids=list(prompt_ids), response_ids=list(response_ids),
                           response_mask=list(response_mask), old_logprobs=[0.0] * len(response_ids),
                           has_logprobs=True)


def _sample_rollouts(model, tok, device: str, groups: int = 3, n: int = 4):
    import torch
    from agl_trainer.algorithm.advantage import grpo_advantages
    from agl_trainer.backends.verl.adapter import rows_to_batch

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
    from agl_trainer.backends.verl.adapter import VERL_LOSS_NAME, register_verl_loss, to_dataproto
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
    return {"stage": "actor", "ok": True, "device": device, **info, "steps": history, "max_weight_change": moved,
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
from agl_trainer.backends.verl.adapter import register_verl_loss
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


# --------------------------------------------------------------------------- env and AGL's loop on verl
def stage_env() -> dict:
    """What this machine has: CUDA devices and the versions of the stack (missing packages listed)."""
    import importlib

    info: dict = {"stage": "env", "ok": True, "python": sys.version.split()[0], "packages": {}, "missing": []}
    for name in ("torch", "transformers", "peft", "verl", "vllm", "ray", "redis", "litellm", "agl_gateway"):
        try:
            mod = importlib.import_module(name)
            info["packages"][name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
            info["missing"].append(f"{name} ({type(e).__name__})")
    import torch

    info["cuda_available"] = torch.cuda.is_available()
    info["cuda_version"] = torch.version.cuda
    if torch.cuda.is_available():
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        free, total = torch.cuda.mem_get_info(0)
        info["gpu_free_gb"], info["gpu_total_gb"] = free / 2**30, total / 2**30
    return info


def stage_maths(device: str) -> dict:
    """AGL's own update maths on ``device`` without verl: per-rollout GRPO advantages, ``ppo_loss`` with
    per-rollout weights, 3 AdamW steps of a tiny model on sampled rollouts; first ratio 1, weights move."""
    import torch
    from agl_trainer.algorithm.loss import per_rollout_token_weights, ppo_loss

    t0 = time.perf_counter()
    model, tok = make_model(device)
    batch, info = _sample_rollouts(model, tok, device)
    t = {k: v.to(device) for k, v in batch["tensors"].items()}
    rindex = torch.tensor([sorted(set(batch["non_tensors"]["agl_rollout_id"])).index(r)
                           for r in batch["non_tensors"]["agl_rollout_id"]], device=device)
    weights = per_rollout_token_weights(t["response_mask"], rindex)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    history = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        lp = response_logprobs(model, t)
        adv = t["advantages"].sum(-1) / t["response_mask"].sum(-1).clamp(min=1)
        loss, st = ppo_loss(lp, t["old_log_probs"], adv, weights, clip_low=0.2, clip_high=0.28, clip_c=3.0)
        loss.backward()
        opt.step()
        history.append({"step": step + 1, "loss": float(loss.detach()), **st})
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    ok = abs(history[0]["ratio_mean"] - 1.0) < 1e-4 and moved > 0 and all(
        torch.isfinite(torch.tensor(h["loss"])) for h in history)
    return {"stage": "maths", "ok": ok, "device": device, **info, "steps": history, "max_weight_change": moved,
            "seconds": time.perf_counter() - t0}


LOOP_AGENT = '''
import json, os, httpx
task = json.loads(os.environ["AGL_INPUT"])
h = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
r = httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", headers=h, timeout=300,
               json={"model": os.environ["AGL_MODEL"], "max_tokens": 16, "temperature": 1.0,
                     "messages": [{"role": "user", "content": task["question"]}]})
r.raise_for_status()
i = int(os.environ["AGL_ROLLOUT_ID"].rsplit("-", 1)[1])
httpx.post(os.environ["AGL_REWARD_URL"], json={"value": float(i % 2)}, headers=h).raise_for_status()
'''
LOOP_TASK = '''
def train_problems():
    return [{"question": f"What is {a} + {a + 1}?"} for a in range(1, 9)]

def heldout_problems():
    return []
'''


def stage_loop(work: Path, model_dir: Path | None, timeout_s: int = 540) -> dict:
    """AGL's run loop driving verl's RayPPOTrainer on one GPU with verl's vLLM rollout, through AGL's
    gateway (``python -m agl_trainer.backends.verl.main --gpu``), 2 steps of 2 groups × 2 rollouts."""
    import shutil

    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    if shutil.which("redis-server") is None and not os.environ.get("AGL_REDIS_URL"):
        return {"stage": "loop", "ok": None, "skipped": "no redis-server on PATH and no AGL_REDIS_URL"}
    if model_dir is None:  # a tiny random model is enough to check the mechanics
        model, tok = make_model("cpu")
        model_dir = work / "model"
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    (work / "agent.py").write_text(LOOP_AGENT)
    (work / "task.py").write_text(LOOP_TASK)
    prefix = f"gpu-smoke-{os.getpid()}:"
    redis_url = os.environ.get("AGL_REDIS_URL", "redis://127.0.0.1:6379/15")
    cfg = {"command": f"python {work / 'agent.py'}", "task_file": str(work / "task.py"), "steps": 2,
           "groups_per_step": 2, "group_size": 2, "eval_size": 0, "concurrency": 4, "rollout_timeout_s": 240,
           "lr": 1e-3, "max_prompt_tokens": 128, "max_response_tokens": 32, "prefix": prefix, "redis_url": redis_url,
           "backend": "verl", "verl_device": "cuda", "model_name": "policy", "out_dir": str(work / "runs")}
    (work / "config.yaml").write_text(json.dumps(cfg))
    src = [str(ROOT / "packages" / p / "src") for p in ("common", "gateway", "controller", "trainer")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(src + [os.environ.get("PYTHONPATH", "")]),
           "AGL_MAIN_PYTHON": sys.executable, "AGL_BASE_MODEL_DIR": str(model_dir), "HF_HUB_OFFLINE": "1"}
    run_dir = work / "run"
    log = work / "verl_main.log"
    with log.open("w") as f:
        proc = subprocess.run([sys.executable, "-m", "agl_trainer.backends.verl.main", str(work / "config.yaml"),
                               "--run-dir", str(run_dir), "--gpu"], stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s, cwd=ROOT)
    out: dict = {"stage": "loop", "returncode": proc.returncode, "log": str(log)}
    try:
        verl = json.loads((run_dir / "verl.json").read_text())
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError) as e:
        print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
        return {**out, "ok": False, "error": f"no run outputs: {e}", "seconds": time.perf_counter() - t0}
    steps = verl["steps"]
    versions = _recorded_versions(redis_url, prefix, metrics)
    checks = {
        "chat_through_gateway_with_ids_and_logprobs": bool(steps) and all(s.get("logprob_max_abs_diff") is not None
                                                                           for s in steps),
        "sleep_frees_gpu_memory": bool(steps) and all(
            s.get("gpu_free_gb_after_sleep", 0) > s.get("gpu_free_gb_before_sleep", 1e9) + 0.5 for s in steps),
        "first_ratio_within_1e-2": bool(steps) and abs((steps[0].get("ratio_mean") or 0) - 1.0) < 1e-2,
        "logprobs_change_after_update_weights": bool(steps) and (steps[0].get("engine_logprob_change") or 0) > 1e-3,
        "calls_after_resume_have_version_1": versions[1:2] == [{1}] if len(versions) > 1 else False,
    }
    return {**out, "ok": proc.returncode == 0 and all(checks.values()), "checks": checks, "steps": steps,
            "recorded_versions": [sorted(v) for v in versions], "init_s": verl.get("init_s"),
            "step_s": [m.get("step_s") for m in metrics if "step" in m], "seconds": time.perf_counter() - t0}


def _recorded_versions(redis_url: str, prefix: str, metrics: list[dict]) -> list[set]:
    import asyncio

    from agl_common.store import Store

    async def read():
        store = Store(redis_url, prefix)
        try:
            out = []
            for m in metrics:
                if "step" not in m:
                    continue
                vs: set = set()
                for gid in m.get("groups", []):
                    for i in range(2):
                        vs |= {c.model_version for c in await store.read_calls(f"{gid}-{i}")}
                out.append(vs)
            return out
        finally:
            await store.close()

    return asyncio.run(read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["env", "maths", "actor", "loop", "ppo", "all", "build-tokenizer"])
    ap.add_argument("src", nargs="?", help="build-tokenizer: SmolLM2 directory with tokenizer.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", type=Path, help="loop: a model directory (default: a tiny random Llama)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu_smoke")))
    args = ap.parse_args()
    if args.stage == "build-tokenizer":
        build_tokenizer(Path(args.src or Path.home() / ".cache/agl/smollm2-135m-instruct"), TOKENIZER_DIR)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: list[dict] = []
    env = stage_env()
    results.append(env)
    if args.device == "cuda" and not env["cuda_available"]:
        env["ok"] = False
        env["error"] = "no CUDA device: run on a GPU machine, or `maths --device cpu` / `actor --device cpu`"
    have = set(env["packages"])
    wanted = {"all": ["maths", "actor", "loop"]}.get(args.stage, [args.stage] if args.stage != "env" else [])
    needs = {"actor": {"verl"}, "loop": {"verl", "vllm", "ray", "redis", "agl_gateway", "litellm"},
             "ppo": {"verl", "vllm", "ray"}, "maths": set()}
    try:
        for stage in wanted:
            if env.get("error"):
                results.append({"stage": stage, "ok": None, "skipped": env["error"]})
                continue
            missing = sorted(needs[stage] - have)
            if missing:
                results.append({"stage": stage, "ok": None, "skipped": f"not installed: {', '.join(missing)}"})
                continue
            try:
                if stage == "maths":
                    results.append(stage_maths(args.device))
                elif stage == "actor":
                    results.append(stage_actor(args.device))
                elif stage == "loop":
                    results.append(stage_loop(args.out / "loop", args.model))
                else:
                    results.append(stage_ppo(args.out / "ppo"))
            except Exception as e:  # noqa: BLE001 - record it, run the next stage
                results.append({"stage": stage, "ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        summary = {"ok": all(r.get("ok") is not False for r in results) and not env.get("error"),
                   "seconds": time.perf_counter() - t0, "stages": results}
        (args.out / "gpu_smoke.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps({"ok": summary["ok"], "stages": {r["stage"]: r.get("ok", r.get("skipped")) for r in results}}))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
