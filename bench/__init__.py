"""Libra's benchmarks: eager, torch.utils.checkpoint, selective activation checkpoint, save_on_cpu, torch.compile's
activation memory budget and Libra, on four models, with measured memory, step time and gradient equality.

Run ``python -m bench`` (or ``--quick``); see ``bench/README.md``.
"""
