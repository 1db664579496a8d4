#!/usr/bin/env bash
# Long BFCL sessions, teacher-forced (issue 65; pace-bench --suite bfcl-chain), on Qwen2.5-Coder-0.5B, in
# stages, each resumable, in two one-thread processes (accelerate, CPU processes over gloo):
#
#   1. 32K-token sessions at B = 2,048: every arm, SESSIONS_32K sessions (half of them first, then half of
#      the 64K sessions, then the rest of both);
#   2. 64K-token sessions at B = 2,048: every arm, SESSIONS_64K sessions;
#   3. PACE alone at L = 32,768, the model's training context, on the same 32K sessions (B = 2,048): the
#      dev chains (seed 1) measured the limit as PACE's largest cost, and this tests it on the chains the
#      protocol plays. Its table (RESULTS/limit-32k) sets it beside the arms of stage 1:
#      python bench/bfcl_chain_plans.py RESULTS/limit-32k --ref RESULTS/32k;
#   4. PACE alone at L = 32,768 on the 64K sessions (RESULTS/limit-64k), as in 3;
#   5. the 32K sessions again at B = 4,096 (the full cache is not played again);
#   6. PACE alone at L = 32,768 on them at B = 4,096 (RESULTS/limit-32k/table-b4096.md): the first sessions
#      put PACE at L = 8,192 behind H2O there, and this tests whether the limit is why, as it was at B = 2,048;
#   7. the ablation, on the 64K sessions: H2O and SnapKV with PACE's bounded positions (positions_only,
#      snapkv_bounded, at L = 8,192), into RESULTS/64k beside the arms. Past the training context H2O and
#      SnapKV read far positions (bench/bfcl_chain_by_position.py): this says what bounding them is worth,
#      and what PACE's plan adds to its limit.
#
# On this 2-core CPU a 32K session costs about an hour for the six arms, a 64K one about two and a half:
# many sessions' work. Each stage resumes where the last one stopped, and the full cache's session in play
# from the end of its last entry saved (OUT/LENGTH/progress: its keys and values, under 1 GB at 64K).
#   bash bench/run_bfcl_chain.sh          # starts it in the background (niced); the log is OUT/run.log
#   bash bench/run_bfcl_chain.sh          # again, after a stop or a kill: every stage resumes (--resume)
#   bash bench/run_bfcl_chain.sh --bank   # copy what has been played so far to RESULTS (tables, records,
#                                         # and each length's calls by position: bench/bfcl_chain_by_position.py)
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

bank_run() {  # bank_run NAME FOLDER: OUT/NAME's table and records (a sharded run's shards merged) into RESULTS/FOLDER
    local name=$1 folder=$2
    if grep -qs . "$OUT/$name"/probes*.jsonl; then  # (cat | grep -q fails under pipefail once cat is cut off)
        "$PY" -m pace_bench --suite bfcl-chain --report --out "$OUT/$name" > /dev/null
        mkdir -p "$RESULTS/$folder"
        cat "$OUT/$name"/probes*.jsonl > "$RESULTS/$folder/probes.jsonl.new"
        mv "$RESULTS/$folder/probes.jsonl.new" "$RESULTS/$folder/probes.jsonl"
        cp "$OUT/$name"/table.md "$OUT/$name"/run.json "$RESULTS/$folder"/
    fi
}
bank() {  # every run into RESULTS; the limit's runs beside the arms they are compared with
    local length
    for length in 32k 64k; do
        bank_run "$length" "$length"
        bank_run "$length-L32768" "limit-$length/pace-L32768"
        if [ -s "$RESULTS/limit-$length/pace-L32768/probes.jsonl" ]; then
            "$PY" bench/bfcl_chain_plans.py "$RESULTS/limit-$length" --ref "$RESULTS/$length" > /dev/null
        fi
        if grep -qs '"budget": 4096' "$RESULTS/limit-$length/pace-L32768/probes.jsonl"; then
            "$PY" bench/bfcl_chain_plans.py "$RESULTS/limit-$length" --ref "$RESULTS/$length" --budget 4096 > /dev/null
        fi
    done
    # the calls past the training context (64K; its entries paired with the same ones in 32K sessions), and
    # the same split inside it as the control (32K)
    if [ -s "$RESULTS/64k/probes.jsonl" ] && [ -s "$RESULTS/32k/probes.jsonl" ]; then
        "$PY" bench/bfcl_chain_by_position.py "$RESULTS/64k" --at 32768 --inside "$RESULTS/32k" > /dev/null \
            || echo "run_bfcl_chain.sh: bench/bfcl_chain_by_position.py failed on $RESULTS/64k" >&2
    fi
    if [ -s "$RESULTS/32k/probes.jsonl" ]; then
        "$PY" bench/bfcl_chain_by_position.py "$RESULTS/32k" --at 24576 > /dev/null \
            || echo "run_bfcl_chain.sh: bench/bfcl_chain_by_position.py failed on $RESULTS/32k" >&2
    fi
}
if [ "${1:-}" = "--bank" ]; then
    bank
    echo "run_bfcl_chain.sh: $RESULTS/*/table.md hold every session played so far"
    exit 0
fi
source bench/background.sh
run_once_in_background "$OUT" "$0" "${1:-}"

stage() {  # stage NAME FOLDER TOKENS SESSIONS BUDGETS ARMS LIMIT: one run into OUT/NAME, banked in RESULTS/FOLDER
    local name=$1 folder=$2 tokens=$3 sessions=$4 budgets=$5 arms=$6 limit=$7
    mkdir -p "$OUT/$name"
    if [ ! -s "$OUT/$name/probes.jsonl" ] && [ -s "$RESULTS/$folder/probes.jsonl" ]; then
        cp "$RESULTS/$folder/probes.jsonl" "$RESULTS/$folder/run.json" "$OUT/$name/"
    fi
    echo "run_bfcl_chain.sh: $(date -u +%FT%TZ) stage: $name, $sessions sessions, B = $budgets, arms $arms, L = $limit"
    local port
    port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    OMP_NUM_THREADS=1 "$PY" -m accelerate.commands.launch --multi_gpu --num_processes "$PROCESSES" --num_machines 1 \
        --mixed_precision no --dynamo_backend no --main_process_port "$port" -m pace_bench --suite bfcl-chain \
        --model "$MODEL" --dtype "$DTYPE" --tokens "$tokens" --sessions "$sessions" --chain-seed "$SEED" \
        --arms "$arms" --budgets "$budgets" --limit "$limit" --chunk 2048 --resume --out "$OUT/$name"
    bank
}
# half of each length first, so that both lengths have results early (session j is the same whatever the
# number of sessions asked for: a stage that asks for more plays only the sessions not yet played)
stage 32k 32k 32768 $(( (SESSIONS_32K + 1) / 2 )) 2048 "$ARMS" 8192
stage 64k 64k 65536 $(( (SESSIONS_64K + 1) / 2 )) 2048 "$ARMS" 8192
stage 32k 32k 32768 "$SESSIONS_32K" 2048 "$ARMS" 8192
stage 64k 64k 65536 "$SESSIONS_64K" 2048 "$ARMS" 8192
stage 32k-L32768 limit-32k/pace-L32768 32768 "$SESSIONS_32K" 2048 pace 32768
stage 64k-L32768 limit-64k/pace-L32768 65536 "$SESSIONS_64K" 2048 pace 32768
stage 32k 32k 32768 "$SESSIONS_32K" 2048,4096 "$ARMS" 8192
stage 32k-L32768 limit-32k/pace-L32768 32768 "$SESSIONS_32K" 2048,4096 pace 32768
stage 64k 64k 65536 "$SESSIONS_64K" 2048 positions_only,snapkv_bounded 8192
echo "run_bfcl_chain.sh: $(date -u +%FT%TZ) done: $RESULTS/*/table.md"
