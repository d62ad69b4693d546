"""Building the image from scratch: how long each layer of the recipe takes, and how big the image is.

Removes the test images, then builds the local Debian base (debootstrap), the base
with the CPU torch wheel, and the project's Dockerfile on it, timing each
(``benchmarks/podman.py``; needs root and podman). The release image on the CUDA
base is built the same way from the same Dockerfile, minus the first two steps.

Run: ``python -m benchmarks.image`` (about 5 minutes here).
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks import podman as pm
from benchmarks.common import Stopwatch, add_common_args, finish, print_table

NAME = "image"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.image", description=__doc__.split("\n")[0])
    add_common_args(parser)
    args = parser.parse_args(argv)
    why_not = pm.missing()
    if why_not:
        raise SystemExit(f"cannot build the image here: {why_not}")
    clock = Stopwatch()
    for image in (pm.IMAGE, pm.BASE, pm.DEBIAN):
        pm.podman("rmi", "-f", image, check=False)
    steps = {}
    started = time.monotonic()
    pm.build_debian()
    steps["debootstrap and import"] = round(time.monotonic() - started, 1)
    started = time.monotonic()
    pm.build_base()
    steps["base: CA certificates, venv, CPU torch"] = round(time.monotonic() - started, 1)
    built = pm.build_image()
    steps["the project's Dockerfile"] = built.seconds
    sizes = dict(debian=pm.image_size(pm.DEBIAN), base=built.base_size_bytes, image=built.size_bytes)
    print_table("building the image with podman", ["step", "seconds"], list(steps.items()))
    print_table("sizes", ["image", "MB"], [(k, v / 1e6) for k, v in sizes.items()])
    finish(NAME, args.out, dict(seconds=steps, bytes=sizes), smoke=args.smoke, clock=clock)  # no plot: plots=[]
    return 0


if __name__ == "__main__":
    sys.exit(main())
