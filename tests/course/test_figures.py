"""Measured figures in images/ come from the same run as the outputs stored beside them: the cell
that shows a measured figure saves it (during ``make execute`` only) with the run's id in the
PNG, and prints that id, so a figure left over from another run is caught on a fresh clone
(file times do not survive a clone; the id does)."""

import json
import re
from pathlib import Path

import pytest

from accel.course import registry

ROOT = Path(__file__).resolve().parents[2]
# the figure argument may be a name or a call (one level of parentheses)
CALL = re.compile(r"save_measured_figure\(\s*(?:[^()]|\([^()]*\))*?,\s*[\"']([\w.]+\.png)[\"']")
SAVED = re.compile(r"measured in run (\w+); saved images/([\w.]+\.png)")


def saving_cells():
    """(chapter, figure name, the stored output text of the cell that saves it)."""
    found = []
    for nb in sorted((ROOT / "chapters").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or not CALL.search(source):
                continue
            text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
            found.extend((nb.name, name, text) for name in CALL.findall(source))
    return found


def test_some_chapters_save_measured_figures():
    assert len(saving_cells()) >= 2


@pytest.mark.parametrize("chapter,name,text", saving_cells(),
                         ids=[f"{c}:{n}" for c, n, _ in saving_cells()])
def test_a_measured_figure_comes_from_the_run_stored_beside_it(chapter, name, text):
    printed = dict((figure, run) for run, figure in SAVED.findall(text))
    assert name in printed, f"{chapter} stores no 'saved images/{name}' line: run make execute"
    stored = registry.figure_run(ROOT / "images" / name)
    assert stored == printed[name], (
        f"images/{name} was drawn in run {stored}, but {chapter} shows run {printed[name]}: "
        f"re-run `make execute NB=chapters/{chapter}` to store both from one run")


def test_every_image_is_drawn_by_code():
    """Each file in images/ is either a registered figure (``make images``) or saved by a
    chapter's measured cell; measured figures are not registered (they would drift)."""
    measured = {name for _, name, _ in saving_cells()}
    registered = set(registry.FIGURES)
    assert not measured & registered
    assert {p.name for p in (ROOT / "images").glob("*.png")} <= measured | registered


def test_figure_placement_counts_what_it_draws(four_devices):
    """One arrow per pair of devices, labelled with the tensors it carries; the title counts the
    boxes drawn (the hidden _Retval left out) and every copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accel.course import diagrams

    table = diagrams.demo_placement()
    fig = diagrams.figure_placement(table)
    ax = fig.axes[0]
    drawn = len([r for r in table if r.op_type != "_Retval"])
    assert ax.get_title() == (f"{drawn} ops drawn on 3 devices (_Retval not drawn), "
                              f"{len(table.transfers)} copies")
    assert len(table.transfers) == 3
    labels = sorted(t.get_text() for t in ax.texts if t.get_color() == "#C44E52")
    assert labels == ["a, b", "c"]  # a and b share the CPU:0 -> CPU:1 arrow
    plt.close(fig)
