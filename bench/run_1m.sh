#!/usr/bin/env bash
# The 1M-token session (issue 26 item 4): PACE, one session of seed 0 at 1,048,576 tokens on
# Qwen2.5-Coder-0.5B, with the length study's B = 2,048, H = 4,096, L = 8,192 (fp32, oracle blueprint),
# saved every CHECKPOINT_EVERY prefill chunks. It takes hours (about 4.5 h of prefill at 64 tok/s):
#
#   bash bench/run_1m.sh            # starts it in the background (nohup); the log is OUT/run.log
#   bash bench/run_1m.sh            # again, after a stop, a kill or a reboot: resumes from the last checkpoint
#
# At the end the report (tokens/s per chunk, cache memory against the full cache's estimate, checks,
# recall, residency, rotary gap) goes to RESULTS. Only one run at a time (a lock in OUT).
# The evicted KV is spilled to OUT/kv (a checkpoint indexes it), capped at SPILL_CAP_MB (least recently
# used pages go first): the oracle plan keeps its spans resident, so nothing needs the rest, and the
# uncapped spill would be about 27 GB at 1M tokens in fp32. It is deleted when the session completes.
#
# The variables below scale it down for a test of the same code path (tests/test_checkpoint.py).
set -euo pipefail
cd "$(dirname "$0")/.."

TOKENS=${TOKENS:-1048576}
MODEL=${MODEL:-qwen2.5-coder-0.5b}
BUDGET=${BUDGET:-2048}
CHUNK=${CHUNK:-4096}
LIMIT=${LIMIT:-8192}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-8}
SPILL_CAP_MB=${SPILL_CAP_MB:-1024}
OUT=${OUT:-runs/length-1m}
RESULTS=${RESULTS:-bench/results/length/1m}
EXTRA=${EXTRA:-}
NICE=${NICE:-19}  # it yields the CPU to anything run in the foreground; its chunk log records the load
export NICE
PY=${PY:-.venv/bin/python}

# shellcheck source=bench/background.sh
source bench/background.sh
run_once_in_background "$OUT" "$0" "${1:-}"
need=$(( SPILL_CAP_MB * 13 / 10 + 1024 ))  # MB: the capped spill and the checkpoints, with room to spare
free=$(df -Pm "$OUT" | awk 'NR == 2 {print $4}')
if [ -z "$(ls -A "$OUT/kv" 2>/dev/null)" ] && [ "$free" -lt "$need" ]; then
    echo "run_1m.sh: $OUT has ${free} MB free; the spilled KV needs about ${need} MB" >&2
    exit 1
fi

echo "run_1m.sh: $(date -u +%FT%TZ) start or resume: $TOKENS tokens, B=$BUDGET H=$CHUNK L=$LIMIT, checkpoint every $CHECKPOINT_EVERY chunks"
# shellcheck disable=SC2086  # EXTRA is a list of arguments
PACE_ALLOW_CODE_EVAL=1 "$PY" -m pace_bench --model "$MODEL" --arms pace --reference-arm pace --sessions 1 \
    --tokens "$TOKENS" --budget "$BUDGET" --chunk "$CHUNK" --limit "$LIMIT" --dtype float32 \
    --store disk --spill-cap-mb "$SPILL_CAP_MB" --checkpoint-every "$CHECKPOINT_EVERY" --chunk-log --no-progress --resume $EXTRA --out "$OUT"
"$PY" bench/session_1m_report.py "$OUT" --out "$RESULTS"
echo "run_1m.sh: $(date -u +%FT%TZ) done: $RESULTS/report.md"
