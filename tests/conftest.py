import os
import sys

# tests/workers.py is imported by name, here and in every rank (the launcher ships sys.path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
