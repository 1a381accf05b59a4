"""The public surface is frozen: a change here is a decision, not an accident."""

import subprocess
import sys

import libra
from libra.cli.main import build_parser


def test_all_snapshot():
    assert sorted(libra.__all__) == [
        "BatchFit", "BudgetInfeasibleError", "Decision", "LibraError", "Plan", "PlanFormatError", "PlanMismatchError",
        "Profile", "UnplannedInputsError", "apply", "max_batch", "plan", "profile",
    ]
    assert issubclass(libra.BudgetInfeasibleError, libra.LibraError)
    assert issubclass(libra.UnplannedInputsError, libra.LibraError)
    assert issubclass(libra.LibraError, RuntimeError)


def test_cli_snapshot():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == ["demo", "max-batch", "plan", "profile", "show"]
    demo_flags = sorted(o for a in sub.choices["demo"]._actions for o in a.option_strings)
    assert demo_flags == ["--batch", "--help", "--layers", "--share", "--steps", "-h"]
    flags = {name: sorted(o for a in p._actions for o in a.option_strings) for name, p in sub.choices.items()}
    assert flags["profile"] == ["--fake", "--help", "--output", "--timing", "--warmup", "-h", "-o"]
    assert flags["plan"] == ["--budget", "--help", "--output", "--solver", "-h", "-o"]
    assert flags["show"] == ["--help", "--plot", "--profile", "-h"]
    assert flags["max-batch"] == ["--budget", "--fake", "--help", "--max-profiles", "--output", "--start", "--timing",
                                  "--warmup", "-h", "-o"]


def test_import_does_not_initialise_cuda():
    code = "import torch, libra, libra.testing; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_library_never_prints(capsys):
    from libra.planner import Planning
    from libra.testing import models

    model, x, y, loss_fn = models.make_mlp(batch=64, d=32, hidden=64, depth=2)
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    plan = libra.plan(prof, max(prof.budget_for_share(0.6), Planning(prof).min_budget_bytes()))
    with libra.apply(model, plan):
        loss_fn(model(x), y).backward()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_integrations_snapshot_and_import_nothing_until_asked():
    code = ("import sys, libra, libra.integrations; "
            "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    from libra.integrations import lightning, transformers

    assert transformers.__all__ == ["LibraCallback"] and lightning.__all__ == ["LibraCallback"]


def test_one_way_flow_between_profiler_planner_and_runtime():
    """profiler -> Profile -> planner -> Plan -> runtime: no layer imports a later one (only the data types of an
    earlier one), at module level or inside a function; libra/api.py and libra/fit.py join them from above."""
    import ast
    from pathlib import Path

    src = Path(libra.__file__).parent
    allowed = {
        "profiler": {"libra.profiler", "libra._ops", "libra._allocator", "libra._forward", "libra.errors", "libra.units"},
        "planner": {"libra.planner", "libra.profiler.types", "libra._ops", "libra.errors", "libra.units"},
        "runtime": {"libra.runtime", "libra.planner.types", "libra._ops", "libra._forward", "libra.errors",
                    "libra.units"},
    }
    checked = 0
    for layer, ok in allowed.items():
        for path in sorted((src / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    if name == "libra" or name.startswith("libra."):
                        checked += 1
                        assert any(name == m or name.startswith(m + ".") for m in ok), (
                            f"{path.relative_to(src)} imports {name}, outside what the {layer} may import")
    assert checked > 30
