#!/usr/bin/env bash
# The rest of the repo suite on Qwen2.5-Coder-0.5B (issue 24), one stage after the other, about 8 hours
# of this 2-core CPU in all, each stage resumable (--resume). The three the issue's acceptance needs come first:
#
#   1. 32K, the session of bench/results/repo32k (requests), the arms it lacks: DynamicCache (if the
#      session fits the model's context), PACE on literal plans, on the probes' own prompts, and with no
#      plan plus rehydration (about 1 h);
#   2. 64K, the arms the first 64K run lacks: SnapKV and PACE with rehydration (about 2 h);
#   3. 32K, MORE_SESSIONS sessions (3: the first is stage 1's, whose records are copied), H2O, PACE
#      with the oracle plan, with prose plans and with no plan but page retrieval (pace_retrieval, added
#      after the others had played: a resumed run plays only it, about 40 min): one session is too few
#      for the sign test to tell PACE from H2O (about 1.5 h);
#   4. 64K with --tiers, the two sessions of bench/results/repo64k (rich, markdown_it): PACE with the
#      oracle plan and with prose plans, whose planned spans the budget pushed out come back from a host
#      tier before their step (about 1.5 h). H2O never restores (no plan, no rehydration), so a tier
#      changes none of its tokens: its records are copied from the 64K run without tiers, as the
#      reference of the sign test (COPY_H2O=0 plays it again, with the tier);
#   5. 128K, one session with --tiers: H2O, PACE oracle, PACE prose (about 2 h).
#
#   bash bench/run_repo.sh     # starts it in the background (nohup, niced); the log is RUNS/repo.log
#   bash bench/run_repo.sh     # again, after a stop or a kill: every stage resumes
#
# Stages 1 and 2 add arms to the earlier runs' folders (their records are kept, from RESULTS where RUNS is
# gone), so each table pairs every arm on the same sessions. Each stage's table, records and settings are
# copied to RESULTS when it ends. The variables below scale it down for a test of the same code path
# (tests/test_repo_suite.py).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-qwen2.5-coder-0.5b}
SHORT=${SHORT:-32768}
LONG=${LONG:-65536}
LONGEST=${LONGEST:-131072}
LONG_SESSIONS=${LONG_SESSIONS:-2}
MORE_SESSIONS=${MORE_SESSIONS:-3}
MORE_ARMS=${MORE_ARMS:-h2o,pace_oracle,pace_prose,pace_retrieval}
TIER_ARMS=${TIER_ARMS:-pace_oracle,pace_prose}
SHORT_ARMS=${SHORT_ARMS:-full,pace_literal,pace_probe,pace_rehydrate}
LONG_ARMS=${LONG_ARMS:-snapkv,pace_rehydrate}
LONGEST_ARMS=${LONGEST_ARMS:-h2o,pace_oracle,pace_prose}
PROBES=${PROBES:-3}
RUNS=${RUNS:-runs}
RESULTS=${RESULTS:-bench/results}
EXTRA=${EXTRA:-}
COPY_H2O=${COPY_H2O:-1}
export NICE=${NICE:-19}
PY=${PY:-.venv/bin/python}

# shellcheck source=bench/background.sh
source bench/background.sh
run_once_in_background "$RUNS/repo" "$0" "${1:-}"

# A checkout whose RUNS is gone (a new machine) starts each stage from the records that RESULTS holds, so
# that nothing that landed is played again (--resume keeps every complete pair of the log).
seed() {  # seed RUN RESULT: RESULTS/RESULT's records into RUNS/RUN, if RUNS/RUN has none
    if [ ! -s "$RUNS/$1/probes.jsonl" ] && [ -s "$RESULTS/$2/probes.jsonl" ]; then
        mkdir -p "$RUNS/$1"
        cp "$RESULTS/$2/probes.jsonl" "$RUNS/$1/"
    fi
}

stage() {  # stage RUN RESULT ARGS...: one pace-bench --suite repo run into RUNS/RUN, its table to RESULTS/RESULT
    local run=$1 result=$2
    shift 2
    seed "$run" "$result"
    echo "run_repo.sh: $(date -u +%FT%TZ) stage: $run $*"
    # shellcheck disable=SC2086  # EXTRA is a list of arguments
    "$PY" -m pace_bench --suite repo --model "$MODEL" --probes-per-kind "$PROBES" --dtype float32 --no-progress \
        --resume --out "$RUNS/$run" "$@" $EXTRA
    mkdir -p "$RESULTS/$result"
    cp "$RUNS/$run"/table.md "$RUNS/$run"/probes.jsonl "$RUNS/$run"/run.json "$RESULTS/$result"/
}

copy_arms() {  # copy_arms FROM TO ARMS: the records of ARMS (comma-separated) from RUNS/FROM, if RUNS/TO has none
    local from=$RUNS/$1/probes.jsonl to=$RUNS/$2/probes.jsonl pattern
    seed "$2" "$2"  # TO banks under its own name: what it banked wins over a fresh copy
    mkdir -p "$RUNS/$2"
    pattern=$(echo "$3" | sed 's/[^,]*/"arm": "&"/g; s/,/\\|/g')
    if [ ! -s "$to" ] && [ -s "$from" ]; then
        grep "$pattern" "$from" > "$to" || true
    fi
}

stage repo32k-v2 repo32k --tokens "$SHORT" --sessions 1 --arms "h2o,snapkv,pace_oracle,pace_prose,$SHORT_ARMS"
stage repo64k repo64k --tokens "$LONG" --sessions "$LONG_SESSIONS" --arms "h2o,pace_oracle,pace_prose,$LONG_ARMS"
copy_arms repo32k-v2 repo32k-more "$MORE_ARMS"  # the same session, the same settings: the same tokens
stage repo32k-more repo32k-more --tokens "$SHORT" --sessions "$MORE_SESSIONS" --arms "$MORE_ARMS"
if [ "$COPY_H2O" = 1 ]; then
    copy_arms repo64k repo64k-tiers h2o
fi
stage repo64k-tiers repo64k-tiers --tokens "$LONG" --sessions "$LONG_SESSIONS" --arms "h2o,$TIER_ARMS" --tiers
stage repo128k-tiers repo128k-tiers --tokens "$LONGEST" --sessions 1 --arms "$LONGEST_ARMS" --tiers
echo "run_repo.sh: $(date -u +%FT%TZ) done"
