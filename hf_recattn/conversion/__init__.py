"""Conversion of pretrained softmax checkpoints."""
