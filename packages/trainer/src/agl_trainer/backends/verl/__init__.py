"""The verl backend (verl 0.9.1, in its own environment ``.venv-verl``; see docs/verl.md):

- :mod:`.adapter`: AGL rows ↔ verl's ``DataProto``, AGL's per-rollout loss registered in verl's registry;
- :mod:`.trainer`: :class:`~.trainer.VerlBackend`, verl's ``RayPPOTrainer`` driven by AGL's run loop;
- :mod:`.main`: ``python -m agl_trainer.backends.verl.main``, the entry point ``train --backend verl`` starts;
- :mod:`.hook`: what verl imports in every process (``VERL_USE_EXTERNAL_MODULES``): the loss, the CPU platform;
- :mod:`.rollout`: the ``agl_cpu`` rollout engine (verl's inference server on CPU).

Nothing is imported here: the main environment imports :mod:`.adapter` without verl installed.
"""
