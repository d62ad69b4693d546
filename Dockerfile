# swarm-client for one GPU: a one-command volunteer that survives preemption.
#
#   docker build -t swarm-client .
#   docker run --gpus all --ipc=host -p 31337:31337 -v swarm:/data \
#     -e SWARM_INITIAL_PEERS=/ip4/203.0.113.5/tcp/31337/p2p/QmBootstrapPeer swarm-client
#
# Every option is a SWARM_* variable (see docs/volunteer.md). The /data volume keeps the
# peer's identity, checkpoints and caches, so a restarted container keeps its peer id and resumes.

# PyTorch 2.5.1 with CUDA 12.4 and cuDNN 9 on Python 3.11 (conda, /opt/conda); torch is inside the
# project's range torch>=2.2,<3, so pip keeps the image's CUDA build. Any base works whose `python3` has
# pip and torch, and which has `useradd`: the test suite builds this file on a local Debian base
# (--build-arg BASE_IMAGE=...) with a CPU torch.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

# ---- builder: only the project's own wheel is built here --------------------------------------
FROM ${BASE_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY swarm ./swarm
COPY client ./client
RUN python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime ---------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SWARM_WORKDIR=/data \
    HF_HOME=/data/huggingface
COPY --from=builder /wheels /wheels
# The constraint pins torch to the base image's own build, so no second torch is downloaded.
RUN python3 -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/torch-constraint.txt /wheels/*.whl \
    && rm -rf /wheels /tmp/torch-constraint.txt \
    && swarm-client --help > /dev/null
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin swarm \
    && mkdir -p /data \
    && chown swarm:swarm /data
USER 1000:1000
WORKDIR /data
VOLUME /data
EXPOSE 31337/tcp
STOPSIGNAL SIGTERM
# The peer rewrites /data/status.json every few seconds; a stale or stuck one makes the container unhealthy.
# `swarm-client health` imports neither torch nor hivemind: it answers in a fraction of a second.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 CMD ["swarm-client", "health"]
ENTRYPOINT ["swarm-client"]
CMD ["join"]
