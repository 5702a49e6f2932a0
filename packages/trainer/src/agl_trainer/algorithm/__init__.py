"""The algorithm, as pure functions: no I/O (no Redis, no HTTP, no files, no engine; ``tests/test_layout.py``
enforces it), so every piece is tested by hand on tensors and records.

- :mod:`.aggregate`: recorded calls → training rows (token ids, response mask, behaviour logprobs; merge breaks);
- :mod:`.batch`: group selection → rows → per-row advantages, the one batch builder (training, export, dashboard);
- :mod:`.advantage`: GRPO / RLOO advantages per rollout or per row;
- :mod:`.loss`: clipped PPO, per-rollout (or token / sequence mean) loss normalization, entropy, KL;
- :mod:`.minibatch`: PPO mini-batches of whole rollouts, micro-batches by tokens;
- :mod:`.evalstats`: accuracy, reward mean, pass@k (one definition for steps and evaluations);
- :mod:`.stepstats`: a step's signals from its rollouts and calls (reward signal, truncation, time split).
"""
