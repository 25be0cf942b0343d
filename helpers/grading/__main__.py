"""`python -m helpers.grading DIR`: grade a class's handed-in notebooks (helpers/grading)."""

import sys

from helpers.grading import main

if __name__ == "__main__":
    sys.exit(main())
