#!/bin/sh
# Checks, before a job touches the TPU, that this worker can run it: one line per check
#   check=<name> ok|fail|note <detail>
# A job starts only when no check says fail. Changes nothing, except that a stale
# /tmp/libtpu_lockfile (no process holds its lock) is removed, which the check notes.
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-job-preflight 1
#   user <name>
#   chips <expected count> <device glob>
#   min_disk_mb <n>                min_mem_mb <n>
#   port <n>                       (worker 0: the coordinator's port must be free)
#   python <base64 venv dir>       (optional; else the system's python3)
#   script <base64 path>           (optional: the job's script, must be in the home)
#   env <NAME>                     (repeated: the names the job sets)
#   probe_seconds <n>              (optional, default 20: the longest one probe may take)
#   snapshot <count> <bytes>       (optional: a workdir snapshot's contents, listed after end)
#   end
#   <sha256> <size>                (with snapshot: count lines, bytes in all)
# With a snapshot, the contents the person's cache on this worker lacks are answered
#   snapshot_missing=<sha256>
# (the cache, ~/.cache/tpu-portal/blobs, is listed as the person, never as root).
# What runs as the user (the environment's python, realpath, sha256sum: the probes)
# writes into files, never into a pipe the checks wait on, within probe_seconds (then
# TERM, and KILL 2 s later); afterwards whatever a probe left running is killed, so the
# pre-flight always ends and leaves nothing behind, whatever the person's code does.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL

LIBTPU_LOCK=/tmp/libtpu_lockfile
PORTAL_LOCK=/run/tpu-portal/tpu.lock
KILL_AFTER=2
HOLDER=/run/tpu-portal/holder
MAX_INPUT=65536
# Reads the environment's versions from the packages' metadata: no jax import.
PYCODE='import sys, importlib.metadata as m
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "none"
pin = "none"
if v("jax") != "none":
    for r in m.requires("jax") or []:
        if r.startswith("libtpu") and "tpu" in r.split(";", 1)[-1]:
            pin = r.split(";")[0].replace(" ", "")
print("python=%d.%d.%d" % sys.version_info[:3], "jax=" + v("jax"), "jaxlib=" + v("jaxlib"),
      "libtpu=" + v("libtpu"), "requests=" + v("requests"), "libtpu_pin=" + pin)'

die() {
    echo "job-preflight: $*" >&2
    exit 1
}
# Names that would break the one-process-per-TPU rule, fake the topology, or override
# what the portal sets itself.
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
# The checks are collected in the shell, each made one line of safe characters (it goes
# back to the portal): a newline, like any character outside the safe set, becomes a
# space, and a line is cut at 440 characters. Most lines are safe as they are and take
# no program; only one that is not goes through tr and cut.
SAFE="A-Za-z0-9 ._:,/()=@+~#%*!?;'\"-"
checks=""
check() {
    line="check=$1 $2 $3"
    case $line in
        *[!$SAFE]*) line=$(printf '%s' "$line" | tr -c "$SAFE" ' ' | cut -c 1-440) ;;
        *) [ "${#line}" -le 440 ] || line=$(printf '%s\n' "$line" | cut -c 1-440) ;;
    esac
    checks="$checks$line
"
}
answer() {
    printf '%s' "$checks"
}
lock_key() {
    dev=$(stat -c %d "$1")
    printf '%02x:%02x:%s' $(((dev >> 8) & 0xfff)) $(((dev & 0xff) | ((dev >> 12) & 0xfff00))) "$(stat -c %i "$1")"
}
describe_pid() {
    owner=$(stat -c %U "/proc/$1" 2>/dev/null || echo "?")
    command=$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | cut -c 1-200)
    printf 'pid=%s user=%s command=%s' "$1" "$owner" "${command:-?}"
}

# A folder of root's for what the probes write, made by the first probe that runs: the
# usual pre-flight (the versions kept, no script) starts no program for it.
work=""
workdir() {
    [ -n "$work" ] || work=$(mktemp -d)
}
# The person's own code (their python) runs with this in its environment, and so does
# whatever it starts (a process that left the probe's group with setsid as well): the
# sweep finds them by it. Made only when their code runs (the versions are often kept).
marker=""
sweep() {
    [ -n "$marker" ] || return 0
    # shellcheck disable=SC2046 # one pid a word
    set -- $(grep -l -s -z -x -F "TPU_PORTAL_PROBE=$marker" /proc/[0-9]*/environ | cut -d/ -f3)
    [ "$#" -eq 0 ] || kill -KILL "$@" 2>/dev/null || true
}
trap 'sweep; [ -z "$work" ] || rm -rf -- "$work"' EXIT
# (PIPE: the answer is written by the shell itself; a portal that went away must not
# end it before the sweep.)
trap 'exit 1' HUP INT TERM PIPE
# The input, read and checked line by line by the shell itself (no program): each line
# must be one of those above, exactly; at most MAX_INPUT bytes.
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
    fits "${1%=}" "A-Za-z0-9+/" 1048576
}
user="" expected="" glob="" min_disk="" min_mem="" port="" python_b64="" script_b64="" probe_seconds=20
snapshot_count="" snapshot_bytes=""
n_line=0 n_user=0 n_chips=0 n_disk=0 n_mem=0 n_env=0 last="" sets_preload="" env_names="" size=0
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
        "tpu-portal-job-preflight 1" | end) ok=1 value="" ;;
        "user "*) fits "$value" "a-z0-9-" 31 && case $value in [a-z]*) ok=1 ;; esac ;;
        "chips "*)
            case $value in
                *" /dev/"*)
                    rest=${value#* } value=${value%% *}
                    fits "$value" 0-9 3 && fits "${rest#/dev/}" "A-Za-z0-9/_.*?-" 100 && ok=1
                    ;;
            esac
            ;;
        "min_disk_mb "* | "min_mem_mb "*) fits "$value" 0-9 9 && ok=1 ;;
        "port "*) fits "$value" 0-9 5 && ok=1 ;;
        "python "* | "script "*) base64_fits "$value" && ok=1 ;;
        "env "*) fits "$value" "A-Za-z0-9_" 128 && case $value in [A-Za-z_]*) ok=1 ;; esac ;;
        "probe_seconds "*) fits "$value" 0-9 3 && ok=1 ;;
        "snapshot "*)
            case $value in
                *" "*) fits "${value%% *}" 0-9 6 && fits "${value#* }" 0-9 9 && ok=1 ;;
            esac
            ;;
    esac
    [ -n "$ok" ] || die "line $n_line of the input is not allowed"
    [ -z "$partial" ] || die "the input was cut off (no final end)"
    [ "$n_line" -gt 1 ] || [ "$key" = tpu-portal-job-preflight ] ||
        die "the input has no tpu-portal-job-preflight 1 header"
    last=$key
    case $key in
        user) user=$value n_user=$((n_user + 1)) ;;
        chips) expected=$value glob=$rest n_chips=$((n_chips + 1)) ;;
        min_disk_mb) min_disk=$value n_disk=$((n_disk + 1)) ;;
        min_mem_mb) min_mem=$value n_mem=$((n_mem + 1)) ;;
        port) [ -n "$port" ] || port=$value ;;
        python) [ -n "$python_b64" ] || python_b64=$value ;;
        script) [ -n "$script_b64" ] || script_b64=$value ;;
        probe_seconds) probe_seconds=$value ;;
        snapshot) snapshot_count=${value%% *} snapshot_bytes=${value#* } ;;
        env)
            env_names="$env_names $value"
            n_env=$((n_env + 1))
            [ "$value" != LD_PRELOAD ] || sets_preload=1
            ;;
    esac
    # The snapshot's list follows the end: read by a program, not line by line here.
    if [ "$key" = end ] && [ -n "$snapshot_count" ]; then break; fi
done
[ "$n_line" -gt 0 ] || die "the input has no tpu-portal-job-preflight 1 header"
[ "$last" = end ] || die "the input was cut off (no final end)"
[ "$n_user" = 1 ] || die "the input needs exactly one user line"
[ "$n_chips" = 1 ] || die "the input needs exactly one chips line"
[ "$n_disk" = 1 ] || die "the input needs exactly one min_disk_mb line"
[ "$n_mem" = 1 ] || die "the input needs exactly one min_mem_mb line"
if [ "$probe_seconds" -lt 1 ] || [ "$probe_seconds" -gt 600 ]; then
    die "probe_seconds is 1 to 600"
fi
case $glob in
    *..*) die "the device glob must not contain '..'" ;;
esac
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
# probe code|tool <name> <command...>: runs the command as the user, stdin from
# /dev/null, stdout in $work/<name>.out and stderr in $work/<name>.err (name -: neither
# is kept); its status, or
# 124 when it did not end within probe_seconds. "code" is the person's own program:
# a clean environment carrying the marker. A "tool" is a system program that starts
# nothing (test, realpath, sha256sum), which may still hang on a file (a FIFO, a dead
# mount). timeout makes its own process group: what is left in it is killed too, and
# the sweep gets the rest.
probe() {
    kind=$1 name=$2
    shift 2
    if [ "$kind" = code ]; then
        [ -n "$marker" ] || marker=$$-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')
        set -- env -i "HOME=$home" PATH=/usr/local/bin:/usr/bin:/bin LC_ALL=C \
            "TPU_PORTAL_PROBE=$marker" "$@"
    fi
    out=/dev/null err=/dev/null
    if [ "$name" != - ]; then
        workdir
        out=$work/$name.out err=$work/$name.err
    fi
    timeout -k "$KILL_AFTER" "$probe_seconds" \
        setpriv --reuid="$uid" --regid="$gid" --init-groups --no-new-privs -- "$@" \
        </dev/null >"$out" 2>"$err" &
    group=$!
    status=0
    wait "$group" || status=$?
    kill -KILL -- "-$group" 2>/dev/null || true
    case $status in
        124 | 137) return 124 ;;
    esac
    return "$status"
}
# The probe's first line of output.
first_line() {
    line=""
    IFS= read -r line <"$work/$1.out" || true
    printf '%s' "$line"
}

# --- the chips: there, and nobody holding one -------------------------------------
found=0 chips="
"
for device in $glob; do
    if [ -e "$device" ]; then
        found=$((found + 1))
        chips="$chips$device
"
    fi
done
if [ "$found" -eq "$expected" ]; then
    check chips ok "$found of $expected at $glob"
else
    check chips fail "$found of $expected at $glob"
fi
# One find over every process's descriptors (not a program per descriptor), giving
# those that point where the glob does (find's match is wider: its * takes a /); the
# shell keeps the first chip each process has open.
open_chips=$(find /proc/[0-9]*/fd -maxdepth 1 -type l -lname "$glob" -printf '%h %l\n' 2>/dev/null || true)
holders=0 seen=" "
while read -r fd_dir target; do
    pid=${fd_dir#/proc/} pid=${pid%/fd}
    case $chips in *"
$target
"*) ;; *) continue ;; esac
    case $seen in *" $pid "*) continue ;; esac
    [ "$pid" != $$ ] || continue
    seen="$seen$pid "
    holders=$((holders + 1))
    check chip_holder fail "$target $(describe_pid "$pid")"
done <<EOF
$open_chips
EOF
[ "$holders" -gt 0 ] || check chip_holder ok "no process has a chip open"

# --- libtpu's lock file, and the portal's own lock ---------------------------------
if [ -e "$LIBTPU_LOCK" ] || [ -L "$LIBTPU_LOCK" ]; then
    key=$(lock_key "$LIBTPU_LOCK" 2>/dev/null || echo none)
    holder=$(awk -v k="$key" '$0 ~ " " k " " { for (i = 1; i <= NF; i++) if ($i == k) print $(i - 1) }' /proc/locks | head -n 1)
    if [ -n "$holder" ] && [ -d "/proc/$holder" ]; then
        check libtpu_lockfile fail "$LIBTPU_LOCK is held by $(describe_pid "$holder")"
    else
        owner=$(stat -c %U "$LIBTPU_LOCK" 2>/dev/null || echo "?")
        rm -f -- "$LIBTPU_LOCK"
        check libtpu_lockfile note "removed a stale $LIBTPU_LOCK of $owner (no process held it)"
    fi
else
    check libtpu_lockfile ok "no $LIBTPU_LOCK"
fi
# A job's start writes the holder file once it holds the lock, and its supervisor
# removes it before letting go: no holder file, no holder (no program started to ask).
# A holder file left by a supervisor that was killed is judged by the lock itself.
if [ -f "$HOLDER" ] && [ -f "$PORTAL_LOCK" ] && ! { flock -n 8; } 8<"$PORTAL_LOCK"; then
    check portal_lock fail "job $(cat "$HOLDER" 2>/dev/null || echo unknown) holds this TPU"
else
    check portal_lock ok "free"
fi

# --- the coordinator's port (worker 0 only) ----------------------------------------
if [ -n "$port" ]; then
    # /proc/net/tcp{,6}: a socket in state 0A (LISTEN) on the port. Read by grep, a
    # block at a time: the kernel walks its table of sockets from the start for every
    # read, and the shell reads a byte at a time: tens of milliseconds on a busy host.
    hex=$(printf '%04X' "$port")
    if grep -q -s -E "^ *[0-9]+: [0-9A-F]+:$hex [0-9A-F]+:[0-9A-F]+ 0A " \
        /proc/net/tcp /proc/net/tcp6; then
        check port fail "port $port is already listening"
    else
        check port ok "port $port is free"
    fi
fi

# --- the Python environment, read as the user --------------------------------------
# Reading the versions starts the environment's Python (the slowest check), so the
# answer is kept, root's, in /run (gone at reboot), one file per account and
# environment (named by the uid and the environment's path in base64, '/' made '_'),
# with what it depends on: the interpreter, its folder and the folders its packages
# live in (installing, upgrading or removing a package changes its folder's time; a
# chmod, the interpreter's or its folder's). While that is the same, the answer is used
# as it is, and the look at whether the user can run the interpreter (three programs) is
# not made again either: the answer was read by the user running it. (A very long path:
# a file named by a hash of it all.)
PYCACHE=/run/tpu-portal/python-versions
# What the answer depends on, now.
read_depends() {
    set -- "$python" "${python%/*}"
    for dir in "$venv"/lib/python3*/site-packages "$home"/.local/lib/python3*/site-packages \
        /usr/lib/python3/dist-packages /usr/local/lib/python3*/dist-packages; do
        [ ! -d "$dir" ] || set -- "$@" "$dir"
    done
    depends=$(stat -L -c '%n %d %i %y %z %s' -- "$@" 2>/dev/null || true)
}
# Sets entry (and depends, unless no answer is kept: the environment is then looked at
# as the user first, within probe_seconds, as a path on a dead mount would hang a stat);
# succeeds, with versions set, when a kept answer still holds.
depends="" entry=""
kept_versions() {
    if [ -z "$python_b64" ]; then
        entry=$uid.system
    elif [ "${#python_b64}" -le 200 ]; then
        entry=$uid- rest=$python_b64
        while :; do
            case $rest in
                */*) entry="$entry${rest%%/*}_" rest=${rest#*/} ;;
                *) break ;;
            esac
        done
        entry=$entry$rest
    else
        [ -d "$PYCACHE" ] || return 1
        read_depends
        entry=$(printf '%s %s\n%s\n' "$uid" "$python" "$depends" | sha256sum)
        entry=${entry%% *}
    fi
    if [ -f "$PYCACHE/$entry" ]; then
        [ -n "$depends" ] || read_depends
        kept="" line=""
        {
            IFS= read -r versions || versions=""
            while IFS= read -r line; do
                kept="$kept$line
"
            done
        } <"$PYCACHE/$entry"
        if [ -n "$versions" ] && [ "$kept" = "$depends
" ]; then
            return 0
        fi
    fi
    return 1
}
# Reads the versions as the user, and keeps them (depends and entry: kept_versions).
python_versions() {
    [ -n "$depends" ] || read_depends
    if [ -z "$entry" ]; then
        entry=$(printf '%s %s\n%s\n' "$uid" "$python" "$depends" | sha256sum)
        entry=${entry%% *}
    fi
    probe code python "$python" -E -c "$PYCODE" || return
    versions=$(first_line python)
    # shellcheck disable=SC2174 # /run is there: -m is for /run/tpu-portal, as job-start.sh makes it
    if [ -d "$PYCACHE" ] || { mkdir -p -m 0755 "${PYCACHE%/*}" && mkdir -m 700 "$PYCACHE"; } 2>/dev/null; then
        printf '%s\n%s\n' "$versions" "$depends" >"$PYCACHE/$entry"
    fi
}
judge_versions() {
    case $versions in
        *"jax=none"* | *"jaxlib=none"*) check python fail "$python has no jax or jaxlib: $versions" ;;
        *) check python ok "$versions" ;;
    esac
}
if [ -n "$python_b64" ]; then
    venv=$(decode "$python_b64")
    python=$venv/bin/python
else
    venv="" python=/usr/bin/python3
fi
late="did not answer within $probe_seconds s"
case $python in
    /*[![:print:]]* | [!/]*) check python fail "the environment path must be absolute and printable" ;;
    *)
        status=0 versions=""
        if kept_versions; then
            status=kept
        else
            probe tool - test -x "$python" || status=$?
        fi
        if [ "$status" = kept ]; then
            judge_versions
        elif [ "$status" = 124 ]; then
            check python fail "$python $late (looking for it)"
        elif [ "$status" != 0 ]; then
            check python fail "$python is not there or $user cannot run it"
        else
            versions="" status=0
            python_versions || status=$?
            if [ "$status" = 124 ]; then
                check python fail "$python $late"
            elif [ "$status" != 0 ]; then
                check python fail "$python did not run: $(tail -n 1 "$work/python.err")"
            else
                judge_versions
            fi
        fi
        ;;
esac

# --- the script: a regular file in the home, readable by the user, and its hash -----
if [ -n "$script_b64" ]; then
    script=$(decode "$script_b64")
    real_home=$(realpath -e -- "$home" 2>/dev/null || echo "$home")
    status=0
    probe tool resolve realpath -e -- "$script" || status=$?
    resolved=$(first_line resolve)
    if [ "$status" = 124 ]; then
        check script fail "$script $late (resolving it)"
    elif [ "$status" != 0 ] || [ -z "$resolved" ]; then
        check script fail "$script does not exist or $user cannot reach it"
    else
        case $resolved in
            "$real_home"/*)
                status=0 step=regular sum=""
                probe tool - test -f "$resolved" || status=$?
                if [ "$status" = 0 ]; then
                    step=sum
                    probe tool sum sha256sum -- "$resolved" || status=$?
                    sum=$(first_line sum)
                fi
                if [ "$status" = 124 ]; then
                    check script fail "$script $late (reading it)"
                elif [ "$step" = regular ]; then
                    check script fail "$script is not a regular file"
                elif [ "$status" != 0 ] || [ -z "$sum" ]; then
                    check script fail "$user cannot read $script"
                else
                    check script ok "sha256=${sum%% *} $resolved"
                fi
                ;;
            *) check script fail "$script resolves to $resolved, outside $user's home" ;;
        esac
    fi
fi

# --- room: disk in the home, memory ------------------------------------------------
# Blocks free to a user and their size, as df counts them (f_bavail, f_frsize).
disk=""
if room=$(stat -f -c '%a %S' -- "$home" 2>/dev/null); then
    disk=$((${room% *} * ${room#* } / 1048576))
fi
if [ -z "$disk" ]; then
    check disk fail "cannot read the free space of $home"
elif [ "$disk" -ge "$min_disk" ]; then
    check disk ok "${disk} MB free in $home"
else
    check disk fail "${disk} MB free in $home, below $min_disk MB"
fi
mem=""
while read -r name kb _; do
    if [ "$name" = MemAvailable: ]; then
        mem=$((kb / 1024))
        break
    fi
done </proc/meminfo
if [ "$mem" -ge "$min_mem" ]; then
    check memory ok "${mem} MB available"
else
    check memory fail "${mem} MB available, below $min_mem MB"
fi

# --- the environment's names, and TCMalloc -----------------------------------------
not_allowed=""
for name in $env_names; do
    if forbidden "$name"; then not_allowed="$not_allowed$name "; fi
done
if [ -n "$not_allowed" ]; then
    check env fail "not allowed: $not_allowed"
else
    check env ok "$n_env names"
fi
tcmalloc=""
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc.so.4 \
    /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4; do
    if [ -f "$lib" ]; then
        tcmalloc=$lib
        break
    fi
done
if [ -n "$sets_preload" ]; then
    check tcmalloc note "LD_PRELOAD is set by the job"
elif [ -n "$tcmalloc" ]; then
    check tcmalloc note "found $tcmalloc"
else
    check tcmalloc note "none"
fi

# --- a workdir snapshot: which of its contents this worker's cache lacks -----------
# The cache is the person's (written as them when a snapshot is placed, by
# snapshot-place.sh); it is listed as the person, and only names and sizes come back.
missing=""
if [ -n "$snapshot_count" ]; then
    workdir
    head -c "$snapshot_bytes" >"$work/snapshot.need"
    valid=$(grep -c -x -E '[0-9a-f]{64} [0-9]{1,13}' "$work/snapshot.need" || true)
    lines=$(wc -l <"$work/snapshot.need")
    if [ "$valid" != "$snapshot_count" ] || [ "$lines" != "$snapshot_count" ]; then
        die "the snapshot's list is not $snapshot_count lines of <sha256> <size>"
    fi
    status=0
    probe tool snapshot_have find "$home/.cache/tpu-portal/blobs/" -maxdepth 1 -type f \
        -printf '%f %s\n' || status=$?
    [ "$status" != 124 ] || : >"$work/snapshot_have.out"
    missing=$(awk 'FILENAME == ARGV[1] { have[$1 " " $2] = 1; next }
        !(($1 " " $2) in have) { print "snapshot_missing=" $1 }' \
        "$work/snapshot_have.out" "$work/snapshot.need")
    lacking=0
    [ -z "$missing" ] || lacking=$(printf '%s\n' "$missing" | wc -l)
    check snapshot ok "$((snapshot_count - lacking)) of $snapshot_count contents cached"
fi

answer
[ -z "$missing" ] || printf '%s\n' "$missing"
