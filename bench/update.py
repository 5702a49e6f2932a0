"""How fast does the CPU backend update here? One PPO update of the demo's shape, per micro-batch size and thread count.

    .venv/bin/python bench/update.py                                   # micro-batch 1024/2048/4096 tokens, all cores
    .venv/bin/python bench/update.py --micro-batch-tokens 2048 --threads 1 2 --dtype float32

Rows shaped like a demo step (64 rollouts of one row: a ~70-token prompt, a 57-token reply, random token ids of
the real vocabulary, recorded logprobs near the policy's), the demo's LoRA (rank 16, all linear layers) on the
real base model, ``ppo_mini_batch_rollouts`` 32 (2 optimizer steps). For each setting: seconds per update, the
trainer's CPU use over that time (process CPU seconds / wall seconds: 2.0 = both cores busy), trained tokens/s,
and the arithmetic rate against a rough bound (``6 x parameters x tokens`` FLOPs for forward + backward of the
sequence; LoRA backward is cheaper, so this overstates the work a little). Prints the CPU and the load average.
Not run in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import tempfile
import time
from pathlib import Path


def demo_rows(n: int, prompt: int, reply: int, vocab: int, seed: int = 0):
    from agl_trainer.algorithm.aggregate import Row

    rng = random.Random(seed)
    rows = []
    for k in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(prompt + reply)]
        rows.append(Row(f"r{k}", ids[:prompt], ids[prompt:], [1] * reply, [-2.0] * reply, n_calls=1))
    return rows


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batch-tokens", nargs="*", type=int, default=[1024, 2048, 4096])
    ap.add_argument("--threads", nargs="*", type=int, default=[os.cpu_count() or 1])
    ap.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32 (the trainer's autocast)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=70)
    ap.add_argument("--reply", type=int, default=57)
    args = ap.parse_args()

    import torch
    from agl_trainer.backends.cpu import CpuBackend
    from agl_trainer.hardware import choose_dtype, describe, read_cpuinfo
    from agl_trainer.model import ensure_base_model

    hw = describe(args.dtype)
    dtype = choose_dtype(args.dtype, read_cpuinfo())
    print(f"CPU {hw['model']}, {hw['cores']} cores, flags {' '.join(hw['flags'])}, PyTorch kernels {hw['capability']};"
          f" trainer autocast {dtype}; load average {os.getloadavg()}", flush=True)
    base = ensure_base_model()
    work = Path(tempfile.mkdtemp(prefix="agl-bench-update-"))
    print(f"{'micro-batch':>11} {'threads':>7} {'update s':>8} {'cpu/wall':>8} {'tokens/s':>8} {'GFLOP/s':>8}  load")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for mbt in args.micro_batch_tokens:
            b = CpuBackend(base, work, lora_rank=16, lora_alpha=32, lr=3e-4, micro_batch_tokens=mbt,
                           bf16=dtype == "bfloat16", ppo_mini_batch_rollouts=32, seed=0)
            n_params = sum(p.numel() for p in b.model.parameters())
            rows = demo_rows(args.rows, args.prompt, args.reply, b.model.config.vocab_size)
            tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
            t, c = time.perf_counter(), cpu_seconds()
            stats = b.update(rows, [1.0 if k % 2 else -1.0 for k in range(len(rows))])
            wall, cpu = time.perf_counter() - t, cpu_seconds() - c
            flops = 6 * n_params * tokens
            print(f"{mbt:>11} {threads:>7} {wall:>8.1f} {cpu / wall:>8.2f} {tokens / wall:>8.0f} "
                  f"{flops / wall / 1e9:>8.1f}  {os.getloadavg()[0]:.1f} (updates {stats['updates']}, "
                  f"KL sample included)", flush=True)
            del b


if __name__ == "__main__":
    main()
