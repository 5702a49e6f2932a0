"""Tasks of the verl CPU test (tests/test_verl_cpu.py)."""


def train_problems():
    return [{"question": f"What is {a} + {a + 1}?", "answer": 2 * a + 1} for a in range(1, 9)]


def heldout_problems():
    return []
