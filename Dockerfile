# fastreduce on a Gaudi PyTorch image (HPU graphs need lazy mode, hence PT_HPU_LAZY_MODE=1).
# Swap the base for any image that already has torch>=2.6 (and numpy), e.g. a CUDA one:
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime -t fastreduce .
ARG BASE_IMAGE=vault.habana.ai/gaudi-docker/1.22.0/ubuntu22.04/habanalabs/pytorch-installer-2.7.1:latest
FROM ${BASE_IMAGE}

WORKDIR /opt/fastreduce
COPY pyproject.toml README.md ./
COPY fastreduce ./fastreduce
COPY examples ./examples

# --no-deps: the image's own torch build (Habana's, CUDA's) must never be replaced.
RUN python3 -m pip install --no-cache-dir --no-deps .

ENV PT_HPU_LAZY_MODE=1
CMD ["torchrun", "--standalone", "--nproc-per-node", "8", "examples/train.py"]
