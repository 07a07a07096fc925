
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

# Accounts in /etc/passwd inside the portal's UID range that it did not list, as
# section 3's awk found them: reported, never removed.
if [ -e "$work/drift" ]; then
    while IFS= read -r line; do printf '%s\n' "$line"; done <"$work/drift"
fi

# The run that made the portal's first account on this host checks what sshd uses
# for it now, rather than at the next run (see section 2).
if [ -z "$members_checked" ] && [ -n "$first_member" ]; then
    check_members_keys "$first_member"
fi

