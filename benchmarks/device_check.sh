#!/bin/bash
# The prepared run on a lent GPU (docs/benchmarks.md, "On a GPU"): `bench reference` against transformers
# on CUDA (float32 products exact?), `bench speculative` on the shipped model, and `bench throughput`'s bf16
# decode with XLA's command buffers on and off. Run from the repository root on the device machine with the
# missing wheels (pyzmq, platformdirs) in .whl/; OUT names the folder the logs and JSON go to. SCALE=small
# shrinks every run (a check of the script on the CPU: SCALE=small PY=python benchmarks/device_check.sh).
S=${SCALE:-full}
OUT=${OUT:-/tmp/devout}; mkdir -p $OUT
if [ -d .whl ] && [ "$S" = full ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
log() { echo "=== $(date +%T) $*" | tee -a $OUT/log.txt; }
run() { local t=$1; shift; log "$*"; timeout $t "$@" >> $OUT/log.txt 2>&1; echo "rc=$?" | tee -a $OUT/log.txt; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())"; } >> $OUT/log.txt 2>&1
if [ "$S" = full ]; then P=512; DT=64; R=2; NT=128; SR=3; TR=10; else P=64; DT=4; R=1; NT=8; SR=1; TR=2; fi
run 90 $PY -m serve.cli bench reference --make-small /tmp/smallhf
run 150 $PY -m serve.cli bench reference --model /tmp/smallhf --prompt-lengths $P --engine-prompt $P --decode-prompt $P --decode-tokens $DT --rounds $R --out $OUT/reference.json
run 180 $PY -m serve.cli bench speculative --batch 1 --new-tokens $NT --repeats $SR --draft-model self --out $OUT/speculative.json
for cb in default off; do
  if [ $cb = off ]; then export XLA_FLAGS="--xla_gpu_enable_command_buffer="; else unset XLA_FLAGS; fi
  run 70 $PY -m serve.cli bench throughput --config small --prompt-lengths $P --batch-sizes 1,16 --contexts $P --repeats $TR --dtype bfloat16 --out $OUT/throughput_cb_$cb.json
done
log done
