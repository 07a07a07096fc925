"""A fleet of real OpenSSH hosts on this machine that stand in for TPU VM workers.

See docs/test-fleet.md. Needs root, iproute2, util-linux and Debian's openssh-server.
"""

from testfleet.fleet import Fleet, Host
from testfleet.slots import SlotBusy
from testfleet.system import FleetError

__all__ = ["Fleet", "FleetError", "Host", "SlotBusy"]
