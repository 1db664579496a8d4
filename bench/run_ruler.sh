#!/usr/bin/env bash
# The RULER table on Qwen2.5-Coder-0.5B (issue 25), about 14 hours of this 2-core CPU in stages, in the
# session setting (the context as tool outputs, each question a later turn answered from the saved
# state) first, one context per cell carrying NEEDLES needles (so 4 questions per NIAH cell, 1 for vt and fwe):
#
#   1. niah_single_1, niah_multikey_2 at 8K and 32K: DynamicCache, SnapKV, SnapKV with bounded positions,
#      PACE with retrieval (about 2 h);
#   2. vt, fwe at 8K and 32K, the same arms (about 1.5 h);
#   3. niah_single_1, niah_multikey_2 at 64K: the bounded arms and SnapKV alone (about 2 h);
#   4. niah_single_1 and niah_multikey_2 at 128K, the same (about 4 h);
#   5. the other arms of the issue on the NIAH tasks at 8K and 32K: H2O, StreamingLLM, and PACE given the
#      question as its plan (about 1 h);
#   6. the question-last setting (RULER's own one-question prompts, each arm compressing the prompt once,
#      in the question's forward) on the NIAH tasks, QL_SAMPLES contexts at 8K and one at 32K:
#      DynamicCache, SnapKV, SnapKV with bounded positions and PACE with the question as its plan (about
#      1.5 h: an evicting arm prefills the held prompt as DynamicCache does);
#   7. PACE with retrieval that follows links (pace_follow) on every task of stages 1-2 at 8K and 32K
#      (about 45 min);
#   8. vt with VT_SAMPLES contexts per length, pace_retrieval against pace_follow (one vt context is one
#      question; about 1 h).
#
# Stages 1-4 are what the issue's expectations compare; 5-8 come last, so they only take time left.
# The whole is about 14 hours of this CPU, several sessions: each resumes where the last one stopped.
#   bash bench/run_ruler.sh     # starts it in the background (nohup, niced); the log is OUT/run.log
#   bash bench/run_ruler.sh     # again, after a stop or a kill: every stage resumes (--resume); a
#                               # context stopped mid-prefill is prefilled again
#   bash bench/run_ruler.sh --bank   # copy what has been answered so far to RESULTS (table, figures,
#                                    # records), while a stage is still going: before a session ends
#
# Every stage writes into OUT, so OUT/table.md and the figures cover all that has been answered; each
# stage's end copies them to RESULTS. The variables below scale it down for a test of the same code path
# (tests/test_ruler.py).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-qwen2.5-coder-0.5b}
NIAH=${NIAH:-niah_single_1,niah_multikey_2}
OTHER=${OTHER:-vt,fwe}
LONGEST_TASKS=${LONGEST_TASKS:-niah_single_1,niah_multikey_2}
SHORT=${SHORT:-8192,32768}
LONG=${LONG:-65536}
LONGEST=${LONGEST:-131072}
ARMS=${ARMS:-full,snapkv,snapkv_bounded,pace_retrieval}
BOUNDED_ARMS=${BOUNDED_ARMS:-snapkv,snapkv_bounded,pace_retrieval}
MORE_ARMS=${MORE_ARMS:-h2o,streaming,pace_plan}
QUESTION_LAST_ARMS=${QUESTION_LAST_ARMS:-full,snapkv,snapkv_bounded,pace_plan}
FOLLOW_ARMS=${FOLLOW_ARMS:-pace_follow}
VT_ARMS=${VT_ARMS:-pace_retrieval,pace_follow}
VT_SAMPLES=${VT_SAMPLES:-3}
QL_SAMPLES=${QL_SAMPLES:-3}
SAMPLES=${SAMPLES:-1}
NEEDLES=${NEEDLES:-4}
OUT=${OUT:-runs/ruler}
RESULTS=${RESULTS:-bench/results/ruler}
EXTRA=${EXTRA:-}
export NICE=${NICE:-19}
PY=${PY:-.venv/bin/python}
DTYPE=${DTYPE:-float32}
# PLAN=hybrid: the hybrid-attention table (issue 39) instead of stages 1-8: the NIAH tasks at SHORT's first
# length with HYBRID_SAMPLES contexts, then at its second with one, with ARMS; e.g. on Gemma 3 270M:
#   PLAN=hybrid MODEL=gemma3-270m ARMS=full,h2o,snapkv,pace_retrieval DTYPE=auto \
#   EXTRA="--budget 1024 --limit 4096 --chunk 2048" OUT=runs/ruler_gemma3 RESULTS=bench/results/ruler_gemma3 \
#   bash bench/run_ruler.sh
PLAN=${PLAN:-all}
HYBRID_SAMPLES=${HYBRID_SAMPLES:-2}

bank() {  # OUT's table, figures and records (every question answered so far) into RESULTS
    mkdir -p "$RESULTS"
    cp "$OUT"/table.md "$OUT"/probes.jsonl "$OUT"/ruler_*.png "$RESULTS"/
}
if [ "${1:-}" = "--bank" ]; then
    "$PY" -m pace_bench --suite ruler --report --out "$OUT" > /dev/null
    bank
    echo "run_ruler.sh: $RESULTS/table.md holds every question answered so far"
    exit 0
fi
# shellcheck source=bench/background.sh
source bench/background.sh
run_once_in_background "$OUT" "$0" "${1:-}"

stage() {  # stage SETTING ARGS... (a --samples among ARGS wins over SAMPLES)
    local setting=$1
    shift
    echo "run_ruler.sh: $(date -u +%FT%TZ) stage: $setting $*"
    # shellcheck disable=SC2086  # EXTRA is a list of arguments
    "$PY" -m pace_bench --suite ruler --model "$MODEL" --settings "$setting" --samples "$SAMPLES" --needles "$NEEDLES" \
        --dtype "$DTYPE" --no-progress --resume --out "$OUT" "$@" $EXTRA
    bank
}
# A checkout whose OUT is gone (a new machine) starts from the records that RESULTS holds: --resume keeps
# them, so nothing that landed is answered again.
if [ ! -s "$OUT/probes.jsonl" ] && [ -s "$RESULTS/probes.jsonl" ]; then
    cp "$RESULTS/probes.jsonl" "$OUT/"
fi
if [ "$PLAN" = "hybrid" ]; then
    stage session --tasks "$NIAH" --lengths "${SHORT%%,*}" --arms "$ARMS" --samples "$HYBRID_SAMPLES"
    stage session --tasks "$NIAH" --lengths "${SHORT#*,}" --arms "$ARMS" --samples 1
    echo "run_ruler.sh: $(date -u +%FT%TZ) done: $RESULTS/table.md"
    exit 0
fi
stage session --tasks "$NIAH" --lengths "$SHORT" --arms "$ARMS"
stage session --tasks "$OTHER" --lengths "$SHORT" --arms "$ARMS"
stage session --tasks "$NIAH" --lengths "$LONG" --arms "$BOUNDED_ARMS"
stage session --tasks "$LONGEST_TASKS" --lengths "$LONGEST" --arms "$BOUNDED_ARMS"
stage session --tasks "$NIAH" --lengths "$SHORT" --arms "$MORE_ARMS"
stage question_last --tasks "$NIAH" --lengths "${SHORT%%,*}" --arms "$QUESTION_LAST_ARMS" --samples "$QL_SAMPLES"
stage question_last --tasks "$NIAH" --lengths "${SHORT#*,}" --arms "$QUESTION_LAST_ARMS"
stage session --tasks "$NIAH,$OTHER" --lengths "$SHORT" --arms "$FOLLOW_ARMS"
stage session --tasks vt --lengths "$SHORT" --arms "$VT_ARMS" --samples "$VT_SAMPLES"
echo "run_ruler.sh: $(date -u +%FT%TZ) done: $RESULTS/table.md"
