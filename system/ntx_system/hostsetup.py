"""`ntx-admin setup` / `restore`: the host changes the NVMe path needs, undoable exactly.

Changes (the same the C++ project's setup script made):
  /etc/modules-load.d/ntransformer.conf   load vfio, vfio_iommu_type1, vfio-pci at boot
  /etc/modprobe.d/ntransformer.conf       let vfio-pci load before nvme (softdep)
  /etc/default/grub                       IOMMU arguments on GRUB_CMDLINE_LINUX_DEFAULT

Every file is backed up before its first change, and a manifest records what existed before
(content hash, mode, backup name) and which directories setup created.  `restore` puts back
exactly that and removes the manifest, so setup → restore leaves the tree byte-identical.
Setup is idempotent: a second run finds nothing to change and keeps the first run's backups.
`--root DIR` applies everything under DIR, which is how the tests run; nothing here touches the
real host unless root is "/".

Thread rule: one setup/restore at a time per root (the caller is a one-shot CLI).
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass

STATE_DIR = "var/lib/ntransformer/setup"
MANIFEST = "manifest.json"

MODULES_LOAD_PATH = "etc/modules-load.d/ntransformer.conf"
MODULES_LOAD_TEXT = """\
# ntransformer: VFIO modules for the dedicated NVMe (installed by ntx-admin setup)
vfio
vfio_iommu_type1
vfio-pci
"""
MODPROBE_PATH = "etc/modprobe.d/ntransformer.conf"
MODPROBE_TEXT = """\
# ntransformer (installed by ntx-admin setup): load vfio-pci before nvme so a controller
# whose driver_override says vfio-pci is never grabbed by nvme first during boot.
softdep nvme pre: vfio-pci
"""
GRUB_PATH = "etc/default/grub"


class SetupError(RuntimeError):
    pass


@dataclass
class Change:
    path: str          # relative to root
    old: bytes | None  # None: did not exist
    new: bytes

    def diff(self) -> str:
        a = (self.old or b"").decode(errors="replace").splitlines(keepends=True)
        b = self.new.decode(errors="replace").splitlines(keepends=True)
        return "".join(difflib.unified_diff(a, b, f"a/{self.path}" if self.old is not None
                                            else "/dev/null", f"b/{self.path}"))


def iommu_kernel_args(cpuinfo: str) -> list[str]:
    vendor = "amd" if "AuthenticAMD" in cpuinfo else "intel"
    return [f"{vendor}_iommu=on", "iommu=pt"]


def edit_grub(text: str, args: list[str]) -> str:
    """Add missing `args` to GRUB_CMDLINE_LINUX_DEFAULT, keeping everything else verbatim."""
    pat = re.compile(r'^(GRUB_CMDLINE_LINUX_DEFAULT=)(["\']?)(.*?)\2[ \t]*$', re.M)
    m = pat.search(text)
    if m is None:
        sep = "" if not text or text.endswith("\n") else "\n"
        return text + sep + f'GRUB_CMDLINE_LINUX_DEFAULT="{" ".join(args)}"\n'
    current = m.group(3).split()
    wanted = {a.split("=")[0]: a for a in args}
    # An argument that contradicts ours (intel_iommu=off) is replaced, not duplicated.
    value = [wanted.pop(a.split("=")[0], a) for a in current]
    value += [a for a in args if a.split("=")[0] in wanted]
    if value == current:
        return text
    quote = m.group(2) or '"'
    return text[:m.start()] + f"{m.group(1)}{quote}{' '.join(value)}{quote}" + text[m.end():]


def _read(root: str, rel: str) -> bytes | None:
    try:
        with open(os.path.join(root, rel), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def planned_changes(root: str, cpuinfo: str | None = None) -> list[Change]:
    if cpuinfo is None:
        cpuinfo = (_read(root, "proc/cpuinfo") or _read("/", "proc/cpuinfo") or b"").decode()
    out = []
    for rel, text in ((MODULES_LOAD_PATH, MODULES_LOAD_TEXT), (MODPROBE_PATH, MODPROBE_TEXT)):
        old = _read(root, rel)
        if old != text.encode():
            out.append(Change(rel, old, text.encode()))
    grub = _read(root, GRUB_PATH)
    if grub is not None:
        new = edit_grub(grub.decode(), iommu_kernel_args(cpuinfo)).encode()
        if new != grub:
            out.append(Change(GRUB_PATH, grub, new))
    return out


def _load_manifest(root: str) -> dict:
    raw = _read(root, os.path.join(STATE_DIR, MANIFEST))
    return json.loads(raw) if raw else {"files": [], "created_dirs": []}


def _makedirs(root: str, rel_dir: str, created: list[str]) -> None:
    parts = rel_dir.split("/")
    for i in range(1, len(parts) + 1):
        rel = "/".join(parts[:i])
        path = os.path.join(root, rel)
        if not os.path.isdir(path):
            os.mkdir(path, 0o755)
            created.append(rel)


def _atomic_write(path: str, data: bytes, mode: int) -> None:
    tmp = path + ".ntx-tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def setup(root: str = "/", *, dry_run: bool = False, cpuinfo: str | None = None,
          log=print) -> list[Change]:
    """Apply (or with dry_run, print) the changes; returns what changed / would change."""
    changes = planned_changes(root, cpuinfo)
    for c in changes:
        log(c.diff().rstrip("\n"))
    if dry_run or not changes:
        if not changes:
            log("setup: nothing to change (already set up)")
        return changes
    manifest = _load_manifest(root)
    known = {f["path"] for f in manifest["files"]}
    created: list[str] = manifest["created_dirs"]
    _makedirs(root, os.path.join(STATE_DIR, "backups"), created)
    for c in changes:
        path = os.path.join(root, c.path)
        if c.path not in known:
            entry = {"path": c.path, "existed": c.old is not None, "backup": None, "mode": None}
            if c.old is not None:
                st = os.stat(path)
                backup = c.path.replace("/", "__")
                shutil.copy2(path, os.path.join(root, STATE_DIR, "backups", backup))
                entry.update(backup=backup, mode=st.st_mode & 0o7777,
                             sha256=hashlib.sha256(c.old).hexdigest())
            manifest["files"].append(entry)
            known.add(c.path)
        _makedirs(root, os.path.dirname(c.path), created)
        mode = os.stat(path).st_mode & 0o7777 if c.old is not None else 0o644
        _atomic_write(path, c.new, mode)
    _atomic_write(os.path.join(root, STATE_DIR, MANIFEST),
                  json.dumps(manifest, indent=1).encode(), 0o600)
    if any(c.path == GRUB_PATH for c in changes):
        log("setup: kernel arguments changed: run update-grub and reboot")
    return changes


def restore(root: str = "/", *, dry_run: bool = False, log=print) -> int:
    """Undo everything recorded in the manifest.  Returns the number of files restored."""
    manifest = _load_manifest(root)
    if not manifest["files"] and not manifest["created_dirs"]:
        log("restore: nothing to restore (no manifest)")
        return 0
    for entry in reversed(manifest["files"]):
        path = os.path.join(root, entry["path"])
        if dry_run:
            log(f"restore: would {'restore' if entry['existed'] else 'remove'} {entry['path']}")
            continue
        if entry["existed"]:
            backup = os.path.join(root, STATE_DIR, "backups", entry["backup"])
            with open(backup, "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise SetupError(f"backup of {entry['path']} is damaged ({backup}); restore it "
                                 f"by hand")
            shutil.copy2(backup, path)
            os.chmod(path, entry["mode"])
        elif os.path.exists(path):
            os.unlink(path)
        log(f"restore: {'restored' if entry['existed'] else 'removed'} {entry['path']}")
    if dry_run:
        return len(manifest["files"])
    for entry in manifest["files"]:
        if entry["backup"]:
            os.unlink(os.path.join(root, STATE_DIR, "backups", entry["backup"]))
    os.unlink(os.path.join(root, STATE_DIR, MANIFEST))
    for rel in sorted(manifest["created_dirs"], key=lambda p: p.count("/"), reverse=True):
        try:
            os.rmdir(os.path.join(root, rel))
        except OSError:
            log(f"restore: left {rel} in place (not empty)")
    return len(manifest["files"])
