#!/bin/sh
# Puts a workdir snapshot's files in a folder of the person's home, as the person: the
# contents their cache on this worker lacks are stored there first (each checked
# against its sha256), then every file is copied from the cache into the folder (a new
# file renamed over the old one, with its mode). Files in the folder that the snapshot
# does not name are left alone, as rsync without --delete leaves them.
#
# Nothing here writes as root: this part only reads the header and the account, then
# the rest runs as the person (setpriv), so a symlink the person planted (the folder,
# the cache, a file) leads nowhere they could not write themselves.
#
# Input on stdin (format: tpus/remote/jobs.py, docs/jobs-host.md):
#   tpu-portal-snapshot-place 1
#   user <name>
#   dir <base64 absolute folder>   (the home or a folder in it)
#   files <count> <bytes>
#   blobs <count> <bytes>
#   end
#   <sha256> <644|755> <base64 relative path>     (files: count lines, bytes in all)
#   <sha256> <size> and then <size> bytes         (blobs: count of them, bytes in all)
# Answers placed=<files written> kept=<files already there as placed before, by size,
# mode and time, as rsync checks> received=<contents stored in the cache>.
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL

die() {
    echo "snapshot-place: $*" >&2
    exit 1
}
fits() {
    case $1 in
        "" | *[!$2]*) return 1 ;;
    esac
    [ "${#1}" -le "$3" ]
}
user="" dir_b64="" files="" blobs="" n=0 last=""
while IFS= read -r line; do
    n=$((n + 1))
    [ "$n" -le 6 ] || die "the header is longer than it may be"
    key=${line%% *} value=${line#* }
    ok=""
    case $line in
        "tpu-portal-snapshot-place 1") [ "$n" = 1 ] && ok=1 ;;
        end) ok=1 ;;
        "user "*) fits "$value" "a-z0-9-" 31 && case $value in [a-z]*) ok=1 ;; esac ;;
        "dir "*) fits "$value" "A-Za-z0-9+/=" 8192 && ok=1 ;;
        "files "* | "blobs "*)
            case $value in
                *" "*) fits "${value%% *}" 0-9 6 && fits "${value#* }" 0-9 15 && ok=1 ;;
            esac
            ;;
    esac
    [ -n "$ok" ] || die "line $n of the input is not allowed"
    [ "$n" -gt 1 ] || [ "$key" = tpu-portal-snapshot-place ] || die "the input has no header"
    last=$key
    case $key in
        user) user=$value ;;
        dir) dir_b64=$value ;;
        files) files=$value ;;
        blobs) blobs=$value ;;
        end) break ;;
    esac
done
[ "$last" = end ] || die "the input was cut off (no end)"
if [ -z "$user" ] || [ -z "$dir_b64" ] || [ -z "$files" ] || [ -z "$blobs" ]; then
    die "the input needs user, dir, files and blobs"
fi

# The account, as the name service has it: getent reads /etc/passwd a block at a time,
# where the shell's read takes a byte a system call (thousands, on a worker with many
# accounts, the portal's at the end).
entry=$(getent passwd "$user") || die "no user $user on this worker"
IFS=: read -r _ _ uid gid _ home _ <<EOF
$entry
EOF
[ "$uid" -ge 1000 ] || die "a workdir is never placed for a system account ($user has uid $uid)"
command -v python3 >/dev/null 2>&1 || die "this worker has no python3, which placing a workdir needs"

# As the person, from here on; the rest of stdin is theirs to read.
# shellcheck disable=SC2016 # the program is Python, not shell
PROGRAM='
import base64, hashlib, os, stat, sys

def fail(text):
    sys.stderr.write("snapshot-place: " + text + "\n")
    sys.exit(1)

home, dir_b64 = sys.argv[1], sys.argv[2]
n_files, files_bytes, n_blobs, blobs_bytes = (int(x) for x in sys.argv[3:7])
src = sys.stdin.buffer
os.umask(0o022)

def exactly(n):
    parts, left = [], n
    while left:
        chunk = src.read(min(left, 1 << 20))
        if not chunk:
            fail("the input ended early")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)

def plain(path):
    parts = path.split("/")
    return (path and not path.startswith("/") and len(path.encode()) <= 1024
            and not any(p in ("", ".", "..") for p in parts)
            and not any(ord(c) < 32 or ord(c) == 127 for c in path))

target = base64.b64decode(dir_b64, validate=True).decode()
if not (target == home or target.startswith(home.rstrip("/") + "/")) or "/../" in target + "/":
    fail("the folder %s is not in %s" % (target, home))
listing = []
for line in exactly(files_bytes).decode().splitlines():
    sha, mode, path_b64 = line.split(" ")
    path = base64.b64decode(path_b64, validate=True).decode()
    if len(sha) != 64 or mode not in ("644", "755") or not plain(path):
        fail("a file of the list is not allowed")
    listing.append((sha, int(mode, 8), path))
if len(listing) != n_files:
    fail("the list has %d files, not %d" % (len(listing), n_files))

def place():
    cache = os.path.join(home, ".cache", "tpu-portal", "blobs")
    os.makedirs(cache, mode=0o700, exist_ok=True)
    received, total = 0, 0
    for _ in range(n_blobs):
        head = src.readline(100).decode()
        sha, _, size = head.strip().partition(" ")
        if len(sha) != 64 or not size.isdigit():
            fail("a content has no header")
        size = int(size)
        total += len(head) + size
        tmp = os.path.join(cache, ".incoming-%d-%s" % (os.getpid(), sha))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        digest, left = hashlib.sha256(), size
        with os.fdopen(fd, "wb") as out:
            while left:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    os.unlink(tmp)
                    fail("the input ended inside a content")
                digest.update(chunk)
                out.write(chunk)
                left -= len(chunk)
        if digest.hexdigest() != sha:
            os.unlink(tmp)
            fail("a content did not match its sha256 " + sha)
        os.replace(tmp, os.path.join(cache, sha))
        received += 1
    if total != blobs_bytes:
        fail("the contents were %d bytes, not %d" % (total, blobs_bytes))

    os.makedirs(target, exist_ok=True)
    placed = kept = 0
    for sha, mode, path in listing:
        dest = os.path.join(target, path)
        folder = os.path.dirname(dest)
        try:
            os.makedirs(folder, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            fail("%s cannot be a folder: a file is in its way" % os.path.dirname(path))
        if os.path.isdir(dest) and not os.path.islink(dest):
            fail("%s is a folder on this worker; the snapshot has a file there" % path)
        try:
            source = open(os.path.join(cache, sha), "rb")
        except FileNotFoundError:
            fail("the cache lost the content of %s since the pre-flight; run the job again" % path)
        cached = os.fstat(source.fileno())
        try:
            there = os.lstat(dest)
        except FileNotFoundError:
            there = None
        # As rsync checks: a regular file of the same size and mode, with the time the
        # portal gave it from the cache, is this content placed before: left as it is.
        if (
            there is not None
            and stat.S_ISREG(there.st_mode)
            and stat.S_IMODE(there.st_mode) == mode
            and there.st_size == cached.st_size
            and there.st_mtime_ns == cached.st_mtime_ns
        ):
            source.close()
            kept += 1
            continue
        tmp = os.path.join(folder, ".tpu-portal-%d-%d" % (os.getpid(), placed))
        with source:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
                out.flush()
                os.fchmod(out.fileno(), mode)
                os.utime(out.fileno(), ns=(cached.st_atime_ns, cached.st_mtime_ns))
        os.replace(tmp, dest)
        placed += 1
    return received, placed, kept

try:
    received, placed, kept = place()
except OSError as exc:
    fail("%s: %s" % (exc.strerror or exc, exc.filename or ""))
print("placed=%d" % placed)
print("kept=%d" % kept)
print("received=%d" % received)
'
exec setpriv --reuid="$uid" --regid="$gid" --init-groups --no-new-privs -- \
    env -i "HOME=$home" PATH=/usr/local/bin:/usr/bin:/bin LC_ALL=C.UTF-8 \
    python3 -I -S -c "$PROGRAM" "$home" "$dir_b64" "${files%% *}" "${files#* }" \
    "${blobs%% *}" "${blobs#* }"
