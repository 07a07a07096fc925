#!/bin/sh
# Starts one worker's part of a job: a detached supervisor that holds this TPU's lock
# for the job's whole life and runs the job's command as its user. Returns as soon as
# the command runs; the supervisor survives the SSH session (its own session, and its
# stdin/stdout/stderr are not the channel's).
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-job-start 1
#   job <id>                        user <name>
#   python <base64 venv dir>        cwd <base64 dir>            (optional)
#   pod <host:port> <processes> <process id>                    (optional)
#   env <NAME> <base64 value>       arg <base64>                (repeated; one arg at least)
#   end
# Answers: start=started|running|refused, and for a started job pid=, boot_id=,
# started_at= (job-status.sh reports the rest). Bad input exits non-zero, changes nothing.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL
umask 077

JOBS=/var/lib/tpu-portal/jobs
RUN=/run/tpu-portal
LOCK=$RUN/tpu.lock
HOLDER=$RUN/holder
MAX_INPUT=1048576
# Names that would break the one-process-per-TPU rule, fake the topology, or override
# what the portal sets itself. The portal refuses them before sending; so does this.
FORBIDDEN='^(TPU_VISIBLE_CHIPS|TPU_VISIBLE_DEVICES|TPU_CHIPS_PER_PROCESS_BOUNDS|TPU_CHIPS_PER_HOST_BOUNDS|TPU_PROCESS_BOUNDS|TPU_PROCESS_ADDRESSES|TPU_PROCESS_PORT|TPU_HOST_BOUNDS|TPU_WORKER_ID|TPU_WORKER_HOSTNAMES|TPU_ACCELERATOR_TYPE|TPU_SKIP_MDS_QUERY|TPU_MESH_CONTROLLER_ADDRESS|TPU_MESH_CONTROLLER_PORT|CLOUD_TPU_TASK_ID|ALLOW_MULTIPLE_LIBTPU_LOAD|JAX_COORDINATOR_ADDRESS|JAX_COORDINATOR_PORT|JAX_NUM_PROCESSES|JAX_PROCESS_ID|JAX_LOCAL_DEVICE_IDS|LD_LIBRARY_PATH|TPU_PORTAL_[A-Z0-9_]*|HOME|USER|LOGNAME|PATH|VIRTUAL_ENV)$'

die() {
    echo "job-start: $*" >&2
    exit 1
}

work=$(mktemp -d)
trap 'rm -rf -- "$work"' EXIT
trap 'exit 1' HUP INT TERM

# 1. The input, checked whole before anything changes.
input=$work/input
head -c $((MAX_INPUT + 1)) >"$input"
[ "$(wc -c <"$input")" -le "$MAX_INPUT" ] || die "the input is larger than $MAX_INPUT bytes"
B64='[A-Za-z0-9+/]+={0,2}'
if LC_ALL=C grep -n -v -E "^(tpu-portal-job-start 1|end|job [a-z0-9][a-z0-9-]{0,63}|user [a-z][a-z0-9-]{0,30}|python $B64|cwd $B64|pod [A-Za-z0-9.:-]{1,255} [0-9]{1,4} [0-9]{1,4}|env [A-Za-z_][A-Za-z0-9_]{0,127} ($B64)?|arg $B64)$" "$input" >"$work/bad"; then
    die "line $(head -n 1 "$work/bad" | cut -d: -f1) of the input is not allowed"
fi
# Every line passed the pattern above: read them with the shell's own read (a last
# line without its newline is not read, so "end" must be the last line read).
job="" user="" python_b64="" cwd_b64="" first_b64="" last=""
n_line=0 n_job=0 n_user=0 n_arg=0 n_python=0 n_cwd=0 n_pod=0
: >"$work/env"
while read -r key value _; do
    n_line=$((n_line + 1))
    [ "$n_line" -gt 1 ] || [ "$key $value" = "tpu-portal-job-start 1" ] ||
        die "the input has no tpu-portal-job-start 1 header"
    last=$key
    case $key in
        job) job=$value n_job=$((n_job + 1)) ;;
        user) user=$value n_user=$((n_user + 1)) ;;
        python) python_b64=$value n_python=$((n_python + 1)) ;;
        cwd) cwd_b64=$value n_cwd=$((n_cwd + 1)) ;;
        pod) n_pod=$((n_pod + 1)) ;;
        env) echo "$value" >>"$work/env" ;;
        arg)
            [ -n "$first_b64" ] || first_b64=$value
            n_arg=$((n_arg + 1))
            ;;
    esac
done <"$input"
[ "$last" = end ] || die "the input was cut off (no final end)"
[ "$n_job" = 1 ] || die "the input names not exactly one job"
[ "$n_user" = 1 ] || die "the input names not exactly one user"
[ "$n_arg" -ge 1 ] || die "the input has no command (arg lines)"
[ "$n_python" -le 1 ] || die "python is given more than once"
[ "$n_cwd" -le 1 ] || die "cwd is given more than once"
[ "$n_pod" -le 1 ] || die "pod is given more than once"
if grep -E "$FORBIDDEN" "$work/env" >"$work/bad"; then
    die "the environment variable $(head -n 1 "$work/bad") is not allowed"
fi

decode() {
    printf '%s' "$1" | base64 -d 2>/dev/null || die "a base64 field is not valid"
}
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

# 2. Already there? Starting the same job again is a success, not a second run.
dir=$JOBS/$job
if [ -d "$dir" ]; then
    if [ -f "$dir/exit" ]; then
        echo "start=refused ended"
    else
        echo "start=running"
    fi
    exit 0
fi

# 3. The TPU's lock: taken here, held by the supervisor (it inherits the descriptor)
#    until the job's last process is gone.
# Made once (the pre-flight may have made $RUN, 0755 too): no programs on later starts.
if [ ! -d "$RUN" ] || [ ! -d "$JOBS" ]; then
    mkdir -p "$RUN" "$JOBS"
    chmod 0755 "$RUN"
    chmod 0711 "$JOBS" "${JOBS%/*}"
fi
exec 9>>"$LOCK"
if ! flock -n 9; then
    echo "start=refused busy $(cat "$HOLDER" 2>/dev/null || echo unknown)"
    exit 0
fi
printf '%s\n' "$job" >"$HOLDER.new"
mv -f "$HOLDER.new" "$HOLDER"

# 4. The job's folder: root's, readable by the user's group; the user cannot change it.
#    Its group is set first: what is written into it (setgid) takes that group.
mkdir -m 2750 "$dir.new"
chown "root:$gid" "$dir.new"
umask 027
# The spec the supervisor runs: the account's ids and the input's own lines (free text
# still in base64). The checked name, home, cwd and python are its arguments.
{
    echo "uid $uid"
    echo "gid $gid"
    echo "job $job"
    grep -E '^(user|python|cwd|pod|env|arg) ' "$input"
} >"$dir.new/spec"
: >"$dir.new/log"
cat >"$dir.new/supervise.sh" <<'SUPERVISOR'
# The supervisor of one job (root, its own session, fd 9 = the TPU's lock, fd 3 = the
# pipe job-start.sh waits on). Arguments: the folder, uid, gid, user, home, cwd, python.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
umask 027  # files root's, readable by the user's group (the folder is setgid)
dir=$1 uid=$2 gid=$3 user=$4 home=$5 cwd=$6 python=$7
cd "$dir"
d() { printf '%s' "$1" | base64 -d; }
# The 22nd field of /proc/PID/stat (the start time), read by the shell itself.
starttime() {
    read -r stat <"/proc/$1/stat" || return 1
    set -f
    # shellcheck disable=SC2086 # split into fields on purpose
    set -- ${stat##*) }
    set +f
    echo "${20}"
}

job="" pod=""
while read -r key value rest; do
    case $key in
        job) job=$value ;;
        pod) pod="$value $rest" ;;
    esac
done <spec
path=/usr/local/bin:/usr/bin:/bin
[ -z "$python" ] || path=$python/bin:$path

set -- env -i -C "$cwd" "HOME=$home" "USER=$user" "LOGNAME=$user" "SHELL=/bin/sh" \
    "LANG=C.UTF-8" "PATH=$path" "TPU_PORTAL_JOB_ID=$job"
[ -z "$python" ] || set -- "$@" "VIRTUAL_ENV=$python"
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
started=$(date +%s.%N)
echo "$started" >started_at
# The command: in its own session and process group (pgid = its pid), as the user with
# no way back to root, without the lock's descriptor or the pipe, output into the log.
setsid setpriv --reuid="$uid" --regid="$gid" --init-groups --no-new-privs -- "$@" \
    </dev/null >>log 2>&1 9>&- 3>&- &
child=$!
echo "$child $(starttime "$child" 2>/dev/null || echo 0)" >pid.new
mv -f pid.new pid
# What job-start.sh answers; it returns once the pipe is closed.
echo "$child $boot $started" >&3
exec 3>&-
set +e
wait "$child"
status=$?
set -e
# Whatever the command left in its group goes with it before the lock is free.
kill -KILL "-$child" 2>/dev/null || true
date +%s.%N >ended_at
if [ "$status" -gt 128 ]; then
    echo "signal $(kill -l $((status - 128))) $status" >exit.new
else
    echo "status $status" >exit.new
fi
mv -f exit.new exit
rm -f /run/tpu-portal/holder
SUPERVISOR
mv "$dir.new" "$dir"

# 5. Detach: a new session, nothing of the SSH channel, the lock's descriptor kept.
#    The supervisor's fd 3 is a pipe to here: it writes the command's pid, the boot id
#    and the start time once the command runs, then closes it (no polling for a file).
answer=$(setsid -f /bin/sh "$dir/supervise.sh" "$dir" "$uid" "$gid" "$user" "$home" \
    "$cwd" "$python" 3>&1 </dev/null >>"$dir/supervisor.log" 2>&1)
exec 9>&-
pid="" boot="" started=""
read -r pid boot started <<ANSWER || true
$answer
ANSWER
[ -n "$started" ] || die "the supervisor did not start the command (see $dir/supervisor.log)"
echo "start=started"
echo "pid=$pid"
echo "boot_id=$boot"
echo "started_at=$started"
