import os
import sys

# tests import helper modules (loops.py) that live beside them
sys.path.insert(0, os.path.dirname(__file__))
