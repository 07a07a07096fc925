"""Which lab a machine belongs to. A host key names one machine and an address
reaches one; once another lab's worker has either, no other lab may pin or register
it, whatever route the rows come by."""

from __future__ import annotations

from django.db.models import Q

from tpus.models import Lab
from tpus.models.inventory import Worker


def _key_blobs(lines: list[str]) -> set[str]:
    """The key material of ``type base64`` lines (what makes two host keys the same)."""
    return {parts[1] for line in lines if len(parts := line.split()) >= 2}


def host_keys_pinned_elsewhere(lab: Lab, lines: list[str]) -> bool:
    """Whether any of these host keys is pinned for a worker of another lab. A host
    key names one machine: if another lab's worker has it, this address is that
    machine (or pretends to be), and pinning it here would hand it to this lab."""
    blobs = _key_blobs(lines)
    if not blobs:
        return False
    # A text search narrows the rows on every database; the exact comparison decides.
    query = Q()
    for blob in blobs:
        query |= Q(host_keys__icontains=blob)
    others = Worker.objects.exclude(vm__lab=lab).filter(query).values_list("host_keys", flat=True)
    return any(blobs & _key_blobs(keys) for keys in others)


def host_key_taken_message(worker: Worker) -> str:
    return (
        f"{worker.alias} offers a host key that is already pinned for a worker of "
        "another lab, so it was not pinned here. Check which machine the worker's "
        "address reaches."
    )


def addresses_of_other_labs(lab: Lab, addresses: set[str]) -> set[str]:
    """Which of these addresses (external or internal) another lab's worker has."""
    rows = (
        Worker.objects.exclude(vm__lab=lab)
        .filter(Q(external_ip__in=addresses) | Q(internal_ip__in=addresses))
        .values_list("external_ip", "internal_ip")
    )
    return {address for row in rows for address in row if address in addresses}
