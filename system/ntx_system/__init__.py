"""ntx_system: the privileged half of ntransformer.

Device discovery and the safety policy (`discovery`, `policy`), host checks and setup
(`check`, `hostsetup`), staging a model onto a dedicated NVMe (`staging`), and our userspace
NVMe driver split the SPDK way: `spec` (wire formats), `qpair` (rings), `ctrlr` (bring-up),
`vfio` (the PCIe transport), `quirks`.  `source` is the storage source the engine's tiers read
through; `service` the privileged steps the systemd unit runs around ntransformerd (find,
check, bind, hand back).
The in-process controller the unit tests drive lives with them (tests/system/fake_nvme.py).
"""
