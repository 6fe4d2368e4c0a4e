"""The unit's start and stop steps (ntx_system.service) over discovery records and a staged
image file: every refusal with its message, the record ntransformerd reads, the hand-back."""
import json
import os

import pytest

from ntx_system import service, staging
from ntx_system.discovery import NvmeDevice
from ntx_system.service import DriveRecord, Refused, ServiceConfig

from .ggufgen import write_synthetic_gguf
from .test_bind import FakeSysfs


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    d = tmp_path_factory.mktemp("svc")
    model = write_synthetic_gguf(d / "m.gguf", n_layers=3, big=20000)
    other = write_synthetic_gguf(d / "other.gguf", n_layers=3, big=20000, seed=7)
    img = d / "dev.img"
    with open(img, "wb") as f:
        f.truncate(4 << 20)
    staging.stage(str(img), model, lba_size=512)
    return str(model), str(other), str(img)


def _drive(img, **kw):
    base = dict(controller="nvme0", pci_address="0000:00:04.0", driver="nvme", iommu_group=5,
                serial="ntxdata", model="QEMU NVMe Ctrl", namespace="nvme0n1", devnode=img,
                size_bytes=4 << 20, lba_size=512, signature="ntx-staged")
    base.update(kw)
    return NvmeDevice(**base)


def _prepare(tmp_path, cfg, devices, fs=None, **kw):
    bound = []

    def bind(pci, sysfs):
        bound.append(pci)
        if fs is not None:
            fs.attach("vfio-pci")
        return "nvme"
    out = service.prepare(cfg, bound_by="ntx-admin", devices=devices, require_root=False,
                          sysfs=fs.root if fs else str(tmp_path / "sys"),
                          run_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"),
                          bind=bind, **kw)
    return out, bound


def test_storage_names_a_drive():
    assert service.storage_drive("nvme:ntxdata") == "ntxdata"
    assert service.storage_drive("file") is None and service.storage_drive("odirect") is None
    with pytest.raises(ValueError, match="names no drive"):
        service.storage_drive("nvme:")


def test_prepare_checks_then_binds_and_records(tmp_path, staged):
    model, _, img = staged
    fs = FakeSysfs(tmp_path / "sys")
    said = []
    rec, bound = _prepare(tmp_path, ServiceConfig(storage="nvme:ntxdata", model=model),
                          [_drive(img)], fs=fs, status=said.append)
    assert bound == ["0000:00:04.0"] and rec.serial == "ntxdata" and rec.iommu_group == 5
    assert rec.model_sha256 == rec.staged_sha256 == staging.read_layout(img).model_sha256
    on_disk = DriveRecord.load(str(tmp_path / "run"))
    assert on_disk == rec and on_disk.bound_by == "ntx-admin"
    assert any("checked" in s for s in said) and any("bound to vfio-pci" in s for s in said)
    known = json.load(open(tmp_path / "state" / service.KNOWN_FILE))
    assert known == {"ntxdata": "0000:00:04.0"}
    # stop step: back to nvme, record gone
    unbound = []

    def unbind(pci, sysfs):
        unbound.append(pci)
        fs.attach("nvme")
    what = service.release(on_disk, sysfs=fs.root, run_dir=str(tmp_path / "run"), unbind=unbind)
    assert unbound == ["0000:00:04.0"] and "handed back to nvme" in what
    assert DriveRecord.load(str(tmp_path / "run")) is None


def test_keep_leaves_the_drive_bound_and_finds_it_again(tmp_path, staged):
    model, _, img = staged
    fs = FakeSysfs(tmp_path / "sys")
    rec, _ = _prepare(tmp_path, ServiceConfig(storage="nvme:ntxdata", nvme_release="keep"),
                      [_drive(img)], fs=fs)
    what = service.release(rec, sysfs=fs.root, run_dir=str(tmp_path / "run"),
                           unbind=lambda *a, **k: pytest.fail("unbound a kept drive"))
    assert "stays on vfio-pci" in what
    # the next start: the kernel no longer shows the serial, the state directory remembers it
    kept = _drive(None, controller=None, driver="vfio-pci", serial=None, namespace=None,
                  signature=None)
    rec2, bound = _prepare(tmp_path, ServiceConfig(storage="nvme:ntxdata"), [kept], fs=fs)
    assert rec2.pci_address == "0000:00:04.0" and rec2.serial == "ntxdata" and bound


@pytest.mark.parametrize("case, match", [
    ("absent", "drive absent: no NVMe drive with serial 'ntxdata'"),
    ("mounted", r"refused by policy: .*mounted at /srv"),
    ("boot", r"refused by policy: .*backs /boot"),
    ("iommu-off", "the IOMMU is off"),
    ("noiommu-not-loaded", "not in no-IOMMU mode"),
    ("other-model", "holds a staged copy of m.gguf .* not of .*other.gguf"),
    ("corrupt", "staged copy on .* is unusable: staged header is corrupt"),
    ("blank", "is unusable: no staged model here"),
    ("missing-model", "no such file"),
])
def test_refusals_name_the_cause_and_bind_nothing(tmp_path, staged, case, match):
    model, other, img = staged
    cfg = ServiceConfig(storage="nvme:ntxdata")
    devices = [_drive(img)]
    if case == "absent":
        devices = [_drive(img, serial="someone-else")]
    elif case == "mounted":
        devices = [_drive(img, mounts=["/srv"])]
    elif case == "boot":
        devices = [_drive(img, mounts=["/boot"], backs=["/boot"])]
    elif case == "iommu-off":
        devices = [_drive(img, iommu_group=None)]
    elif case == "noiommu-not-loaded":
        cfg = ServiceConfig(storage="nvme:ntxdata", noiommu=True)
        devices = [_drive(img, iommu_group=None)]
    elif case == "other-model":
        cfg = ServiceConfig(storage="nvme:ntxdata", model=other)
    elif case == "missing-model":
        cfg = ServiceConfig(storage="nvme:ntxdata", model=str(tmp_path / "typo.gguf"))
    elif case in ("corrupt", "blank"):
        copy = tmp_path / "dev.img"
        data = bytearray(open(img, "rb").read())
        if case == "corrupt":
            data[200] ^= 0xFF                      # inside the JSON body: checksum mismatch
        else:
            data[:4096] = bytes(4096)
        copy.write_bytes(bytes(data))
        devices = [_drive(str(copy))]
    with pytest.raises(Refused, match=match):
        _, bound = _prepare(tmp_path, cfg, devices)
    assert DriveRecord.load(str(tmp_path / "run")) is None


def test_not_root_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(Refused, match="not root"):
        service.prepare(ServiceConfig(storage="nvme:ntxdata"), bound_by="ntransformerd",
                        devices=[], run_dir=str(tmp_path))


def test_file_storage_binds_nothing(tmp_path):
    assert service.prepare(ServiceConfig(storage="file"), bound_by="ntx-admin",
                           devices=[], require_root=False) is None


def test_model_hash_is_cached(tmp_path, staged):
    model = staged[0]
    a = service.file_sha256(model, str(tmp_path))
    cache = json.load(open(tmp_path / service.SHA_CACHE_FILE))
    assert list(cache.values()) == [a]
    key = next(iter(cache))
    cache[key] = "f" * 64                         # the cache answers without reading the file
    json.dump(cache, open(tmp_path / service.SHA_CACHE_FILE, "w"))
    assert service.file_sha256(model, str(tmp_path)) == "f" * 64


def test_config_keys(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('storage = "nvme:ntxdata"\nnoiommu = true\nmax_batch = 4\n')
    cfg = ServiceConfig.from_toml(str(p))
    assert (cfg.storage, cfg.noiommu, cfg.nvme_release) == ("nvme:ntxdata", True, "nvme")
    p.write_text('nvme_release = "sometimes"\n')
    with pytest.raises(Refused, match="nvme_release"):
        ServiceConfig.from_toml(str(p))
    assert ServiceConfig.from_toml(str(tmp_path / "none.toml")).storage == "file"


def test_restore_hands_back_a_drive_the_service_left_bound(tmp_path, monkeypatch, capsys):
    from ntx_system import admin, bind

    root = tmp_path / "root"
    fs = FakeSysfs(root / "sys", driver="vfio-pci")
    run_dir = str(root / "run/ntransformer")
    DriveRecord(serial="ntxdata", pci_address=fs.addr, iommu_group=5, previous_driver="nvme",
                bound_by="ntx-admin").save(run_dir)

    def fake_write(path, text):
        if path.endswith("driver/unbind"):
            os.unlink(os.path.join(fs.dev, "driver"))
        elif path.endswith("drivers_probe"):
            fs.attach(open(os.path.join(fs.dev, "driver_override")).read().strip() or "nvme")
        else:
            open(path, "w").write(text)
    monkeypatch.setattr(bind, "_write", fake_write)
    monkeypatch.setattr(bind, "vfio_group_holders", lambda group, proc="/proc": [])
    assert admin.main(["restore", "--dry-run", "--root", str(root)]) == 0
    assert "would hand 0000:00:04.0 (serial ntxdata) back to nvme" in capsys.readouterr().out
    assert bind.current_driver(fs.addr, fs.root) == "vfio-pci"        # a dry run changes nothing
    assert admin.main(["restore", "--root", str(root)]) == 0
    assert "handed back to nvme" in capsys.readouterr().out
    assert bind.current_driver(fs.addr, fs.root) == "nvme" and DriveRecord.load(run_dir) is None
