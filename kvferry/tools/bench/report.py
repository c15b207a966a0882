"""Figures printed while a benchmark runs, one line each (the final table or JSON comes after)."""

import sys


def say(args, title: str, figures: dict) -> None:
    if not args.json:
        print(f"{title}: " + ", ".join(f"{k}={v}" for k, v in figures.items() if k != "step_ms"), file=sys.stderr)
