#!/usr/bin/env bash
# Ray for the lent GPU machine, which has no network and takes at most 64 MiB of files per call. Ray's wheel is
# 79 MB, most of it Java (ray/jars) and libraries the rollout engine never imports (RLlib, Serve, Data, Train, Tune,
# the dashboard's web client). Without them, and repacked with xz, Ray comes to about 30 MB; with the usual .whl
# folder's wheels (diffusers, pydantic, peft, torchao: packed the same way) the whole bundle leaves room for the
# repository. jsonschema and its three helpers are the only requirements of Ray's that the machine's image lacks;
# ftfy (and its wcwidth) is omnispec's own, which Wan's prompt cleaning in diffusers needs (without it diffusers
# fails with a NameError on ftfy).
#
#   bash benchmarks/ray_bundle.sh pack .ray             # here: download and repack (a few minutes of xz)
#   bash benchmarks/ray_bundle.sh unpack .ray /tmp/site # there, then: export PYTHONPATH=/tmp/site:$PWD
#
# PYTHON_VERSION=3.11 packs for a local python 3.11 instead, to check the trimmed package here before a call.
set -euo pipefail
mode=$1 dir=$2
py=${PYTHON_VERSION:-3.12}
if [ "$mode" = pack ]; then
    mkdir -p "$dir"; work=$(mktemp -d)
    get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$work" "$@" 2>&1 | grep -v 'is ignored' || true; }
    get ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py \
        diffusers==0.42.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection peft==0.21.2 \
        torchao==0.17.0 ftfy==6.3.1 wcwidth
    mkdir "$work/site"
    for w in "$work"/*.whl; do unzip -q -o "$w" -d "$work/site"; done
    (cd "$work/site/ray" && rm -rf jars rllib serve data train tune llm dashboard/client)
    tar -C "$work/site" -cf - . | xz -9e -T1 > "$dir/site.tar.xz"
    rm -rf "$work"; du -sh "$dir"
elif [ "$mode" = unpack ]; then
    site=$3; mkdir -p "$site"
    tar -C "$site" -xJf "$dir/site.tar.xz"
else
    echo "usage: $0 pack DIR | unpack DIR SITE" >&2; exit 2
fi
