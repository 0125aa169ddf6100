"""Prepare TensorRT type stubs for mypy (placeholder until the tensorrt backend lands)."""
import os
import sys

os.makedirs(sys.argv[1] if len(sys.argv) > 1 else ".stubs", exist_ok=True)
