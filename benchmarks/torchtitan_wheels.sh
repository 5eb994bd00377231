#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels TorchTitan 0.2.2 needs that the GPU image
# (Python 3.12, torch 2.11, datasets' other needs already there) lacks: about 2 MB. A session lent
# a GPU runs this here first, then names .whl in the device tool's `carry`:
#
#   bash benchmarks/torchtitan_wheels.sh
#   run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=570)
#
# gpu_run.sh installs them into /tmp/site there. The versions are the ones tried on this CPU
# with PyPI's torch 2.11.0 and huggingface_hub 1.33.0 (the image's): TorchTitan 0.3.0 cannot be
# used, it imports torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 tomli==2.5.0 fsspec==2026.9.0
ls .whl
du -sh .whl
