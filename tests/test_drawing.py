"""The shared drawing toolkit, and the README gallery: every lesson's key figure, regenerated here,
is byte for byte the one committed in figures/ (run `make figures` after changing a drawing)."""

import base64
import filecmp
import os

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")

from helpers import drawing
from helpers.lessons import lessons

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timelines_name_every_rank_and_every_kind_of_bar():
    events = [[("work", 0.0, 0.010), ("barrier", 0.010, 0.030)] for _ in range(4)]
    fig = drawing.plot_timelines({"work, then dist.barrier()": events})
    ax = fig.axes[0]
    assert ax.get_title() == "work, then dist.barrier(): all 4 ranks done after 30 ms"
    assert [label.get_text() for label in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["work", "barrier"]
    colors = {patch.get_facecolor() for patch in ax.patches}
    assert len(colors) == 2  # work and barrier in different colours


def test_a_figures_smallest_text_is_its_smallest_drawn_font_in_the_pngs_pixels():
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    assert drawing.smallest_text_px(fig) is None  # not drawn yet: its ticks have no labels
    ax.plot([0, 1], [0, 1], label="a line")
    ax.legend()
    ax.text(0.5, 0.5, "", fontsize=4)  # empty, and hidden: neither counts
    ax.text(0.5, 0.5, "hidden", fontsize=5).set_visible(False)
    data, metadata = drawing.figure_bundle(fig)
    # the tick labels and the legend, at the course's 11 pt: 11 * 100 / 72 px
    assert metadata == {"image/png": {drawing.SMALLEST_TEXT: 15.28}}
    assert base64.b64decode(data["image/png"]).startswith(b"\x89PNG")
    ax.text(0.2, 0.2, "small", fontsize=7.2)
    fig.set_dpi(200)
    assert drawing.smallest_text_px(fig) == 20.0  # 7.2 pt at 200 dpi
    plt.close(fig)


def test_the_gallery_shows_every_lesson_and_is_up_to_date(tmp_path):
    written = drawing.write_key_figures(str(tmp_path))
    assert [os.path.basename(path) for path in written] == [f"{lesson.stem}.svg"
                                                              for lesson in lessons()]
    with open(os.path.join(REPO, "README.md")) as readme_file:
        readme = readme_file.read()
    for path in written:
        committed = os.path.join(REPO, "figures", os.path.basename(path))
        assert filecmp.cmp(path, committed, shallow=False), f"run `make figures`: {committed}"
        assert f"figures/{os.path.basename(path)}" in readme
