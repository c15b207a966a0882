"""How kvferry starts a Python child of its own (the GGUF converter, the compile process): this interpreter, with
this kvferry.

`python -m` and `python -c` put the working folder first on the import path, so a `kvferry/` folder there (another
checkout, or one a different user could write) would be what the child imports, while the parent, started as the
`kvferry` command, never looked there. `-P` leaves it out, and PYTHONPATH names the folder this kvferry came from,
for a parent that runs from a source tree without an install.
"""

import os
import sys
from pathlib import Path

import kvferry

PACKAGE_ROOT = str(Path(kvferry.__file__).resolve().parent.parent)


def python_command(*args: str) -> list[str]:
    return [sys.executable, "-P", *args]


def python_env() -> dict[str, str]:
    paths = [PACKAGE_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
