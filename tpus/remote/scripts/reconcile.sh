#!/bin/sh
# Makes this TPU VM worker match what the portal wants: its collaborators' accounts,
# their SSH keys and sudo rights, revoked users locked out, data disks in fstab and
# mounted. The whole desired state arrives on stdin (format: tpus/remote/desired.py,
# docs/reconcile.md); running it again with the same input changes nothing.
#
# Rules this script keeps, and why:
# - Input is untrusted until checked. It is read completely into a root-only file
#   first; without its header and final "end" (a cut-off transfer) nothing changes.
#   Every line must match a strict pattern before any of it is used, fields are read
#   with `read` and always quoted, never evaluated.
# - No write as root goes through a path a collaborator controls. Their keys live in
#   /etc/ssh/tpu-portal-keys/<user> (root-owned), which sshd reads through an
#   AuthorizedKeysFile drop-in; nothing inside /home/<user> is touched, except that
#   useradd creates the home when it creates the account.
# - Files are replaced atomically (a temporary file in the same directory, then mv),
#   and sudoers files and the sshd configuration are validated before they count.
# - One collaborator's problem (a UID clash) is reported as user_error and does not
#   stop the others; the script fails as a whole only for bad input or a broken sshd.
#
# Answers with key=value lines on stdout (see docs/reconcile.md).
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
LC_ALL=C
export PATH LC_ALL
umask 022
# Functions declare their variables with `local` (dash, bash and busybox sh all have it),
# so one step cannot overwrite the loop variables of another.

KEYS_DIR=/etc/ssh/tpu-portal-keys
DROPIN=/etc/ssh/sshd_config.d/50-tpu-portal.conf
SUDOERS_DIR=/etc/sudoers.d
FSTAB=/etc/fstab
FSTAB_MARK='# tpu-portal'
LOCK=/run/tpu-portal-reconcile.lock
MAX_INPUT=16777216
MAX_LINE=4400

changed=0 users_created=0 keys_written=0 keys_removed=0 sudo_files=0 revoked=0
processes_killed=0 mounted=0 unmounted=0 formatted=0 fstab_written=0 sshd_reloaded=0
inflight=""

die() {
    echo "reconcile: $*" >&2
    exit 1
}

work=$(mktemp -d)
cleanup() {
    if [ -n "$inflight" ]; then rm -f -- "$inflight"; fi
    rm -rf -- "$work"
}
trap cleanup EXIT
trap 'exit 1' HUP INT TERM

# Keep a reason on one line of safe characters: it goes back to the portal as a value.
oneline() {
    printf '%s' "$1" | tr -c 'A-Za-z0-9 ._:,/()=@+-' ' ' | cut -c 1-300
}

user_error() {
    echo "user_error=$1:$(oneline "$2")"
}

mount_error() {
    echo "mount_error=$1:$(oneline "$2")"
}

# ---------------------------------------------------------------------------------
# 1. Read and check the input. Nothing on the host changes before this is done.
# ---------------------------------------------------------------------------------
input=$work/input
head -c $((MAX_INPUT + 1)) >"$input"
# One awk for its shape: its size (each line's length plus its newline, summed), the
# length of each line, and whether the last line is "end". A last line without its
# newline counts one byte too many; the loop below refuses such an input (and grep one
# with a NUL byte, which not every awk counts).
shape=$(awk -v max="$MAX_LINE" -v most="$MAX_INPUT" '
    length($0) > max { print "line " NR; long = 1; exit }
    { bytes += length($0) + 1 }
    END { if (long) exit; if (bytes > most) print "size"; else if ($0 != "end") print "cut" }
    ' "$input")
case $shape in
size) die "the desired state is larger than $MAX_INPUT bytes" ;;
line*) die "$shape of the input is too long; nothing was changed" ;;
esac
first=""
IFS= read -r first <"$input" || true
[ "$first" = "tpu-portal-desired 1" ] || die "the input does not start with 'tpu-portal-desired 1'"
[ "$shape" != cut ] || die "the input does not end with 'end': it was cut short, nothing was changed"

# Each line must be one of these records, whole (-x), nothing else: no options before
# a key, no second key, no control characters, no quotes, no '$', no tabs.
KEY_TYPES='(ssh-ed25519|sk-ssh-ed25519@openssh\.com|ecdsa-sha2-nistp(256|384|521)|sk-ecdsa-sha2-nistp256@openssh\.com|ssh-rsa)'
NAME='[a-z][a-z0-9-]{0,30}'
NUMBER='[1-9][0-9]{0,9}'
bad=$(grep -a -n -v -x -E -m 1 \
    -e 'tpu-portal-desired 1' \
    -e "range $NUMBER $NUMBER" \
    -e "user $NAME $NUMBER [01] [01]" \
    -e "key $NAME $KEY_TYPES [A-Za-z0-9+/]+={0,2}( [A-Za-z0-9._@:+=/-]{1,100})?" \
    -e 'mount [a-z]([a-z0-9-]{0,61}[a-z0-9])? (/[A-Za-z0-9._-]+)+ (ro|rw)' \
    -e 'end' \
    "$input") || true
[ -z "$bad" ] || die "line ${bad%%:*} of the input is not a valid record; nothing was changed"

# Split the records into files of our own private folder, checking each field again
# and where each record may stand. Duplicates are found with lists kept in variables
# (" 30001 30002 "): every field was checked above to hold no space and no pattern
# character, and "$x" in a case pattern matches literally.
: >"$work/users"
: >"$work/mounts"
uid_min="" uid_max="" line_no=0 ended=0 uids=" " devices=" " points=" "
while IFS=' ' read -r kind f1 f2 f3 f4 rest <&3; do
    line_no=$((line_no + 1))
    [ "$ended" = 0 ] || die "'end' appears before the end"
    if [ "$line_no" = 2 ] && [ "$kind" != range ]; then die "line 2 must be the UID range"; fi
    case $kind in
    tpu-portal-desired) [ "$line_no" = 1 ] || die "the header appears twice" ;;
    end) ended=1 ;;
    range)
        [ "$line_no" = 2 ] || die "the UID range appears twice"
        case $f1$f2 in *[!0-9]*) die "bad UID range" ;; esac
        uid_min=$f1 uid_max=$f2
        [ "$uid_min" -ge 1000 ] && [ "$uid_min" -le "$uid_max" ] &&
            [ "$uid_max" -le 2000000000 ] || die "the UID range must lie within 1000..2000000000"
        ;;
    user)
        case $f1 in [a-z]*) ;; *) die "bad username" ;; esac
        case $f1 in *[!a-z0-9-]*) die "bad username" ;; esac
        case $f2 in *[!0-9]*) die "bad uid" ;; esac
        case $f3$f4 in [01][01]) ;; *) die "bad flags for $f1" ;; esac
        [ "$f2" -ge "$uid_min" ] && [ "$f2" -le "$uid_max" ] &&
            [ "$f2" != 65534 ] && [ "$f2" != 65535 ] ||
            die "uid $f2 of $f1 is outside the UID range"
        if [ -e "$work/keys.$f1" ]; then die "$f1 is listed twice"; fi
        # Numbers have no leading zeros (checked above), so equal text is equal uid.
        case $uids in *" $f2 "*) die "a uid is listed twice" ;; esac
        uids="$uids$f2 "
        : >"$work/keys.$f1"
        echo "$f1 $f2 $f3 $f4" >>"$work/users"
        ;;
    key)
        case $f1 in *[!a-z0-9-]*) die "bad username in a key" ;; esac
        case $f3 in *[!A-Za-z0-9+/=]*) die "bad key data for $f1" ;; esac
        case $f4 in *[!A-Za-z0-9._@:+=/-]*) die "bad key comment for $f1" ;; esac
        [ -z "$rest" ] || die "a key line for $f1 has extra fields"
        [ -f "$work/keys.$f1" ] || die "a key for $f1 comes before (or without) its user"
        if [ -n "$f4" ]; then
            echo "$f2 $f3 $f4" >>"$work/keys.$f1"
        else
            echo "$f2 $f3" >>"$work/keys.$f1"
        fi
        ;;
    mount)
        case $f1 in *[!a-z0-9-]*) die "bad device name" ;; esac
        case $f2 in
        */ | *//* | */./* | */../* | */. | */..) die "mount point $f2 has '.' or '..' parts" ;;
        /bin | /bin/* | /boot | /boot/* | /dev | /dev/* | /etc | /etc/* | /home | /home/* | \
            /lib | /lib/* | /lib32 | /lib32/* | /lib64 | /lib64/* | /libx32 | /libx32/* | \
            /proc | /proc/* | /root | /root/* | /run | /run/* | /sbin | /sbin/* | \
            /snap | /snap/* | /sys | /sys/* | /tmp | /tmp/* | /usr | /usr/* | /var | /var/*)
            die "disks are never mounted at or under a system folder or /home ($f2)"
            ;;
        /[A-Za-z0-9._-]*) ;;
        *) die "bad mount point" ;;
        esac
        case $f2 in *[!A-Za-z0-9._/-]*) die "bad mount point" ;; esac
        case $f3 in ro | rw) ;; *) die "bad mount mode" ;; esac
        case $devices in *" $f1 "*) die "a device is listed twice" ;; esac
        case $points in *" $f2 "*) die "a mount point is listed twice" ;; esac
        devices="$devices$f1 " points="$points$f2 "
        echo "$f1 $f2 $f3" >>"$work/mounts"
        ;;
    *) die "unknown record" ;;
    esac
done 3<"$input"
# `read` fails on a last line without its newline, leaving that line's text behind.
[ -z "$kind$f1$f2$f3$f4$rest" ] || die "the last line has no newline: the input was cut short, nothing was changed"
[ "$ended" = 1 ] || die "the input does not end with 'end': it was cut short, nothing was changed"
[ -n "$uid_min" ] || die "no UID range"

# One reconcile at a time on this host (the portal also locks per VM). /run is
# root-owned, unlike /run/lock, so no one can plant a symlink at this path.
exec 9>>"$LOCK"
flock -w 120 9 || die "another reconcile has been running for two minutes"
if [ -L "$FSTAB" ]; then die "$FSTAB is a symlink; not replacing it"; fi

# ---------------------------------------------------------------------------------
# 2. Host preparation (once per host; afterwards only checked): where keys live.
# ---------------------------------------------------------------------------------
# Does path $1 hold exactly the content of $2, as a plain file owned by root with mode $3?
same_file() {
    [ -f "$1" ] && [ ! -L "$1" ] && cmp -s -- "$2" "$1" &&
        [ "$(stat -c '%a %u %g' -- "$1")" = "$3 0 0" ]
}

# Write $2 (a file of ours) to path $1 atomically with mode $3, through a temporary
# file in the target's own folder (rename never follows a symlink at the target).
# Every folder written to is root's alone (the keys folder is checked; /etc, its ssh
# folders and /run are the system's), so a fixed temporary name is safe there; install
# removes whatever a killed run left under it and creates the file anew (O_EXCL).
# Returns 1 (and changes nothing) when the target already has that content and mode.
replace_file() {
    if same_file "$1" "$2" "$3"; then return 1; fi
    inflight=${1%/*}/.tpu-portal.$$
    install -m "$3" -- "$2" "$inflight"
    mv -f -- "$inflight" "$1"
    inflight=""
    return 0
}

reload_sshd() {
    local pid tries
    if [ -d /run/systemd/system ]; then
        systemctl try-reload-or-restart ssh.service 2>/dev/null ||
            systemctl try-reload-or-restart sshd.service ||
            die "sshd could not be reloaded"
    elif [ -s /run/sshd.pid ]; then
        pid=$(head -n 1 /run/sshd.pid)
        case $pid in '' | *[!0-9]*) die "/run/sshd.pid does not hold a process id" ;; esac
        # sshd re-executes itself on SIGHUP and writes its pid file again once it
        # listens; waiting for that keeps the next login from meeting a closed port.
        rm -f /run/sshd.pid
        kill -HUP "$pid" || die "sshd (pid $pid) could not be signalled"
        tries=0
        while [ ! -s /run/sshd.pid ] && [ "$tries" -lt 100 ]; do
            sleep 0.05
            tries=$((tries + 1))
        done
    else
        return 0 # no sshd running: it reads the configuration when it starts
    fi
    sshd_reloaded=1
}

if [ -L "$KEYS_DIR" ] || { [ -e "$KEYS_DIR" ] && [ ! -d "$KEYS_DIR" ]; }; then
    die "$KEYS_DIR exists and is not a folder"
fi
# The user's own ~/.ssh/authorized_keys keeps working (keys a collaborator adds by
# hand); the portal's file comes last. sshd uses the first value it reads for an
# option, and Debian's sshd_config includes sshd_config.d/*.conf at its top.
DROPIN_TEXT='# Managed by TPU Portal. Collaborators'"'"' keys are kept in root-owned files, so the
# portal never writes inside a home directory.
AuthorizedKeysFile .ssh/authorized_keys .ssh/authorized_keys2 /etc/ssh/tpu-portal-keys/%u'
printf '%s\n' "$DROPIN_TEXT" >"$work/dropin"

# Checking the sshd configuration (sshd -t, sshd -T) costs more than the rest of a
# no-op run. It is done in full whenever anything sshd reads may have changed since
# the last run that passed it: the stamp holds the drop-in this script wants and, for
# the sshd binary, sshd_config, the sshd_config.d folder and every file in it, the
# inode, size, modification and change times (in ns), mode and owner. Any edit,
# rename, chmod or new file changes one of these. The facts are taken *before* the
# check, so a change made while it runs is seen by the next run. The stamp lives in
# /run (root-only, emptied at boot: the first run after a boot checks in full).
SSHD_STAMP=/run/tpu-portal-sshd.checked
{
    printf '%s\n' "$DROPIN_TEXT"
    stat -L -c '%n %F %i %s %.9Y %.9Z %a %u %g' -- /usr/sbin/sshd /etc/ssh/sshd_config \
        /etc/ssh/sshd_config.d /etc/ssh/sshd_config.d/* 2>/dev/null || true
} >"$work/sshd-facts"
if [ -f "$SSHD_STAMP" ] && [ ! -L "$SSHD_STAMP" ] && cmp -s -- "$work/sshd-facts" "$SSHD_STAMP"; then
    : # checked before, nothing sshd reads has changed since
else
    reload=0
    if ! same_file "$DROPIN" "$work/dropin" 644; then
        mkdir -p /etc/ssh/sshd_config.d
        if ! reason=$(/usr/sbin/sshd -t 2>&1); then
            die "the sshd configuration is already invalid; not touching it: $(oneline "$reason")"
        fi
        had_dropin=0
        if [ -f "$DROPIN" ]; then
            cp -p -- "$DROPIN" "$work/dropin.before"
            had_dropin=1
        fi
        replace_file "$DROPIN" "$work/dropin" 644 || true
        if ! reason=$(/usr/sbin/sshd -t 2>&1); then
            if [ "$had_dropin" = 1 ]; then
                # As it was: content, mode and modification time.
                replace_file "$DROPIN" "$work/dropin.before" "$(stat -c %a -- "$work/dropin.before")" || true
                touch -r "$work/dropin.before" -- "$DROPIN"
            else
                rm -f -- "$DROPIN"
            fi
            die "sshd -t refused the configuration with the portal's drop-in (removed again): $(oneline "$reason")"
        fi
        changed=$((changed + 1))
        reload=1
    fi
    # sshd writes its pid file whenever it (re)starts, after reading its configuration.
    # A pid file older than the drop-in means a run wrote it but stopped before the
    # reload (that run wrote no stamp, so this check runs).
    if [ -s /run/sshd.pid ] && [ -z "$(find /run/sshd.pid -newer "$DROPIN" 2>/dev/null)" ]; then
        reload=1
    fi
    # Someone's earlier drop-in (or a line above the Include) could set AuthorizedKeysFile
    # first; then the portal's keys would be ignored, so say so rather than pretend.
    if ! settings=$(/usr/sbin/sshd -T 2>&1); then
        die "sshd -T fails, the sshd configuration is broken: $(oneline "$(echo "$settings" | tail -n 1)")"
    fi
    effective=$(echo "$settings" | grep -i '^authorizedkeysfile ' || true)
    case " $effective " in
    *" /etc/ssh/tpu-portal-keys/%u "*) ;;
    *) die "sshd does not use the portal's key files (AuthorizedKeysFile is set elsewhere first): $(oneline "$effective")" ;;
    esac
    if [ "$reload" = 1 ]; then reload_sshd; fi
    inflight=$(mktemp /run/.tpu-portal.XXXXXX)
    cat -- "$work/sshd-facts" >"$inflight"
    mv -f -- "$inflight" "$SSHD_STAMP"
    inflight=""
fi

# ---------------------------------------------------------------------------------
# 3. Users.
# ---------------------------------------------------------------------------------
# The keys folder is made only now, once sshd accepted the drop-in that names it. Its
# owner and mode are checked (and set) below, with its files, before any of them is
# written.
if [ ! -d "$KEYS_DIR" ]; then
    mkdir -m 0755 "$KEYS_DIR"
    changed=$((changed + 1))
fi

# The live processes (not zombies) that belong to uid $1: by real or effective uid,
# or by login uid, which survives `sudo` and `su` started from the user's session.
pids_of_uid() {
    {
        ps -e -o pid=,ruid=,euid= | awk -v u="$1" '$2 == u || $3 == u { print $1 }'
        grep -l -x -- "$1" /proc/[0-9]*/loginuid 2>/dev/null | cut -d / -f 3
    } | grep -v -x -- "$$" | sort -u | while read -r p; do
        state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$p/status" 2>/dev/null)
        case $state in '' | Z | X) ;; *) echo "$p" ;; esac
    done
}

# Kill every process of uid $1; bounded, so a stuck process cannot hang the run.
kill_processes() {
    local pids count tries
    pids=$(pids_of_uid "$1")
    [ -n "$pids" ] || return 0
    count=$(echo "$pids" | wc -l)
    tries=0
    while [ -n "$pids" ] && [ "$tries" -lt 50 ]; do
        # shellcheck disable=SC2086  # a list of numbers from ps and /proc
        kill -KILL $pids 2>/dev/null || true
        sleep 0.1
        pids=$(pids_of_uid "$1")
        tries=$((tries + 1))
    done
    processes_killed=$((processes_killed + count))
    changed=$((changed + 1))
    [ -z "$pids" ] || return 1
}

# Remove the portal's files for $1 (its keys file and its sudoers file).
remove_portal_files() {
    if [ -e "$KEYS_DIR/$1" ] || [ -L "$KEYS_DIR/$1" ]; then
        rm -f -- "$KEYS_DIR/$1"
        keys_removed=$((keys_removed + 1))
        changed=$((changed + 1))
    fi
    if [ -e "$SUDOERS_DIR/tpu-portal-$1" ] || [ -L "$SUDOERS_DIR/tpu-portal-$1" ]; then
        rm -f -- "$SUDOERS_DIR/tpu-portal-$1"
        sudo_files=$((sudo_files + 1))
        changed=$((changed + 1))
    fi
}

# What the host knows about the listed users is read once, not asked per user: the
# account databases as getent lists them and the type, mode, owner, size and content
# of the portal's own files, joined with the list by one awk. The loop at the end of
# this section reads one line per user into these variables, which the functions
# below use:
#   name uid active sudo          the input
#   pw_found pw_uid pw_gid pw_shell          `getent passwd NAME` (first entry wins)
#   gr_found gr_gid                          `getent group NAME`
#   sh_found sh_password sh_expire           `getent shadow NAME` (fields 2 and 8)
#   keys_same sudo_same           1: the keys / sudoers file is a plain file of root's
#                                 with the right mode, size and content already
# Only a user's own steps change their entries, and names and uids are unique in the
# input, so what was read stays true for every user still to come. A name the listing
# does not have (an NSS source that does not enumerate, or an account still to be
# made) is asked of getent directly, with its uid, as before any account is created.
# The same awk finds the drift (accounts in /etc/passwd inside the portal's UID range
# that it did not list) and whether fstab has a line of ours.
getent passwd >"$work/passwd" || true
getent group >"$work/group" || true
getent shadow >"$work/shadow" || true
SUDO_RULE=' ALL=(ALL:ALL) NOPASSWD:ALL'
stat -c '%a %u %g %s %F|%n' -- "$KEYS_DIR" "$KEYS_DIR"/* "$SUDOERS_DIR"/tpu-portal-* \
    "$work"/keys.* >"$work/files" 2>/dev/null || true
# The keys folder comes first: root's alone, so that no one else can swap its files.
keys_dir_meta=""
IFS= read -r keys_dir_meta <"$work/files" || true
case $keys_dir_meta in
"755 0 0 "*" directory|$KEYS_DIR") ;;
*)
    chown 0:0 "$KEYS_DIR"
    chmod 0755 "$KEYS_DIR"
    changed=$((changed + 1))
    ;;
esac
fstab_in=$FSTAB
[ -f "$FSTAB" ] || fstab_in=/dev/null
# A file's content is compared as its lines, each with a newline: with equal sizes,
# equal lines mean equal bytes (a missing last newline or a cut at a NUL byte would
# make the lines shorter than the size).
awk -v keys="$KEYS_DIR/" -v sudoers="$SUDOERS_DIR/tpu-portal-" -v work="$work/" \
    -v rule="$SUDO_RULE" -v lo="$uid_min" -v hi="$uid_max" -v mark=" $FSTAB_MARK" '
    function fits(path, mode, size, m) {
        if (!(path in meta)) return 0
        split(meta[path], m, " ")
        return m[1] == mode && m[2] == 0 && m[3] == 0 && m[4] == size &&
            m[5] == "regular" && m[6] == "file" && m[7] == ""
    }
    function content(path, line, text) {
        text = ""
        while ((getline line < path) > 0) text = text line "\n"
        close(path)
        return text
    }
    FILENAME == ARGV[1] { split($0, f, ":"); if (!(f[1] in pw)) pw[f[1]] = f[3] ":" f[4] ":" f[7]; next }
    FILENAME == ARGV[2] { split($0, f, ":"); if (!(f[1] in gr)) gr[f[1]] = f[3]; next }
    FILENAME == ARGV[3] { split($0, f, ":"); if (!(f[1] in sh)) sh[f[1]] = f[2] ":" f[8]; next }
    FILENAME == ARGV[4] { i = index($0, "|"); meta[substr($0, i + 1)] = substr($0, 1, i - 1); next }
    FILENAME == ARGV[5] {
        n = $1; listed[n] = 1; keys_same = 0; sudo_same = 0
        split(meta[work "keys." n], want, " ")
        if ($3 == 1 && want[4] > 0 && fits(keys n, 644, want[4]) &&
            content(keys n) == content(work "keys." n)) keys_same = 1
        if ($3 == 1 && $4 == 1 && fits(sudoers n, 440, length(n rule) + 1) &&
            content(sudoers n) == n rule "\n") sudo_same = 1
        print n ":" $2 ":" $3 ":" $4 ":" (n in pw ? "1:" pw[n] : "0:::") ":" \
            (n in gr ? "1:" gr[n] : "0:") ":" (n in sh ? "1:" sh[n] : "0::") ":" \
            keys_same ":" sudo_same
        next
    }
    FILENAME == ARGV[6] {
        # Names are made safe as oneline() does: one line of safe characters, 300 at most.
        split($0, f, ":")
        if (f[3] ~ /^[0-9]+$/ && f[3] + 0 >= lo && f[3] + 0 <= hi && !(f[1] in listed) &&
            !seen[f[1]]++) {
            n = f[1]
            gsub("[^-A-Za-z0-9 ._:,/()=@+]", " ", n)
            print "drift_user=" substr(n, 1, 300) > (work "drift")
        }
        next
    }
    substr($0, length($0) - length(mark) + 1) == mark { ours = 1 }
    END { if (ours) printf "" > (work "fstab-ours") }
    ' "$work/passwd" "$work/group" "$work/shadow" "$work/files" "$work/users" /etc/passwd \
    "$fstab_in" >"$work/facts"

# Ask NSS directly about an account the listing did not have (sets the pw_ variables),
# and who holds its uid: one getent for both, which prints the entry for the name (if
# any) and then the one for the number (if any). Only without an entry for the name is
# the owner of the number needed, and then every line printed is that owner's.
lookup_account() {
    local entries n x u g sh
    pw_found=0 pw_uid="" pw_gid="" pw_shell=""
    entries=$(getent passwd "$name" "$uid" || true)
    while IFS=: read -r n x u g x x sh; do
        if [ "$n" = "$name" ] && [ "$pw_found" = 0 ]; then
            pw_found=1 pw_uid=$u pw_gid=$g pw_shell=$sh
        elif [ -z "$uid_owner" ] && [ -n "$n" ]; then
            uid_owner=$n
        fi
    done <<END
$entries
END
}

# The same for a group (sets the gr_ variables), and who holds the gid.
lookup_group() {
    local entries n x g
    gr_found=0 gr_gid=""
    entries=$(getent group "$name" "$uid" || true)
    while IFS=: read -r n x g x; do
        if [ "$n" = "$name" ] && [ "$gr_found" = 0 ]; then
            gr_found=1 gr_gid=$g
        elif [ -z "$gid_owner" ] && [ -n "$n" ]; then
            gid_owner=$n
        fi
    done <<END
$entries
END
}

# The account $name with uid $uid and group $name (gid $uid) exists, or the reason it
# cannot; $1 and $2 are the password and expiry fields for a new account. Never
# re-numbers anything: a name or number that belongs to someone else stops here.
ensure_account() {
    local out
    uid_owner="" gid_owner=""
    if [ "$pw_found" = 0 ]; then lookup_account; fi
    if [ "$pw_found" = 1 ]; then
        [ "$pw_uid" = "$uid" ] || {
            user_error "$name" "the account exists with uid $pw_uid, the portal says $uid"
            return 1
        }
    else
        [ -z "$uid_owner" ] || {
            user_error "$name" "uid $uid belongs to $uid_owner"
            return 1
        }
    fi
    if [ "$gr_found" = 0 ]; then lookup_group; fi
    if [ "$gr_found" = 1 ]; then
        [ "$gr_gid" = "$uid" ] || {
            user_error "$name" "the group $name exists with gid $gr_gid, the portal says $uid"
            return 1
        }
    else
        [ -z "$gid_owner" ] || {
            user_error "$name" "gid $uid belongs to the group $gid_owner"
            return 1
        }
        out=$(groupadd -g "$uid" -- "$name" 2>&1) || {
            user_error "$name" "groupadd: $out"
            return 1
        }
        changed=$((changed + 1))
    fi
    if [ "$pw_found" = 0 ]; then
        # -m makes the home only if it is missing (then from /etc/skel); an existing
        # home, say of an earlier account, is left as it is.
        out=$(useradd -m -d "/home/$name" -s /bin/bash -u "$uid" -g "$uid" \
            -p "$1" -e "$2" -c '' -- "$name" 2>&1) || {
            user_error "$name" "useradd: $out"
            return 1
        }
        created=1
        users_created=$((users_created + 1))
        changed=$((changed + 1))
        return 0
    fi
    if [ "$pw_shell" != /bin/bash ] || [ "$pw_gid" != "$uid" ]; then
        out=$(usermod -s /bin/bash -g "$uid" -- "$name" 2>&1) || {
            user_error "$name" "usermod: $out"
            return 1
        }
        changed=$((changed + 1))
    fi
}

# The shadow entry of $name has password field $1 and expiry field $2 (days since
# 1970, empty for never); returns 1 if it had to be changed, 2 if it could not be.
ensure_shadow() {
    local entry x out
    # useradd has just written both fields, as given.
    if [ "$created" = 1 ]; then return 0; fi
    if [ "$sh_found" = 0 ]; then
        # Not in the listing: ask now.
        sh_password="" sh_expire=""
        entry=$(getent shadow "$name" || true)
        if [ -n "$entry" ]; then
            IFS=: read -r x sh_password x x x x x sh_expire x <<END
$entry
END
        fi
    fi
    if [ "$sh_password" = "$1" ] && [ "$sh_expire" = "$2" ]; then
        return 0
    fi
    out=$(usermod -p "$1" -e "$2" -- "$name" 2>&1) || {
        user_error "$name" "usermod: $out"
        return 2
    }
    changed=$((changed + 1))
    return 1
}

converge_active() {
    local rc target out
    ensure_account '*' '' || return 0
    # '*' is no password at all (never a known one); no expiry, not locked.
    rc=0
    ensure_shadow '*' '' || rc=$?
    [ "$rc" != 2 ] || return 0

    if [ -s "$work/keys.$name" ]; then
        if [ "$keys_same" = 1 ]; then
            :
        elif replace_file "$KEYS_DIR/$name" "$work/keys.$name" 644; then
            keys_written=$((keys_written + 1))
            changed=$((changed + 1))
        fi
        : >"$work/keep-key.$name"
    fi

    if [ "$sudo" = 1 ]; then
        echo "$name$SUDO_RULE" >"$work/sudo"
        target=$SUDOERS_DIR/tpu-portal-$name
        if [ "$sudo_same" != 1 ]; then
            # The temporary name has a '.', so sudo ignores it until it is checked
            # and renamed.
            inflight=$SUDOERS_DIR/.tpu-portal.$$
            install -m 0440 -- "$work/sudo" "$inflight"
            if out=$(visudo -c -q -f "$inflight" 2>&1); then
                mv -f -- "$inflight" "$target"
                inflight=""
                sudo_files=$((sudo_files + 1))
                changed=$((changed + 1))
            else
                rm -f -- "$inflight"
                inflight=""
                user_error "$name" "visudo refused the sudoers file: $out"
                return 0
            fi
        fi
        : >"$work/keep-sudo.$name"
    fi
}

converge_revoked() {
    local rc
    # The account stays (its uid stays reserved, its files keep their owner) but
    # cannot be used: locked ('!*') and expired (day 1), so sshd refuses it under
    # UsePAM even with keys in the user's own ~/.ssh.
    ensure_account '!*' 1 || return 0
    remove_portal_files "$name"
    rc=0
    ensure_shadow '!*' 1 || rc=$?
    [ "$rc" != 2 ] || return 0
    [ "$rc" = 0 ] || revoked=$((revoked + 1))
    # Their processes are killed below, once every account is locked.
    echo "$name $uid" >>"$work/revoked"
}

: >"$work/revoked"
while IFS=: read -r name uid active sudo pw_found pw_uid pw_gid pw_shell \
    gr_found gr_gid sh_found sh_password sh_expire keys_same sudo_same <&3; do
    created=0
    if [ "$active" = 1 ]; then
        converge_active
    else
        converge_revoked
    fi
done 3<"$work/facts"

# Processes of revoked users. One look at the process table for all of them, taken
# after every account is locked (no new session can start meanwhile): a uid owns a
# process by real or effective uid, or by login uid, which survives `sudo` and `su`
# started from the user's session; zombies do not count, nor this script. Only a user
# found there goes through kill_processes, which looks again for itself.
if [ -s "$work/revoked" ]; then
    ps -e -o pid=,ruid=,euid=,s= >"$work/ps"
    grep -H -s . /proc/[0-9]*/loginuid >"$work/loginuids" || true
    busy=" $(awk -v self="$$" '
        FILENAME == ARGV[1] { want[$2] = 1; next }
        FILENAME == ARGV[2] {
            state[$1] = $4
            if ($2 in want) owner[$1, $2] = 1
            if ($3 in want) owner[$1, $3] = 1
            next
        }
        {   # /proc/<pid>/loginuid:<uid>; a pid missing from ps counts as alive
            split($0, f, ":"); split(f[1], p, "/")
            if (f[2] in want) owner[p[3], f[2]] = 1
        }
        END {
            for (k in owner) {
                split(k, pu, SUBSEP)
                if (pu[1] != self && state[pu[1]] != "Z" && state[pu[1]] != "X" && !(pu[2] in out)) {
                    out[pu[2]] = 1
                    printf "%s ", pu[2]
                }
            }
        }' "$work/revoked" "$work/ps" "$work/loginuids") "
    while read -r name uid <&3; do
        case $busy in
        *" $uid "*) kill_processes "$uid" || user_error "$name" "some processes survived SIGKILL" ;;
        esac
    done 3<"$work/revoked"
fi

# The portal's own folders hold files only for users it listed and could set up; a
# user whose account clashed gets none (the name may belong to someone else here).
# (A name too long for a marker file cannot be a user's: the test fails, it goes.)
for path in "$KEYS_DIR"/* "$KEYS_DIR"/.[!.]* "$KEYS_DIR"/..?*; do
    [ -e "$path" ] || [ -L "$path" ] || continue
    base=${path##*/}
    if [ ! -e "$work/keep-key.$base" ]; then
        rm -f -- "$path"
        keys_removed=$((keys_removed + 1))
        changed=$((changed + 1))
    fi
done
for path in "$SUDOERS_DIR"/tpu-portal-* "$SUDOERS_DIR"/.tpu-portal.*; do
    [ -e "$path" ] || [ -L "$path" ] || continue
    base=${path##*/}
    case $base in
    tpu-portal-*) if [ -e "$work/keep-sudo.${base#tpu-portal-}" ]; then continue; fi ;;
    esac
    rm -f -- "$path"
    sudo_files=$((sudo_files + 1))
    changed=$((changed + 1))
done

# Accounts in the portal's UID range that it did not list (found by the awk above):
# reported, never removed.
if [ -s "$work/drift" ]; then
    while IFS= read -r line; do echo "$line"; done <"$work/drift"
fi

# ---------------------------------------------------------------------------------
# 4. Data disks: an fstab line each (nofail, so a missing disk never stops a boot),
#    mounted when the disk is there.
# ---------------------------------------------------------------------------------
# Is every existing folder on the way to $1 a real folder that only root can change?
# Then a mkdir or mount there cannot be redirected by anyone else.
safe_path() {
    local walk rest part perms mode
    walk=""
    rest=${1#/}
    while [ -n "$rest" ]; do
        part=${rest%%/*}
        case $rest in */*) rest=${rest#*/} ;; *) rest="" ;; esac
        walk=$walk/$part
        if [ -L "$walk" ]; then return 1; fi
        if [ ! -e "$walk" ]; then return 0; fi
        [ -d "$walk" ] || return 1
        if [ -n "$rest" ]; then
            perms=$(stat -c '%u %a' -- "$walk")
            case $perms in
            "0 "*) ;;
            *) return 1 ;;
            esac
            mode=${perms#0 }
            # group or others may write: someone else could swap what is inside
            case $mode in *[2367]? | *[2367]) return 1 ;; esac
        fi
    done
}

# The disks' part of fstab and their mounts; run only when there is something to do:
# a disk is wanted here, or fstab still has a line of ours.
converge_disks() {
    local device point mode source rest line options fstype now current out wanted fresh blank
    : >"$work/fstab-managed"
    while IFS=' ' read -r device point mode <&3; do
        # A line the portal does not manage already mounts something here: leave both.
        if [ -f "$FSTAB" ] && awk -v p="$point" \
            '$1 !~ /^#/ && $2 == p && $0 !~ / # tpu-portal$/ { found = 1 } END { exit !found }' "$FSTAB"; then
            mount_error "$device" "fstab already has an entry for $point"
            continue
        fi
        # Checked before the fstab line is written: at boot, mount would follow the path too.
        if ! safe_path "$point"; then
            mount_error "$device" "$point is not a plain folder or lies below a symlink or a folder others can write to"
            continue
        fi
        echo "/dev/disk/by-id/google-$device $point ext4 $mode,discard,defaults,nofail 0 2 $FSTAB_MARK" \
            >>"$work/fstab-managed"
    done 3<"$work/mounts"

    # Mount points of ours that are no longer wanted: unmount them first (the portal
    # detaches the disk after this run), then drop their lines from fstab. A line whose
    # disk is still busy stays, so the next run tries again (and reports it again).
    wanted=" "
    while read -r source point rest <&3; do
        wanted="$wanted$point "
    done 3<"$work/fstab-managed"
    : >"$work/still-mounted"
    grep -e " $FSTAB_MARK\$" "$FSTAB" 2>/dev/null | grep -v -x -F -f "$work/fstab-managed" >"$work/unwanted" || true
    while IFS= read -r line <&3; do
        IFS=' ' read -r source point rest <<END
$line
END
        case $point in /*) ;; *) continue ;; esac
        # Points of ours hold no space or pattern character; "$point" matches literally.
        case $wanted in *" $point "*) continue ;; esac
        if mountpoint -q -- "$point" &&
            [ "$(findmnt -n -o SOURCE --mountpoint "$point")" = "$(readlink -f -- "$source")" ]; then
            if out=$(umount -- "$point" 2>&1); then
                unmounted=$((unmounted + 1))
                changed=$((changed + 1))
            else
                mount_error "${source#/dev/disk/by-id/google-}" "cannot unmount $point: $out"
                echo "$line" >>"$work/still-mounted"
            fi
        fi
    done 3<"$work/unwanted"

    if [ -e "$FSTAB" ]; then
        grep -v -e " $FSTAB_MARK\$" "$FSTAB" >"$work/fstab" || true
    else
        : >"$work/fstab"
    fi
    cat "$work/fstab-managed" "$work/still-mounted" >>"$work/fstab"
    if ! { [ -e "$FSTAB" ] && cmp -s "$work/fstab" "$FSTAB"; }; then
        replace_file "$FSTAB" "$work/fstab" 644 || true
        fstab_written=1
        changed=$((changed + 1))
    fi

    while read -r source point fstype options rest <&3; do
        device=${source#/dev/disk/by-id/google-}
        mode=${options%%,*}
        if [ ! -d "$point" ]; then
            mkdir -p -m 0755 -- "$point"
            changed=$((changed + 1))
        fi
        if [ ! -b "$source" ]; then
            echo "waiting_device=$device"
            continue
        fi
        if mountpoint -q -- "$point"; then
            now=$(findmnt -n -o SOURCE --mountpoint "$point")
            if [ "$now" != "$(readlink -f -- "$source")" ]; then
                mount_error "$device" "$point has another filesystem mounted ($now)"
                continue
            fi
            current=$(findmnt -n -o OPTIONS --mountpoint "$point" | cut -d , -f 1)
            if [ "$current" != "$mode" ]; then
                if out=$(mount -o "remount,$mode" -- "$point" 2>&1); then
                    changed=$((changed + 1))
                else
                    mount_error "$device" "cannot remount $point $mode: $out"
                fi
            fi
            continue
        fi
        # Mounting over files would hide them (a collaborator's data written there while
        # the disk was away, say): only an empty folder becomes a mount point.
        if [ -n "$(ls -A -- "$point")" ]; then
            mount_error "$device" "$point is not empty, not mounting over it"
            continue
        fi
        # A new disk from Google is blank. One that holds nothing blkid knows (no
        # filesystem, no partition table, no RAID or LVM signature: exit status 2)
        # gets an ext4 filesystem, once, when it is attached read-write, which the
        # portal allows only on single-worker VMs, so no other host writes to it at
        # the same time. Its top folder is shared like /tmp: everyone may create
        # files, only their owner may remove them. A disk with anything on it is
        # never formatted.
        fresh=0
        blank=0
        blkid -p -- "$source" >/dev/null 2>&1 || blank=$?
        if [ "$blank" = 2 ]; then
            if [ "$mode" != rw ]; then
                mount_error "$device" "the disk is blank (no filesystem): attach it read-write to one single-worker VM once and the portal formats it"
                continue
            fi
            if ! out=$(mkfs.ext4 -q -m 0 -- "$source" </dev/null 2>&1); then
                mount_error "$device" "mkfs.ext4 failed: $out"
                continue
            fi
            fresh=1
            formatted=$((formatted + 1))
            changed=$((changed + 1))
        fi
        if out=$(mount -- "$point" 2>&1); then
            mounted=$((mounted + 1))
            changed=$((changed + 1))
            if [ "$fresh" = 1 ]; then chmod 1777 -- "$point"; fi
        else
            mount_error "$device" "mount $point: $out"
        fi
    done 3<"$work/fstab-managed"
}

if [ -s "$work/mounts" ] || [ -e "$work/fstab-ours" ]; then
    converge_disks
fi

# ---------------------------------------------------------------------------------
# 5. The answer.
# ---------------------------------------------------------------------------------
read -r boot_id </proc/sys/kernel/random/boot_id
echo "boot_id=$boot_id"
echo "users_created=$users_created"
echo "keys_written=$keys_written"
echo "keys_removed=$keys_removed"
echo "sudo_files=$sudo_files"
echo "revoked=$revoked"
echo "processes_killed=$processes_killed"
echo "mounted=$mounted"
echo "unmounted=$unmounted"
echo "formatted=$formatted"
echo "fstab_written=$fstab_written"
echo "sshd_reloaded=$sshd_reloaded"
echo "changed=$changed"
if [ "$changed" = 0 ]; then echo "noop=1"; fi
