"""Does training make the agent better? The demo configuration for several seeds, side by side.

    .venv/bin/python bench/learning.py                      # run `agl-trainer demo --seed S` for seeds 0 1 2
    .venv/bin/python bench/learning.py --runs runs/demo/*   # read finished runs instead (their summary.json)
    .venv/bin/python bench/learning.py --config examples/arithmetic/team.yaml   # the multi-call team, 3 seeds

Prints held-out accuracy before → after per seed, the mean gain ± its standard error, minutes of training and
where the time went, the load average, and writes ``accuracy_vs_minutes.png`` (every seed's curve of held-out
accuracy on the fixed subset against minutes of training, with the full before/after points).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_seed(seed: int, out_dir: Path, extra: list[str], config: Path | None = None) -> Path:
    """Run the demo (or ``agl-trainer train config``) with ``seed`` into ``out_dir``; returns its run directory.
    Raises ``CalledProcessError``."""
    before = set(out_dir.glob("*")) if out_dir.exists() else set()
    if config is None:
        argv = ["demo", "--seed", str(seed), "--out-dir", str(out_dir)]
    else:  # the config's fields with this out_dir, written beside the runs
        import yaml

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / config.name
        path.write_text(yaml.safe_dump({**(yaml.safe_load(config.read_text()) or {}), "out_dir": str(out_dir)}))
        argv = ["train", str(path), "--seed", str(seed)]
    subprocess.run([str(ROOT / ".venv/bin/agl-trainer"), *argv, *extra], check=True, cwd=ROOT)
    (new,) = [p for p in out_dir.glob("*") if p not in before and p.is_dir()]
    return new


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std / sqrt(n); 0 for one value)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in summaries:
        pts = [(c["minutes"], c["subset_accuracy"]) for c in s["curve"]]
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"seed {s['seed']} (subset)")
        full = [c for c in s["curve"] if c["when"] in ("before", "after")]
        ax.scatter([c["minutes"] for c in full], [c["accuracy"] for c in full], marker="s", color=line.get_color())
    ax.set_xlabel("minutes of training (evaluations excluded)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("held-out accuracy vs minutes (squares: full held-out set)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="*", type=Path, help="finished run directories to read instead of running")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--config", type=Path, default=None, help="train this YAML (agl-trainer train) instead of the demo")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "runs/learning")
    ap.add_argument("--png", type=Path, default=None, help="default: OUT_DIR/accuracy_vs_minutes.png")
    args, extra = ap.parse_known_args()
    dirs = args.runs if args.runs else [run_seed(s, args.out_dir, extra, args.config) for s in args.seeds]
    summaries = []
    for d in dirs:
        f = Path(d) / "summary.json"
        if not f.exists():
            print(f"skipping {d}: no summary.json (unfinished run?)", file=sys.stderr)
            continue
        summaries.append(json.loads(f.read_text()))
    if not summaries:
        sys.exit("no finished runs")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} (2 cores)")
    print(f"{'seed':>4} {'before':>7} {'after':>7} {'gain':>7} {'n':>4} {'train min':>9} {'steps':>5} "
          f"{'gen':>5} {'start':>5} {'wait':>5} {'update':>6} {'load':>5} {'drain':>5} {'idle':>5}  run")
    gains = []
    for s in summaries:
        gain = s["heldout_after"] - s["heldout_before"]
        gains.append(gain)
        fr = [s.get(f"frac_{k}", 0) for k in ("generation", "harness_startup", "wait", "update", "weight_load",
                                              "pause_drain", "idle")]
        print(f"{s['seed']:>4} {s['heldout_before']:>7.3f} {s['heldout_after']:>7.3f} {gain:>+7.3f} "
              f"{s['heldout_n']:>4} {s['train_minutes']:>9.1f} {s['steps']:>5} "
              + " ".join(f"{x:>5.0%}" for x in fr[:3]) + f" {fr[3]:>6.0%} " + " ".join(f"{x:>5.0%}" for x in fr[4:])
              + f"  {s['run_dir']}")
    m, se = mean_se(gains)
    b, _ = mean_se([s["heldout_before"] for s in summaries])
    a, _ = mean_se([s["heldout_after"] for s in summaries])
    print(f"mean over {len(summaries)} seed(s): {b:.3f} → {a:.3f}, gain {m:+.3f} ± {se:.3f} (standard error), "
          f"{mean_se([s['train_minutes'] for s in summaries])[0]:.1f} min of training")
    png = args.png or (args.out_dir / "accuracy_vs_minutes.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(summaries, png)
    print(f"curve: {png}")


if __name__ == "__main__":
    main()
