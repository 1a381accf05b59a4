"""The CLI end to end, as a new user would run it: profile -> plan -> show, max-batch, and one-line errors."""

import sys

import pytest

from libra.cli.main import main

FACTORY = '''
from libra.testing import models

def make():
    model, x, y, loss_fn = models.make_mlp(batch=1024, d=64, hidden=256, depth=4)
    return model, lambda: loss_fn(model(x), y).backward()

def make_meta():
    import torch
    with torch.device("meta"):
        model = models.GPT(vocab=256, d=64, layers=2, heads=4, seq=32)
    x = torch.randint(0, 256, (2, 32))
    return model, lambda: model(x).sum().backward()

def make_batch(batch_size):
    model, x, y, loss_fn = models.make_mlp(batch=batch_size, d=64, hidden=256, depth=4)
    return model, lambda: loss_fn(model(x), y).backward()
'''


def test_profile_plan_show(tmp_path, capsys):
    script = tmp_path / "factory.py"
    script.write_text(FACTORY)
    prof, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", f"{script}:make", "-o", str(prof)]) == 0
    assert prof.exists()
    assert main(["plan", str(prof), "--budget", "1TiB", "-o", str(plan)]) == 0
    assert "nothing is recomputed" in capsys.readouterr().out
    assert main(["show", str(plan)]) == 0
    assert "predicted peak" in capsys.readouterr().out


def test_profile_a_meta_model_fake_on_a_named_device(tmp_path, capsys):
    import libra

    script = tmp_path / "factory.py"
    script.write_text(FACTORY)
    prof = tmp_path / "profile.json"
    assert main(["profile", f"{script}:make_meta", "--fake", "cpu", "--timing", "estimate", "-o", str(prof)]) == 0
    loaded = libra.Profile.load(str(prof))
    assert loaded.device == "cpu" and loaded.provenance["op_seconds"] == "estimate"
    assert main(["profile", f"{script}:make_meta", "--fake", "-o", str(prof)]) == 2  # no device named
    assert "fake='cpu'" in capsys.readouterr().err


def test_errors_are_short_and_exit_nonzero(tmp_path, capsys):
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: libra.Plan.load") and "Fix:" in err
    assert main(["profile", "no_colon_here"]) == 2
    assert "SCRIPT_OR_MODULE:FACTORY" in capsys.readouterr().err
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    assert main(["plan", str(bad), "--budget", "1GiB"]) == 2
    assert "schema_version" in capsys.readouterr().err


def test_show_plot_draws_the_memory_timeline(tmp_path, capsys):
    script = tmp_path / "factory.py"
    script.write_text(FACTORY)
    prof, plan, png = tmp_path / "profile.json", tmp_path / "plan.json", tmp_path / "timeline.png"
    assert main(["profile", f"{script}:make", "-o", str(prof)]) == 0
    import libra

    # a budget that recomputes: what was live before the step (in this process, tests before this one may leave
    # tensors behind) plus half of the step's own activations
    loaded = libra.Profile.load(str(prof))
    budget = loaded.static_bytes + (loaded.eager_peak_bytes - loaded.static_bytes) // 2
    assert main(["plan", str(prof), "--budget", str(budget), "-o", str(plan)]) == 0
    assert libra.Plan.load(str(plan)).regions  # something is recomputed, so the plot has a plan to draw
    capsys.readouterr()
    assert main(["show", str(plan), "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: libra show: --plot") and "--profile" in err and "Fix:" in err and not png.exists()
    assert main(["show", str(plan), "--profile", str(prof), "--plot", str(png)]) == 0
    assert "memory timeline of" in capsys.readouterr().out
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert png.stat().st_size > 20_000 and pixels.shape[0] >= 300 and pixels.shape[1] >= 600
    assert pixels.std() > 0.05  # not a blank canvas
    from libra.testing.synthetic import chain_profile

    other = tmp_path / "other.json"
    chain_profile(4, 4).save(other)
    assert main(["show", str(plan), "--profile", str(other), "--plot", str(png)]) == 2
    assert "error: libra.memory_timeline: the plan was made from a profile" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import libra
    from libra.planner.timeline import Timeline
    from libra.plot import plot_memory_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    timeline = Timeline((1, 2, 1), (1, 1, 1), (0.0, 1.0, 2.0), 1, 2, 1)
    with pytest.raises(libra.LibraError, match=r"pip install 'libra-remat\[plot\]'"):
        plot_memory_timeline(timeline, tmp_path / "t.png")


def test_max_batch_prints_the_answer(tmp_path, capsys):
    script = tmp_path / "factory.py"
    script.write_text(FACTORY)
    plan = tmp_path / "plan.json"
    import libra
    from libra.testing import models
    from libra.units import format_bytes

    # room for batch 16 eagerly and for more with recompute, above whatever this process already holds
    model, x, y, loss_fn = models.make_mlp(batch=16, d=64, hidden=256, depth=4)
    at16 = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    del model, x, y
    budget = at16.eager_peak_bytes + 2 * at16.activation_peak_bytes
    assert main(["max-batch", f"{script}:make_batch", "--budget", str(budget), "--start", "16", "-o", str(plan)]) == 0
    captured = capsys.readouterr()
    assert f"largest batch under {format_bytes(budget)}:" in captured.out and "with Libra" in captured.out
    assert "eagerly" in captured.out and plan.exists()
    assert captured.err.count("  batch ") >= 3  # progress: one line per profiled size
    assert main(["max-batch", f"{script}:make_batch", "--budget", "100KiB", "--start", "16"]) == 2
    err = capsys.readouterr().err
    assert "error: libra.max_batch: expected batch 16 to fit" in err and "Fix:" in err
    assert main(["max-batch", "nocolon", "--budget", "1GiB"]) == 2
    assert capsys.readouterr().err.startswith("error: libra max-batch: expected SCRIPT_OR_MODULE:FACTORY")


def test_every_subcommand_has_help(capsys):
    for command in ("profile", "plan", "show", "demo", "max-batch"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert "usage: libra " + command in capsys.readouterr().out


def test_demo_trains_within_budget_and_reports_both_times(capsys):
    # a small demo: the allocator meter's peak within the budget, eager's gradients, fastest and median step times
    assert main(["demo", "--steps", "2", "--layers", "3", "--batch", "4", "--share", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "under budget: yes (the allocator's peak)" in out and "gradients identical: yes" in out
    assert "step time (fastest)" in out and "step time (median)" in out and "2 steps each, interleaved" in out
