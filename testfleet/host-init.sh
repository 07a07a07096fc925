# The first process of a fleet host. It runs as PID 1 of a fresh PID, mount, UTS and
# IPC namespace inside the host's network namespace, builds the host's private view of
# the machine, and then becomes sshd, so killing it kills everything on the host.
#   $1  the host's folder in the fleet's state dir
#   $2  the host name
#   $3… folders of the machine to hide behind an empty tmpfs (work trees, the state dir)
set -eu
dir=$1
name=$2
shift 2

# /etc and /var: the machine's files below, this host's changes above. useradd,
# passwd and visudo replace files by rename(), which an overlay supports.
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$dir/etc,workdir=$dir/etc.work" /etc
mount -t overlay overlay -o "lowerdir=/var,upperdir=$dir/var,workdir=$dir/var.work" /var
mount --bind "$dir/home" /home
mount --bind "$dir/root" /root

# This PID namespace's processes only, and the host's own boot id where a TPU VM has it.
mount -t proc proc /proc
mount --bind "$dir/boot_id" /proc/sys/kernel/random/boot_id

# Hide the portal's work trees, the admin private key and the fleet's state. The host
# folder's mounts above are already in place, so covering the state dir is safe.
for path in "$@"; do
    if [ -d "$path" ]; then
        mount -t tmpfs -o mode=0755,size=1m testfleet-hidden "$path"
    fi
done
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /var/tmp
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mkdir -p /run/sshd /run/lock
chmod 1777 /run/lock

hostname "$name"
exec /usr/sbin/sshd -D -e
