"""Checkpoint name maps: one small module per family turns Hugging Face tensors into `Layer`s."""
