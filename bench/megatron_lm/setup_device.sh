#!/usr/bin/env bash
# Prepares a GPU machine without network to run Megatron-LM's unit-test subset (tag core_v0.16.1)
# in this folder, under torchrun and under xdist-megatron (bench/real_suite.py).
#
#   bash bench/out/megatron_lm/setup_device.sh && . bench/out/megatron_lm/env.sh
#
# 1. installs wheels/ (megatron-core 0.16.1 and pydantic with its dependencies, for CPython 3.12,
#    none of them in the image) into $TARGET, without deps and without an index, compiled as pip
#    does by default (the image turns bytecode writing off: a module without a .pyc is compiled
#    again by every process that imports it, as an installed package never is);
# 2. installs xdist-megatron from this checkout into $TARGET too (its pytest11 entry point is what
#    `-p no:xdist_megatron.plugin` and `--dist megatron` rely on);
# 3. creates /opt/data/.offline: upstream's session fixture `ensure_test_data` downloads a data set
#    unless /opt/data holds something;
# 4. writes env.sh (PYTHONPATH: $TARGET, site/ with megatron/{training,rl,legacy} of the same tag,
#    which join megatron-core's namespace package `megatron`, and this folder for `tests`,
#    `model_provider`, `gpt_builders`) and checks the imports the subset needs.
# PYTHON, TARGET, WHEELS and DATA can be overridden (a CPU rehearsal uses other wheels and data).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
PYTHON=${PYTHON:-python3}
TARGET=${TARGET:-/tmp/megatron_site}
WHEELS=${WHEELS:-$HERE/wheels}
DATA=${DATA:-/opt/data}

pip_install() {
    "$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$TARGET" "$@"
}

pip_install "$WHEELS"/*.whl
# A copy, built with the image's setuptools; the build may leave build/ and *.egg-info (ignored).
pip_install --no-build-isolation "$REPO"

mkdir -p "$DATA" && touch "$DATA/.offline"

cat >"$HERE/env.sh" <<EOF
export PYTHONPATH=$TARGET:$HERE/site:$HERE\${PYTHONPATH:+:\$PYTHONPATH}
EOF
. "$HERE/env.sh"

"$PYTHON" - <<'EOF'
"""Everything the subset imports at collection, and where it comes from."""
import importlib
from importlib import metadata

import torch

for name in ["megatron.core", "megatron.training", "megatron.rl", "megatron.legacy", "pydantic",
             "einops", "yaml", "regex", "six", "triton", "click", "requests", "packaging",
             "xdist", "execnet", "xdist_megatron.plugin", "tests.unit_tests.conftest"]:
    module = importlib.import_module(name)
    print(f"{name:28} {getattr(module, '__file__', None) or list(module.__path__)}")
print("megatron-core", metadata.version("megatron-core"), "| pytest", metadata.version("pytest"),
      "| xdist", metadata.version("pytest-xdist"), "| torch", torch.__version__,
      "| GPUs", torch.cuda.device_count())
EOF
# megatron-core builds its NCCL allocator (cpp_extension.load_inline) into its own package folder
# on first use: ~20 s that only the first run on a machine paid (test_nccl_allocator). Built here,
# so that every run of the sitting finds it built.
if "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    "$PYTHON" -c "from megatron.core import nccl_allocator; nccl_allocator._build_nccl_allocator()" \
        >/dev/null 2>&1 || echo "the NCCL allocator did not build: its first test will"
fi
echo "ready: . $HERE/env.sh; cd $HERE; python3 ../../real_suite.py tests/unit_tests --nproc 2"
