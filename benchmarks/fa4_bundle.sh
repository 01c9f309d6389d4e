#!/usr/bin/env bash
# FlashAttention-4 for the lent GPU machine, which has no network and takes at most 64 MiB of files per call.
# flash-attn-4's wheels and its CuTe DSL compiler (nvidia-cutlass-dsl: a 144 MB and a 37 MB shared library) come
# to 74 MB as wheels; repacked with xz (x86 filter) they are 49.5 MB. The rest of what a preset row needs rides along,
# unpacked and repacked the same way (7 MB): pydantic and diffusers; torchao without its C++ extensions (fp8_dynamic
# runs on torch's own scaled matmuls, and torchao loads whichever extensions it finds); sageattention (the `sage`
# backend); ftfy and wcwidth (Wan's prompt cleaning in diffusers). With the repository the carry is about 65 MB.
#
#   bash benchmarks/fa4_bundle.sh pack .fa4     # here: download and repack (a few minutes of xz)
#   bash benchmarks/fa4_bundle.sh unpack .fa4 /tmp/fa4site   # there: then
#   export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/python_packages:$PWD
#
# unpack also installs any wheel copied into DIR, for a peer or test that needs one more package, as long as the
# carry still fits.
#
# Versions: flash-attn-4 4.0.0b15 with nvidia-cutlass-dsl 4.4.2 (one wheel, CUDA 12 build; it ran on the H200's
# CUDA 13 driver) and quack-kernels 0.4.1; later betas need the DSL's 4.5+ split wheels, over the limit. torchao
# 0.17.0 is the release paired with the machine's torch 2.11.
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
        typing-inspection torchao==0.17.0 sageattention==1.0.6 ftfy==6.3.1 wcwidth
    mkdir "$work/site" "$work/py"
    for w in flash_attn_4 quack_kernels nvidia_cutlass_dsl_libs_base; do unzip -q -o "$work"/$w-*.whl -d "$work/site"; done
    for w in diffusers pydantic-2 pydantic_core annotated_types typing_inspection torchao sageattention ftfy wcwidth \
        apache_tvm_ffi torch_c_dlpack_ext; do unzip -q -o "$work"/$w*.whl -d "$work/py"; done
    rm -f "$work"/py/torchao/_C*.so; rm -rf "$work"/py/torchao/_models "$work"/py/test
    xz --x86 --lzma2=preset=9e,dict=192MiB -T1 -c "$work/site/$big" > "$dir/cutlass_ir.so.xz"
    xz --x86 --lzma2=preset=9e -T1 -c "$work/site/$runtime" > "$dir/cute_dsl_runtime.so.xz"
    rm "$work/site/$big" "$work/site/$runtime"
    tar -C "$work/site" -cf - . | xz -9 > "$dir/site.tar.xz"
    tar -C "$work/py" -cf - . | xz -9e -T2 > "$dir/py.tar.xz"
    rm -rf "$work"; du -sh "$dir"
elif [ "$mode" = unpack ]; then
    site=$3; mkdir -p "$site"
    tar -C "$site" -xJf "$dir/site.tar.xz"
    tar -C "$site" -xJf "$dir/py.tar.xz"
    xz -dc "$dir/cutlass_ir.so.xz" > "$site/$big"
    xz -dc "$dir/cute_dsl_runtime.so.xz" > "$site/$runtime"  # the DSL's JIT needs it (a call without it failed)
    wheels=("$dir"/*.whl)
    if [ -e "${wheels[0]}" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}"
    fi
else
    echo "usage: $0 pack DIR | unpack DIR SITE" >&2; exit 2
fi
