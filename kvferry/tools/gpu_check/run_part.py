"""`python -m kvferry.tools.gpu_check.run_part NAME MODULE:FUNCTION`: one part of the GPU check, in this process.

(Apart from part.py: run as __main__, that module would be loaded twice, and PartFailed raised by a part
would be another class than the one caught here.)
"""

import importlib
import os
import sys
import traceback

from kvferry.tools.gpu_check.part import Context, PartFailed, excerpt


def main(argv: list[str]) -> int:
    """argv: the part's name and its code, "module:function"."""
    name, code = argv
    module_name, function_name = code.split(":")
    ctx = Context()
    try:
        function = getattr(importlib.import_module(module_name), function_name)
        function(ctx)
    except PartFailed as exc:
        ctx.finish(False, str(exc))
        print(f"gpu-check: {name} FAILED: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:  # the report says what broke, whatever it was, and where
        formatted = traceback.format_exc()
        print(formatted, file=sys.stderr, end="", flush=True)
        ctx.finish(False, f"{type(exc).__name__}: {str(exc)[:500]}\n{excerpt(formatted)}")
        return 1
    ctx.finish(True, None)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # At once: the part's result is written, and a thread it could not stop (a hung generation loop, say) must not
    # keep this process alive until the driver's timeout kills it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
