# One reconcile at a time on this host (the portal also locks per VM). /run is
# root-owned, unlike /run/lock, so no one can plant a symlink at this path.
exec 9>>"$LOCK"
flock -w 120 9 || die "another reconcile has been running for two minutes"

# Newer state wins. Two runs for one VM can meet here (a revoke that took the VM over
# from a run that is still going); the lock orders them, and the host keeps the
# highest version it has applied for the VM's series and refuses an older state,
# changing nothing, whatever order the two got the lock in. Kept under /var/lib (a
# reboot does not forget it), in a folder of root's own that others may only pass
# through (0711: the job folders are in it, and each person reads their job's log).
VERSION_DIR=/var/lib/tpu-portal
if [ -n "$series" ]; then
    if [ -L "$VERSION_DIR" ] || { [ -e "$VERSION_DIR" ] && [ ! -d "$VERSION_DIR" ]; }; then
        die "$VERSION_DIR exists and is not a folder"
    fi
    [ -d "$VERSION_DIR" ] || mkdir -m 0711 "$VERSION_DIR"
fi

# One `stat`, here after the lock, for what this part needs to know of the files: the
# version folder, the stamp of the sshd check and what sshd reads (section 2), each
# line "path type inode size mtime ctime mode owner group", in the order given. -L
# follows symlinks: the version folder is not one (just checked), and the stamp is
# used only if it is not one. A path that does not exist has no line.
SSHD_STAMP=/run/tpu-portal-sshd.checked
facts=$(stat -L -c '%n %F %i %s %.9Y %.9Z %a %u %g' -- "$VERSION_DIR" "$SSHD_STAMP" \
    /usr/sbin/sshd /etc/ssh/sshd_config /etc/ssh/sshd_config.d /etc/ssh/sshd_config.d/* \
    2>/dev/null) || true
version_dir_facts="" stamp_facts=""
case $facts in "$VERSION_DIR "*)
    version_dir_facts=${facts%%"$nl"*}
    facts=${facts#"$version_dir_facts"}
    facts=${facts#"$nl"}
    ;;
esac
case $facts in "$SSHD_STAMP "*)
    stamp_facts=${facts%%"$nl"*}
    facts=${facts#"$stamp_facts"}
    facts=${facts#"$nl"}
    ;;
esac

if [ -n "$series" ]; then
    case $version_dir_facts in
    "$VERSION_DIR directory "*) ;;
    *) die "$VERSION_DIR exists and is not a folder" ;;
    esac
    # Its mode and owner are the last fields but one and two.
    owner_mode=${version_dir_facts% *}
    [ "${owner_mode##* }" = 0 ] || die "$VERSION_DIR does not belong to root"
    owner_mode=${owner_mode% *}
    [ "${owner_mode##* }" = 711 ] || chmod 0711 "$VERSION_DIR"
    seen_series="" seen_version=""
    if [ -f "$VERSION_DIR/version" ] && [ ! -L "$VERSION_DIR/version" ]; then
        read -r seen_series seen_version _ <"$VERSION_DIR/version" || true
    fi
    case $seen_version in '' | *[!0-9]*) seen_series="" ;; esac
    if [ "$seen_series" = "$series" ] && [ "$seen_version" -gt "$version" ]; then
        read -r boot_id </proc/sys/kernel/random/boot_id
        echo "boot_id=$boot_id"
        echo "stale=$seen_version"
        echo "changed=0"
        echo "noop=1"
        exit 0
    fi
    if [ "$seen_series $seen_version" != "$series $version" ]; then
        replace_text "$VERSION_DIR/version" "$series $version" 600
    fi
fi

# ---------------------------------------------------------------------------------
# 2. Host preparation (once per host; afterwards only checked): where keys live.
# ---------------------------------------------------------------------------------

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
# Deleting a key in the portal must stop it opening this host, so the portal's own
# accounts log in only with the keys in its root-owned files: a key a collaborator
# copied into ~/.ssh/authorized_keys is ignored. Every other account (the lab's own
# admins, the portal's service account that Google's guest agent manages, anything
# the image has) keeps sshd's usual files.
#
# The portal's accounts are told apart by a group, not by a list of names: every
# account it makes or takes over is a member of $PORTAL_GROUP, and sshd matches
# `Match Group` at each login from the account databases. So the drop-in never
# changes when someone is granted or revoked (no sshd -t and reload per grant, no
# list that grows with the lab); only root can change a group's members; and a member
# removed by hand is put back by the next run. The line before the Match block names
# the portal's files for everyone, so an account made by an earlier version still
# logs in during the run that adds it to the group. sshd uses the first value it
# reads for an option (a matching Match block's over the global one), and Debian's
# sshd_config includes sshd_config.d/*.conf at its top.
PORTAL_GROUP=tpu-portal-users
DROPIN_TEXT='# Managed by TPU Portal. Collaborators'"'"' keys are kept in root-owned files, so the
# portal never writes inside a home directory, and its accounts (the members of
# '"$PORTAL_GROUP"') log in only with those: a key they put in ~/.ssh is ignored.
AuthorizedKeysFile .ssh/authorized_keys .ssh/authorized_keys2 /etc/ssh/tpu-portal-keys/%u
Match Group '"$PORTAL_GROUP"'
    AuthorizedKeysFile /etc/ssh/tpu-portal-keys/%u'
printf '%s\n' "$DROPIN_TEXT" >"$work/dropin"

# With the Match block, what sshd uses depends on the account: ask sshd -T for a login
# by member $1 of the portal's group, and fail the whole run if anything but the
# portal's file counts for them (another drop-in's Match block read first, say).
check_members_keys() {
    local settings effective
    if ! settings=$(/usr/sbin/sshd -T -C "user=$1,host=localhost,addr=127.0.0.1" 2>&1); then
        die "sshd -T -C fails for $1, the sshd configuration is broken: $(oneline "$(echo "$settings" | tail -n 1)")"
    fi
    effective=$(echo "$settings" | grep -i '^authorizedkeysfile ' || true)
    [ "$effective" = "authorizedkeysfile $KEYS_DIR/%u" ] ||
        die "sshd does not limit the portal's accounts to the portal's key files (for $1 AuthorizedKeysFile is set elsewhere first): $(oneline "$effective")"
}

# A member of the portal's group that exists, to ask sshd about; none on a host the
# portal has given no account yet.
portal_member() {
    local entry candidate
    entry=$(getent group "$PORTAL_GROUP" || true)
    entry=${entry##*:}
    while [ -n "$entry" ]; do
        candidate=${entry%%,*}
        case $entry in *,*) entry=${entry#*,} ;; *) entry="" ;; esac
        case $candidate in [a-z]*) ;; *) continue ;; esac
        case $candidate in *[!a-z0-9-]*) continue ;; esac
        if getent passwd "$candidate" >/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
}

# Checking the sshd configuration (sshd -t, sshd -T) costs more than the rest of a
# no-op run. It is done in full whenever anything sshd reads may have changed since
# the last run that passed it: the stamp holds the drop-in this script wants and, for
# the sshd binary, sshd_config, the sshd_config.d folder and every file in it, the
# inode, size, modification and change times (in ns), mode and owner. Any edit,
# rename, chmod or new file changes one of these. The facts are taken *before* the
# check (by the `stat` above), so a change made while it runs is seen by the next
# run. The stamp lives in /run (root-only, emptied at boot: the first run after a
# boot checks in full).
sshd_facts="$DROPIN_TEXT$nl"
if [ -n "$facts" ]; then sshd_facts="$sshd_facts$facts$nl"; fi
printf '%s' "$sshd_facts" >"$work/sshd-facts"

# Does the stamp hold exactly $sshd_facts? Its size (from the `stat` above) must be
# theirs, then its bytes: read by the shell, which costs less than starting `cmp` for
# a file this small. (`read` skips a NUL byte; the text read is then shorter than the
# size, so it differs.)
stamp_matches() {
    local size text line
    if [ ! -f "$SSHD_STAMP" ] || [ -L "$SSHD_STAMP" ]; then return 1; fi
    size=${stamp_facts% * * * * *}
    [ "${size##* }" = "${#sshd_facts}" ] || return 1
    text="" line=""
    while IFS= read -r line; do text="$text$line$nl"; done <"$SSHD_STAMP"
    [ "$text$line" = "$sshd_facts" ]
}

if stamp_matches; then
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
    # Without a member yet, the portal's accounts are checked once the first is made
    # (after section 3), and the stamp gets a line no facts have: the next run checks
    # in full again, until a run finds a member here.
    probe=$(portal_member)
    if [ -n "$probe" ]; then
        check_members_keys "$probe"
        members_checked=1
    else
        members_checked=""
        echo "no member of $PORTAL_GROUP was checked" >>"$work/sshd-facts"
    fi
    if [ "$reload" = 1 ]; then reload_sshd; fi
    inflight=$(mktemp /run/.tpu-portal.XXXXXX)
    cat -- "$work/sshd-facts" >"$inflight"
    mv -f -- "$inflight" "$SSHD_STAMP"
    inflight=""
fi
