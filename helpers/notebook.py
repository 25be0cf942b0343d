"""Small conveniences for the notebooks: show a worker's source instead of copying it into a cell.

Used by notebooks/02_point_to_point.ipynb onwards.
"""

import inspect

from IPython.display import Code


def show_code(function):
    """The source of a function from `helpers`, highlighted (text/plain is the source itself)."""
    return Code(inspect.getsource(function), language="python")
