#!/bin/sh
# Ends a process outside the portal that holds one of this worker's chips (the lab's
# policy on idle chips): TERM, up to the grace period for it to go, then KILL. Only the
# recorded process is signalled, and only while it still is that process (its start
# time, as job-cancel.sh checks) and still has a chip open: a pid alone may be someone
# else's by now, and a process that let the chips go is left alone. Running it again
# once the process is gone changes nothing.
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-holder-stop 1
#   pid <pid>
#   start <ticks>                  (the 22nd field of its /proc/<pid>/stat)
#   chips <device glob>            (the TPU's chips, as job-status.sh looks at them)
#   grace <seconds>                (0..600)
#   end
# Answers: stop=term|kill|gone|other|released (TERM was enough, KILL was needed, it had
# gone before, the pid is another process now, it no longer holds a chip: the last three
# signal nothing) and alive=0|1 (the process still runs).
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL

MAX_INPUT=4096

die() {
    echo "holder-stop: $*" >&2
    exit 1
}

work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT
input=$work/input
head -c $((MAX_INPUT + 1)) >"$input"
[ "$(wc -c <"$input")" -le "$MAX_INPUT" ] || die "the input is larger than $MAX_INPUT bytes"
[ "$(head -n 1 "$input")" = "tpu-portal-holder-stop 1" ] || die "the input has no tpu-portal-holder-stop 1 header"
[ "$(tail -n 1 "$input")" = end ] || die "the input was cut off (no final end)"
if grep -n -v -E '^(tpu-portal-holder-stop 1|end|pid [1-9][0-9]{0,9}|start [0-9]{1,20}|chips /dev/[A-Za-z0-9/_.*?-]{1,100}|grace [0-9]{1,3})$' "$input" >"$work/bad"; then
    die "line $(head -n 1 "$work/bad" | cut -d: -f1) of the input is not allowed"
fi
for key in pid start chips grace; do
    [ "$(grep -c "^$key " "$input")" = 1 ] || die "the input names not exactly one $key"
done
pid=$(sed -n 's/^pid //p' "$input")
start=$(sed -n 's/^start //p' "$input")
glob=$(sed -n 's/^chips //p' "$input")
grace=$(sed -n 's/^grace //p' "$input")
case $glob in
    *..*) die "the device glob must not contain '..'" ;;
esac
[ "$grace" -le 600 ] || die "the grace period is at most 600 s"

# The recorded process: its stat says the same start time, and it is not a zombie.
same_process() {
    [ -r "/proc/$pid/stat" ] || return 1
    rest=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null) || return 1
    case ${rest%% *} in Z | X | x | "") return 1 ;; esac
    [ "$(printf '%s' "$rest" | cut -d ' ' -f 20)" = "$start" ]
}
# It has one of the TPU's chips open.
holds_chip() {
    : >"$work/chips"
    for device in $glob; do
        [ ! -e "$device" ] || echo "$device" >>"$work/chips"
    done
    [ -s "$work/chips" ] || return 1
    find "/proc/$pid/fd" -maxdepth 1 -type l -printf '%l\n' 2>/dev/null |
        grep -q -x -F -f "$work/chips"
}
# Hundredths of a second since boot, from /proc/uptime, read by the shell itself.
now() {
    read -r up _ </proc/uptime
    t=${up%.*}${up#*.}
}

if [ ! -d "/proc/$pid" ]; then
    echo "stop=gone"
    echo "alive=0"
    exit 0
fi
if ! same_process; then
    echo "stop=other"
    echo "alive=0"
    exit 0
fi
if ! holds_chip; then
    echo "stop=released"
    echo "alive=1"
    exit 0
fi
kill -TERM "$pid" 2>/dev/null || true
now
deadline=$((t + grace * 100))
while same_process && [ "$t" -lt "$deadline" ]; do
    sleep 0.05
    now
done
how=term
if same_process; then
    how="kill"
    kill -KILL "$pid" 2>/dev/null || true
    now
    deadline=$((t + 500))
    while same_process && [ "$t" -lt "$deadline" ]; do
        sleep 0.02
        now
    done
fi
echo "stop=$how"
if same_process; then echo "alive=1"; else echo "alive=0"; fi
