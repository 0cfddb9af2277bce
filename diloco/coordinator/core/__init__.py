"""The coordinator's pure core: membership and leases, snapshot bookkeeping."""
