#!/usr/bin/env bash
# Builds llama.cpp's benchmark tools for benchmarks/vs_llamacpp.py from the source the llama-cpp-python sdist
# vendors (PyPI is reachable where GitHub may not be), and converts a posttrain HF export to GGUF at F32, BF16
# and Q8_0 with llama.cpp's own converter.
#   bash benchmarks/build_llamacpp.sh DEST [HF_DIR] [PYTHON]
# The source is pinned: llama-cpp-python LLAMACPP_PYTHON_VERSION (default below), whose vendored llama.cpp carries
# no git metadata, so DEST/llamacpp_version.json records the sdist's version and sha256 and the vendored ggml
# version; benchmarks/vs_llamacpp.py copies it into its JSON.
# Afterwards: DEST/bin/llama-batched-bench, DEST/bin/llama-bench, DEST/convert_hf_to_gguf.py (+ conversion/), DEST/gguf-py and,
# with HF_DIR, DEST/smollm2-{f32,bf16,q8_0}.gguf. PYTHON (default .venv/bin/python) needs transformers and torch
# for the conversion; the converter's own sentencepiece is installed into it. ~15 minutes on 2 cores.
set -euo pipefail
dest=$(mkdir -p "$1" && cd "$1" && pwd)
hf_dir=${2:-}
python=${3:-.venv/bin/python}
version=${LLAMACPP_PYTHON_VERSION:-0.3.36}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Only the sdist itself from source: `--no-binary :all:` would build every build dependency from source too.
"$python" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work"
sdist=$(echo "$work"/llama_cpp_python-*.tar.gz)
tar xzf "$sdist" -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
ggml_version=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$src/ggml/CMakeLists.txt" | paste -sd.)

cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$work/cmake.log"
cmake --build "$work/build" -j "$(nproc)" --target llama-batched-bench llama-bench >> "$work/cmake.log"
mkdir -p "$dest/bin"
printf '{"llama_cpp_python": "%s", "sdist_sha256": "%s", "ggml": "%s", "cmake_flags": "-DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release"}\n' \
    "$version" "$(sha256sum "$sdist" | cut -d' ' -f1)" "$ggml_version" > "$dest/llamacpp_version.json"
cp -a "$work/build/bin/." "$dest/bin/"
cp "$src/convert_hf_to_gguf.py" "$dest/"
cp -r "$src/gguf-py" "$dest/"
if [ -d "$src/conversion" ]; then  # newer converters import their model classes from this package beside them
    cp -r "$src/conversion" "$dest/"
fi

if [ -n "$hf_dir" ]; then
    "$python" -m pip install -q sentencepiece
    for precision in f32 bf16 q8_0; do
        PYTHONPATH="$dest/gguf-py" "$python" "$dest/convert_hf_to_gguf.py" "$hf_dir" \
            --outtype "$precision" --outfile "$dest/smollm2-$precision.gguf" > /dev/null
    done
fi
echo "llama.cpp tools in $dest/bin"
