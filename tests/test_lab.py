"""`make lab` opens on the chapter list without JupyterLab's "fetch Jupyter news?" pop-up: the
install step puts the course's settings override where JupyterLab reads it."""

import sys
from pathlib import Path

from jupyterlab_server.settings_utils import get_settings

APP = Path(sys.prefix) / "share" / "jupyter" / "lab"
NOTIFY = "@jupyterlab/apputils-extension:notification"


def test_jupyterlab_never_asks_about_news(tmp_path):
    settings, warnings = get_settings(str(APP / "settings"), str(APP / "schemas"),
                                      str(tmp_path), schema_name=NOTIFY)
    assert warnings == [] or all(w is None for w in warnings)
    assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"
    assert settings["schema"]["properties"]["checkForUpdates"]["default"] is False
