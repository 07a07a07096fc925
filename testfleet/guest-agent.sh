#!/bin/sh
# What Google's guest agent does on a TPU VM worker with the node's `ssh-keys`
# metadata, for the test fleet: every listed account exists, is in google-sudoers
# (passwordless sudo, as on a real VM), and its ~/.ssh/authorized_keys holds exactly
# its listed keys. An account listed before but not now keeps its home but loses its
# keys and its sudo. Input on stdin, one record per line:
#   user <name>
#   key <name> <type> <base64> [<comment>]
set -eu
umask 022
state=/var/lib/testfleet-guest-agent
mkdir -p "$state"
getent group google-sudoers >/dev/null || groupadd --system google-sudoers
if [ ! -f /etc/sudoers.d/google_sudoers ]; then
  echo '%google-sudoers ALL=(ALL:ALL) NOPASSWD:ALL' > /etc/sudoers.d/google_sudoers
  chmod 0440 /etc/sudoers.d/google_sudoers
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: > "$work/users"
while read -r kind name rest; do
  case $name in *[!a-z0-9_-]*|'') echo "bad name: $name" >&2; exit 2 ;; esac
  case $kind in
    user) echo "$name" >> "$work/users"; : > "$work/keys.$name" ;;
    key) echo "$rest" >> "$work/keys.$name" ;;
    *) echo "bad record: $kind" >&2; exit 2 ;;
  esac
done
while read -r name; do
  id "$name" >/dev/null 2>&1 || useradd -m -s /bin/bash "$name"
  usermod -a -G google-sudoers "$name"
  home=$(getent passwd "$name" | cut -d: -f6)
  install -d -o "$name" -g "$name" -m 700 "$home/.ssh"
  install -o "$name" -g "$name" -m 600 "$work/keys.$name" "$home/.ssh/authorized_keys"
done < "$work/users"
touch "$state/users"
while read -r name; do
  grep -qx "$name" "$work/users" && continue
  id "$name" >/dev/null 2>&1 || continue
  home=$(getent passwd "$name" | cut -d: -f6)
  [ -f "$home/.ssh/authorized_keys" ] && : > "$home/.ssh/authorized_keys"
  gpasswd -d "$name" google-sudoers >/dev/null 2>&1 || true
done < "$state/users"
cp "$work/users" "$state/users"
