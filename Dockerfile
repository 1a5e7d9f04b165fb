# GPU image for cloud VMs: a CUDA PyTorch base, the project's requirements in a venv that sees the
# base's torch, DeepSpeed's ops compiled in (no JIT wait on first start), ssh + pdsh for multi-node.
#
#   docker build -t dstrain .
#   docker run --gpus all --ipc=host --rm -v $PWD/runs:/workspace/dstrain/runs dstrain
#   docker run --gpus all --ipc=host --rm dstrain launch/single_node.sh --recipe recipes/llama-3.2-1b/sft.yaml
#
# BASE_IMAGE must carry CUDA's compiler (a -devel image) for the GPU ops to be built; any Debian/Ubuntu
# base works, without torch too (torch==TORCH_VERSION is then installed). The `test` stage trains the
# tiny recipe to its end inside the build: `docker build --target test .` (tests/cluster/test_docker.py).
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE} AS runtime

ARG TORCH_VERSION=2.13.0
# DeepSpeed ops compiled into the image (names as DeepSpeed's op builders call them)
ARG DS_PREBUILD_OPS="CPUAdamBuilder AsyncIOBuilder FusedAdamBuilder"
# GPU generations to compile for: A100, A10/RTX 30, L4/RTX 40, H100/H200
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
# pip settings for builds behind a mirror (passed through, not stored in the image)
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
# set (e.g. to 1): pip installs without byte-compiling every module (half the install's time; for a throwaway image
# such as the suite's: a container compiles what it imports when it imports it, at each start)
ARG NO_COMPILE

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    VIRTUAL_ENV=/opt/dstrain
ENV PATH=/opt/dstrain/bin:${PATH}

# Compilers for DeepSpeed's ops, libaio for NVMe offload, ssh + pdsh for the hostfile launcher;
# a Python only where the base has none.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential make ca-certificates libaio-dev \
      openssh-client openssh-server pdsh procps \
 && if ! command -v python3 >/dev/null; then \
      apt-get install -y --no-install-recommends python3 python3-venv python3-dev; fi \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd

WORKDIR /workspace/dstrain
COPY requirements.txt ./
RUN python3 -m venv --system-site-packages "$VIRTUAL_ENV" \
 && (python -c "import torch" 2>/dev/null || pip install ${NO_COMPILE:+--no-compile} "torch==${TORCH_VERSION}") \
 && pip install ${NO_COMPILE:+--no-compile} -r requirements.txt

# Build each op once now; at run time DeepSpeed finds it in TORCH_EXTENSIONS_DIR. Where the base has
# CUDA, build the CUDA variants even though no GPU is visible during the build.
# (the dstrain files that key each op's build directory by its build inputs come along: runs find the same ones)
COPY scripts/prebuild_ops.py scripts/
COPY dstrain/env.py dstrain/
COPY dstrain/parallel/ds_internals/ dstrain/parallel/ds_internals/
RUN DS_ACCELERATOR=$(python -c "import torch; print('cuda' if torch.version.cuda else 'cpu')") \
    PYTHONPATH=/workspace/dstrain python scripts/prebuild_ops.py ${DS_PREBUILD_OPS}

COPY . .
# docker stop sends SIGTERM to the CMD: launch/single_node.sh passes it to the ranks (checkpoint, exit 75);
# give them time to save with `docker stop -t 120`
STOPSIGNAL SIGTERM
CMD ["launch/single_node.sh"]

# Smoke test, run by the build itself: the default recipe to its last step on 2 CPU ranks (or the GPUs),
# then its evaluation loss must have fallen by half and the exported model must load. SMOKE_ARGS are more
# recipe overrides (the suite's build passes --train.max_steps=40: the full recipe is tested outside the image).
FROM runtime AS test
ARG SMOKE_ARGS=""
RUN NPROC_PER_NODE=2 OUTPUT_DIR=/tmp/smoke launch/single_node.sh --log.wandb=false --log.progress_bar=false \
      ${SMOKE_ARGS} \
 && python scripts/image_smoke_test.py /tmp/smoke
