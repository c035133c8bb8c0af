"""Offline calibration: activation profiling, predictor training, evaluation."""
