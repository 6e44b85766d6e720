"""`make lab` opens on the chapter list without JupyterLab's "fetch Jupyter news?" pop-up: the
install step copies the course's settings override (``lab/overrides.json``) into the
environment's ``share/jupyter/lab/settings/overrides.d``, where JupyterLab reads it.

The test reads the project's file, placed where the Makefile puts it, against the schemas of
whatever JupyterLab is installed: it passes however the environment was made (``make``, or
``pip install -e ".[course,test]"`` into any virtual environment)."""

import re
import shutil
from pathlib import Path

from jupyterlab.commands import get_app_dir
from jupyterlab_server.settings_utils import get_settings

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ROOT / "lab" / "overrides.json"
NOTIFY = "@jupyterlab/apputils-extension:notification"


def installed_name() -> str:
    """The file name the Makefile gives the override inside ``overrides.d``."""
    makefile = (ROOT / "Makefile").read_text()
    settings = re.search(r"^LAB_SETTINGS\s*:=\s*\$\(VENV\)/(\S+)$", makefile, re.M)
    assert settings and settings.group(1) == "share/jupyter/lab/settings/overrides.d"
    copy = re.search(r"cp lab/overrides\.json \$\(LAB_SETTINGS\)/(\S+\.json)", makefile)
    assert copy, "the Makefile no longer copies lab/overrides.json into $(LAB_SETTINGS)"
    return copy.group(1)


def test_jupyterlab_never_asks_about_news(tmp_path):
    app_settings = tmp_path / "settings"
    (app_settings / "overrides.d").mkdir(parents=True)
    shutil.copy(OVERRIDES, app_settings / "overrides.d" / installed_name())
    schemas = Path(get_app_dir()) / "schemas"
    settings, warnings = get_settings(str(app_settings), str(schemas), str(tmp_path / "user"),
                                      schema_name=NOTIFY)
    assert warnings == [] or all(w is None for w in warnings)
    assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"
    assert settings["schema"]["properties"]["checkForUpdates"]["default"] is False


def test_without_the_override_jupyterlab_would_ask(tmp_path):
    """The check above is not vacuous: JupyterLab's own default does ask."""
    schemas = Path(get_app_dir()) / "schemas"
    settings, _ = get_settings(str(tmp_path / "empty"), str(schemas), str(tmp_path / "user"),
                               schema_name=NOTIFY)
    assert settings["schema"]["properties"]["fetchNews"]["default"] != "false"
