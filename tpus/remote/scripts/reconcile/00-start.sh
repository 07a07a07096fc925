#!/bin/sh
# shellcheck disable=SC3043  # `local`: dash, bash and busybox sh all have it
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
#
# The script is kept as parts, joined in name order into one text when it is sent
# (tpus/remote/scripts.py), so it still runs as one `sh -c` in one SSH round trip:
#   00-start      settings, helpers every part uses (die, replace_file, ...)
#   10-input      read and check stdin; nothing changes on the host before it passes
#   20-sshd       the lock, the sshd drop-in, what sshd really uses
#   30-users      accounts, keys files, sudoers files, revoked accounts locked
#   40-processes  processes of revoked users killed
#   45-leftovers  the portal's files nobody should have, drift, the first member
#   50-disks      fstab lines and mounts of data disks
#   90-answer     the counters
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
inflight="" members_checked=1 first_member=""
nl='
'

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

# The disks' part as a whole could not run (or stopped): accounts and keys still count.
disk_error() {
    echo "disk_error=$(oneline "$1")"
}


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

# Write the line $2 to path $1 atomically with mode $3 (600 or 644), a file known to
# differ (no comparison): the shell writes the temporary file itself, created anew
# with that mode (umask; noclobber: O_EXCL) in the target's own folder, root's alone as
# replace_file's are; one a killed run left under that name is removed first. Two
# programs fewer than replace_file, on a file every run writes.
replace_text() {
    case $3 in
        644) ;;
        600) umask 077 ;;
        *) die "replace_text: mode $3" ;;
    esac
    inflight=${1%/*}/.tpu-portal.$$
    set -C
    if ! { printf '%s\n' "$2" >"$inflight"; } 2>/dev/null; then
        rm -f -- "$inflight"
        printf '%s\n' "$2" >"$inflight"
    fi
    set +C
    umask 022
    mv -f -- "$inflight" "$1"
    inflight=""
}

# replace_file for a file of ours that the shell wrote as lines (each with its
# newline, none with a NUL byte: a keys file): the shell reads it and writes the
# temporary file itself (replace_text), one program fewer than install.
replace_lines() {
    local text line
    if same_file "$1" "$2" "$3"; then return 1; fi
    text=""
    while IFS= read -r line; do text="$text$line$nl"; done <"$2"
    replace_text "$1" "${text%"$nl"}" "$3"
}
