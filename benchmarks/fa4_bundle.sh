#!/usr/bin/env bash
# FlashAttention-4 for the lent GPU machine, which has no network and takes at most 64 MiB of files per call.
# flash-attn-4's wheels and its CuTe DSL compiler (nvidia-cutlass-dsl: a 144 MB and a 37 MB shared library) come
# to 74 MB as wheels; repacked with xz (x86 filter) they are 54 MB, which leaves room for the repository and
# pydantic/diffusers (packed the same way, 4 MB), not for the usual .whl folder too.
#
#   bash benchmarks/fa4_bundle.sh pack .fa4     # here: download and repack (about 4 minutes of xz)
#   bash benchmarks/fa4_bundle.sh unpack .fa4 /tmp/fa4site   # there: then
#   export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/python_packages:$PWD
#
# unpack installs every wheel in DIR: the peers and tests that need cache-dit, peft or psutil get them by copying
# those wheels (from the usual .whl folder) into DIR, about 2 MB, which still fits.
#
# Versions: flash-attn-4 4.0.0b15 with nvidia-cutlass-dsl 4.4.2 (one wheel, CUDA 12 build; it ran on the H200's
# CUDA 13 driver) and quack-kernels 0.4.1; later betas need the DSL's 4.5+ split wheels, over the limit.
set -euo pipefail
mode=$1 dir=$2
big=nvidia_cutlass_dsl/python_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cpython-312-x86_64-linux-gnu.so
runtime=nvidia_cutlass_dsl/lib/libcute_dsl_runtime.so
if [ "$mode" = pack ]; then
    mkdir -p "$dir"; work=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$work" \
        flash-attn-4==4.0.0b15 quack-kernels==0.4.1 nvidia-cutlass-dsl-libs-base==4.4.2 apache-tvm-ffi==0.1.15.post2 \
        torch-c-dlpack-ext==0.1.5 diffusers==0.42.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
        typing-inspection pytest-timeout
    mkdir "$work/site" "$work/py"
    for w in flash_attn_4 quack_kernels nvidia_cutlass_dsl_libs_base; do unzip -q -o "$work"/$w-*.whl -d "$work/site"; done
    for w in diffusers pydantic-2 pydantic_core annotated_types typing_inspection; do unzip -q -o "$work"/$w*.whl -d "$work/py"; done
    xz --x86 --lzma2=preset=9e,dict=192MiB -T1 -c "$work/site/$big" > "$dir/cutlass_ir.so.xz"
    xz --x86 --lzma2=preset=9e -T1 -c "$work/site/$runtime" > "$dir/cute_dsl_runtime.so.xz"
    rm "$work/site/$big" "$work/site/$runtime"
    tar -C "$work/site" -cf - . | xz -9 > "$dir/site.tar.xz"
    tar -C "$work/py" -cf - . | xz -9e > "$dir/py.tar.xz"
    cp "$work"/apache_tvm_ffi-*.whl "$work"/torch_c_dlpack_ext-*.whl "$work"/pytest_timeout-*.whl "$dir/"
    rm -rf "$work"; du -sh "$dir"
elif [ "$mode" = unpack ]; then
    site=$3; mkdir -p "$site"
    tar -C "$site" -xJf "$dir/site.tar.xz"
    tar -C "$site" -xJf "$dir/py.tar.xz"
    xz -dc "$dir/cutlass_ir.so.xz" > "$site/$big"
    xz -dc "$dir/cute_dsl_runtime.so.xz" > "$site/$runtime"  # the DSL's JIT needs it (a call without it failed)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$dir"/*.whl
else
    echo "usage: $0 pack DIR | unpack DIR SITE" >&2; exit 2
fi
