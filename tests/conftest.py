import os
import sys

# tests import helpers (spawn.py) from this folder
sys.path.insert(0, os.path.dirname(__file__))
