#!/usr/bin/env bash
# The GPU check (docs/cuda.md): kvserve's CUDA path end to end, everything it finds under $OUT
# (results.json, pytest.log, bench.md, steps.log, gpu_check.log). A failing step never stops it.
#
#   on the lent GPU machine:  bash scripts/gpu_check.sh            (with .gpu-check carried)
#   here, on the CPU:         bash scripts/gpu_check.sh --dry-run  (tiny models; make gpu-check)
#
# Other flags go to `python -m kvserve.benchmarks.gpu_check`: --only STEP,..., --skip STEP,...,
# --resume (keep the last run's verdicts, run the rest), --deadline-s SECONDS, --list. $OUT
# defaults to a new temporary folder; GPU_CHECK_WORK (models, bench JSON, step logs) to
# /tmp/gpu-check-work on the device (where --resume finds it) and a new temporary folder in a
# dry run; GPU_CHECK_PYTHON defaults to .venv/bin/python, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
dry_run=0
for arg in "$@"; do [ "$arg" = --dry-run ] && dry_run=1; done
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-out.XXXXXX)}
if [ "$dry_run" = 1 ]; then
    WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu-check-work.XXXXXX)}
else
    WORK=${GPU_CHECK_WORK:-/tmp/gpu-check-work}
fi
mkdir -p "$OUT" "$WORK"
PYTHON=${GPU_CHECK_PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "[gpu-check] $(date -Is) python $PYTHON; out $OUT; work $WORK; args: $*"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}

# The packages the device image lacks travel as wheels (make gpu-wheels); each is installed
# only where the image has no copy or an older one, so none of the image's own is downgraded.
wheels=.gpu-check/wheels
if [ "$dry_run" = 0 ] && compgen -G "$wheels/*.whl" >/dev/null; then
    mapfile -t needed < <("$PYTHON" -m kvserve.benchmarks.gpu_check.prepare needed "$wheels")
    if ((${#needed[@]})); then
        echo "[gpu-check] installing ${needed[*]##*/} into /tmp/site"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "${needed[@]}" || echo "[gpu-check] error: the wheels did not install"
    fi
    export PYTHONPATH=$PWD/src:/tmp/site${PYTHONPATH#"$PWD/src"}
elif [ "$dry_run" = 0 ]; then
    echo "[gpu-check] warning: no wheels in $wheels: run make gpu-wheels here and carry .gpu-check"
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# On the device nothing is cached yet; here the C kernels' cache is kept.
[ "$dry_run" = 0 ] && export HF_HOME=$WORK/hf KVSERVE_CACHE_DIR=$WORK/kvserve-cache
"$PYTHON" -m kvserve.benchmarks.gpu_check --out "$OUT" --work "$WORK" "$@"
status=$?
echo "[gpu-check] exit $status; in $OUT: $(cd "$OUT" && echo *)"
exit $status
