"""bind/unbind against a fake sysfs tree: the writes they make, in order."""
import os

import pytest

from ntx_system import bind


class FakeSysfs:
    """Just enough of /sys/bus/pci for one device; drivers_probe 'binds' per driver_override."""
    def __init__(self, root, addr="0000:00:04.0", driver="nvme"):
        self.root, self.addr = str(root), addr
        self.dev = os.path.join(self.root, "bus/pci/devices", addr)
        os.makedirs(self.dev)
        for d in ("nvme", "vfio-pci"):
            os.makedirs(os.path.join(self.root, "bus/pci/drivers", d))
        open(os.path.join(self.dev, "driver_override"), "w").write("(null)\n")
        os.makedirs(os.path.join(self.root, "kernel/iommu_groups/5"))
        os.symlink("../../../kernel/iommu_groups/5", os.path.join(self.dev, "iommu_group"))
        if driver:
            self.attach(driver)

    def attach(self, driver):
        link = os.path.join(self.dev, "driver")
        if os.path.islink(link):
            os.unlink(link)
        os.symlink(os.path.join(self.root, "bus/pci/drivers", driver), link)


def test_bind_then_unbind(tmp_path, monkeypatch):
    fs = FakeSysfs(tmp_path)
    writes = []
    real_write = bind._write

    def fake_write(path, text):
        writes.append((os.path.relpath(path, fs.root), text))
        if path.endswith("driver/unbind"):
            os.unlink(os.path.join(fs.dev, "driver"))
            return
        if path.endswith("drivers_probe"):
            override = open(os.path.join(fs.dev, "driver_override")).read().strip()
            fs.attach(override or "nvme")
            return
        real_write(path, text)

    monkeypatch.setattr(bind, "_write", fake_write)
    assert bind.bind_vfio(fs.addr, sysfs=fs.root) == "nvme"
    assert bind.current_driver(fs.addr, fs.root) == "vfio-pci"
    assert [w[0].split("/")[-1] for w in writes] == ["driver_override", "unbind",
                                                      "drivers_probe"]
    bind.unbind_vfio(fs.addr, sysfs=fs.root, proc=str(tmp_path / "noproc"))
    assert bind.current_driver(fs.addr, fs.root) == "nvme"


def test_unbind_refuses_while_group_is_held(tmp_path):
    fs = FakeSysfs(tmp_path, driver="vfio-pci")
    proc = tmp_path / "proc"
    (proc / "4242/fd").mkdir(parents=True)
    os.symlink("/dev/vfio/5", proc / "4242/fd/7")
    with pytest.raises(bind.BindError, match="PID 4242"):
        bind.unbind_vfio(fs.addr, sysfs=fs.root, proc=str(proc))


def test_unknown_device(tmp_path):
    with pytest.raises(bind.BindError, match="no PCI device"):
        bind.bind_vfio("0000:ff:00.0", sysfs=str(tmp_path))
