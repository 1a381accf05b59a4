"""``Plan.explain()``: a readable account of a plan."""

from __future__ import annotations

from libra.planner.types import Decision, Plan
from libra.units import format_bytes

__all__ = ["explain_plan"]


def explain_plan(plan: Plan) -> str:
    counts = plan.counts
    lines = [
        f"Libra plan ({plan.solver}) for a budget of {format_bytes(plan.budget_bytes)} on {plan.device}",
        f"  predicted peak  {format_bytes(plan.predicted_peak_bytes)}  (eager {format_bytes(plan.eager_peak_bytes)}, "
        f"static {format_bytes(plan.static_bytes)})",
        f"  predicted step  {plan.predicted_step_seconds * 1e3:.1f} ms  (eager {plan.eager_step_seconds * 1e3:.1f} ms, "
        f"x{plan.predicted_step_seconds / max(plan.eager_step_seconds, 1e-12):.2f})",
        f"  peak moment     {plan.peak_description}",
        f"  saved activations: {counts[Decision.KEEP]} kept, {counts[Decision.RECOMPUTE]} recomputed, "
        f"{counts[Decision.OFFLOAD]} offloaded",
    ]
    if not plan.regions:
        lines.append("  nothing is recomputed: applying this plan installs nothing")
    else:
        lines.append(f"  checkpointed modules ({len(plan.regions)}): ops kept / replayed / left out of the replay")
        for r in plan.regions:
            name = r.module + (f"[{r.call}]" if r.call else "")
            if r.plain:
                how = "  plain checkpoint"
            elif r.hooked:
                how = "  hooked: what it saves goes to host memory, but what it returns"
            else:
                how = ""
            replayed = len(r.ops) - len(r.save) - len(r.skip)
            lines.append(f"    {name:<32} {len(r.save):>4} / {replayed:<4} / {len(r.skip):<4}{how}")
        recomputed = [k for k, d in plan.decisions.items() if d is Decision.RECOMPUTE]
        lines.append("  recomputed activations: " + ", ".join(recomputed[:8]) + (" ..." if len(recomputed) > 8 else ""))
    if plan.provenance:
        p = plan.provenance
        memory = {"fake": "fake tensors (no eager step)", "step": "one real step"}.get(p.get("memory"), "?")
        times = {"benchmark": "each op timed alone (an estimate)", "step": "timed in the step",
                 "estimate": "estimated from each op's operations and bytes (no temporaries measured)",
                 "safe": "timed in a real step with every module call recomputed"}.get(
            p.get("op_seconds"), "?")
        lines.append(f"  profile         memory from {memory}; op times {times}")
        link = p.get("host_bandwidth", "none")
        if link != "none":
            lines.append(f"  host link       {plan.host_bandwidth / 1e9:.1f} GB/s ({link})")
    if plan.refused:
        lines.append(f"  left out ({len(plan.refused)}): module calls Libra cannot recompute or offload")
        for module, call, reason in plan.refused:
            lines.append(f"    {module + (f'[{call}]' if call else ''):<32} {reason}")
    return "\n".join(lines)
