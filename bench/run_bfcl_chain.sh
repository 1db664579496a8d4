#!/usr/bin/env bash
# Long BFCL sessions, teacher-forced (issue 65; pace-bench --suite bfcl-chain), on Qwen2.5-Coder-0.5B, in
# stages, each resumable, in two one-thread processes (accelerate, CPU processes over gloo):
#
#   1. 32K-token sessions at B = 2,048: every arm, SESSIONS_32K sessions (half of them first, then half of
#      the 64K sessions, then the rest of both);
#   2. 64K-token sessions at B = 2,048: every arm, SESSIONS_64K sessions;
#   3. the 32K sessions again at B = 4,096 (the full cache is not played again).
#
# On this 2-core CPU a 32K session costs about an hour for the six arms, a 64K one about two and a half:
# many sessions' work. Each stage resumes where the last one stopped, and the full cache's session in play
# from the end of its last entry saved (OUT/LENGTH/progress: its keys and values, under 1 GB at 64K).
#   bash bench/run_bfcl_chain.sh          # starts it in the background (niced); the log is OUT/run.log
#   bash bench/run_bfcl_chain.sh          # again, after a stop or a kill: every stage resumes (--resume)
#   bash bench/run_bfcl_chain.sh --bank   # copy what has been played so far to RESULTS (tables, records)
#
# RESULTS holds the records, so a new checkout resumes from them: a stage's OUT starts from RESULTS' records.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-qwen2.5-coder-0.5b}
ARMS=${ARMS:-full,h2o,pace,snapkv,streaming,pace_retrieval}
SESSIONS_32K=${SESSIONS_32K:-12}
SESSIONS_64K=${SESSIONS_64K:-6}
SEED=${SEED:-0}
DTYPE=${DTYPE:-auto}
PROCESSES=${PROCESSES:-2}
OUT=${OUT:-runs/bfcl_chain}
RESULTS=${RESULTS:-bench/results/bfcl_chain}
export NICE=${NICE:-10}
PY=${PY:-.venv/bin/python}

bank() {  # each length's table and records (a sharded run's shards merged) into RESULTS
    local length
    for length in 32k 64k; do
        if grep -qs . "$OUT/$length"/probes*.jsonl; then  # (cat | grep -q fails under pipefail once cat is cut off)
            "$PY" -m pace_bench --suite bfcl-chain --report --out "$OUT/$length" > /dev/null
            mkdir -p "$RESULTS/$length"
            cat "$OUT/$length"/probes*.jsonl > "$RESULTS/$length/probes.jsonl.new"
            mv "$RESULTS/$length/probes.jsonl.new" "$RESULTS/$length/probes.jsonl"
            cp "$OUT/$length"/table.md "$OUT/$length"/run.json "$RESULTS/$length"/
        fi
    done
}
if [ "${1:-}" = "--bank" ]; then
    bank
    echo "run_bfcl_chain.sh: $RESULTS/*/table.md hold every session played so far"
    exit 0
fi
source bench/background.sh
run_once_in_background "$OUT" "$0" "${1:-}"

stage() {  # stage LENGTH TOKENS SESSIONS BUDGETS
    local length=$1 tokens=$2 sessions=$3 budgets=$4
    mkdir -p "$OUT/$length"
    if [ ! -s "$OUT/$length/probes.jsonl" ] && [ -s "$RESULTS/$length/probes.jsonl" ]; then
        cp "$RESULTS/$length/probes.jsonl" "$RESULTS/$length/run.json" "$OUT/$length/"
    fi
    echo "run_bfcl_chain.sh: $(date -u +%FT%TZ) stage: $length, $sessions sessions, B = $budgets"
    local port
    port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    OMP_NUM_THREADS=1 "$PY" -m accelerate.commands.launch --multi_gpu --num_processes "$PROCESSES" --num_machines 1 \
        --mixed_precision no --dynamo_backend no --main_process_port "$port" -m pace_bench --suite bfcl-chain \
        --model "$MODEL" --dtype "$DTYPE" --tokens "$tokens" --sessions "$sessions" --chain-seed "$SEED" \
        --arms "$ARMS" --budgets "$budgets" --limit 8192 --chunk 2048 --resume --out "$OUT/$length"
    bank
}
# half of each length first, so that both lengths have results early (session j is the same whatever the
# number of sessions asked for: a stage that asks for more plays only the sessions not yet played)
stage 32k 32768 $(( (SESSIONS_32K + 1) / 2 )) 2048
stage 64k 65536 $(( (SESSIONS_64K + 1) / 2 )) 2048
stage 32k 32768 "$SESSIONS_32K" 2048
stage 64k 65536 "$SESSIONS_64K" 2048
stage 32k 32768 "$SESSIONS_32K" 2048,4096
echo "run_bfcl_chain.sh: $(date -u +%FT%TZ) done: $RESULTS/*/table.md"
