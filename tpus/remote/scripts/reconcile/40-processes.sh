
# Processes of revoked users, looked for once every account is locked (no new session
# can start meanwhile). A uid owns a process by real or effective uid, or by login
# uid, which survives `sudo` and `su` started from the user's session; zombies do not
# count, nor this script.
#
# Prints "<pid> <uid>" for each live process of a uid listed in $work/revoked: one
# `ps` and one read of every /proc/<pid>/loginuid, for all revoked users at once.
revoked_processes() {
    ps -e -o pid=,ruid=,euid=,s= >"$work/ps"
    grep -H -s . /proc/[0-9]*/loginuid >"$work/loginuids" || true
    awk -v self="$$" '
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
                if (pu[1] != self && state[pu[1]] != "Z" && state[pu[1]] != "X")
                    print pu[1], pu[2]
            }
        }' "$work/revoked" "$work/ps" "$work/loginuids"
}

# SIGKILL them all, and look again, for up to five seconds, so a stuck process cannot
# hang the run; whoever still has a process then gets a user_error.
if [ -s "$work/revoked" ]; then
    busy=$(revoked_processes)
    if [ -n "$busy" ]; then
        processes_killed=$(echo "$busy" | cut -d ' ' -f 1 | sort -u | wc -l)
        changed=$((changed + $(echo "$busy" | cut -d ' ' -f 2 | sort -u | wc -l)))
        tries=0
        while [ -n "$busy" ] && [ "$tries" -lt 50 ]; do
            # shellcheck disable=SC2046  # a list of numbers from ps and /proc
            kill -KILL $(echo "$busy" | cut -d ' ' -f 1) 2>/dev/null || true
            sleep 0.1
            busy=$(revoked_processes)
            tries=$((tries + 1))
        done
        left=" $(echo "$busy" | cut -d ' ' -f 2 | sort -u | tr '\n' ' ')"
        while read -r name uid <&3; do
            case $left in *" $uid "*) user_error "$name" "some processes survived SIGKILL" ;; esac
        done 3<"$work/revoked"
    fi
fi
