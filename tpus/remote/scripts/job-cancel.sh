#!/bin/sh
# Cancels a job on this worker: TERM to every process of its cgroup, up to the grace
# period for the cgroup to empty, then KILL to the whole cgroup (cgroup.kill); returns
# once the cgroup is empty (or says it is not), after its supervisor wrote the end and
# freed the TPU's lock. Cancelling a job that already ended, or that this worker never
# had, changes nothing; nor does cancelling a job of an earlier boot (its processes went
# with that boot, and whatever has its old pid now is someone else's).
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-job-cancel 1
#   job <id>
#   grace <seconds>                (0..600)
#   end
# Answers: cancel=term|kill|ended|lost|unknown (how it ended: TERM was enough, KILL was
# needed, it had ended before, it went with an earlier boot, no such job), empty=1|0
# (nothing of the job runs any more) and lock=free|held.
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
# Hundredths of a second since boot, from /proc/uptime, read by the shell itself.
now() {
    read -r up _ </proc/uptime
    t=${up%.*}${up#*.}
}
populated() {
    [ -f "$1/cgroup.events" ] || return 1
    while read -r key value; do
        if [ "$key" = populated ]; then
            [ "$value" = 1 ]
            return
        fi
    done <"$1/cgroup.events"
    return 1
}
kill_cgroup() {
    # A kernel may refuse the write to cgroup.kill for a cgroup busy with forks at its
    # pids limit (EIO): then the freeze and the KILL of each process below do it. The
    # supervisor removes the cgroup as soon as it empties, which may be at any step here:
    # a cgroup that is gone has nothing left to kill or to thaw.
    if [ -f "$1/cgroup.kill" ] && { echo 1 >"$1/cgroup.kill"; } 2>/dev/null; then
        :
    elif [ -f "$1/cgroup.freeze" ] && { echo 1 >"$1/cgroup.freeze"; } 2>/dev/null; then
        # Frozen, nothing forks between the list and the KILL (a second at most).
        frozen=0 tries=0
        while [ "$frozen" = 0 ] && [ "$tries" -lt 50 ]; do
            { while read -r key value; do
                [ "$key" != frozen ] || frozen=$value
            done <"$1/cgroup.events"; } 2>/dev/null || return 0
            tries=$((tries + 1))
            [ "$frozen" = 1 ] || sleep 0.02
        done
        xargs -r kill -KILL <"$1/cgroup.procs" 2>/dev/null || true
        { echo 0 >"$1/cgroup.freeze"; } 2>/dev/null || true
    else
        xargs -r kill -KILL <"$1/cgroup.procs" 2>/dev/null || true
    fi
}
# A process is the one recorded when its start time (the 22nd field of its stat) is
# the recorded one, and it is not a zombie: a pid alone may be someone else's by now.
same_process() {
    [ -r "/proc/$1/stat" ] || return 1
    rest=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
    case ${rest%% *} in Z | X) return 1 ;; esac
    [ "$(printf '%s' "$rest" | cut -d ' ' -f 20)" = "$2" ]
}
# The members of a process group that still run (zombies do not count).
group_alive() {
    cat /proc/[0-9]*/stat 2>/dev/null |
        awk -v g="$1" '{ sub(/.*\) /, ""); if ($3 == g && $1 != "Z" && $1 != "X") { found = 1 } }
                       END { exit !found }'
}

dir=$JOBS/$job
if [ ! -d "$dir" ]; then
    echo "cancel=unknown"
    echo "empty=1"
    lock_state
    exit 0
fi
[ -f "$dir/cancel" ] || date +%s.%N >"$dir/cancel"
if [ -f "$dir/exit" ]; then
    echo "cancel=ended"
    echo "empty=1"
    lock_state
    exit 0
fi

# The supervisor writes the boot id as it starts, and the cgroup and pid a moment
# after it starts the command.
tries=0
while [ ! -f "$dir/pid" ] && [ "$tries" -lt 500 ]; do
    tries=$((tries + 1))
    sleep 0.01
done
read -r boot </proc/sys/kernel/random/boot_id
read -r job_boot <"$dir/boot_id" 2>/dev/null || job_boot=""
if [ "$job_boot" != "$boot" ]; then
    # Of an earlier boot (or never started): nothing of it runs; signal nothing.
    echo "cancel=lost"
    echo "empty=1"
    lock_state
    exit 0
fi

cgroup=$(sed -n 's/^v2 //p' "$dir/cgroup" 2>/dev/null || true)
how=term
empty=1
if [ -n "$cgroup" ]; then
    # The job's cgroup exists only in this boot: whatever is in it is the job's.
    if populated "$cgroup"; then
        xargs -r kill -TERM <"$cgroup/cgroup.procs" 2>/dev/null || true
        now
        deadline=$((t + grace * 100))
        while populated "$cgroup" && [ "$t" -lt "$deadline" ]; do
            sleep 0.05
            now
        done
        if populated "$cgroup"; then
            how="kill"
            kill_cgroup "$cgroup"
            deadline=$((t + 1000))
            while populated "$cgroup" && [ "$t" -lt "$deadline" ]; do
                sleep 0.02
                now
                kill_cgroup "$cgroup"
            done
        fi
        ! populated "$cgroup" || empty=0
    fi
elif [ -f "$dir/pid" ]; then
    # A folder from before jobs had cgroups: its process group, only while its leader
    # is still the recorded process (same boot, same start time).
    read -r pgid pgid_start <"$dir/pid" || pgid=0 pgid_start=0  # written a moment ago
    if same_process "$pgid" "$pgid_start"; then
        kill -TERM "-$pgid" 2>/dev/null || true
        now
        deadline=$((t + grace * 100))
        while group_alive "$pgid" && [ "$t" -lt "$deadline" ]; do
            sleep 0.05
            now
        done
        if group_alive "$pgid"; then
            how="kill"
            kill -KILL "-$pgid" 2>/dev/null || true
        fi
    fi
fi
# The supervisor notices the end, frees the lock, and writes the end.
read -r sup sup_start <"$dir/supervisor" 2>/dev/null || sup=""
supervising=0
tries=0
while [ -n "$sup" ] && same_process "$sup" "$sup_start" && [ "$tries" -lt 200 ]; do
    supervising=1
    tries=$((tries + 1))
    sleep 0.025
done
if [ "$supervising" = 0 ] && [ -n "$cgroup" ] && [ "$empty" = 1 ]; then
    # No supervisor to remove the cgroup (it was killed): remove it here.
    while read -r _ where; do
        rmdir "$where" 2>/dev/null || true
    done <"$dir/cgroup"
fi
echo "cancel=$how"
echo "empty=$empty"
lock_state
