"""Draws docs/memory_timeline.png: the demo's GPT-2-like model (6 layers, d=128, seq 128, batch 8, dropout 0.1),
eager vs Libra at half of eager's activation memory, as predicted by the planner's simulator.

Run from the repository root: ``.venv/bin/python docs/memory_timeline.py``. The same picture from a shell:
``libra profile libra.cli.demo:make -o profile.json``, ``libra plan profile.json --budget ... -o plan.json``,
``libra show plan.json --profile profile.json --plot timeline.png``.
"""

from pathlib import Path

import libra
from libra.cli.demo import make
from libra.planner.timeline import memory_timeline
from libra.plot import plot_memory_timeline

model, step = make(batch_size=8)
step()  # warm-up, as `libra profile` does
model.zero_grad(set_to_none=True)
profile = libra.profile(model, step)
plan = libra.plan(profile, profile.budget_for_share(0.5))
out = plot_memory_timeline(
    memory_timeline(profile, plan),
    Path(__file__).with_name("memory_timeline.png"),
    title=f"GPT-2-like, 6 layers, batch 8: budget = static + 50% of eager's activation memory "
          f"(predicted step x{plan.predicted_step_seconds / plan.eager_step_seconds:.2f})",
)
print(f"{out}: eager peak {plan.eager_peak_bytes} B, plan peak {plan.predicted_peak_bytes} B, "
      f"budget {plan.budget_bytes} B")
