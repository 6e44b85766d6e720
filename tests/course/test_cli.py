"""The course's command line (``python -m accel``) and registry: benchmarks and figures by name,
the figures a chapter measures saved only under ``make execute``, every benchmark run in one
process."""

import json
import textwrap

import pytest

from accel import __main__ as cli
from accel import viz
from accel.course import registry
from accel.procs import run_python


def test_figures_by_name(tmp_path):
    saved = registry.save_figures(tmp_path, ["02_placement.png", "01_devices.png"])
    assert all(p.exists() and p.stat().st_size > 1000 for p in saved)
    with pytest.raises(ValueError, match=r"unknown figure\(s\) \['99_nope.png'\]"):
        registry.save_figures(tmp_path, ["99_nope.png"])


def test_bench_registry_and_cli(capsys):
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        registry.get("nope")
    assert callable(registry.get("copy-cost"))
    assert cli.main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in listed] == sorted(registry.BENCHMARKS)
    assert all(line.split("\t")[1] == registry.BENCHMARKS[line.split("\t")[0]][1]
               for line in listed)
    assert cli.main(["devices"]) == 0
    assert "/device:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "nope"])
    assert exit_info.value.code == 2


def test_help_reads_as_plain_text(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "python -m accel bench NAME" in text
    assert "``" not in text and ":func:" not in text


def test_every_registered_figure_and_benchmark_resolves():
    import importlib

    for target in [*registry.FIGURES.values(), *(t for t, _ in registry.BENCHMARKS.values())]:
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_images_cli_one_figure_and_unknown_name(tmp_path, capsys):
    assert cli.main(["images", "--out", str(tmp_path), "02_placement.png"]) == 0
    assert (tmp_path / "02_placement.png").stat().st_size > 1000
    assert capsys.readouterr().out.strip().endswith("02_placement.png")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["images", "--out", str(tmp_path), "99_nope.png"])
    assert exit_info.value.code == 2


def test_measured_figures_are_saved_only_by_make_execute(tmp_path, monkeypatch):
    fig = viz.bars({"a": 1.0}, "x")
    monkeypatch.delenv("ACCEL_SAVE_FIGURES", raising=False)
    assert registry.save_measured_figure(fig, "m.png", out=tmp_path) is None
    assert not (tmp_path / "m.png").exists()
    monkeypatch.setenv("ACCEL_SAVE_FIGURES", "1")
    assert registry.save_measured_figure(fig, "m.png", out=tmp_path) == tmp_path / "m.png"
    assert (tmp_path / "m.png").stat().st_size > 1000
    assert registry.figure_run(tmp_path / "m.png") == registry.RUN_ID
    assert len(registry.RUN_ID) == 12


@pytest.mark.slow
def test_every_benchmark_runs_one_after_another_in_one_process():
    """``python -m accel bench all --quick`` runs every benchmark; the keras-towers result (the
    issue's towers-vs-MirroredStrategy goal) is checked as well: every ratio is of two step
    times of this same run, and the three contenders did the same training."""
    code = textwrap.dedent("""
        import json
        from accel.course import registry
        results, real = {}, registry.run
        def run(name, quick=False):
            results[name] = real(name, quick=quick)
            return results[name]
        registry.run = run
        from accel.__main__ import main
        main(['bench', 'all', '--quick'])
        print("RESULT " + json.dumps(results["keras-towers"], default=float))
    """)
    out = run_python(code, timeout=600, warm=True)
    ran = [line[3:] for line in out.splitlines() if line.startswith("== ")]
    assert ran == sorted(registry.BENCHMARKS)
    towers = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    variants = ("single", "towers", "mirrored")
    ratios = ("towers/mirrored_2", "towers/single_2", "mirrored/single_2")
    assert set(towers) == {*(f"{v}_2" for v in variants), *ratios, "weight_gap_2", "ceiling",
                           "warmup", "rounds", "repeat"}
    assert all(towers[f"{v}_2"] > 0 for v in variants)
    for key in ratios:
        a, b = key[:-2].split("/")
        assert towers[key] == pytest.approx(towers[f"{a}_2"] / towers[f"{b}_2"], rel=1e-12)
    assert towers["weight_gap_2"] < 1e-5
    assert "towers/mirrored" in out and "goal: towers within 1.1x" in out
