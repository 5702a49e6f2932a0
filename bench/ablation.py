"""Two arms of the multi-call team agent, same seeds, same budget, side by side: rollout-level vs sample-level credit
(``--study credit``, the default), or one shared adapter vs one adapter per role (``--study roles``).

    .venv/bin/python bench/ablation.py                              # 2 arms x seeds 0 1 2 (~6 x 55 min on 2 cores)
    .venv/bin/python bench/ablation.py --seeds 0 --max-train-minutes 10   # a shorter try
    .venv/bin/python bench/ablation.py --study roles --seeds 0      # shared vs per-role adapters
    .venv/bin/python bench/ablation.py --study roles --seeds 1 --steps 7   # both arms the same 7 steps
    .venv/bin/python bench/ablation.py --runs runs/ablation/*/*     # read finished runs instead

``--study credit``: the two arms differ only in the credit settings (every other field from ``--config``,
``examples/arithmetic/team.yaml`` by default):

- ``rollout``: ``advantage_level: rollout``, ``loss_agg_mode: rollout-mean`` (AGL's default, Agent Lightning's
  rollout-level credit: a rollout counts once in its group and weighs the same in the loss whatever its rows);
- ``sample``: ``advantage_level: row``, ``loss_agg_mode: seq-mean-token-mean`` (each row its own sample: a rollout
  that broke into k rows counts k times in its group's statistics and in the loss).

``--study roles`` (``examples/arithmetic/roles.yaml`` by default: the team whose solver and checker name their
models, every policy served as a LoRA adapter):

- ``shared``: ``roles: {}``: one adapter trained on every row, whichever agent made the call;
- ``per-role``: the config's roles: the solver's and the checker's own adapters, each trained on its rows.

Prints, per arm and seed, held-out accuracy before → after, the gain, the mean ± standard error per arm, how many
trained rollouts had more than one row (if none, the two arms train alike), the load average and the CPU; writes
``ablation.png``: held-out accuracy on the fixed subset and the policy's mean token entropy against minutes of
training, every run, coloured by arm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import mean_se  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: study → its default config, its arms (name → the fields that make it, tested in order) and the picture's title
STUDIES = {
    "credit": {"config": "examples/arithmetic/team.yaml", "title": "rollout-level vs sample-level credit (team agent)",
               "arms": {"rollout": {"advantage_level": "rollout", "loss_agg_mode": "rollout-mean"},
                        "sample": {"advantage_level": "row", "loss_agg_mode": "seq-mean-token-mean"}}},
    "roles": {"config": "examples/arithmetic/roles.yaml", "title": "one shared adapter vs one adapter per role "
              "(team agent)", "arms": {"shared": {"roles": {}}, "per-role": {}}},
}
ARMS = {name: fields for study in STUDIES.values() for name, fields in study["arms"].items()}


def arm_of(config: dict, study: str = "credit") -> str:
    """The arm of ``study`` a run's ``config.json`` belongs to (its first arm whose fields it has; a config
    without a field has its default); ``other`` for settings no arm uses."""
    defaults = {"advantage_level": "rollout", "loss_agg_mode": "rollout-mean", "roles": {}}
    for name, fields in STUDIES[study]["arms"].items():
        if all(config.get(k, defaults.get(k)) == v for k, v in fields.items()):
            return name
    return "other"


def run_arm(arm: str, seed: int, base: Path, out_dir: Path, overrides: dict) -> Path:
    """Train ``base`` with the arm's fields and ``overrides`` for ``seed``; returns the run directory.
    Raises ``CalledProcessError`` if the run fails."""
    cfg = {**(yaml.safe_load(base.read_text()) or {}), **overrides, **ARMS[arm], "out_dir": str(out_dir / arm)}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runs = out_dir / arm
    before = set(runs.glob("*")) if runs.exists() else set()
    subprocess.run([str(ROOT / ".venv/bin/agl-trainer"), "train", str(path), "--seed", str(seed)], check=True, cwd=ROOT)
    (new,) = [p for p in runs.glob("*") if p not in before and p.is_dir()]
    return new


def read_run(run_dir: Path, study: str = "credit") -> dict | None:
    """A finished run's summary, config, arm, per-step metrics and the step minutes; None if unfinished."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return None
    config = json.loads((run_dir / "config.json").read_text())
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step" in m
             and "reward_mean" in m]
    minutes, t = [], 0.0
    for m in steps:
        t += m.get("step_s", 0.0) / 60
        minutes.append(t)
    return {"dir": run_dir, "summary": json.loads(summary.read_text()), "config": config, "arm": arm_of(config, study),
            "steps": steps, "minutes": minutes}


def multi_row_share(run: dict) -> tuple[int, int]:
    """(trained rollouts with more than one row, trained rollouts) over the run's steps."""
    return (sum(m.get("multi_row_rollouts", 0) for m in run["steps"]),
            sum(m.get("rollouts_trained", 0) for m in run["steps"]))


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"rollout": "tab:blue", "sample": "tab:orange", "shared": "tab:blue", "per-role": "tab:green",
               "other": "tab:grey"}
    fig, (acc, ent) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        c, label = colours[r["arm"]], f"{r['arm']} seed {r['summary']['seed']}"
        curve = r["summary"]["curve"]
        acc.plot([p["minutes"] for p in curve], [p["subset_accuracy"] for p in curve], marker="o", color=c,
                 label=label, alpha=0.8)
        pts = [(t, m["entropy"]) for t, m in zip(r["minutes"], r["steps"]) if m.get("entropy") is not None]
        ent.plot([p[0] for p in pts], [p[1] for p in pts], color=c, label=label, alpha=0.8)
    acc.set_xlabel("minutes of training")
    acc.set_ylabel("held-out accuracy (fixed subset)")
    acc.set_ylim(-0.02, 1.02)
    ent.set_xlabel("minutes of training")
    ent.set_ylabel("policy entropy (nats/token, trained rows)")
    for ax in (acc, ent):
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(runs: list[dict], png: Path, study: str = "credit") -> None:
    """Print the table and write the PNG."""
    cpus = {r["summary"].get("hardware", {}).get("model", "?") for r in runs}
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; CPU {', '.join(sorted(cpus))}")
    print(f"{'arm':>8} {'seed':>4} {'before':>7} {'after':>7} {'gain':>7} {'n':>4} {'min':>5} {'steps':>5} "
          f"{'multi-row':>10}  run")
    for r in sorted(runs, key=lambda r: (r["arm"], r["summary"]["seed"])):
        s = r["summary"]
        multi, total = multi_row_share(r)
        print(f"{r['arm']:>8} {s['seed']:>4} {s['heldout_before']:>7.3f} {s['heldout_after']:>7.3f} "
              f"{s['heldout_after'] - s['heldout_before']:>+7.3f} {s['heldout_n']:>4} {s['train_minutes']:>5.1f} "
              f"{s['steps']:>5} {multi:>5}/{total:<4}  {r['dir']}")
    for arm in STUDIES[study]["arms"]:
        mine = [r["summary"] for r in runs if r["arm"] == arm]
        if not mine:
            continue
        b, b_se = mean_se([s["heldout_before"] for s in mine])
        a, a_se = mean_se([s["heldout_after"] for s in mine])
        g, g_se = mean_se([s["heldout_after"] - s["heldout_before"] for s in mine])
        print(f"{arm}: {len(mine)} seed(s), held-out {b:.3f} ± {b_se:.3f} → {a:.3f} ± {a_se:.3f}, "
              f"gain {g:+.3f} ± {g_se:.3f} (mean ± standard error)")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, png, STUDIES[study]["title"])
    print(f"picture: {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="*", type=Path, help="finished run directories to read instead of running")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--study", choices=list(STUDIES), default="credit")
    ap.add_argument("--arms", nargs="*", choices=list(ARMS), default=None, help="default: the study's arms")
    ap.add_argument("--config", type=Path, default=None, help="default: the study's config")
    ap.add_argument("--max-train-minutes", type=float, default=None, help="override the config's training budget")
    ap.add_argument("--steps", type=int, default=None,
                    help="train exactly this many steps (the arms match in updates; the time budget is lifted to "
                         "150 minutes unless --max-train-minutes is given)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "runs/ablation")
    ap.add_argument("--png", type=Path, default=None, help="default: OUT_DIR/ablation.png")
    args = ap.parse_args()
    study = STUDIES[args.study]
    arms = args.arms or list(study["arms"])
    if set(arms) - set(study["arms"]):
        sys.exit(f"--arms of the {args.study} study: {', '.join(study['arms'])}")
    config = args.config or ROOT / study["config"]
    overrides = {"max_train_minutes": args.max_train_minutes} if args.max_train_minutes else {}
    if args.steps is not None:
        if args.steps < 1:
            sys.exit("--steps: at least 1")
        overrides = {"steps": args.steps, "max_train_minutes": args.max_train_minutes or 150.0}
    dirs = args.runs if args.runs else [run_arm(a, s, config, args.out_dir, overrides)
                                        for s in args.seeds for a in arms]
    runs = []
    for d in dirs:
        r = read_run(Path(d), args.study)
        if r is None:
            print(f"skipping {d}: no summary.json (unfinished run?)", file=sys.stderr)
            continue
        runs.append(r)
    if not runs:
        sys.exit("no finished runs")
    report(runs, args.png or (args.out_dir / f"{'ablation' if args.study == 'credit' else args.study}.png"),
           args.study)


if __name__ == "__main__":
    main()
