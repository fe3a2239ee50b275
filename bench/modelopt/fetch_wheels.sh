#!/usr/bin/env bash
# Downloads (here, with network) the CPython 3.12 x86-64 wheels that Model-Optimizer (a2fbac7ba)
# and its two lanes (tests/gpu_megatron, assemble.sh's tests/gpu files) need and the GPU machine's
# image lacks, into DIR:
#   bash bench/modelopt/fetch_wheels.sh DIR
# modelopt's own dependencies (its pyproject) that the image lacks: omegaconf (and its
# antlr4-python3-runtime 4.9.*, an sdist only: built here into a pure-Python wheel), pulp,
# pydantic with its dependencies; the tests' ini (pyproject addopts) needs pytest-instafail; two
# modules import modelopt.torch.utils.plugins.megatron_preprocess_data, which imports HF datasets
# (datasets, dill, multiprocess; pyarrow, xxhash, pandas, aiohttp are in the image).
# tests/gpu: test_deepspeed.py imports deepspeed (0.19.5, an sdist only: built here with
# DS_BUILD_OPS=0 into a pure-Python wheel, as bench/deepspeed_harness.py's runs use it; of its
# needs only hjson is not in the image); test_save_ckpt_from_shards.py imports
# modelopt.torch.puzzletron, which imports hydra-core 1.3.2 (modelopt's puzzletron extra pins it),
# fire (and termcolor), immutabledict and typeguard at import.
# megatron-core 0.16.1 (the version of bench/out/megatron_full/wheels, which may be empty in a
# fresh checkout: passing both to assemble.sh is fine). The rest of what modelopt imports is in
# the image (KINDS.md): ninja, numpy, nvidia-ml-py, packaging, setuptools, torch, tqdm, PyYAML,
# regex, rich, safetensors, scipy, transformers, huggingface-hub, peft, accelerate, einops,
# torchvision.
set -euo pipefail
DIR=$1
mkdir -p "$DIR"
get() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$DIR" "$@"
}
get omegaconf==2.3.0 pulp==3.3.0 pytest-instafail==0.5.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    megatron-core==0.16.1 hjson==3.1.0 hydra-core==1.3.2 fire==0.7.1 termcolor==3.3.0 \
    immutabledict==4.3.1 typeguard==4.6.1
# antlr4-python3-runtime 4.9.3 and deepspeed have no wheel on the index: build them (pure Python)
python3 -m pip wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$DIR" deepspeed==0.19.5
ls -la "$DIR"
