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
# account files (passwd, group, shadow) and the type, mode, owner, size and content
# of the portal's own files, joined with the list by one awk. The loop at the end of
# this section reads one line per user into these variables, which the functions
# below use:
#   name uid active sudo          the input
#   pw_found pw_uid pw_gid pw_shell          NAME in /etc/passwd (first entry wins)
#   gr_found gr_gid                          NAME in /etc/group
#   sh_found sh_password sh_expire           NAME in /etc/shadow (fields 2 and 8)
#   keys_same sudo_same           1: the keys / sudoers file is a plain file of root's
#                                 with the right mode, size and content already
#   member                        1: a member of the portal's group (the portal made
#                                 or took over the account)
# Only a user's own steps change their entries, and names and uids are unique in the
# input, so what was read stays true for every user still to come. The files are read
# by the awk itself (three getent listings were three programs, each loading the name
# service's modules, on every run of every worker): the accounts the portal makes are
# local ones. A name the files do not have (one another name service knows, or an
# account still to be made) is asked of getent directly, with its uid, as before any
# account is created: every source counts there.
# The same awk notes whether the portal's group exists, finds the accounts in
# /etc/passwd the portal did not list (drift, reported once the users are done: this
# run makes no account it does not list and changes no uid) and notes whether fstab
# has a line of the portal's (for section 4; nothing before it changes fstab).
passwd_file=/etc/passwd group_file=/etc/group shadow_file=/etc/shadow
[ -f "$passwd_file" ] || passwd_file=/dev/null
[ -f "$group_file" ] || group_file=/dev/null
[ -f "$shadow_file" ] || shadow_file=/dev/null
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
# A file's content is compared as its lines, each with a newline: with equal sizes,
# equal lines mean equal bytes (a missing last newline or a cut at a NUL byte would
# make the lines shorter than the size). fstab is read only if it is a regular file
# (or a symlink to one, which the disks' part then refuses anyway).
fstab_input=/dev/null
if [ -f "$FSTAB" ]; then fstab_input=$FSTAB; fi
awk -v keys="$KEYS_DIR/" -v sudoers="$SUDOERS_DIR/tpu-portal-" -v work="$work/" \
    -v rule="$SUDO_RULE" -v group="$PORTAL_GROUP" -v lo="$uid_min" -v hi="$uid_max" \
    -v mark=" $FSTAB_MARK" '
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
    FILENAME == ARGV[1] {
        split($0, f, ":")
        if (!(f[1] in pw)) pw[f[1]] = f[3] ":" f[4] ":" f[7]
        # Drift: an account inside the UID range, in the order of the file; reported
        # (at the end) if the input does not list it, never removed.
        if (f[3] ~ /^[0-9]+$/ && f[3] + 0 >= lo && f[3] + 0 <= hi && !(f[1] in inrange)) {
            inrange[f[1]] = 1
            drift[++drifts] = f[1]
        }
        next
    }
    FILENAME == ARGV[2] {
        split($0, f, ":")
        if (f[1] == group && !(f[1] in gr)) {
            n = split(f[4], m, ",")
            for (i = 1; i <= n; i++) member[m[i]] = 1
        }
        if (!(f[1] in gr)) gr[f[1]] = f[3]
        next
    }
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
            keys_same ":" sudo_same ":" (n in member ? 1 : 0)
        next
    }
    FILENAME == ARGV[6] {
        # fstab: does a line end with the mark of ours?
        if (length($0) >= length(mark) && substr($0, length($0) - length(mark) + 1) == mark)
            ours = 1
        next
    }
    END {
        if (!(group in gr)) printf "" > (work "no-group")
        if (ours) printf "" > (work "fstab-ours")
        # Names made safe as oneline() does.
        for (i = 1; i <= drifts; i++) {
            n = drift[i]
            if (n in listed) continue
            gsub("[^-A-Za-z0-9 ._:,/()=@+]", " ", n)
            print "drift_user=" substr(n, 1, 300) > (work "drift")
        }
    }
    ' "$passwd_file" "$group_file" "$shadow_file" "$work/files" "$work/users" \
    "$fstab_input" >"$work/facts"

# The group the portal puts its accounts in (see the sshd drop-in above): a system
# group, made once.
if [ -e "$work/no-group" ]; then
    out=$(groupadd --system -- "$PORTAL_GROUP" 2>&1) || die "groupadd $PORTAL_GROUP: $(oneline "$out")"
    changed=$((changed + 1))
fi

# Ask NSS directly about $name in database $1 (passwd or group), for a name the
# listing did not have, and who holds the number $uid there. One getent answers both:
# it prints the entry for the name (if any), then the one for the number (if any).
# Sets found, number (uid or gid), gid and shell (passwd only), and owner (who holds
# $uid, when that is not $name).
lookup() {
    local entries n x id g sh
    found=0 number="" gid="" shell="" owner=""
    entries=$(getent "$1" "$name" "$uid" || true)
    while IFS=: read -r n x id g x x sh; do
        if [ "$n" = "$name" ] && [ "$found" = 0 ]; then
            found=1 number=$id gid=$g shell=$sh
        elif [ -z "$owner" ] && [ -n "$n" ]; then
            owner=$n
        fi
    done <<END
$entries
END
}

# The account $name with uid $uid and group $name (gid $uid) exists, as a member of
# the portal's group, or the reason it cannot; $1 and $2 are the password and expiry
# fields for a new account. Never re-numbers anything and never takes over a name the
# portal did not make: a user or group of that name that is not the portal's (a
# package's `docker` group, a lab admin's own account) stops here, rather than the
# collaborator joining that group or logging in as that account.
ensure_account() {
    local out
    uid_owner="" gid_owner=""
    if [ "$pw_found" = 0 ]; then
        lookup passwd
        pw_found=$found pw_uid=$number pw_gid=$gid pw_shell=$shell uid_owner=$owner
    fi
    if [ "$gr_found" = 0 ]; then
        lookup group
        gr_found=$found gr_gid=$number gid_owner=$owner
    fi
    # Not in the portal's group: either no such user yet, or an account made by an
    # earlier version of this script (which made the user with that uid in a group of
    # its own name with gid = uid, and nothing else), which is taken over. Anything else
    # of that name belongs to someone else.
    if [ "$member" != 1 ]; then
        if [ "$pw_found" = 1 ]; then
            if [ "$pw_uid" != "$uid" ] || [ "$pw_gid" != "$uid" ] ||
                [ "$gr_found" != 1 ] || [ "$gr_gid" != "$uid" ]; then
                user_error "$name" "a user named $name already exists with uid $pw_uid on this worker (not created by the portal)"
                return 1
            fi
        elif [ "$gr_found" = 1 ]; then
            user_error "$name" "a group named $name already exists on this worker (not created by the portal)"
            return 1
        fi
    fi
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
        # A new account's group is made by useradd below, with the account.
        if [ "$pw_found" = 1 ]; then
            out=$(groupadd -g "$uid" -- "$name" 2>&1) || {
                user_error "$name" "groupadd: $out"
                return 1
            }
            changed=$((changed + 1))
        fi
    fi
    if [ "$pw_found" = 0 ]; then
        # -m makes the home only if it is missing (then from /etc/skel); an existing
        # home, say of an earlier account, is left as it is. Without the group yet,
        # useradd makes it too (-U), in the same write of the account files: its GID
        # range narrowed to the one number $uid (-K), it takes that GID or fails and
        # writes nothing, never another number.
        if [ "$gr_found" = 1 ]; then
            out=$(useradd -m -d "/home/$name" -s /bin/bash -u "$uid" -g "$uid" \
                -G "$PORTAL_GROUP" -p "$1" -e "$2" -c '' -- "$name" 2>&1)
        else
            out=$(useradd -m -d "/home/$name" -s /bin/bash -u "$uid" -U \
                -K "GID_MIN=$uid" -K "GID_MAX=$uid" \
                -G "$PORTAL_GROUP" -p "$1" -e "$2" -c '' -- "$name" 2>&1)
        fi || {
            user_error "$name" "useradd: $out"
            return 1
        }
        created=1
        member=1
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
    if [ "$member" != 1 ]; then
        out=$(usermod -a -G "$PORTAL_GROUP" -- "$name" 2>&1) || {
            user_error "$name" "usermod: $out"
            return 1
        }
        member=1
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
            # shellcheck disable=SC2034  # x: the fields not wanted
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
        elif replace_lines "$KEYS_DIR/$name" "$work/keys.$name" 644; then
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
    gr_found gr_gid sh_found sh_password sh_expire keys_same sudo_same member <&3; do
    created=0
    if [ "$active" = 1 ]; then
        converge_active
    else
        converge_revoked
    fi
    if [ -z "$first_member" ] && [ "$member" = 1 ]; then first_member=$name; fi
done 3<"$work/facts"
