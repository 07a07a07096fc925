#!/bin/sh
# Cancels a job on this worker: TERM to its process group, a grace period, then KILL;
# then waits for its supervisor to write the end and free the TPU's lock. Cancelling a
# job that already ended, or that this worker never had, changes nothing.
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-job-cancel 1
#   job <id>
#   grace <seconds>                (0..600)
#   end
# Answers: cancel=term|kill|ended|unknown (how it ended: TERM was enough, KILL was
# needed, it had ended before, no such job) and lock=free|held.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL

JOBS=/var/lib/tpu-portal/jobs
LOCK=/run/tpu-portal/tpu.lock
MAX_INPUT=4096

die() {
    echo "job-cancel: $*" >&2
    exit 1
}

work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT
input=$work/input
head -c $((MAX_INPUT + 1)) >"$input"
[ "$(wc -c <"$input")" -le "$MAX_INPUT" ] || die "the input is larger than $MAX_INPUT bytes"
[ "$(head -n 1 "$input")" = "tpu-portal-job-cancel 1" ] || die "the input has no tpu-portal-job-cancel 1 header"
[ "$(tail -n 1 "$input")" = end ] || die "the input was cut off (no final end)"
if grep -n -v -E '^(tpu-portal-job-cancel 1|end|job [a-z0-9][a-z0-9-]{0,63}|grace [0-9]{1,3})$' "$input" >"$work/bad"; then
    die "line $(head -n 1 "$work/bad" | cut -d: -f1) of the input is not allowed"
fi
[ "$(grep -c '^job ' "$input")" = 1 ] || die "the input names not exactly one job"
job=$(sed -n 's/^job //p' "$input")
grace=$(sed -n 's/^grace //p' "$input" | head -n 1)
grace=${grace:-10}
[ "$grace" -le 600 ] || die "the grace period is at most 600 s"

lock_state() {
    if [ -f "$LOCK" ] && ! flock -n "$LOCK" true; then
        echo "lock=held"
    else
        echo "lock=free"
    fi
}

dir=$JOBS/$job
if [ ! -d "$dir" ]; then
    echo "cancel=unknown"
    lock_state
    exit 0
fi
[ -f "$dir/cancel" ] || date +%s.%N >"$dir/cancel"
if [ -f "$dir/exit" ]; then
    echo "cancel=ended"
    lock_state
    exit 0
fi

# The members of a process group that still run (zombies do not count).
group_alive() {
    cat /proc/[0-9]*/stat 2>/dev/null |
        awk -v g="$1" '{ sub(/.*\) /, ""); if ($3 == g && $1 != "Z" && $1 != "X") { found = 1 } }
                       END { exit !found }'
}
supervisor_alive() {
    [ -r "/proc/$1/stat" ] || return 1
    rest=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
    case ${rest%% *} in Z | X) return 1 ;; esac
    [ "$(printf '%s' "$rest" | cut -d ' ' -f 20)" = "$2" ]
}

# The supervisor writes pid a moment after it starts the command.
tries=0
while [ ! -f "$dir/pid" ] && [ "$tries" -lt 500 ]; do
    tries=$((tries + 1))
    sleep 0.01
done
how=term
if [ -f "$dir/pid" ]; then
    read -r pgid _ <"$dir/pid"
    if group_alive "$pgid"; then
        kill -TERM "-$pgid" 2>/dev/null || true
        ticks=$((grace * 20))
        while [ "$ticks" -gt 0 ] && group_alive "$pgid"; do
            ticks=$((ticks - 1))
            sleep 0.05
        done
        if group_alive "$pgid"; then
            how="kill"
            kill -KILL "-$pgid" 2>/dev/null || true
        fi
    fi
fi
# The supervisor notices the end, writes it, and frees the lock.
read -r sup sup_start <"$dir/supervisor" 2>/dev/null || sup=""
tries=0
while [ -n "$sup" ] && supervisor_alive "$sup" "$sup_start" && [ "$tries" -lt 200 ]; do
    tries=$((tries + 1))
    sleep 0.025
done
echo "cancel=$how"
lock_state
