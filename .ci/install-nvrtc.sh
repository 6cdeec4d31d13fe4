#!/usr/bin/env bash
# Installs libnvrtc (CUDA 13.0) from the PyPI wheel `nvidia-cuda-nvrtc` into .ci-cache/nvrtc and
# points the dynamic loader at it, so that fa-cuda's NVRTC compile check really runs in CI
# (no GPU or driver is needed to compile). Meant to be *sourced* by .ci/run:
#
#     source .ci/install-nvrtc.sh
#
# Re-uses the unpacked wheel when it is already there. Exports FA_NVRTC_LIB_DIR and prepends it to
# LD_LIBRARY_PATH. Returns non-zero (without exiting the caller's shell) if the install fails.

fa_install_nvrtc() {
    local version="${FA_NVRTC_VERSION:-13.0.88}"
    local root
    root="$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
    local cache="$root/.ci-cache/nvrtc"
    local lib="$cache/nvidia/cu13/lib"
    if ! ls "$lib"/libnvrtc.so.13* >/dev/null 2>&1; then
        echo "install-nvrtc: fetching nvidia-cuda-nvrtc==$version (~90 MB)" >&2
        local tmp
        tmp="$(mktemp -d)" || return 1
        python3 -m pip download --quiet --no-deps --only-binary=:all: \
            --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_17_x86_64 --python-version 3.12 --implementation py \
            -d "$tmp" "nvidia-cuda-nvrtc==$version" || { rm -rf "$tmp"; return 1; }
        mkdir -p "$cache" || return 1
        python3 -m zipfile -e "$tmp"/nvidia_cuda_nvrtc-*.whl "$cache" || { rm -rf "$tmp"; return 1; }
        rm -rf "$tmp"
        if ! ls "$lib"/libnvrtc.so.13* >/dev/null 2>&1; then
            # Older wheel layouts put the libraries under nvidia/cuda_nvrtc/lib.
            lib="$(dirname "$(find "$cache" -name 'libnvrtc.so.*' | head -n 1)")"
        fi
    fi
    if ! ls "$lib"/libnvrtc.so.13* >/dev/null 2>&1; then
        echo "install-nvrtc: libnvrtc.so.13 not found under $cache" >&2
        return 1
    fi
    # cudarc's loader also tries the unversioned name; make sure it exists.
    [ -e "$lib/libnvrtc.so" ] || ln -s "$(basename "$(ls "$lib"/libnvrtc.so.13* | head -n 1)")" "$lib/libnvrtc.so"
    export FA_NVRTC_LIB_DIR="$lib"
    case ":${LD_LIBRARY_PATH:-}:" in
        *":$lib:"*) ;;
        *) export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
    echo "install-nvrtc: libnvrtc from $lib" >&2
}

fa_install_nvrtc
