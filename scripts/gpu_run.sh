#!/usr/bin/env bash
# scripts/gpu_run.sh -- the prepared GPU run: each stage its own process with its own time limit,
# every log line and figure written under $OUT as it goes (a run cut short keeps what it measured).
#
#   OUT=gpu-out scripts/gpu_run.sh probe decode check int8      # the stages, in this order
#   stages: probe | decode | int8 | int8+bf16 | int4 | int4+bf16 | continuous (scripts/gpu_figures.py) | kernels (scripts/gpu_kernels.py)
#           | host (scripts/host_overhead.py: a compiled bf16 step's host work, Llama-3.1-8B's shapes, batch 1 and 16)
#           | check (python bench.py --check) | quick (python bench.py --quick) | bench (python bench.py)
#   STAGE=SECONDS overrides a stage's limit; quick:a,b and bench:a,b run only experiments a and b
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NANOINFER_PROGRESS=1   # a progress line each: a cut stage says where it was
log="$OUT/log.txt"
run() {   # run LIMIT CMD...: one stage, its output to the terminal and the log
    local limit=$1; shift
    echo "=== $(date +%T) [limit ${limit}s] $*" | tee -a "$log"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $(date +%T) exit ${PIPESTATUS[0]}" | tee -a "$log"
}
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$log"
for s in "$@"; do
    name=${s%%=*}; limit=${s#*=}; [ "$limit" = "$s" ] && limit=""
    only=""; case $name in *:*) only="--only ${name#*:}"; name=${name%%:*} ;; esac
    case $name in
        probe)  run "${limit:-60}" python3 scripts/gpu_figures.py probe --out "$OUT" ;;
        decode) run "${limit:-210}" python3 scripts/gpu_figures.py decode --out "$OUT" ;;
        int8)   run "${limit:-120}" python3 scripts/gpu_figures.py int8 --out "$OUT" ;;
        int4)   run "${limit:-150}" python3 scripts/gpu_figures.py int4 --out "$OUT" ;;
        continuous) run "${limit:-120}" python3 scripts/gpu_figures.py continuous --out "$OUT" ;;
        int8+bf16) run "${limit:-180}" python3 scripts/gpu_figures.py int8 --baseline --out "$OUT" ;;
        int4+bf16) run "${limit:-180}" python3 scripts/gpu_figures.py int4 --baseline --out "$OUT" ;;
        kernels) run "${limit:-150}" python3 scripts/gpu_kernels.py --out "$OUT" ${only:+--only ${only#--only }} ;;
        host)   run "${limit:-150}" python3 scripts/host_overhead.py --model random:llama-3.1-8b --device cuda --dtype bfloat16 --compile --batches 1 16 --steps 64 --repeat 2 ;;
        check)  run "${limit:-120}" python3 bench.py --check --json "$OUT/check.json" --no-plots ;;
        quick)  run "${limit:-300}" python3 bench.py --quick $only --json "$OUT/quick.json" --plots "$OUT/plots" ;;
        bench)  run "${limit:-600}" python3 bench.py $only --json "$OUT/bench.json" --plots "$OUT/plots" ;;
        *) echo "unknown stage $name" | tee -a "$log" ;;
    esac
done
# the device tool returns at most 8 files: the pictures travel as one archive
[ -d "$OUT/plots" ] && tar czf "$OUT/plots.tgz" -C "$OUT" plots && rm -r "$OUT/plots"
exit 0
