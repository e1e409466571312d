"""The site's scripts and styles, all shipped inside installed packages so a built site needs no network: Plotly's
charting library (the `plotly` package's plotly.min.js) and DataTables with jQuery (the bundle the `itables` package
ships), copied once into the site's assets/ beside sdbench's own glue (site.js, site.css).

The DataTables bundle is an ES module, and browsers refuse module scripts on pages opened from the file system; its
one closing `export{...}` is therefore turned into a global (`window.sdbenchTables`) so it loads as a plain script.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

from sdbench.errors import SdbenchError

HERE = Path(__file__).parent
INSTALL = "install the site's libraries: pip install 'sdbench[site]' (or `make setup`)"
_EXPORT = re.compile(r"export\s*\{([^}]*)\}\s*;?")


def package_file(package: str, relative: str) -> Path:
    """A file inside an installed package, found without importing it; one clear error when it is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SdbenchError(f"sdbench site needs the `{package}` package: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise SdbenchError(f"sdbench site: `{package}` has no {relative} (an unexpected version?): {INSTALL}")
    return path


def check_libraries() -> None:
    """Before anything is read: the libraries the site's pages load are installed."""
    plotly_js()
    tables_js()


def plotly_js() -> Path:
    return package_file("plotly", "package_data/plotly.min.js")


def tables_js() -> Path:
    return package_file("itables", "html/dt_bundle.js")


def as_plain_script(module: str) -> str:
    """The DataTables bundle with its closing export turned into `window.sdbenchTables = {name: value, ...}`."""
    found = None
    for found in _EXPORT.finditer(module):  # the last one: the bundle's closing export (its licences follow)
        pass
    if not found:
        raise SdbenchError("sdbench site: the DataTables bundle has no closing export (an unexpected itables version?)")
    pairs = []
    for item in found.group(1).split(","):
        local, _, exported = (part.strip() for part in item.strip().partition(" as "))
        pairs.append(f"{exported or local}: {local}")
    return module[: found.start()] + "window.sdbenchTables = {" + ", ".join(pairs) + "};" + module[found.end():]


def write_assets(out: Path) -> Path:
    """assets/ under the site's folder: the libraries and sdbench's glue; returns the folder."""
    folder = out / "assets"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plotly_js(), folder / "plotly.min.js")
    tables = tables_js()
    (folder / "tables.js").write_text(as_plain_script(tables.read_text(encoding="utf-8")), encoding="utf-8")
    shutil.copyfile(tables.with_name("dt_bundle.css"), folder / "tables.css")
    for name in ("site.js", "site.css"):
        shutil.copyfile(HERE / name, folder / name)
    return folder
