"""`kvferry gpu-check OUTDIR`: the GPU check's driver where kvferry is installed (scripts/gpu_check.sh runs the
same driver from a source tree, with the carried wheels)."""

from kvferry.tools.gpu_check import driver


def add_gpu_check_parser(sub) -> None:
    p = sub.add_parser(
        "gpu-check",
        help="everything that needs a CUDA GPU, in at most 7.5 minutes: kernels, graphs, benches, a real stack",
        description=driver.__doc__,
    )
    driver.add_arguments(p)
    p.set_defaults(func=driver.run)
