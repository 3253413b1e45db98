#!/usr/bin/env bash
# Builds Horovod 0.28.1 for MXNet 1.9.1 (CPU, MPI from the mpich wheel; no
# TensorFlow, PyTorch or Gloo) into a virtual environment of its own, for the
# comparisons in docs/benchmarks.md. Nothing of hvdmx uses it.
#
#   bash benchmarks/horovod/build.sh [DIR]      # default DIR: /tmp/hvdmx-horovod
#
# Then DIR/venv/bin/python has horovod.mxnet, and DIR/venv/bin/mpiexec runs it:
#   python examples/scaling_benchmark.py --horovod-python DIR/venv/bin/python
#   DIR/venv/bin/mpiexec -n 2 DIR/venv/bin/python benchmarks/horovod/model_allreduce.py
# Under a minute on this project's machine once pip's cache is warm;
# HVDMX_BUILD_JOBS sets the compile jobs (default 2). DIR must be new, empty
# or made by this script: it replaces DIR/venv and DIR/src.
set -euo pipefail
dir=$(realpath -m "${1:-/tmp/hvdmx-horovod}")
jobs=${HVDMX_BUILD_JOBS:-2}
if [[ -d $dir && -n $(ls -A "$dir") && ! -e $dir/.hvdmx-horovod ]]; then
  echo "build.sh: $dir is not empty and was not made by this script; give a new directory" >&2
  exit 2
fi
mkdir -p "$dir"
touch "$dir/.hvdmx-horovod"
cd "$dir"
rm -rf venv src
python3 -m venv venv
venv/bin/pip install -q "mxnet==1.9.1" "numpy<1.24" mpich mpi4py cmake setuptools wheel \
  packaging psutil pyyaml cloudpickle
mkdir -p src
venv/bin/pip download -q --no-deps --no-binary :all: -d src horovod==0.28.1
tar -C src -xzf src/horovod-0.28.1.tar.gz
cd src/horovod-0.28.1
# MXNet 1.9.1's libmxnet.so is built with the old libstdc++ ABI and has no
# mxnet.library.compiled_with_gcc_cxx11_abi(), for which Horovod's
# FindMxnet.cmake falls back to the new ABI (1); the old one (0) matches.
sed -i "s/hasattr(mxnet.library, 'compiled_with_gcc_cxx11_abi') else 1)/hasattr(mxnet.library, 'compiled_with_gcc_cxx11_abi') else 0)/" \
  cmake/Modules/FindMxnet.cmake
grep -q "compiled_with_gcc_cxx11_abi') else 0)" cmake/Modules/FindMxnet.cmake
PATH="$dir/venv/bin:$PATH" MAKEFLAGS="-j$jobs" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
  CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 \
  HOROVOD_WITHOUT_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=MPI \
  "$dir/venv/bin/pip" install --no-build-isolation --no-cache-dir --no-deps . \
  > "$dir/build.log" 2>&1 || { tail -40 "$dir/build.log"; exit 1; }
cd "$dir"
out=$(OMP_NUM_THREADS=1 venv/bin/mpiexec -n 2 venv/bin/python -c \
  "import mxnet as mx, horovod.mxnet as hvd; hvd.init(); x = mx.nd.ones((4,)) * (hvd.rank() + 1); print(hvd.allreduce(x, op=hvd.Sum).asnumpy().tolist())")
[[ $out == $'[3.0, 3.0, 3.0, 3.0]\n[3.0, 3.0, 3.0, 3.0]' ]] || { echo "check failed: $out"; exit 1; }
echo "Horovod 0.28.1 for MXNet is in $dir/venv"
