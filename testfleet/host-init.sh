#!/bin/sh
# The first process of a fleet host. It runs as PID 1 of a fresh PID, mount, UTS and
# IPC namespace inside the host's network namespace, builds the host's private view of
# the machine, and then becomes sshd, so killing it kills everything on the host.
#   $1  the host's folder in the fleet's state dir
#   $2  the host name
#   $3  how many fake TPU chips the host has (/dev/accel0 …)
#   $4… folders of the machine to hide behind an empty tmpfs (work trees, the state dir)
set -eu
dir=$1
name=$2
chips=$3
shift 3

# /etc and /var: the machine's files below, this host's changes above. useradd,
# passwd and visudo replace files by rename(), which an overlay supports.
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$dir/etc,workdir=$dir/etc.work" /etc
mount -t overlay overlay -o "lowerdir=/var,upperdir=$dir/var,workdir=$dir/var.work" /var
mount --bind "$dir/home" /home
mount --bind "$dir/root" /root

# This PID namespace's processes only, and the host's own boot id where a TPU VM has it.
mount -t proc proc /proc
mount --bind "$dir/boot_id" /proc/sys/kernel/random/boot_id

# The host's own cgroups (testfleet/cgroups.py; every process of the host already runs
# in them), where a worker has its hierarchies. `ip netns exec` mounted a fresh /sys, so
# each hierarchy is mounted once more (the same hierarchy, not a new one) to reach the
# host's directory. Hybrid: a tmpfs at /sys/fs/cgroup with unified (cgroup2), pids and
# memory (v1), as on this kind of machine; unified: the v2 directory at /sys/fs/cgroup.
if [ -f "$dir/cgroups" ]; then
    stage=$dir/cgroup.stage
    mkdir -p "$stage"
    layout=unified
    while read -r kind path; do
        case $kind in
            layout)
                layout=$path
                [ "$layout" = unified ] ||
                    mount -t tmpfs -o mode=0755,nosuid,nodev,noexec,size=64k cgroup /sys/fs/cgroup
                continue
                ;;
            unified) mount -t cgroup2 cgroup2 "$stage" ;;
            pids | memory) mount -t cgroup -o "$kind" cgroup "$stage" ;;
            *) continue ;;
        esac
        target=/sys/fs/cgroup
        if [ "$layout" != unified ]; then
            target=/sys/fs/cgroup/$kind
            mkdir "$target"
        fi
        mount --bind "$stage$path" "$target"
        umount "$stage"
    done <"$dir/cgroups"
    rmdir "$stage"
    [ "$layout" = unified ] || mount -o remount,ro /sys/fs/cgroup
fi

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

# A /dev of the host's own, so each host has its own fake TPU chips (/dev/accel0 …):
# character devices that behave like /dev/null, which a job can open and hold the way
# libtpu holds a real chip. The machine's /dev is never changed.
mount -t tmpfs -o mode=0755,nosuid,size=1m testfleet-dev /dev
mknod -m 666 /dev/null c 1 3
mknod -m 666 /dev/zero c 1 5
mknod -m 666 /dev/full c 1 7
mknod -m 666 /dev/random c 1 8
mknod -m 666 /dev/urandom c 1 9
mknod -m 666 /dev/tty c 5 0
mkdir -m 755 /dev/pts
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts /dev/pts
ln -s pts/ptmx /dev/ptmx
mkdir -m 1777 /dev/shm
mount -t tmpfs -o mode=1777,nosuid,nodev testfleet-shm /dev/shm
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
chip=0
while [ "$chip" -lt "$chips" ]; do
    mknod -m 666 "/dev/accel$chip" c 1 3
    chip=$((chip + 1))
done

hostname "$name"
exec /usr/sbin/sshd -D -e
