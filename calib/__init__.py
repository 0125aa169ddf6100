"""Calibration data, TensorRT calibration caches and calibrators (worker side: Python >= 3.6)."""
