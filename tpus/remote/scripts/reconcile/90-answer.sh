# ---------------------------------------------------------------------------------
# 5. The answer.
# ---------------------------------------------------------------------------------
read -r boot_id </proc/sys/kernel/random/boot_id
echo "boot_id=$boot_id"
echo "users_created=$users_created"
echo "keys_written=$keys_written"
echo "keys_removed=$keys_removed"
echo "sudo_files=$sudo_files"
echo "revoked=$revoked"
echo "processes_killed=$processes_killed"
echo "mounted=$mounted"
echo "unmounted=$unmounted"
echo "formatted=$formatted"
echo "fstab_written=$fstab_written"
echo "sshd_reloaded=$sshd_reloaded"
echo "changed=$changed"
if [ "$changed" = 0 ]; then echo "noop=1"; fi
