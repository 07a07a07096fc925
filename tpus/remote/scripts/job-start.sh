#!/bin/sh
# Starts one worker's part of a job: a detached supervisor that holds this TPU's lock
# for the job's whole life and runs the job's command as its user, in a cgroup of its
# own with the lab's limits. Returns as soon as the command runs; the supervisor
# survives the SSH session (its own session, and its stdin/stdout/stderr are not the
# channel's). Removes the folders of jobs that ended longer ago than keep_days.
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-job-start 1
#   job <id>                        user <name>
#   python <base64 venv dir>        cwd <base64 dir>            (optional)
#   pod <host:port> <processes> <process id>                    (optional)
#   env <NAME> <base64 value>       arg <base64>                (repeated; one arg at least)
#   tasks_max <n>                   memory_max_mb <n>           (optional; 0: 90% of memory)
#   log_max_bytes <n>               keep_days <n>               (optional; 0: keep forever)
#   metrics_ports <n>[,<n>...]      (optional: TPU_RUNTIME_METRICS_PORTS, where libtpu
#                                   serves its runtime metrics; job-status.sh reads them)
#   hold                            (optional: prepare, then wait for the word, below)
#   end
# With hold (the exec that runs the pre-flight first, tpus/remote/ssh.py), the input
# ends at its end line, the job's cgroup and folder are made at once, and the start
# waits for the portal's word on stdin:
#   go
#   env <NAME> <base64 value>       (repeated: added to the job's environment)
#   end
# Anything else, or the end of stdin, starts nothing and removes what was made.
# Answers: start=started|running|refused, and for a started job pid=, boot_id=,
# started_at=, cgroup=, tasks_max=, memory_max= (job-status.sh reports the rest). Bad
# input exits non-zero, changes nothing.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL
umask 077

JOBS=/var/lib/tpu-portal/jobs
RUN=/run/tpu-portal
LOCK=$RUN/tpu.lock
HOLDER=$RUN/holder
SUPERVISE=$RUN/supervise-51ae040978705c7f44bf4200ef724a15f18c3e1c59748e71a14909fc60f6b7b5.sh
MAX_INPUT=1048576
UNIT_PREFIX=tpu-portal-job-

die() {
    echo "job-start: $*" >&2
    exit 1
}
# Names that would break the one-process-per-TPU rule, fake the topology, or override
# what the portal sets itself. The portal refuses them before sending; so does this.
forbidden() {
    case $1 in
        TPU_VISIBLE_CHIPS | TPU_VISIBLE_DEVICES | TPU_CHIPS_PER_PROCESS_BOUNDS | \
            TPU_CHIPS_PER_HOST_BOUNDS | TPU_PROCESS_BOUNDS | TPU_PROCESS_ADDRESSES | \
            TPU_PROCESS_PORT | TPU_HOST_BOUNDS | TPU_WORKER_ID | TPU_WORKER_HOSTNAMES | \
            TPU_ACCELERATOR_TYPE | TPU_SKIP_MDS_QUERY | TPU_MESH_CONTROLLER_ADDRESS | \
            TPU_MESH_CONTROLLER_PORT | CLOUD_TPU_TASK_ID | ALLOW_MULTIPLE_LIBTPU_LOAD | \
            JAX_COORDINATOR_ADDRESS | JAX_COORDINATOR_PORT | JAX_NUM_PROCESSES | JAX_PROCESS_ID | \
            JAX_LOCAL_DEVICE_IDS | LD_LIBRARY_PATH | HOME | USER | LOGNAME | PATH | VIRTUAL_ENV | \
            TPU_RUNTIME_METRICS_PORTS) return 0 ;;
        TPU_PORTAL_*) case ${1#TPU_PORTAL_} in *[!A-Z0-9_]*) return 1 ;; esac ;;
        *) return 1 ;;
    esac
}

trap 'exit 1' HUP INT TERM

# 1. The input, read and checked line by line by the shell itself (no program), whole
#    before anything changes: each line must be one of those above, exactly; at most
#    MAX_INPUT bytes. The lines the supervisor reads are kept for its spec.
# fits <value> <allowed characters> <longest>: not empty, only those, not too long.
fits() {
    case $1 in
        "" | *[!$2]*) return 1 ;;
    esac
    [ "${#1}" -le "$3" ]
}
# Base64: [A-Za-z0-9+/]+ and at most two '=' at the end.
base64_fits() {
    set -- "${1%=}"
    fits "${1%=}" "A-Za-z0-9+/" "$MAX_INPUT"
}
# The ports: 4 or 5 digits each, one to eight of them, comma-separated.
ports_fit() {
    set -- "$1," 0
    while [ -n "$1" ]; do
        port=${1%%,*}
        fits "$port" 0-9 5 && [ "${#port}" -ge 4 ] || return 1
        set -- "${1#*,}" $(($2 + 1))
    done
    [ "$2" -le 8 ]
}
job="" user="" python_b64="" cwd_b64="" first_b64="" last="" spec="" bad_name="" hold=""
n_line=0 n_job=0 n_user=0 n_arg=0 n_python=0 n_cwd=0 n_pod=0 n_hold=0 seen_limits=" " size=0
# The lab's limits for each job on each worker, unless the input says otherwise.
tasks_max=4096 memory_max_mb=0 log_max_bytes=104857600 keep_days=0
partial=""
while :; do
    # A last line without its newline is checked, then refused as cut off.
    line=""
    if ! IFS= read -r line; then
        [ -n "$line" ] || break
        partial=1
    fi
    n_line=$((n_line + 1))
    size=$((size + ${#line} + 1))
    [ "$size" -le "$MAX_INPUT" ] || die "the input is larger than $MAX_INPUT bytes"
    key=${line%% *} value=${line#* }
    ok=""
    case $line in
        "tpu-portal-job-start 1" | end | hold) ok=1 value="" ;;
        "job "*) fits "$value" "a-z0-9-" 64 && case $value in [a-z0-9]*) ok=1 ;; esac ;;
        "user "*) fits "$value" "a-z0-9-" 31 && case $value in [a-z]*) ok=1 ;; esac ;;
        "python "* | "cwd "* | "arg "*) base64_fits "$value" && ok=1 ;;
        "pod "*)
            set -f
            # shellcheck disable=SC2086 # the words, checked one by one
            set -- $value
            set +f
            [ "$#" = 3 ] && [ "$value" = "$1 $2 $3" ] && fits "$1" "A-Za-z0-9.:-" 255 &&
                fits "$2" 0-9 4 && fits "$3" 0-9 4 && ok=1
            ;;
        "env "*)
            # The name, a space, and the value in base64 (none: empty).
            name=${value%% *}
            case $value in
                *" "*) [ -z "${value#* }" ] || base64_fits "${value#* }" || name="" ;;
                *) name="" ;;
            esac
            fits "$name" "A-Za-z0-9_" 128 && case $name in [A-Za-z_]*) ok=1 ;; esac
            ;;
        "tasks_max "*) fits "$value" 0-9 7 && ok=1 ;;
        "memory_max_mb "*) fits "$value" 0-9 9 && ok=1 ;;
        "log_max_bytes "*) fits "$value" 0-9 15 && ok=1 ;;
        "keep_days "*) fits "$value" 0-9 5 && ok=1 ;;
        "metrics_ports "*) ports_fit "$value" && ok=1 ;;
    esac
    [ -n "$ok" ] || die "line $n_line of the input is not allowed"
    [ -z "$partial" ] || die "the input was cut off (no final end)"
    [ "$n_line" -gt 1 ] || [ "$key" = tpu-portal-job-start ] ||
        die "the input has no tpu-portal-job-start 1 header"
    last=$key
    case $key in
        user | python | cwd | pod | env | arg | metrics_ports) spec="$spec$line
" ;;
    esac
    case $key in
        job) job=$value n_job=$((n_job + 1)) ;;
        user) user=$value n_user=$((n_user + 1)) ;;
        python) python_b64=$value n_python=$((n_python + 1)) ;;
        cwd) cwd_b64=$value n_cwd=$((n_cwd + 1)) ;;
        pod) n_pod=$((n_pod + 1)) ;;
        tasks_max | memory_max_mb | log_max_bytes | keep_days)
            case $seen_limits in
                *" $key "*) die "$key is given more than once" ;;
            esac
            seen_limits="$seen_limits$key "
            eval "$key=\$value" # the name is one of the four above, the value digits
            ;;
        env) [ -n "$bad_name" ] || ! forbidden "$name" || bad_name=$name ;;
        arg)
            [ -n "$first_b64" ] || first_b64=$value
            n_arg=$((n_arg + 1))
            ;;
        hold) hold=1 n_hold=$((n_hold + 1)) ;;
        end) [ -z "$hold" ] || break ;; # the word follows on stdin
    esac
done
[ "$last" = end ] || die "the input was cut off (no final end)"
[ "$n_job" = 1 ] || die "the input names not exactly one job"
[ "$n_user" = 1 ] || die "the input names not exactly one user"
[ "$n_arg" -ge 1 ] || die "the input has no command (arg lines)"
[ "$n_python" -le 1 ] || die "python is given more than once"
[ "$n_cwd" -le 1 ] || die "cwd is given more than once"
[ "$n_pod" -le 1 ] || die "pod is given more than once"
[ "$n_hold" -le 1 ] || die "hold is given more than once"
# Leading zeros would read as octal numbers below.
tasks_max=${tasks_max#"${tasks_max%%[!0]*}"} memory_max_mb=${memory_max_mb#"${memory_max_mb%%[!0]*}"}
log_max_bytes=${log_max_bytes#"${log_max_bytes%%[!0]*}"} keep_days=${keep_days#"${keep_days%%[!0]*}"}
tasks_max=${tasks_max:-0} memory_max_mb=${memory_max_mb:-0}
log_max_bytes=${log_max_bytes:-0} keep_days=${keep_days:-0}
if [ "$tasks_max" -lt 16 ] || [ "$tasks_max" -gt 4194304 ]; then die "tasks_max is 16 to 4194304"; fi
[ "$memory_max_mb" = 0 ] || [ "$memory_max_mb" -ge 32 ] || die "memory_max_mb is 0 or at least 32"
[ "$log_max_bytes" -ge 1024 ] || die "log_max_bytes is at least 1024"
[ -z "$bad_name" ] || die "the environment variable $bad_name is not allowed"

# The bytes of a base64 field, decoded by the shell itself (a program for a long one);
# fails on one that is not base64 (its length not a multiple of 4, '=' but at the end).
B64=ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/
b64d() {
    if [ "${#1}" -gt 1024 ]; then
        printf '%s' "$1" | base64 -d
        return
    fi
    set -- "$1" ""
    [ $((${#1} % 4)) = 0 ] || return 1
    while [ -n "$1" ]; do
        quad=${1%"${1#????}"}
        set -- "${1#????}" "$2"
        bits=0 pad=0
        while [ -n "$quad" ]; do
            char=${quad%"${quad#?}"}
            quad=${quad#?}
            if [ "$char" = = ]; then
                pad=$((pad + 1)) value=0
            else
                [ "$pad" = 0 ] || return 1
                value=${B64%%"$char"*}
                value=${#value}
                [ "$value" -lt 64 ] || return 1
            fi
            bits=$((bits << 6 | value))
        done
        if [ "$pad" -gt 0 ] && { [ -n "$1" ] || [ "$pad" -gt 2 ]; }; then return 1; fi
        for shift in 16 8 0; do
            [ "$shift" -ge $((pad * 8)) ] || break
            byte=$((bits >> shift & 255))
            set -- "$1" "$2\\$((byte >> 6))$((byte >> 3 & 7))$((byte & 7))"
        done
    done
    # shellcheck disable=SC2059 # octal escapes only
    printf "$2"
}
decode() {
    b64d "$1" 2>/dev/null || die "a base64 field is not valid"
}
# The account, as the name service has it: getent reads /etc/passwd a block at a time,
# where the shell's read takes a byte a system call (thousands, on a worker with many
# accounts, the portal's at the end).
entry=$(getent passwd "$user") || die "no user $user on this worker"
IFS=: read -r _ _ uid gid _ home _ <<EOF
$entry
EOF
[ "$uid" -ge 1000 ] || die "jobs never run as a system account ($user has uid $uid)"

python=""
[ -z "$python_b64" ] || python=$(decode "$python_b64")
cwd=$home
[ -z "$cwd_b64" ] || cwd=$(decode "$cwd_b64")
for path in "$python" "$cwd"; do
    case $path in
        "" | /*) ;;
        *) die "paths must be absolute" ;;
    esac
    case $path in
        *[![:print:]]*) die "paths must be printable" ;;
    esac
done
first_arg=$(decode "$first_b64")
[ -n "$first_arg" ] || die "the command is empty"
case $first_arg in
    *=*) die "the command's first word must not contain '='" ;;
esac

# The word, with hold: go and the environment's further lines, or nothing starts.
late=""
await_word() {
    word=""
    IFS= read -r word || exit 0
    [ "$word" = go ] || exit 0
    while :; do
        line=""
        IFS= read -r line || die "the word was cut off (no final end)"
        case $line in
            end) return 0 ;;
            "env "*)
                value=${line#env } name=""
                case $value in
                    *" "*)
                        name=${value%% *}
                        [ -z "${value#* }" ] || base64_fits "${value#* }" || name=""
                        ;;
                esac
                fits "$name" "A-Za-z0-9_" 128 || die "a line of the word is not allowed"
                case $name in [A-Za-z_]*) ;; *) die "a line of the word is not allowed" ;; esac
                ! forbidden "$name" || die "the environment variable $name is not allowed"
                late="$late$line
"
                ;;
            *) die "a line of the word is not allowed" ;;
        esac
    done
}

# 2. Already there? Starting the same job again is a success, not a second run.
dir=$JOBS/$job
if [ -d "$dir" ]; then
    [ -z "$hold" ] || await_word
    if [ -f "$dir/exit" ]; then
        echo "start=refused ended"
    else
        echo "start=running"
    fi
    exit 0
fi

# 3. Where jobs live, and old folders expired.
# Made once (the pre-flight may have made $RUN, 0755 too): no programs on later starts.
if [ ! -d "$RUN" ] || [ ! -d "$JOBS" ]; then
    mkdir -p "$RUN" "$JOBS"
    chmod 0755 "$RUN"
    chmod 0711 "$JOBS" "${JOBS%/*}"
fi
read -r boot </proc/sys/kernel/random/boot_id
# Expiry, at most once an hour (the first start with keep_days after a boot, then
# one an hour later: /run is empty at boot), in the background (the start does not
# wait for it) and before the lock (a start refused as busy does it too): the folders
# of jobs that ended more than keep_days ago, and of jobs of an earlier boot whose log
# has not grown for as long (nothing of a past boot runs). A folder of this boot
# without an end is never removed: its job may run. At most 50 a pass.
read -r uptime _ </proc/uptime
uptime=${uptime%.*}
expired_at=""
[ ! -f "$RUN/expired-at" ] || read -r expired_at <"$RUN/expired-at" || expired_at=""
case $expired_at in *[!0-9]*) expired_at="" ;; esac
if [ "$keep_days" -gt 0 ] && [ -d "$JOBS" ] &&
    { [ -z "$expired_at" ] || [ $((uptime - expired_at)) -ge 3600 ]; }; then
    echo "$uptime" >"$RUN/expired-at"
    (
        # Nothing of the SSH channel: the exec ends without waiting for this.
        exec </dev/null >/dev/null 2>&1
        minutes=$((keep_days * 1440))
        find "$JOBS" -mindepth 1 -maxdepth 2 \( -name log -o -name '*.new' \) -mmin "+$minutes" |
            head -n 50 |
            while read -r path; do
                case $path in
                    */log) old=${path%/log} ;;
                    *) old=$path ;;
                esac
                if [ "$old" = "$dir" ] || [ "$old" = "$dir.new" ]; then continue; fi
                case ${old##*/} in
                    *.new) ;; # a start that never finished: no process ever ran from it
                    *)
                        if [ -f "$old/exit" ]; then
                            [ -n "$(find "$old/exit" -mmin "+$minutes")" ] || continue
                        else
                            read -r old_boot <"$old/boot_id" || old_boot=""
                            if [ -z "$old_boot" ] || [ "$old_boot" = "$boot" ]; then continue; fi
                        fi
                        ;;
                esac
                rm -rf -- "$old"
            done
    ) &
fi

# Until the supervisor runs, a failure undoes what this start made (the holder file
# once it holds the lock).
cgroup="" pids_dir="" memory_dir="" holding=""
cleanup_cgroups() {
    for path in "$@"; do
        [ -z "$path" ] || rmdir "$path" 2>/dev/null || true
    done
}
trap 'cleanup_cgroups "$cgroup" "$pids_dir" "$memory_dir"; [ -z "$holding" ] || rm -f "$HOLDER"; rm -rf -- "$dir.new" "$SUPERVISE.$job"' EXIT

# 3c. The job's cgroup, with the lab's limits on tasks and memory. Where systemd runs
#     (a TPU VM), a transient scope in the person's user-<uid>.slice, made by the
#     supervisor with systemd-run. Elsewhere a directory of the portal's own subtree,
#     tpu-portal/job-<id> under the cgroup v2 mount, with the pids and memory limits in
#     v2 where its controllers are offered and in the v1 pids and memory hierarchies
#     where those are what the worker has (a hybrid layout). Either way the job's
#     processes leave the portal account's session before the command runs.
# (Read by the shell itself: a start forks as few programs as it can.)
memory_bytes=$((memory_max_mb * 1048576))
if [ "$memory_bytes" = 0 ]; then
    while read -r key total _; do
        if [ "$key" = MemTotal: ]; then
            memory_bytes=$((total * 1024 * 9 / 10))
            break
        fi
    done </proc/meminfo
fi
# The hierarchies, from /proc/self/mountinfo: "... <mount point> <options> [optional
# fields] - <type> <source> <super options>". The shell reads a file a byte at a time,
# and mountinfo is kilobytes: what it found is kept in /run for this boot (one short
# line, read by the next start instead).
LAYOUT=$RUN/cgroup-layout
v2_mount="" pids_mount="" memory_mount="" layout_boot=""
[ ! -f "$LAYOUT" ] || read -r layout_boot v2_mount pids_mount memory_mount <"$LAYOUT" || true
if [ "$layout_boot" != "$boot" ] || [ -z "$v2_mount" ]; then
    v2_mount="" pids_mount="" memory_mount=""
    while read -r _ _ _ _ point _ rest; do
        case " $rest" in
            *" - cgroup2 "*) [ -n "$v2_mount" ] || v2_mount=$point ;;
            *" - cgroup "*)
                case ",${rest##* }," in
                    *,pids,*) [ -n "$pids_mount" ] || pids_mount=$point ;;
                    *,memory,*) [ -n "$memory_mount" ] || memory_mount=$point ;;
                esac
                ;;
        esac
    done </proc/self/mountinfo
    # Mount points with a space (mountinfo writes it \040) are not kept: read again.
    case "$v2_mount$pids_mount$memory_mount" in
        *\\*) ;;
        *) [ -z "$v2_mount" ] || echo "$boot $v2_mount ${pids_mount:--} ${memory_mount:--}" >"$LAYOUT" ;;
    esac
fi
[ "$pids_mount" != - ] || pids_mount=""
[ "$memory_mount" != - ] || memory_mount=""
[ -n "$v2_mount" ] || die "this worker has no cgroup v2 hierarchy (jobs run in cgroups)"
tasks_where=none memory_where=none
read -r init_comm </proc/1/comm || init_comm=""
if [ "$init_comm" = systemd ] && [ -d /run/systemd/system ] && command -v systemd-run >/dev/null; then
    unit=$UNIT_PREFIX$job.scope
    plan=$(printf 'systemd %s user-%s.slice %s %s %s' "$unit" "$uid" "$tasks_max" \
        "$memory_bytes" "$v2_mount")
    tasks_where=$tasks_max memory_where=$memory_bytes
else
    base=$v2_mount/tpu-portal
    cgroup=$base/job-$job
    read -r offered <"$v2_mount/cgroup.controllers" || offered=""
    case " $offered " in *" pids "*) ;; *) [ -z "$pids_mount" ] || pids_dir=$pids_mount/tpu-portal/job-$job ;; esac
    case " $offered " in *" memory "*) ;; *) [ -z "$memory_mount" ] || memory_dir=$memory_mount/tpu-portal/job-$job ;; esac
    # shellcheck disable=SC2086 # the v1 directories, those that are wanted
    mkdir -p "$cgroup" $pids_dir $memory_dir
    # The controllers this hierarchy offers are enabled down to the portal's subtree.
    for controller in pids memory; do
        case " $offered " in *" $controller "*) ;; *) continue ;; esac
        for parent in "$v2_mount" "$base"; do
            read -r enabled <"$parent/cgroup.subtree_control" || enabled=""
            case " $enabled " in
                *" $controller "*) ;;
                *) echo "+$controller" >"$parent/cgroup.subtree_control" 2>/dev/null || true ;;
            esac
        done
    done
    plan="v2 $cgroup"
    if [ -f "$cgroup/pids.max" ]; then
        echo "$tasks_max" >"$cgroup/pids.max"
        tasks_where=$tasks_max
    elif [ -n "$pids_dir" ]; then
        echo "$tasks_max" >"$pids_dir/pids.max"
        plan="$plan
pids $pids_dir"
        tasks_where=$tasks_max
    fi
    if [ -f "$cgroup/memory.max" ]; then
        echo "$memory_bytes" >"$cgroup/memory.max"
        [ ! -f "$cgroup/memory.swap.max" ] || echo 0 >"$cgroup/memory.swap.max"
        memory_where=$memory_bytes
    elif [ -n "$memory_dir" ]; then
        echo "$memory_bytes" >"$memory_dir/memory.limit_in_bytes"
        plan="$plan
memory $memory_dir"
        memory_where=$memory_bytes
    fi
fi

# 4. The job's folder: root's, readable by the user's group; the user cannot change it.
#    Its group is set before its mode: what is written into it (setgid) takes that
#    group. (One install: mkdir, chown and chmod in one program.) A folder left by a
#    start that never finished is refused, and removed by this one's end.
[ ! -e "$dir.new" ] || die "$dir.new is there already"
install -d -o root -g "$gid" -m 2750 "$dir.new"
umask 027
# The spec the supervisor runs: the account's ids and the input's own lines (free text
# still in base64). The checked name, home, cwd and python are its arguments.
{
    echo "uid $uid"
    echo "gid $gid"
    echo "job $job"
    printf '%s' "$spec"
} >"$dir.new/spec"
: >"$dir.new/log"
# The pipe from the command to the log's writer (the supervisor's), and the one the
# supervisor learns on that the command runs as the person, made here: with hold,
# while the other workers still check.
mkfifo -m 600 "$dir.new/log.pipe" "$dir.new/switch.pipe"
# Where the job's cgroup is (cgroup), or where systemd runs the scope to make
# (cgroup.plan; the supervisor writes cgroup once systemd made it).
if [ -n "$cgroup" ]; then
    printf '%s\n' "$plan" >"$dir.new/cgroup"
else
    printf '%s\n' "$plan" >"$dir.new/cgroup.plan"
fi
# The supervisor's script is the same for every job: kept in $RUN (root's, emptied at
# boot) under a name that is the SHA-256 of its text (a test pins the two together),
# and written only when it is not there yet, so most starts start no program for it.
if [ ! -f "$SUPERVISE" ] || [ -L "$SUPERVISE" ]; then
    cat >"$SUPERVISE.$job" <<'SUPERVISOR'
# The supervisor of one job (root, its own session, fd 9 = the TPU's lock, fd 3 = the
# pipe job-start.sh waits on). Arguments: the folder, uid, gid, user, home, cwd, python,
# the log's cap in bytes. The cgroup file says where the job's cgroup is; where systemd
# runs, cgroup.plan says which scope to make, and the cgroup file is written once it is.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
umask 027  # files root's, readable by the user's group (the folder is setgid)
dir=$1 uid=$2 gid=$3 user=$4 home=$5 cwd=$6 python=$7 log_max=$8
cd "$dir"
# The bytes of a base64 field, decoded by the shell itself (a program for a long one);
# fails on one that is not base64 (its length not a multiple of 4, '=' but at the end).
B64=ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/
b64d() {
    if [ "${#1}" -gt 1024 ]; then
        printf '%s' "$1" | base64 -d
        return
    fi
    set -- "$1" ""
    [ $((${#1} % 4)) = 0 ] || return 1
    while [ -n "$1" ]; do
        quad=${1%"${1#????}"}
        set -- "${1#????}" "$2"
        bits=0 pad=0
        while [ -n "$quad" ]; do
            char=${quad%"${quad#?}"}
            quad=${quad#?}
            if [ "$char" = = ]; then
                pad=$((pad + 1)) value=0
            else
                [ "$pad" = 0 ] || return 1
                value=${B64%%"$char"*}
                value=${#value}
                [ "$value" -lt 64 ] || return 1
            fi
            bits=$((bits << 6 | value))
        done
        if [ "$pad" -gt 0 ] && { [ -n "$1" ] || [ "$pad" -gt 2 ]; }; then return 1; fi
        for shift in 16 8 0; do
            [ "$shift" -ge $((pad * 8)) ] || break
            byte=$((bits >> shift & 255))
            set -- "$1" "$2\\$((byte >> 6))$((byte >> 3 & 7))$((byte & 7))"
        done
    done
    # shellcheck disable=SC2059 # octal escapes only
    printf "$2"
}
d() { b64d "$1"; }
# The 22nd field of /proc/PID/stat (the start time), read by the shell itself.
starttime() {
    read -r stat <"/proc/$1/stat" || return 1
    set -f
    # shellcheck disable=SC2086 # split into fields on purpose
    set -- ${stat##*) }
    set +f
    echo "${20}"
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
# Every process of the cgroup, at once: cgroup.kill, or where the kernel has none,
# freeze, KILL each process listed, thaw (a frozen process dies of a KILL once thawed).
kill_cgroup() {
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

job="" pod="" metrics_ports=""
while read -r key value rest; do
    case $key in
        job) job=$value ;;
        pod) pod="$value $rest" ;;
        metrics_ports) metrics_ports=$value ;;
    esac
done <spec
path=/usr/local/bin:/usr/bin:/bin
[ -z "$python" ] || path=$python/bin:$path

set -- env -i -C "$cwd" "HOME=$home" "USER=$user" "LOGNAME=$user" "SHELL=/bin/sh" \
    "LANG=C.UTF-8" "PATH=$path" "TPU_PORTAL_JOB_ID=$job"
[ -z "$python" ] || set -- "$@" "VIRTUAL_ENV=$python"
[ -z "$metrics_ports" ] || set -- "$@" "TPU_RUNTIME_METRICS_PORTS=$metrics_ports"
if [ -n "$pod" ]; then
    set -- "$@" "TPU_PORTAL_COORDINATOR=${pod%% *}"
    rest=${pod#* }
    set -- "$@" "TPU_PORTAL_NUM_PROCESSES=${rest%% *}" "TPU_PORTAL_PROCESS_ID=${rest#* }"
fi
while read -r kind name value; do
    [ "$kind" = env ] || continue
    set -- "$@" "$name=$(d "$value")"
done <spec
while read -r kind value; do
    [ "$kind" = arg ] || continue
    set -- "$@" "$(d "$value")"
done <spec

echo "$$ $(starttime $$)" >supervisor
read -r boot </proc/sys/kernel/random/boot_id
echo "$boot" >boot_id

# The log: the command's output through a pipe to a writer that keeps log_max bytes,
# then ends the log with a line saying where and why it was cut and reads on (the job
# keeps running, its further output is discarded). It ends when the last process of
# the job has closed its output.
write_log() {
    # dd writes what each read gave at once (head would hold it in a buffer). Its count
    # is of reads, though, even in bytes: a short read from the pipe is one, so a job
    # printing a line at a time would stop one dd after log_max / 64 KiB lines. Each dd
    # goes on where the last stopped, until one reads nothing (every writer closed the
    # pipe) or log_max bytes are in. A log that cannot be written (a full disk) is left
    # as it is and the rest read away: the job runs on, as it does past the cap.
    left=$log_max
    size=0
    while [ "$left" -gt 0 ]; do
        if ! dd bs=65536 iflag=count_bytes count="$left" status=none >>log; then
            cat >/dev/null
            return 0
        fi
        now=$(stat -c %s log)
        [ "$now" -gt "$size" ] || return 0
        left=$((left - (now - size)))
        size=$now
    done
    if [ "$(head -c 1 | wc -c)" -gt 0 ]; then
        printf '\n[tpu-portal] The log was cut here, after %s bytes: the lab keeps at most %s bytes of log per job and worker. The job went on running; its further output was discarded.\n' \
            "$log_max" "$log_max" >>log
        cat >/dev/null
    fi
}
[ -p log.pipe ] || mkfifo -m 600 log.pipe
[ -p switch.pipe ] || mkfifo -m 600 switch.pipe
# (exec closes them for good: dash would keep a copy of a function's redirected fds.)
(
    exec 3>&- 9>&-
    write_log
) <log.pipe &
writer=$!
exec 5>log.pipe

# The command: in its own session and process group (pgid = its pid), as the user with
# no way back to root, without the lock's descriptor or the pipe, in the job's cgroup
# before it runs (so nothing of it is left in the portal account's session).
mode=delegated
if [ -f cgroup.plan ]; then
    read -r mode unit slice tasks bytes v2_mount <cgroup.plan
fi
if [ "$mode" = systemd ]; then
    setsid systemd-run --scope --quiet --collect --unit="$unit" --slice="$slice" \
        --property=TasksMax="$tasks" --property=MemoryMax="$bytes" -- \
        setpriv --reuid="$uid" --regid="$gid" --init-groups --no-new-privs -- "$@" \
        </dev/null >&5 2>&5 9>&- 3>&- 5>&- &
    child=$!
    # systemd-run moves itself into the scope, then runs the command in its place.
    cgroup="" tries=0
    while [ "$tries" -lt 500 ]; do
        line=$(grep '^0::' "/proc/$child/cgroup" 2>/dev/null || true)
        case $line in
            */"$unit")
                cgroup=$v2_mount${line#0::}
                break
                ;;
        esac
        tries=$((tries + 1))
        sleep 0.01
    done
    { [ -z "$cgroup" ] || echo "v2 $cgroup"; } >cgroup.new
    mv -f cgroup.new cgroup
else
    # The hand-over: the child holds fd 7, the only end of switch.pipe open for
    # writing, and the first program it runs as the person (the sh after setpriv and
    # setsid) closes it as it starts the command. Reading the pipe to its end waits
    # for exactly that, or for the child's end, with no pause and no program.
    exec 6<>switch.pipe 7>switch.pipe
    (
        exec 6<&-
        while read -r _ where; do
            echo 0 >"$where/cgroup.procs" || exit 125
        done <"$dir/cgroup"
        # The person's ids first (the first program started), then a session of its
        # own, then the command without fd 7.
        exec setpriv --reuid="$uid" --regid="$gid" --init-groups --no-new-privs -- \
            setsid sh -c 'exec "$@" 7>&-' sh "$@"
    ) </dev/null >&5 2>&5 9>&- 3>&- 5>&- &
    child=$!
    # A reader that is not a writer; then the supervisor's own ends go.
    exec 8<switch.pipe 6<&- 7>&-
    read -r _ cgroup <"$dir/cgroup"
fi
exec 5>&-
# The start's time, taken while the command is on its way (setsid, setpriv and env
# take it a few milliseconds of a busy worker), and written before anything answers.
started=$(date +%s.%N)
echo "$started" >started_at
# The answer waits until the command runs as the user (it has joined its cgroup and
# left root's side), or is gone already. Where systemd runs it, that is looked at at
# once, then after waits that grow (each is a program started: a busy worker is not
# asked often), 2 s at most; elsewhere the hand-over above says it.
if [ "$mode" = systemd ]; then
    for pause in 0.01 0.02 0.05 0.1 0.1 0.1 0.1 0.1 0.2 0.2 0.2 0.2 0.5 -; do
        now_uid=""
        while read -r key real _; do
            if [ "$key" = Uid: ]; then
                now_uid=$real
                break
            fi
        done <"/proc/$child/status" 2>/dev/null || break
        if [ "$now_uid" = "$uid" ] || [ "$pause" = - ]; then break; fi
        sleep "$pause"
    done
else
    read -r _ <&8 || true
    exec 8<&-
fi
# (Written in place, one short write: job-status.sh and job-cancel.sh read a pid file
# still empty as no process.)
echo "$child $(starttime "$child" 2>/dev/null || echo 0)" >pid
# What job-start.sh answers; it returns once the pipe is closed.
echo "$child $boot $started $cgroup" >&3
exec 3>&-
set +e
wait "$child"
status=$?
set -e
# Whatever the command left in its cgroup (a process that left its group with setsid
# among them) is killed, and the TPU is free only once the cgroup is empty.
if [ -n "$cgroup" ]; then
    waited=0
    while populated "$cgroup"; do
        kill_cgroup "$cgroup"
        sleep 0.02
        waited=$((waited + 1))
        [ "$waited" -lt 50 ] || sleep 1
    done
else
    kill -KILL "-$child" 2>/dev/null || true
fi
# The log's last bytes: the writer ends as soon as it has them (a busy worker can take
# a moment); one held open by something outside the job is not waited on past 10 s.
tries=0
while kill -0 "$writer" 2>/dev/null && [ "$tries" -lt 500 ]; do
    tries=$((tries + 1))
    sleep 0.02
done
kill -KILL "$writer" 2>/dev/null || true
wait "$writer" 2>/dev/null || true
if [ "$mode" != systemd ]; then
    while read -r _ where; do
        rmdir "$where" 2>/dev/null || true
    done <cgroup
fi
if [ "$status" -gt 128 ]; then
    echo "signal $(kill -l $((status - 128))) $status" >exit.new
else
    echo "status $status" >exit.new
fi
# The TPU is free now, and then the end is written: a part reads as ended only once
# nothing of it runs and the lock is free. The log's pipe goes too (both its ends are
# closed; only root may open it) and so does the hand-over's: one program at the end,
# none while the job starts.
rm -f /run/tpu-portal/holder log.pipe switch.pipe
exec 9>&-
date +%s.%N >ended_at
mv -f exit.new exit
SUPERVISOR
    mv -f -- "$SUPERVISE.$job" "$SUPERVISE"
fi

# 5. With hold, everything up to here was made while the other workers still checked;
#    now the word. Then the lock, the holder, and the folder under its name.
if [ -n "$hold" ]; then
    await_word
    [ -z "$late" ] || printf '%s' "$late" >>"$dir.new/spec"
fi
# The TPU's lock: taken here, held by the supervisor (it inherits the descriptor) until
# the job's last process is gone.
exec 9>>"$LOCK"
if ! flock -n 9; then
    echo "start=refused busy $(cat "$HOLDER" 2>/dev/null || echo unknown)"
    exit 0
fi

# Whether a cgroup v2 directory still has processes (cgroup.events, read by the shell).
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
# The TPU is free only once every job's cgroup is empty: a job of this boot whose
# processes outlived its supervisor (killed by hand) still holds it.
for record in "$JOBS"/*/cgroup; do
    old=${record%/cgroup}
    if [ ! -f "$record" ] || [ -f "$old/exit" ] || [ "$old" = "$dir.new" ]; then continue; fi
    read -r old_boot <"$old/boot_id" 2>/dev/null || continue
    [ "$old_boot" = "$boot" ] || continue
    while read -r kind path; do
        if [ "$kind" = v2 ] && populated "$path"; then
            echo "start=refused busy ${old##*/}"
            exit 0
        fi
    done <"$record"
done
holding=1
# (Written in place: one short write, and a reader that finds it empty names no job.)
printf '%s\n' "$job" >"$HOLDER"
mv "$dir.new" "$dir"
# From here the supervisor owns the folder, the cgroup and the holder file.
trap - EXIT

# 6. Detach: a new session, nothing of the SSH channel, the lock's descriptor kept.
#    The supervisor's fd 3 is a pipe to here: it writes the command's pid, the boot id
#    the start time and its cgroup once the command runs, then closes it (no polling).
answer=$(setsid -f /bin/sh "$SUPERVISE" "$dir" "$uid" "$gid" "$user" "$home" \
    "$cwd" "$python" "$log_max_bytes" 3>&1 </dev/null >>"$dir/supervisor.log" 2>&1)
exec 9>&-
pid="" boot="" started="" cgroup=""
read -r pid boot started cgroup <<ANSWER || true
$answer
ANSWER
[ -n "$started" ] || die "the supervisor did not start the command (see $dir/supervisor.log)"
echo "start=started"
echo "pid=$pid"
echo "boot_id=$boot"
echo "started_at=$started"
echo "cgroup=${cgroup:--}"
echo "tasks_max=$tasks_where"
echo "memory_max=$memory_where"
