"""Kernels in C for the CPU, compiled on the machine that runs them (see build.py)."""
