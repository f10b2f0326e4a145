"""What E2B's interpreter adds to a Python kernel's displays (``launch_kernel.py`` installs it):

- ``e2b/data``: a pandas DataFrame as ``{column: [values]}`` (``DataFrame.to_dict("list")``), up
  to ``MAX_DATA_CELLS`` cells; the SDKs' ``Result.data``;
- ``e2b/chart``: a matplotlib figure's data (type, title, axes, elements), through the
  ``e2b-charts`` package where the template has it (``python-datasci``); the SDKs' ``Result.chart``;
- a PIL image saved to a file, or shown, is displayed as well (there is no screen to show it on).

The formatters know their types by name: nothing is imported until a user's cell makes a
DataFrame or a figure. A formatter that fails adds nothing (the other formats still go out).
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import os
from typing import Any

from ipykernel.kernelapp import IPKernelApp
from IPython.core.formatters import BaseFormatter
from traitlets import ObjectName, Unicode

DATA_MIME = "e2b/data"
CHART_MIME = "e2b/chart"
MAX_DATA_CELLS = 100_000  # a bigger frame still shows its table, without its data in full


class DataFormatter(BaseFormatter):
    format_type = Unicode(DATA_MIME)
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict,)


class ChartFormatter(BaseFormatter):
    """A figure is recognised by its class's name when it is displayed: a printer registered
    for it by type does not survive in a kernel whose matplotlib runs the inline backend
    (measured in the guest: the lookup misses), as E2B's interpreter found too."""

    format_type = Unicode(CHART_MIME)
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict,)

    def __call__(self, obj: Any) -> Any:
        if self.enabled and _is_figure(obj):
            return figure_chart(obj)
        return super().__call__(obj)


def _is_figure(obj: Any) -> bool:
    """Whether ``obj`` is a matplotlib Figure (of any subclass), without importing matplotlib."""
    return any(c.__name__ == "Figure" and c.__module__ == "matplotlib.figure" for c in type(obj).__mro__)


def frame_data(frame: Any) -> dict[str, Any] | None:
    if frame.size > MAX_DATA_CELLS:
        return None
    try:
        return {str(k): [_plain(v) for v in vs] for k, vs in frame.to_dict(orient="list").items()}
    except Exception:  # a frame pandas cannot turn into lists: no data, the table still shows
        return None


def _plain(value: Any) -> Any:
    """A cell as a value JSON can carry: numpy scalars as Python's, times as ISO text, a
    missing value (NaN, NaT) as null."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if type(value).__name__ == "NaTType":
        return None
    item = getattr(value, "item", None)  # numpy's scalars (bool_, int64, float32, datetime64)
    if callable(item):
        value = item()
        if isinstance(value, (str, bool, int, float)) or value is None:
            return _plain(value)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return str(value)


def figure_chart(figure: Any) -> dict[str, Any] | None:
    try:
        from e2b_charts.main import chart_figure_to_chart
    except ImportError:  # this template has no e2b-charts: the figure shows as an image only
        return None
    if not hasattr(type(figure), "get_suptitle"):  # matplotlib < 3.8 (Debian 12's 3.6)
        type(figure).get_suptitle = _suptitle
    try:
        chart = chart_figure_to_chart(figure)
        return None if chart is None else dict(chart.model_dump(mode="json"))
    except Exception:  # a figure e2b-charts cannot read: it still shows as an image
        return None


def _suptitle(figure: Any) -> str:
    title = getattr(figure, "_suptitle", None)
    return "" if title is None else str(title.get_text())


def register(shell: Any) -> None:
    """The two formatters on ``shell``, and the PIL hooks if PIL is installed."""
    display = shell.display_formatter
    data: Any = DataFormatter(parent=display)
    chart: Any = ChartFormatter(parent=display)
    display.formatters[DATA_MIME], display.formatters[CHART_MIME] = data, chart
    data.for_type_by_name("pandas.core.frame", "DataFrame", frame_data)
    if importlib.util.find_spec("PIL") is not None:
        _hook_pil()


def _hook_pil() -> None:
    from IPython import display as ipython_display
    from PIL import Image

    display: Any = ipython_display.display

    if getattr(Image.Image.save, "_kernelhost", False):
        return
    save = Image.Image.save

    def save_and_show(self: Any, fp: Any, format: Any = None, **params: Any) -> Any:
        if isinstance(fp, (str, os.PathLike)):
            display(self)
        return save(self, fp, format, **params)

    def show(self: Any, title: Any = None) -> None:
        display(self)

    save_and_show._kernelhost = True  # type: ignore[attr-defined]
    setattr(Image.Image, "save", save_and_show)  # noqa: B010  (mypy: methods are not assigned)
    setattr(Image.Image, "show", show)  # noqa: B010


def install() -> None:
    """Register on the shell of every kernel app started from now on."""
    init_shell: Any = IPKernelApp.init_shell
    if getattr(init_shell, "_kernelhost", False):
        return

    def init_shell_and_displays(self: Any) -> None:
        init_shell(self)
        register(self.shell)

    init_shell_and_displays._kernelhost = True  # type: ignore[attr-defined]
    setattr(IPKernelApp, "init_shell", init_shell_and_displays)  # noqa: B010  (mypy: a method)
