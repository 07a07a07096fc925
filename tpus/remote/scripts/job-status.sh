#!/bin/sh
# Reports, in one run, the state of every job on this worker that the portal asks
# about or that has not ended, and the new bytes of their logs from the offsets given.
# Changes nothing.
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-job-status 1
#   max_bytes <n>                  (log bytes per job and answer, at most 1 MiB)
#   offset <job id> <bytes>        (repeated: the jobs asked about, log bytes already had)
#   tail <job id> <bytes>          (the same, but when more than max_bytes are new, the
#                                   last max_bytes of the log: a page shows its end)
#   chips <device glob>            (optional: also name every process with a chip open)
#   end
# Answers: boot_id=, lock=free|held <job>, then per job
#   job=<id> <state> pid=<pgid> boot_id=<id> started_at=<t> ended_at=<t>|- exit=<n>|-
#       signal=<NAME>|- cancel=0|1 process=alive|gone log_size=<n>
#   log=<id> <offset> <base64 of the bytes from offset>
# with <state> running, ended, lost (the worker rebooted or the supervisor died before
# the end was written), or unknown (no such job here). With a chips line, one line per
# process holding a chip (the portal's own jobs' among them, known by their cgroup):
#   holder=<device> pid=<pid> pgid=<pgid> user=<user> job=<id>|- command=<cmdline>
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL

JOBS=/var/lib/tpu-portal/jobs
HOLDER=/run/tpu-portal/holder
LOCK=/run/tpu-portal/tpu.lock
MAX_INPUT=1048576

die() {
    echo "job-status: $*" >&2
    exit 1
}

work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT
input=$work/input
head -c $((MAX_INPUT + 1)) >"$input"
[ "$(wc -c <"$input")" -le "$MAX_INPUT" ] || die "the input is larger than $MAX_INPUT bytes"
[ "$(head -n 1 "$input")" = "tpu-portal-job-status 1" ] || die "the input has no tpu-portal-job-status 1 header"
[ "$(tail -n 1 "$input")" = end ] || die "the input was cut off (no final end)"
if grep -n -v -E '^(tpu-portal-job-status 1|end|max_bytes [0-9]{1,7}|(offset|tail) [a-z0-9][a-z0-9-]{0,63} [0-9]{1,15}|chips /dev/[A-Za-z0-9/_.*?-]{1,100})$' "$input" >"$work/bad"; then
    die "line $(head -n 1 "$work/bad" | cut -d: -f1) of the input is not allowed"
fi
max=$(sed -n 's/^max_bytes //p' "$input" | head -n 1)
max=${max:-65536}
[ "$max" -le 1048576 ] || die "max_bytes is at most 1048576"
glob=$(sed -n 's/^chips //p' "$input" | head -n 1)
case $glob in
    *..*) die "the device glob must not contain '..'" ;;
esac

# Alive means: /proc/PID/stat exists, it is the same process (start time), and it is
# not a zombie (kill -0 succeeds on zombies).
alive() {
    [ -r "/proc/$1/stat" ] || return 1
    rest=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
    state=${rest%% *}
    case $state in Z | X | x | "") return 1 ;; esac
    [ "$(printf '%s' "$rest" | cut -d ' ' -f 20)" = "$2" ]
}

read -r boot </proc/sys/kernel/random/boot_id
echo "boot_id=$boot"

# The jobs asked about, then every job here that has not ended.
{
    sed -n -e 's/^offset \(.*\)/\1 from/p' -e 's/^tail \(.*\)/\1 tail/p' "$input"
    if [ -d "$JOBS" ]; then
        for dir in "$JOBS"/*/; do
            [ -d "$dir" ] || continue
            dir=${dir%/}
            [ -f "$dir/exit" ] || echo "${dir##*/} 0"
        done
    fi
} | awk '!seen[$1]++' >"$work/jobs"

while read -r job offset mode; do
    dir=$JOBS/$job
    if [ ! -d "$dir" ] || [ ! -f "$dir/started_at" ]; then
        echo "job=$job unknown"
        continue
    fi
    started=$(cat "$dir/started_at")
    job_boot=$(cat "$dir/boot_id" 2>/dev/null || echo -)
    pid=- process=gone
    if [ -f "$dir/pid" ]; then
        read -r pid pid_start <"$dir/pid"
        if [ "$job_boot" = "$boot" ] && alive "$pid" "$pid_start"; then process=alive; fi
    fi
    # The supervisor first, its exit file second: it writes the file before it ends, so
    # one seen gone has left the file if it ever will (looked at the other way round, a
    # part ending between the two looks would read as lost).
    supervising=0
    read -r sup sup_start <"$dir/supervisor" 2>/dev/null || sup=""
    if [ "$job_boot" = "$boot" ] && [ -n "$sup" ] && alive "$sup" "$sup_start"; then
        supervising=1
    fi
    ended=- code=- signal=-
    if [ -f "$dir/exit" ]; then
        state=ended
        ended=$(cat "$dir/ended_at" 2>/dev/null || echo -)
        read -r how number _ <"$dir/exit"
        if [ "$how" = signal ]; then signal=$number; else code=$number; fi
    elif [ "$supervising" = 1 ]; then
        state=running
    else
        state=lost
    fi
    cancel=0
    [ ! -f "$dir/cancel" ] || cancel=1
    size=$(stat -c %s "$dir/log")
    echo "job=$job $state pid=$pid boot_id=$job_boot started_at=$started ended_at=$ended exit=$code signal=$signal cancel=$cancel process=$process log_size=$size"
    if [ "$mode" = tail ] && [ $((size - offset)) -gt "$max" ]; then
        offset=$((size - max))
    fi
    if [ "$offset" -lt "$size" ]; then
        printf 'log=%s %s ' "$job" "$offset"
        tail -c "+$((offset + 1))" "$dir/log" | head -c "$max" | base64 -w 0
        echo
    fi
done <"$work/jobs"

# The lock after the jobs: a part writes its end only once it has let the lock go, so a
# job read as ended is never still named as the holder (looked at the other way round,
# one ending in between the two looks would read as both).
if [ -f "$LOCK" ] && ! flock -n "$LOCK" true; then
    echo "lock=held $(cat "$HOLDER" 2>/dev/null || echo unknown)"
else
    echo "lock=free"
fi

# Who has a chip open (from /proc/*/fd, as root): the same scan as the pre-flight's.
[ -n "$glob" ] || exit 0
: >"$work/chips"
for device in $glob; do
    [ ! -e "$device" ] || echo "$device" >>"$work/chips"
done
[ -s "$work/chips" ] || exit 0
find /proc/[0-9]*/fd -maxdepth 1 -type l -printf '%h %l\n' 2>/dev/null |
    awk -v self=$$ 'NR == FNR { chip[$0] = 1; next }
        { split($1, p, "/"); pid = p[3] }
        pid != self && ($2 in chip) && !(pid in seen) { seen[pid] = 1; print pid, $2 }' \
        "$work/chips" - >"$work/holders"
while read -r pid target; do
    pgid=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d ' ' -f 3)
    owner=$(stat -c %U "/proc/$pid" 2>/dev/null || echo "?")
    command=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | tr -c 'A-Za-z0-9 ._:,/()=@+~#%*-' ' ' | cut -c 1-200)
    # A portal job's process, known by its cgroup (whatever its group): root's
    # tpu-portal/job-<id>, or the scope tpu-portal-job-<id>.scope.
    in_job=-
    while IFS= read -r line; do
        case $line in
            0::*/tpu-portal/job-*) in_job=${line##*/tpu-portal/job-} ;;
            0::*/tpu-portal-job-*.scope)
                in_job=${line##*/tpu-portal-job-}
                in_job=${in_job%.scope}
                ;;
        esac
    done <"/proc/$pid/cgroup" 2>/dev/null || true
    case $in_job in
        - | *[!a-z0-9-]* | "") in_job=- ;;
    esac
    echo "holder=$target pid=$pid pgid=${pgid:-?} user=$owner job=$in_job command=${command:-?}"
done <"$work/holders"
exit 0
