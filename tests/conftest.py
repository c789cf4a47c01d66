import os
import sys

# Tests import the harness as `tests.harness`; make the repo root importable when pytest runs
# from anywhere.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
