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
#   metrics <port>[,<port>...]     (optional: also read libtpu's runtime metrics there)
#   end
# Answers: boot_id=, lock=free|held <job>, then per job
#   job=<id> <state> pid=<pgid> boot_id=<id> started_at=<t> ended_at=<t>|- exit=<n>|-
#       signal=<NAME>|- cancel=0|1 process=alive|gone log_size=<n>
#   log=<id> <offset> <base64 of the bytes from offset>
# with <state> running, ended, lost (the worker rebooted or the supervisor died before
# the end was written), or unknown (no such job here). With a chips line, one line per
# process holding a chip (the portal's own jobs' among them, known by their cgroup):
#   holder=<device> pid=<pid> pgid=<pgid> start=<ticks> user=<user> job=<id>|- command=<cmdline>
# (start: the process's start time, the 22nd field of its stat, so that a later signal
# reaches this process and not another that got its pid)
# With a metrics line, metrics=ok and one line per chip libtpu reported, or
# metrics=none <why> (nothing listens on the ports, no python3, no answer in time):
#   chip=<device id> used=<HBM bytes> total=<HBM bytes> duty=<percent>
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
if grep -n -v -E '^(tpu-portal-job-status 1|end|max_bytes [0-9]{1,7}|(offset|tail) [a-z0-9][a-z0-9-]{0,63} [0-9]{1,15}|chips /dev/[A-Za-z0-9/_.*?-]{1,100}|metrics [0-9]{4,5}(,[0-9]{4,5}){0,7})$' "$input" >"$work/bad"; then
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
        read -r pid pid_start <"$dir/pid" || pid=- pid_start=0  # written a moment ago
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

# libtpu's runtime metrics (HBM used and total, duty cycle, per chip) from the local
# ports the job's libtpu serves them on (TPU_RUNTIME_METRICS_PORTS), asked as Google's
# tpu-info asks them, by a small client in python3's standard library (nothing to
# install), as nobody (whoever listens on a port answers it), a second per port, 5 s in
# all. Ports nothing listens on (/proc/net/tcp, one awk) are not asked, so a worker
# without them costs no python.
ports=""
while read -r key value; do
    [ "$key" != metrics ] || ports=$value
done <"$input"
if [ -n "$ports" ]; then
    listening=$(awk -v want="$ports" '
        BEGIN { n = split(want, w, ","); for (i = 1; i <= n; i++) hex[sprintf("%04X", w[i])] = w[i] }
        $4 == "0A" { split($2, a, ":"); p = hex[a[2]]; if (p != "" && !seen[p]++) printf "%s ", p }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null || true)
    if [ -z "$listening" ]; then
        echo "metrics=none nothing listens on port(s) $ports"
    elif ! command -v python3 >/dev/null 2>&1; then
        echo "metrics=none the worker has no python3"
    else
        # shellcheck disable=SC2086 # one argument per port
        timeout 5 setpriv --reuid=65534 --regid=65534 --clear-groups --no-new-privs \
            python3 -I -S - $listening <<'CLIENT' 2>/dev/null || echo "metrics=none no answer in time"
# A client of libtpu's RuntimeMetricService.GetRuntimeMetric over HTTP/2 without TLS
# (gRPC's local credentials add nothing on the wire), in the standard library's C
# modules alone (the socket module's imports would double the start-up). Arguments: the
# ports that listen. Prints metrics=ok and a chip= line per chip, or metrics=none.
import _socket, _struct, sys

NAMES = (b"tpu.runtime.hbm.memory.usage.bytes", b"tpu.runtime.hbm.memory.total.bytes",
         b"tpu.runtime.tensorcore.dutycycle.percent")
PATH = b"/tpu.monitoring.runtime.RuntimeMetricService/GetRuntimeMetric"
LIMIT = 1 << 20  # bytes read from one port at most
MAX_CHIPS = 64


def uvarint(buf, i):
    n = shift = 0
    while True:
        n |= (buf[i] & 127) << shift
        i += 1
        if buf[i - 1] < 128:
            return n, i
        shift += 7
        if shift > 63:
            raise ValueError("varint")


def fields(buf):
    """A protobuf message's fields: {number: [values]} (bytes for length-delimited)."""
    i, out = 0, {}
    while i < len(buf):
        key, i = uvarint(buf, i)
        kind = key & 7
        if kind == 0:
            value, i = uvarint(buf, i)
        elif kind == 1:
            value, i = buf[i:i + 8], i + 8
        elif kind == 2:
            size, i = uvarint(buf, i)
            value, i = buf[i:i + size], i + size
        elif kind == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError("wire type")
        if i > len(buf):
            raise ValueError("cut")
        out.setdefault(key >> 3, []).append(value)
    return out


def first(message, number):
    return fields(message).get(number, [b""])[0]


def text(value):  # an HPACK string literal, not Huffman-coded, shorter than 127
    return bytes([len(value)]) + value


def frame(kind, flags, stream, payload=b""):
    return _struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + _struct.pack(">I", stream) + payload


def connect(port):
    for family, host in ((_socket.AF_INET, "127.0.0.1"), (_socket.AF_INET6, "::1")):
        sock = _socket.socket(family, _socket.SOCK_STREAM)
        sock.settimeout(1)
        try:
            sock.connect((host, port))
            return sock
        except OSError:
            sock.close()
    raise OSError("no connection")


def ask(port):
    """The three metrics from one port, each {device id: value}: one connection, one
    stream per metric (POST, :path, content-type application/grpc, te trailers)."""
    sock = connect(port)
    out = [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", frame(4, 0, 0)]
    for n, name in enumerate(NAMES):
        block = (b"\x83\x86\x04" + text(PATH) + b"\x01" + text(b"localhost:%d" % port)
                 + b"\x0f\x10" + text(b"application/grpc") + b"\x00" + text(b"te") + text(b"trailers"))
        body = b"\x0a" + bytes([len(name)]) + name
        out += [frame(1, 4, 2 * n + 1, block),
                frame(0, 1, 2 * n + 1, b"\x00" + _struct.pack(">I", len(body)) + body)]
    sock.sendall(b"".join(out))
    data, done, buf, seen = {1: b"", 3: b"", 5: b""}, set(), b"", 0
    while len(done) < 3:
        while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
            more = sock.recv(65536)
            seen += len(more)
            if not more or seen > LIMIT:
                raise ValueError("cut")
            buf += more
        size = int.from_bytes(buf[:3], "big")
        kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
        payload, buf = buf[9:9 + size], buf[9 + size:]
        if kind == 0 and stream in data:
            if flags & 8:  # padded
                payload = payload[1:len(payload) - payload[0]]
            data[stream] += payload
        elif kind == 4 and not flags & 1:
            sock.sendall(frame(4, 1, 0))  # settings acknowledged
        elif kind == 6 and not flags & 1:
            sock.sendall(frame(6, 1, 0, payload))  # ping answered
        elif kind == 7:
            break  # goaway
        if stream in data and (kind == 3 or kind in (0, 1) and flags & 1):
            done.add(stream)
    sock.close()
    values = []
    for n in range(3):
        message, per = data[2 * n + 1], {}
        values.append(per)
        # A gRPC message: not compressed, its length, then MetricResponse.
        if len(message) < 5 or message[0] != 0:
            continue
        response = message[5:5 + int.from_bytes(message[1:5], "big")]
        # MetricResponse.metric (1) → TPUMetric.metrics (3) → Metric: attribute (1) →
        # value (2) → int_attr (3), the device id; gauge (3): as_double (1), as_int (2).
        for entry in fields(first(response, 1)).get(3, []):
            device = fields(first(first(entry, 1), 2)).get(3, [None])[0]
            gauge = fields(first(entry, 3))
            if 1 in gauge:
                value = _struct.unpack("<d", gauge[1][0])[0]
            elif 2 in gauge:
                value = gauge[2][0]
            else:
                continue
            if device is not None and device < MAX_CHIPS:
                per[device] = value
    return values


lines, printed = [], set()
for port in sys.argv[1:]:
    try:
        used, total, duty = ask(int(port))
    except Exception:  # a port that does not answer as libtpu does gives nothing
        continue
    chips = sorted(used)
    # Duty cycle is per chip; memory may be per core (two per chip on v2 and v3).
    cycles = [duty[d] for d in sorted(duty)]
    per = len(chips) // len(cycles) if cycles and len(chips) % len(cycles) == 0 else 0
    for n, chip in enumerate(chips):
        if chip in total and per and chip not in printed and 0 <= used[chip] <= total[chip] < 2 ** 50:
            printed.add(chip)
            cycle = min(max(float(cycles[n // per]), 0.0), 100.0)
            lines.append("chip=%d used=%d total=%d duty=%.2f" % (chip, used[chip], total[chip], cycle))
if lines:
    sys.stdout.write("metrics=ok\n" + "\n".join(lines[:MAX_CHIPS]) + "\n")
else:
    sys.stdout.write("metrics=none no answer from libtpu\n")
CLIENT
    fi
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
    stat=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null || true)
    pgid=$(printf '%s' "$stat" | cut -d ' ' -f 3)
    start=$(printf '%s' "$stat" | cut -d ' ' -f 20)
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
    echo "holder=$target pid=$pid pgid=${pgid:-?} start=${start:-?} user=$owner job=$in_job command=${command:-?}"
done <"$work/holders"
exit 0
