"""Structured output on the worker side: constraints compiled with xgrammar, and each sequence's matcher."""
