#!/usr/bin/env bash
# One lent GPU's session: hybrid layers measured on the CUDA kernels the estimate assumes, and vision encoders.
#
#   bash scripts/measure_kernels.sh            # on the GPU machine, repository root, after the preparation below
#
# The estimate of a Gated DeltaNet or Mamba-2 layer assumes flash-linear-attention, mamba_ssm's Triton SSD and
# causal_conv1d installed beside transformers (estimator.scans.scan_path; docs/activations.md). A GPU image has
# none of them and nothing can be downloaded there, so they travel in .gpu/ (ignored; prepared here, where pip
# and the source mirrors work):
#   .gpu/whl/   transformers 5.23.0, peft 0.21.2, regex wheels (the versions the estimate traces)
#   .gpu/src/   fla (fla-org/flash-linear-attention bc3b101d), mamba_ssm (state-spaces/mamba e9594ce1) and the
#               causal_conv1d Python package (Dao-AILab/causal-conv1d 0d2252d1): the commits the emulation cites
#   .gpu/cc/csrc  causal-conv1d's CUDA sources, built there for sm_90 and bf16 only (scripts/build_causal_conv1d.py)
# Steps: while causal_conv1d builds in the background, phase 4 runs once to warm Triton's compilation and
# autotuning (TRITON_CACHE_AUTOTUNING keeps its choices on disk; autotuning's benchmark runs allocate a 256 MB
# cache-flush buffer and copies that a steady step does not), then one ViT-H case measures with its allocation
# stream (and phase 5, the vision encoders, with VISION=1); then
# scripts/kernel_probe.py checks that transformers bound every kernel function of a model to its package (else
# that model is not measured: a row on the torch reference would be filed as the kernels' truth), and phases 4
# and 6 are measured with TRITON_PRINT_AUTOTUNING=1, whose log shows any autotuning that still happened. Rows: $OUT/kernels.jsonl
# ($OUT/vision.jsonl with VISION=1; $OUT/streams/*.npz) ($OUT/warm.jsonl: the warming pass, kept to compare); logs: $OUT/log.txt, $OUT/build.log.
set -u -o pipefail
: "${OUT:?set OUT to the folder the rows go to}"
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${BUDGET_S:-560}          # seconds the whole script may take; no case starts after it
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/log.txt"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TQDM_DISABLE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl >>"$OUT/log.txt" 2>&1 || { log "wheels did not install"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD/.gpu/src:/tmp/ccb:$PWD
export TRITON_CACHE_DIR=/tmp/triton TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/log.txt" 2>&1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)" >>"$OUT/log.txt" 2>&1
WHO=willitfit-team
NOTES="kernels: flash-linear-attention bc3b101d, mamba_ssm e9594ce1 (Triton), causal-conv1d 0d2252d1 (built sm_90, bf16 only); transformers 5.23.0 carried"
# fla (bc3b101d) refuses the gated GDN backward on Hopper with Triton 3.4.0-3.7.0 (wrong values, fla #640): with
# LIFT_FLA_640=1 the carried copy runs its Triton path anyway, whose allocations are those of Triton >= 3.7.1 (the
# check sits before them; only the gradients' values are wrong), and every row's notes say so
if [ "${LIFT_FLA_640:-0}" = 1 ]; then
    sed -i 's/    if g is not None and IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:/    if False:/' \
        .gpu/src/fla/ops/common/chunk_o.py
    grep -q '    if False:' .gpu/src/fla/ops/common/chunk_o.py || { log "fla's #640 check not found"; exit 5; }
    NOTES="$NOTES; fla's Hopper check (#640) lifted: gradients' values wrong, allocations as Triton >= 3.7.1"
fi
( timeout 300 python3 scripts/build_causal_conv1d.py .gpu/cc/csrc /tmp/ccb --bf16-only >"$OUT/build.log" 2>&1
  echo $? >/tmp/ccb.rc ) &
# Triton's kernels compile and autotune on first use (minutes); their keys hold no conv shape, so this pass warms
# them while causal_conv1d builds (its short convolutions run on the torch reference meanwhile: not a measurement)
log "phase 4 warming Triton's autotuning while causal_conv1d builds"
WILLITFIT_MEASURE_LOG=/tmp/warm.log python3 scripts/measure_plan.py --phases 4 --out "$OUT/warm.jsonl" \
    --stop-after 240 --timeout 240 --contributor $WHO \
    --notes "warming pass, short convolutions on the torch reference: not a measurement" 2>&1 \
    | grep -v '^measure' | tail -n 30 >>"$OUT/log.txt"
if [ "${VISION:-0}" = 1 ]; then   # phase 5 was measured on 2026-11-28 (data/measured/2026-11-28-h200.jsonl)
    log "phase 5 (vision encoders)"
    WILLITFIT_MEASURE_LOG=/tmp/vision.log python3 scripts/measure_plan.py --phases 5 --out "$OUT/vision.jsonl" \
        --stop-after 100 --timeout 120 --contributor $WHO 2>&1 | grep -v '^measure' | tail -n 40 >>"$OUT/log.txt"
fi
# the vision rows read 83-222 MB above their estimates in training: one case's allocation stream says which
# allocations (scripts/stream_diff.py against `python -m bench trace --stream` of the same case, here)
log "ViT-H/14 batch 32 with its allocation stream"
WILLITFIT_MEASURE_LOG=/tmp/vision.log python3 -m bench measure --model vit-huge-patch14 --batch 32 --seq 257 \
    --stream-dir "$OUT/streams" --out /tmp/vit.jsonl --timeout 120 2>&1 | grep -v '^measure' | tail -n 5 >>"$OUT/log.txt"
wait
log "causal_conv1d build exit $(cat /tmp/ccb.rc 2>/dev/null || echo none)"
python3 scripts/kernel_probe.py --out "$OUT/probe.json" --ok /tmp/ok.txt >/dev/null 2>>"$OUT/log.txt"
OK=$(cat /tmp/ok.txt 2>/dev/null)
if [ -z "$OK" ]; then log "no model has all its kernels: hybrid phases not measured"; exit 4; fi
log "phases 4 and 6 measured: $OK"
TRITON_PRINT_AUTOTUNING=1 WILLITFIT_MEASURE_LOG=/tmp/worker.log python3 scripts/measure_plan.py --phases 4,6 \
    --only "$OK" --out "$OUT/kernels.jsonl" --stop-after $(( $(left) - 25 )) --timeout 120 --contributor $WHO \
    --notes "$NOTES" >/tmp/measured.log 2>&1
grep -v '^measure' /tmp/measured.log | grep -v -i 'autotun' | tail -n 40 >>"$OUT/log.txt"
log "autotuning lines in the measured pass's workers: $(grep -c -i 'autotun' /tmp/worker.log)"
grep -i -m 20 'autotun' /tmp/worker.log >>"$OUT/log.txt"
for f in /tmp/warm.log /tmp/vision.log /tmp/worker.log; do
    echo "== $f (errors and warnings)"; grep -i -E 'error|warn|fall|refus' "$f" | sort | uniq -c | sort -rn | head -n 15
done >>"$OUT/log.txt" 2>&1
log "done"
