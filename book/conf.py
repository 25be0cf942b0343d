"""Sphinx's settings for `make book` (book/website.py stages the pages it builds from).

MyST-NB reads the committed notebooks without executing them; sphinx-book-theme, the theme of
Jupyter Book 1, gives the navigation. Every asset is local: no widget scripts (book/website.py
replaces each explorer by the picture it starts from and a line), no MathJax (no page has math),
no web fonts.
"""

project = "Distributed PyTorch, hands-on"
html_show_copyright = False
author = ""  # no "By ..." in the footer either

extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["_build", "_extra", "_static"]
html_extra_path = ["_extra"]  # README's gallery: figures/*.svg, beside index.html

# The committed outputs are the lesson (nbval checks them): never run again here.
nb_execution_mode = "off"
# ipywidgets' scripts come from a CDN: none are loaded (no page holds a live widget).
nb_ipywidgets_js = {}
# Every output as committed, what a cell wrote to stderr too, and a stream's pieces as one.
nb_output_stderr = "show"
nb_merge_streams = True

myst_heading_anchors = 3  # README's links such as docs/platforms.md#gpus resolve to headings
suppress_warnings = ["myst.header"]  # notebooks open with "# 01 — title" then "## Goals": fine

html_theme = "sphinx_book_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["book.css"]
html_theme_options = {
    "use_download_button": True,  # the page's .ipynb, to run in Jupyter
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "use_issues_button": False,
    "use_edit_page_button": False,
    "show_toc_level": 2,
    "navigation_with_keys": True,
}
html_last_updated_fmt = None
html_show_sourcelink = False  # the download button offers each page's source: a lesson's .ipynb
