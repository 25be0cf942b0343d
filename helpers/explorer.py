"""The lessons' explorers: sliders and choices that redraw a picture as they move (ipywidgets'
`interactive`), whose saved output also carries the picture they start from.

A live widget needs a running kernel. Read without one (on GitHub, in the book, in a handout), a
notebook shows of a widget's output only what its bundle holds besides the widget, which for
`interactive` is a line of repr. An explorer's bundle holds its first picture too, as a PNG: a
frontend that runs widgets shows the widget, which it ranks above an image; one that cannot shows
the picture. The first state is drawn once, in the kernel, and is both that image and what the
live widget shows until a control moves (its Output widget's outputs, set from the kernel rather
than captured by the frontend).
"""

import base64

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.utils.capture import capture_output
from ipywidgets.widgets.interaction import show_inline_matplotlib_plots

from helpers.drawing import PNG, figure_bundle


class Explorer(widgets.interactive):
    """`interactive(show, **controls)`, whose first call of `show` is drawn in the kernel: what it
    displays (its figures, as the inline backend draws them), then what it prints."""

    first_state: tuple | None = None  # the Output widget's outputs at the start

    def update(self, *args):
        if self.first_state is not None:
            return super().update(*args)
        self.kwargs = {widget._kwarg: widget.get_interact_value()
                       for widget in self.kwargs_widgets}
        shown_before = set(plt.get_fignums())
        with capture_output() as captured:  # under IPython: displays too, figures shown inline
            self.result = self.f(**self.kwargs)
            show_inline_matplotlib_plots()
        outputs = [{"output_type": "display_data", "data": _encoded(shown.data),
                    "metadata": shown.metadata or {}} for shown in captured.outputs]
        for number in sorted(set(plt.get_fignums()) - shown_before):  # no inline backend
            figure = plt.figure(number)
            drawn, metadata = figure_bundle(figure)
            outputs.append({"output_type": "display_data", "metadata": metadata,
                            "data": {**drawn, "text/plain": repr(figure)}})
            plt.close(figure)
        if captured.stdout:
            outputs.append({"output_type": "stream", "name": "stdout", "text": captured.stdout})
        self.first_state = tuple(outputs)
        self.out.outputs = self.first_state
        return None

    def first_picture(self) -> dict | None:
        """The first state's first figure: its output, a base64 PNG and its metadata (None if it
        drew none)."""
        return next((output for output in self.first_state if PNG in output.get("data", {})),
                    None)

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        picture = self.first_picture()
        if bundle is None or picture is None:
            return bundle
        return {**bundle, PNG: picture["data"][PNG]}, {PNG: picture["metadata"].get(PNG, {})}


def explorer(show, **controls) -> Explorer:
    """Controls (ipywidgets' sliders, dropdowns, ...) by `show`'s argument names: `show` is called
    with their values at the start and at every change, and draws (and may print) what they
    choose."""
    return Explorer(show, **controls)


def _encoded(data: dict) -> dict:
    """A display's data as a notebook stores it: images base64 text."""
    return {mime: base64.b64encode(value).decode("ascii")
            if isinstance(value, bytes) and mime.startswith("image/") else value
            for mime, value in data.items()}
