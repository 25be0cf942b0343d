"""Lesson 13 (work in progress, on branch lesson-13): real model sizes on fake ranks, and
PyTorch's own accounting of memory and communication, checked against real runs."""
