# Sourced by the long-run scripts (run_1m.sh, run_ruler.sh): run the calling script again in the
# background, niced (NICE, default 19: it yields the CPU to anything run in the foreground), logging to
# OUT/run.log, and in the foreground hold OUT/.lock so that one run of it goes at a time.
#   source bench/background.sh; run_once_in_background "$OUT" "$0" "${1:-}"
run_once_in_background() {
    local out=$1 script=$2 mode=$3
    mkdir -p "$out"
    if [ "$mode" != "--foreground" ]; then
        nohup nice -n "${NICE:-19}" bash "$script" --foreground >> "$out/run.log" 2>&1 < /dev/null &
        echo "started in the background (pid $!); follow it with: tail -f $out/run.log"
        echo "to stop it: kill $!; to resume: bash $script again"
        exit 0
    fi
    exec 9> "$out/.lock"
    if ! flock -n 9; then
        echo "$(basename "$script"): another run holds $out/.lock; one run at a time" >&2
        exit 1
    fi
}
