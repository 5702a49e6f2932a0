"""What a run reports besides metrics.jsonl: the step table, the accuracy curve, the time split totals."""

from __future__ import annotations

import sys
from pathlib import Path

from agl_common.settings import printable
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .algorithm.stepstats import TIME_KEYS


class _PlainConsole(Console):
    """A console that prints text as it is: no Rich markup (a path, prefix, id or engine message holding ``[/]`` was
    a ``MarkupError`` traceback), and the control characters but newlines and tabs of every string it renders
    escaped — what it prints, and a table's title, headers and cells alike (an engine's or a Redis server's error
    text with ESC or OSC-8 sequences drove the terminal; round 23: a policy's name in an evaluation's table title)."""

    def render_str(self, text: str, **kwargs):  # noqa: D102 - Console.render_str: every str Rich renders passes here
        return super().render_str(printable(text, "\n\t"), **kwargs)


def output_console(stderr: bool = False) -> Console:
    """The console a command prints on (stdout, or stderr if ``stderr``): markup off, control characters escaped
    (:class:`_PlainConsole`). Not a terminal (a pipe, a log): no wrapping or cutting at 80 columns; a line stays one
    line (soft wrap), however long."""
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    return _PlainConsole(stderr=stderr, markup=False, **({} if tty else {"width": 250, "soft_wrap": True}))


def progress_bars(console: Console, **kwargs) -> Progress:
    """Rich progress bars on ``console`` (a description, a bar, done of total, the time elapsed) that print their
    descriptions as they are (a ``TextColumn`` reads markup whatever its console's setting: a model name with
    ``[/]`` was a traceback); ``kwargs`` go to :class:`rich.progress.Progress`."""
    return Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True, **kwargs)


#: (metrics key, column title, format) of the step table
COLUMNS = [("step", "step", "{}"), ("reward_mean", "reward", "{:.2f}"), ("group_signal_frac", "signal", "{:.0%}"),
           ("truncation_rate", "cut", "{:.0%}"), ("response_tokens_mean", "tokens", "{:.0f}"),
           ("loss", "loss", "{:+.3f}"), ("ratio_first", "ratio₀", "{:.3f}"), ("clip_frac_first", "clip₀", "{:.1%}"),
           ("kl", "KL", "{:.4f}"), ("entropy", "H", "{:.3f}"), ("rows", "rows", "{}"), ("merge_breaks", "breaks", "{}"), ("failed", "failed", "{}"),
           ("time_generation_s", "gen s", "{:.0f}"), ("time_harness_startup_s", "start s", "{:.0f}"),
           ("time_update_s", "update s", "{:.0f}"), ("step_s", "step s", "{:.0f}")]


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def step_table(rows: list[dict]) -> Table:
    """The per-step table (``-``: not measured at that step, e.g. no update without reward signal)."""
    table = Table(title="training steps (signal: groups with unequal rewards; cut: replies that hit max_tokens)")
    for _, title, _ in COLUMNS:
        table.add_column(title, justify="right")
    for m in rows:
        table.add_row(*[_fmt(m.get(k), f) for k, _, f in COLUMNS])
    return table


def plot_curve(metrics: list[dict], evals: list[dict], path: Path) -> None:
    """Held-out accuracy against minutes of training (left) and the training reward per step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    pts = sorted((e["minutes"], e["subset_accuracy"]) for e in evals if e.get("subset_accuracy") is not None)
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"fixed held-out subset (n={evals[0].get('subset_n', '?')})")
    for e in evals:
        if e["when"] in ("before", "after"):
            ax.scatter([e["minutes"]], [e["accuracy"]], marker="s", color="black", zorder=3)
            ax.annotate(f"{e['when']} {e['accuracy']:.2f} (n={e['n']})", (e["minutes"], e["accuracy"]),
                        textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("minutes of training")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="upper left")
    ax2.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics], marker=".", label="train reward")
    ax2.set_xlabel("step")
    ax2.set_ylim(-0.02, 1.02)
    ax2.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def time_split_totals(metrics: list[dict]) -> dict[str, float]:
    """Seconds per category of :data:`agl_trainer.algorithm.stepstats.TIME_KEYS` summed over ``metrics``, and each as a
    fraction of the summed ``step_s`` (``frac_*``)."""
    total = sum(m.get("step_s", 0.0) for m in metrics) or 1.0
    out = {}
    for k in TIME_KEYS:
        out[k] = sum(m.get(k) or 0.0 for m in metrics)
        out["frac_" + k.removeprefix("time_").removesuffix("_s")] = out[k] / total
    return out
