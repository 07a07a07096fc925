# ---------------------------------------------------------------------------------
# 4. Data disks: mounted when the disk is there, and then given an fstab line (nofail,
#    so a disk missing at boot never stops it). A disk that is not mounted (its device
#    is not there yet, or it was refused) has no line: at the next boot, mount would
#    otherwise put it over whatever the folder holds by then.
# ---------------------------------------------------------------------------------
# A disk moves between VMs, and whoever had root on the last one could leave a setuid
# binary or a device node on it. Mounted nosuid,nodev, neither gives anything to the
# users of the next VM: the setuid bit is ignored and the node cannot be opened.
DISK_OPTIONS=nosuid,nodev
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

# Who keeps $1 busy: up to three processes with a file, their folder or their root
# there, as " (held by pid 812 python3 of milo, ...)"; nothing when none is found.
holders_of() {
    local link pid seen found what owner comm
    seen=" " found=""
    # Mount points of ours hold no space or pattern character (checked on input).
    for link in $(find /proc/[0-9]*/cwd /proc/[0-9]*/root /proc/[0-9]*/fd -maxdepth 1 \
        \( -lname "$1" -o -lname "$1/*" \) 2>/dev/null | head -n 50); do
        pid=${link#/proc/}
        pid=${pid%%/*}
        case $seen in *" $pid "*) continue ;; esac
        seen="$seen$pid "
        what=$(ps -o user=,comm= -p "$pid" 2>/dev/null) || continue
        read -r owner comm <<END
$what
END
        found="$found, pid $pid $comm of $owner"
        case $seen in *" "*" "*" "*" "*) break ;; esac
    done
    if [ -n "$found" ]; then echo " (held by ${found#, })"; fi
}

# The disks' part of fstab and their mounts; run only when there is something to do:
# a disk is wanted here, or fstab still has a line of ours.
converge_disks() {
    local device point mode source rest line options fstype now current remount out wanted fresh blank
    # The lines of the disks wanted here that pass the checks below; each goes into
    # fstab (fstab-managed) only once its disk is mounted.
    : >"$work/fstab-wanted"
    : >"$work/fstab-managed"
    while IFS=' ' read -r device point mode <&3; do
        # A line the portal does not manage already mounts something here: leave both.
        if [ -f "$FSTAB" ] && awk -v p="$point" \
            '$1 !~ /^#/ && $2 == p && $0 !~ / # tpu-portal$/ { found = 1 } END { exit !found }' "$FSTAB"; then
            mount_error "$device" "fstab already has an entry for $point"
            continue
        fi
        # Checked before anything is mounted or written: at boot, mount would follow the
        # path too.
        if ! safe_path "$point"; then
            mount_error "$device" "$point is not a plain folder or lies below a symlink or a folder others can write to"
            continue
        fi
        echo "/dev/disk/by-id/google-$device $point ext4 $mode,$DISK_OPTIONS,discard,defaults,nofail 0 2 $FSTAB_MARK" \
            >>"$work/fstab-wanted"
    done 3<"$work/mounts"

    # Mount points of ours that are no longer wanted: unmount them first (the portal
    # detaches the disk only once every worker has), then drop their lines from fstab.
    # A line whose disk is still busy stays, so the next run tries again (and reports
    # it again, with what holds it). A disk that went away while mounted (detached
    # outside the portal) leaves a stale mount whose device is gone: unmounted too.
    wanted=" "
    while read -r source point rest <&3; do
        wanted="$wanted$point "
    done 3<"$work/fstab-wanted"
    : >"$work/still-mounted"
    grep -e " $FSTAB_MARK\$" "$FSTAB" 2>/dev/null | grep -v -x -F -f "$work/fstab-wanted" >"$work/unwanted" || true
    while IFS= read -r line <&3; do
        IFS=' ' read -r source point rest <<END
$line
END
        case $point in /*) ;; *) continue ;; esac
        # Points of ours hold no space or pattern character; "$point" matches literally.
        case $wanted in *" $point "*) continue ;; esac
        mountpoint -q -- "$point" || continue
        now=$(findmnt -n -o SOURCE --mountpoint "$point")
        if [ "$now" = "$(readlink -f -- "$source")" ] || { [ ! -e "$source" ] && [ ! -b "$now" ]; }; then
            if out=$(umount -- "$point" 2>&1); then
                unmounted=$((unmounted + 1))
                changed=$((changed + 1))
            else
                mount_error "${source#/dev/disk/by-id/google-}" "cannot unmount $point: $out$(holders_of "$point")"
                echo "$line" >>"$work/still-mounted"
            fi
        fi
    done 3<"$work/unwanted"

    # shellcheck disable=SC2034  # fstype: always ext4, read to reach the options
    while IFS= read -r line <&3; do
        read -r source point fstype options rest <<END
$line
END
        device=${source#/dev/disk/by-id/google-}
        mode=${options%%,*}
        if [ ! -d "$point" ]; then
            # shellcheck disable=SC2174  # the parents get 0755 too, from umask 022
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
            # The mode comes first in the options; a disk mounted by an earlier version
            # (without nosuid,nodev) or remounted by hand is brought back too.
            current=,$(findmnt -n -o OPTIONS --mountpoint "$point"),
            remount=0
            case $current in ,"$mode",*) ;; *) remount=1 ;; esac
            case $current in *,nosuid,*) ;; *) remount=1 ;; esac
            case $current in *,nodev,*) ;; *) remount=1 ;; esac
            if [ "$remount" = 1 ]; then
                if out=$(mount -o "remount,$mode,$DISK_OPTIONS" -- "$point" 2>&1); then
                    changed=$((changed + 1))
                else
                    mount_error "$device" "cannot remount $point $mode,$DISK_OPTIONS: $out"
                fi
            fi
            echo "$line" >>"$work/fstab-managed"
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
        # With the same options as its fstab line (less defaults,nofail), which is
        # written below, once the disk is there.
        if out=$(mount -t ext4 -o "${options%,defaults,nofail}" -- "$source" "$point" 2>&1); then
            mounted=$((mounted + 1))
            changed=$((changed + 1))
            if [ "$fresh" = 1 ]; then chmod 1777 -- "$point"; fi
            echo "$line" >>"$work/fstab-managed"
        else
            mount_error "$device" "mount $point: $out"
        fi
    done 3<"$work/fstab-wanted"

    # fstab: the lines of others as they were, then ours: the disks mounted now, and
    # the unwanted ones still busy (their line stays until they can be unmounted).
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
}

# The disks' part runs on its own, after the accounts, keys and revokes are done:
# whatever stops it (a symlinked fstab, a full /etc, a tool that fails) is answered as
# disk_error and the run still exits 0, so what the run did for access counts. It runs
# as a job of its own (not in an `if` or `||`, where `set -e` would not stop it) and
# hands its counters back through a file.
if [ -L "$FSTAB" ]; then
    disk_error "$FSTAB is a symlink; not replacing it"
elif [ -s "$work/mounts" ] || [ -e "$work/fstab-ours" ]; then
    (
        converge_disks
        echo "$mounted $unmounted $formatted $fstab_written $changed" >"$work/disk-counters"
    ) 2>"$work/disk-stderr" &
    disk_status=0
    wait "$!" || disk_status=$?
    if [ -s "$work/disk-counters" ]; then
        read -r mounted unmounted formatted fstab_written changed <"$work/disk-counters"
    fi
    if [ "$disk_status" != 0 ]; then
        disk_error "the disks part stopped: $(tail -n 1 "$work/disk-stderr")"
        changed=$((changed + 1))
    fi
fi

