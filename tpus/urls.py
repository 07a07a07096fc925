from django.urls import path

from tpus.views import connect, grants, hostkeys, inventory, jobs, labs, provisioning, ssh

urlpatterns = [
    path("", labs.dashboard, name="dashboard"),
    path("labs/", labs.lab_list, name="lab_list"),
    path("labs/new/", labs.lab_create, name="lab_create"),
    path("labs/<slug:slug>/", labs.lab_detail, name="lab_detail"),
    path("labs/<slug:slug>/join/", labs.lab_join, name="lab_join"),
    path("labs/<slug:slug>/policy/accept/", labs.policy_accept, name="policy_accept"),
    path("labs/<slug:slug>/admin/", labs.lab_admin, name="lab_admin"),
    path("labs/<slug:slug>/settings/", labs.lab_settings, name="lab_settings"),
    path("labs/<slug:slug>/audit/", labs.lab_audit, name="lab_audit"),
    path("labs/<slug:slug>/people/search/", labs.people_search, name="people_search"),
    path(
        "labs/<slug:slug>/memberships/<int:membership_id>/approve/",
        labs.membership_approve,
        name="membership_approve",
    ),
    path(
        "labs/<slug:slug>/memberships/<int:membership_id>/reject/",
        labs.membership_reject,
        name="membership_reject",
    ),
    path(
        "labs/<slug:slug>/memberships/<int:membership_id>/role/",
        labs.membership_role,
        name="membership_role",
    ),
    path(
        "labs/<slug:slug>/memberships/<int:membership_id>/remove/",
        labs.membership_remove,
        name="membership_remove",
    ),
    path("labs/<slug:slug>/invites/", labs.invite_create, name="invite_create"),
    path(
        "labs/<slug:slug>/invites/<int:invite_id>/revoke/",
        labs.invite_revoke,
        name="invite_revoke",
    ),
    path("invites/<str:token>/", labs.invite, name="invite"),
    path("ssh/", ssh.ssh_page, name="ssh_page"),
    path("ssh/config", ssh.ssh_config_download, name="ssh_config"),
    path("ssh/known_hosts", ssh.ssh_known_hosts_download, name="ssh_known_hosts"),
    path("ssh/feed/rotate/", ssh.ssh_feed_rotate, name="ssh_feed_rotate"),
    path("ssh/feed/disable/", ssh.ssh_feed_disable, name="ssh_feed_disable"),
    path("ssh/forwarding/", ssh.ssh_forwarding, name="ssh_forwarding"),
    path("ssh/forwards/<int:vm_id>/", ssh.ssh_forward, name="ssh_forward"),
    path(
        "ssh/forwards/<int:vm_id>/<int:local_port>/remove/",
        ssh.ssh_forward_remove,
        name="ssh_forward_remove",
    ),
    path("ssh/feed/<str:token>/config", ssh.ssh_feed_config, name="ssh_feed_config"),
    path("ssh/feed/<str:token>/known_hosts", ssh.ssh_feed_known_hosts, name="ssh_feed_known_hosts"),
    path("labs/<slug:slug>/vms/", inventory.vm_list, name="vm_list"),
    path("labs/<slug:slug>/vms/import/", inventory.vm_import, name="vm_import"),
    path("labs/<slug:slug>/vms/new/", provisioning.vm_create, name="vm_create"),
    path("labs/<slug:slug>/allowances/", provisioning.allowance_set, name="allowance_set"),
    path(
        "labs/<slug:slug>/vm-requests/<int:request_id>/cancel/",
        provisioning.vm_request_cancel,
        name="vm_request_cancel",
    ),
    path(
        "labs/<slug:slug>/vm-requests/<int:request_id>/retry/",
        provisioning.vm_request_retry,
        name="vm_request_retry",
    ),
    path("labs/<slug:slug>/vms/register/", inventory.vm_register, name="vm_register"),
    path("labs/<slug:slug>/vms/sync/", inventory.vm_sync, name="vm_sync"),
    path("labs/<slug:slug>/vms/search/", grants.vm_search, name="vm_search"),
    path("labs/<slug:slug>/vms/<int:vm_id>/", inventory.vm_detail, name="vm_detail"),
    path("labs/<slug:slug>/vms/<int:vm_id>/access/", grants.vm_access, name="vm_access"),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/<str:action>/power/",
        provisioning.vm_power,
        name="vm_power",
    ),
    path("labs/<slug:slug>/vms/<int:vm_id>/delete/", provisioning.vm_delete, name="vm_delete"),
    path("labs/<slug:slug>/vms/<int:vm_id>/progress/", grants.vm_progress, name="vm_progress"),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/connection/",
        connect.vm_connection,
        name="vm_connection",
    ),
    path("labs/<slug:slug>/vms/<int:vm_id>/connect/", connect.vm_connect, name="vm_connect"),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/disconnect/",
        connect.vm_disconnect,
        name="vm_disconnect",
    ),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/workers/<int:index>/keys/",
        hostkeys.worker_keys,
        name="worker_keys",
    ),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/workers/<int:index>/keys/scan/",
        hostkeys.worker_keys_scan,
        name="worker_keys_scan",
    ),
    path("labs/<slug:slug>/vms/<int:vm_id>/grant/", grants.grant_create, name="grant_create"),
    path(
        "labs/<slug:slug>/memberships/<int:membership_id>/grant/",
        grants.member_grant,
        name="member_grant",
    ),
    path(
        "labs/<slug:slug>/grants/<int:grant_id>/revoke/", grants.grant_revoke, name="grant_revoke"
    ),
    path("labs/<slug:slug>/grants/<int:grant_id>/retry/", grants.grant_retry, name="grant_retry"),
    path("labs/<slug:slug>/usage/", jobs.lab_usage, name="lab_usage"),
    path("labs/<slug:slug>/usage/csv/", jobs.lab_usage_csv, name="lab_usage_csv"),
    path("labs/<slug:slug>/vms/<int:vm_id>/jobs/", jobs.vm_jobs, name="vm_jobs"),
    path("labs/<slug:slug>/vms/<int:vm_id>/jobs/new/", jobs.job_submit, name="job_submit"),
    path("labs/<slug:slug>/vms/<int:vm_id>/jobs/<int:job_id>/", jobs.job_detail, name="job_detail"),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/jobs/<int:job_id>/live/", jobs.job_live, name="job_live"
    ),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/jobs/<int:job_id>/cancel/",
        jobs.job_cancel,
        name="job_cancel",
    ),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/jobs/<int:job_id>/rerun/",
        jobs.job_rerun,
        name="job_rerun",
    ),
    path(
        "labs/<slug:slug>/vms/<int:vm_id>/jobs/<int:job_id>/workers/<int:index>/log",
        jobs.job_log,
        name="job_log",
    ),
    path("labs/<slug:slug>/disks/register/", inventory.disk_register, name="disk_register"),
    path("labs/<slug:slug>/disks/<int:disk_id>/", inventory.disk_detail, name="disk_detail"),
    path(
        "labs/<slug:slug>/disks/<int:disk_id>/progress/",
        inventory.disk_progress,
        name="disk_progress",
    ),
    path(
        "labs/<slug:slug>/disks/<int:disk_id>/detach/<int:vm_id>/",
        inventory.disk_detach,
        name="disk_detach",
    ),
]
