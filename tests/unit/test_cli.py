"""The CLI end to end, as a new user would run it: profile -> plan -> show, and one-line errors."""

from pathlib import Path

from libra.cli.main import main

FACTORY = '''
from libra.testing import models

def make():
    model, x, y, loss_fn = models.make_mlp(batch=1024, d=64, hidden=256, depth=4)
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
    assert Path(tmp_path).exists()
