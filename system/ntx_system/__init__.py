"""ntx_system: the privileged half of ntransformer.

Device discovery and the safety policy (`discovery`, `policy`), host checks and setup
(`check`, `hostsetup`), staging a model onto a dedicated NVMe (`staging`), and our userspace
NVMe driver split the SPDK way: `spec` (wire formats), `qpair` (rings), `ctrlr` (bring-up),
`vfio` (the PCIe transport), `quirks`.  `sim` is an in-process NVMe controller model used by
the unit tests; `source` is the storage source the engine's tiers read through.
"""
