"""Building and running the project's image with podman, on a machine without a registry or a Docker engine.

The release image is built on the pytorch/pytorch CUDA base; here the same
Dockerfile is built on a local Debian base (made with debootstrap, imported, and
given a virtualenv with the CPU torch wheel this machine has), passed as
``--build-arg BASE_IMAGE``. The facts this relies on are in the project's
container notes: runc rather than crun, lowered ulimits, ``--format docker`` (OCI
images drop HEALTHCHECK), and the host's extra CA certificates inside the base so
pip can reach the package index through the machine's proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEBIAN = "localhost/swarm-debian:bookworm"
BASE = "localhost/swarm-test-base:bookworm"
IMAGE = "localhost/swarm-client:test"
CA_DIR = Path("/usr/local/share/ca-certificates")
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
"""
BASE_CONTAINERFILE = """FROM {debian}
ENV PATH=/opt/venv/bin:$PATH PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates && python3 -m venv /opt/venv \\
    && python3 -m pip install --no-cache-dir --find-links /wheels "torch=={torch}" \\
    && python3 -c "import torch"
"""


class PodmanError(RuntimeError):
    pass


def missing() -> str | None:
    """Why the image cannot be built here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc debootstrap)"
    if shutil.which("runc") is None:
        return "runc is not installed (apt-get install runc)"
    if os.geteuid() != 0:
        return "building the test base image (debootstrap, rootful podman) needs root"
    return None


def environment() -> dict[str, str]:
    conf = Path(tempfile.gettempdir()) / "swarm-containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return dict(os.environ, CONTAINERS_CONF=str(conf))


def podman(*args: str, timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, env=environment(), **kwargs
    )
    if check and result.returncode != 0:
        raise PodmanError(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


def _torch_wheel() -> tuple[Path, str]:
    """The local CPU torch wheel (pip's find-links on this machine) and its version."""
    import torch

    version = torch.__version__
    for folder in filter(None, [os.environ.get("PIP_FIND_LINKS"), "/opt/wheels"]):
        for wheel in Path(folder).glob(f"torch-{version.replace('+', '*')}*.whl"):
            return wheel.parent, version
    raise PodmanError(f"no local wheel of torch {version} to put in the base image")


def build_debian(log=print) -> None:
    """A minimal Debian bookworm with python3 and venv, imported as DEBIAN (about 2 minutes)."""
    if shutil.which("debootstrap") is None:
        raise PodmanError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="swarm-debootstrap-") as root:
        log("debootstrap bookworm (python3, venv, ca-certificates)")
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,python3-pip,ca-certificates",
                "bookworm",
                root,
            ],
            check=True,
            capture_output=True,
            timeout=900,
        )
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            ["podman", "import", "-", DEBIAN], stdin=tar.stdout, capture_output=True, env=environment(), timeout=600
        )
        tar.wait()
        if imported.returncode != 0:
            raise PodmanError(f"podman import failed: {imported.stderr.decode()[-2000:]}")


def build_base(log=print) -> None:
    """DEBIAN plus this machine's CA certificates and a virtualenv with the local CPU torch, as BASE."""
    if not exists(DEBIAN):
        build_debian(log)
    wheels, version = _torch_wheel()
    with tempfile.TemporaryDirectory(prefix="swarm-base-") as context:
        (Path(context) / "ca").mkdir()
        for cert in CA_DIR.glob("*.crt"):
            shutil.copy(cert, Path(context) / "ca" / cert.name)
        (Path(context) / "Containerfile").write_text(BASE_CONTAINERFILE.format(debian=DEBIAN, torch=version))
        log(f"base image {BASE} (torch {version} from {wheels})")
        podman("build", "--network", "host", "-v", f"{wheels}:/wheels:ro", "-t", BASE, context, timeout=1200)


@dataclass(frozen=True)
class Built:
    image: str
    seconds: float  # the project's Dockerfile only, the base being ready
    size_bytes: int
    base_size_bytes: int


def build_image(log=print) -> Built:
    """The project's Dockerfile on BASE, tagged IMAGE."""
    if not exists(BASE):
        build_base(log)
    log(f"podman build {IMAGE} from {REPO}")
    started = time.monotonic()
    podman(
        "build",
        "--format",
        "docker",
        "--network",
        "host",
        "--build-arg",
        f"BASE_IMAGE={BASE}",
        "-t",
        IMAGE,
        str(REPO),
        timeout=1800,
    )
    seconds = time.monotonic() - started
    return Built(IMAGE, round(seconds, 1), image_size(IMAGE), image_size(BASE))


def image_size(image: str) -> int:
    return int(json.loads(podman("image", "inspect", image).stdout)[0]["Size"])


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.podman --result FILE``: build IMAGE, then write what was built, or why it was not,
    to FILE as JSON (``ok`` and the fields of ``Built``, or ``error``). The test suite runs this in the background
    from its start (``tests/image_build.py``)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        outcome = dict(ok=True, **asdict(build_image(log=lambda line: print(line, flush=True))))
    except (PodmanError, subprocess.SubprocessError, OSError) as error:
        traceback.print_exc()  # into the build's log, whose tail the waiting fixture shows
        outcome = dict(ok=False, error=f"{type(error).__name__}: {error}")
    partial = args.result.with_name(args.result.name + ".partial")
    partial.write_text(json.dumps(outcome))
    partial.replace(args.result)  # whole or absent, for a reader that polls it
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
