# ---------------------------------------------------------------------------------
# 1. Read and check the input. Nothing on the host changes before this is done.
# ---------------------------------------------------------------------------------
input=$work/input
head -c $((MAX_INPUT + 1)) >"$input"
# One awk for its shape: its size (each line's length plus its newline, summed), the
# length of each line, and whether the last line is "end". A last line without its
# newline counts one byte too many; the loop below refuses such an input (and grep one
# with a NUL byte, which not every awk counts). The same awk notes the first line
# whose fields are longer than the records below allow (see there).
shape=$(awk -v max="$MAX_LINE" -v most="$MAX_INPUT" '
    length($0) > max { print "line " NR; long = 1; exit }
    { bytes += length($0) + 1 }
    !over && (($1 == "range" && (length($2) > 10 || length($3) > 10)) ||
        ($1 == "version" && (length($2) > 64 || length($3) > 18)) ||
        ($1 == "user" && (length($2) > 31 || length($3) > 10)) ||
        ($1 == "key" && (length($2) > 31 || length($5) > 100)) ||
        ($1 == "mount" && length($2) > 63)) { over = NR }
    END {
        if (long) exit
        if (bytes > most) print "size " over + 0
        else if ($0 != "end") print "cut " over + 0
        else print "whole " over + 0
    }
    ' "$input")
case $shape in
size*) die "the desired state is larger than $MAX_INPUT bytes" ;;
line*) die "$shape of the input is too long; nothing was changed" ;;
esac
over=${shape#* } shape=${shape%% *}
first=""
IFS= read -r first <"$input" || true
[ "$first" = "tpu-portal-desired 1" ] || die "the input does not start with 'tpu-portal-desired 1'"
[ "$shape" != cut ] || die "the input does not end with 'end': it was cut short, nothing was changed"

# The rules for names, key types, devices and mount points are tpus/remote/rules.py's,
# stated again here; tpus/tests/test_validation_rules_on_hosts.py runs this part on a
# host with cases generated from that module, so the two agree. Each line must be one
# of these records, whole (-x), nothing else: no options before a key, no second key,
# no control characters, no quotes, no '$', no tabs. Their fields' longest lengths
# (a name 31, a number 10, a series 64, a version 18, a key's comment 100, a device
# 63) are the awk's above, on the fields as awk splits them, which for a line of one
# of these records are exactly its fields: a bounded repeat like {0,30} made grep
# build an automaton several times larger, more than a millisecond of the worker's
# CPU on every run. A line is refused if either finds it wanting; the first such
# line is named.
KEY_TYPES='(ssh-ed25519|sk-ssh-ed25519@openssh\.com|ecdsa-sha2-nistp(256|384|521)|sk-ecdsa-sha2-nistp256@openssh\.com|ssh-rsa)'
NAME='[a-z][a-z0-9-]*'
NUMBER='[1-9][0-9]*'
bad=$(grep -a -n -v -x -E -m 1 \
    -e 'tpu-portal-desired 1' \
    -e "range $NUMBER $NUMBER" \
    -e 'version [a-z0-9][a-z0-9-]* (0|[1-9][0-9]*)' \
    -e "user $NAME $NUMBER [01] [01]" \
    -e "key $NAME $KEY_TYPES [A-Za-z0-9+/]+={0,2}( [A-Za-z0-9._@:+=/-]+)?" \
    -e 'mount [a-z]([a-z0-9-]*[a-z0-9])? (/[A-Za-z0-9._-]+)+ (ro|rw)' \
    -e 'end' \
    "$input") || true
bad=${bad%%:*}
if [ "$over" != 0 ] && { [ -z "$bad" ] || [ "$over" -lt "$bad" ]; }; then bad=$over; fi
[ -z "$bad" ] || die "line $bad of the input is not a valid record; nothing was changed"

# Split the records into files of our own private folder, checking each field again
# and where each record may stand. Duplicates are found with lists kept in variables
# (" 30001 30002 "): every field was checked above to hold no space and no pattern
# character, and "$x" in a case pattern matches literally.
: >"$work/users"
: >"$work/mounts"
series="" version="" uid_min="" uid_max="" line_no=0 ended=0 uids=" " devices=" " points=" "
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
        if ! { [ "$uid_min" -ge 1000 ] && [ "$uid_min" -le "$uid_max" ] &&
            [ "$uid_max" -le 2000000000 ]; }; then
            die "the UID range must lie within 1000..2000000000"
        fi
        ;;
    version)
        [ "$line_no" = 3 ] || die "the version must be line 3"
        case $f1 in [a-z0-9]*) ;; *) die "bad series" ;; esac
        case $f1 in *[!a-z0-9-]*) die "bad series" ;; esac
        case $f2 in '' | *[!0-9]*) die "bad version" ;; esac
        [ -z "$f3" ] || die "the version line has extra fields"
        series=$f1 version=$f2
        ;;
    user)
        case $f1 in [a-z]*) ;; *) die "bad username" ;; esac
        case $f1 in *[!a-z0-9-]*) die "bad username" ;; esac
        case $f2 in *[!0-9]*) die "bad uid" ;; esac
        case $f3$f4 in [01][01]) ;; *) die "bad flags for $f1" ;; esac
        if ! { [ "$f2" -ge "$uid_min" ] && [ "$f2" -le "$uid_max" ] &&
            [ "$f2" != 65534 ] && [ "$f2" != 65535 ]; }; then
            die "uid $f2 of $f1 is outside the UID range"
        fi
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
            /snap | /snap/* | /srv | /srv/* | /sys | /sys/* | /tmp | /tmp/* | /usr | /usr/* | \
            /var | /var/*)
            die "disks are never mounted at or under a system folder or /home ($f2)"
            ;;
        /[A-Za-z0-9._-]*) ;;
        *) die "bad mount point" ;;
        esac
        case $f2 in *[!A-Za-z0-9._/-]*) die "bad mount point" ;; esac
        [ "${#f2}" -le 255 ] || die "a mount point is at most 255 characters long"
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

