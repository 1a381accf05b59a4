"""Libra inside the trainers people use: a callback plans the trainer's own training step under a budget.

- :class:`libra.integrations.transformers.LibraCallback` for the Hugging Face ``Trainer``.
- :class:`libra.integrations.lightning.LibraCallback` for Lightning 2.x (``import lightning``).

Each is imported from its own module, so that importing ``libra`` never imports a trainer library.
"""
