# DeepSeek V4 with NVFP4 weights on vLLM through our CuTeDSL kernels (B200 / H100 / H200).
#   docker build -t dsv4-nvfp4-cutedsl:vllm0.21.0 .     (or: make build)
#   docker run --gpus all --ipc=host -p 8000:8000 -v /path/to/ckpt:/model:ro -e MODEL=/model IMAGE
# Without MODEL the image generates and serves the tiny full-NVFP4 checkpoint. Each start first
# compiles vLLM's mHC kernels (~90 s) unless /root/.tilelang and /root/.cache/vllm (its DeepGEMM
# GEMM) are kept volumes, and our CuTeDSL kernels unless /root/.cache/cutedsl is; vLLM's
# torch.compile cache lives in /root/.cache/vllm too (make run keeps all three as volumes).
# The base tag must equal the vllm pin in requirements.txt (tests/test_foundation.py checks it):
# the overlay replaces two files of exactly that release.
FROM vllm/vllm-openai:v0.21.0

WORKDIR /opt/dsv4-nvfp4
# The pins the base image lacks (transformers 5.17.0 for the golden reference, pytest, ruff; the
# rest are already satisfied by the base and pip leaves them alone). One place: requirements.txt.
COPY requirements.txt ./
RUN python3 -m pip install --no-cache-dir -r requirements.txt
COPY . .
# Installs this project (editable, so `make test` runs in the container) and overlays the two
# DeepSeek V4 files; the build fails if the script refuses (vLLM version or pristine hash mismatch).
RUN PYTHON=python3 bash apply_patches.sh && PYTHON=python3 bash apply_patches.sh --check

# The compiled CuTeDSL kernels (cutedsl/jit.py): keep this folder in a volume so a restart loads
# them instead of compiling.
ENV PYTHON=python3 PORT=8000 CUTEDSL_CACHE_DIR=/root/.cache/cutedsl
EXPOSE 8000
ENTRYPOINT ["bash", "/opt/dsv4-nvfp4/scripts/serve.sh"]
