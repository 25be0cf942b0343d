"""helpers/explorer.py: an explorer's saved output carries the picture it starts from, which is
also what its live widget shows until a control moves; and the book shows that picture where the
widget was (book/website.py)."""

import base64
import io
import sys
from pathlib import Path

import ipywidgets as widgets
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest
from IPython.core.pylabtools import print_figure

from helpers import drawing
from helpers.explorer import PNG, explorer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "book"))
import website  # noqa: E402 - book/ is not a package


def bars(count):
    figure, axes = plt.subplots(figsize=(3, 2))
    axes.bar(range(count), range(1, count + 1))
    return figure


def pixels(png) -> np.ndarray:
    return matplotlib.image.imread(io.BytesIO(base64.b64decode(png) if isinstance(png, str)
                                              else png))


@pytest.mark.once  # the same figure drawn twice in one process: no rounding in play
def test_an_explorer_saves_its_first_picture_and_shows_it_until_a_control_moves():
    calls = []

    def show(count):
        calls.append(count)
        bars(count)
        plt.show()
        print(f"{count} bars")

    plt.close("all")
    slider = widgets.IntSlider(value=3, min=1, max=8)
    live = explorer(show, count=slider)
    bundle, metadata = live._repr_mimebundle_()
    assert set(bundle) == {"text/plain", website.WIDGET, PNG}
    # its smallest text, the tick labels at the course's font size: points at 100 dpi, in px
    assert metadata == {PNG: {drawing.SMALLEST_TEXT: round(drawing.FONT_PT * 100 / 72, 2)}}
    alone = bars(3)
    expected = pixels(print_figure(alone, "png", bbox_inches="tight"))
    plt.close(alone)
    assert np.array_equal(pixels(bundle[PNG]), expected)
    assert calls == [3]  # the first state is drawn once, for both
    assert plt.get_fignums() == []  # and its figure closed
    # until a control moves, the live widget shows that state: the picture, then what was printed
    assert [output["output_type"] for output in live.out.outputs] == ["display_data", "stream"]
    assert live.out.outputs[0]["data"][PNG] == bundle[PNG]
    assert live.out.outputs[1]["text"] == "3 bars\n"

    slider.value = 5
    assert calls == [3, 5] and live.kwargs == {"count": 5}
    assert live._repr_mimebundle_()[0][PNG] == bundle[PNG]  # what is saved is the first state
    plt.close("all")


@pytest.mark.once  # no numbers
def test_the_book_shows_an_explorers_picture_and_says_where_its_sliders_move():
    picture = base64.b64encode(b"a png").decode()
    notebook = {"metadata": {"widgets": {"state": {}}}, "cells": [{
        "cell_type": "code", "source": "widgets.schedule_explorer()",
        "outputs": [{"output_type": "display_data", "metadata": {}, "data": {
            website.WIDGET: {"model_id": "x"}, PNG: picture, "text/plain": "interactive(...)"}}]}]}
    shown = website.for_the_book(notebook)
    assert "widgets" not in shown["metadata"]
    assert [output["data"] for output in shown["cells"][0]["outputs"]] == [
        {PNG: picture, "text/plain": "the explorer's first picture"},
        {"text/markdown": website.LIVE_ONLY, "text/plain": website.LIVE_ONLY}]
