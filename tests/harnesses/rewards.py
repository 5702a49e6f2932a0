"""Reward functions for controller tests (``--reward-fn rewards:slow``)."""

import time


def slow(inp: dict, output: str) -> float:
    """A judge that takes ``inp["judge_s"]`` seconds (blocking, as a test run or a model call would)."""
    time.sleep(float(inp.get("judge_s", 2.0)))
    return 1.0
