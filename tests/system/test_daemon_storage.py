"""ntransformerd streaming from an NVMe drive, in process, over the fake controller (CI, no VM):
the same ids as the daemon reading the GGUF file, with the model given and with the model read
from the drive alone; the storage tier's counters; a drive error mid-stream (UNAVAILABLE,
NOT_SERVING, then serving again); a refusal; LoadModel keeping the old model when the new one
fails."""
from __future__ import annotations

import os
import re
import threading
import time

import grpc
import numpy as np
import pytest

from ntx_system import staging
from ntx_system.spec import STATUS_UNRECOVERED_READ_ERROR

from .fake_nvme import FakeNvmeController, FakeNvmeTransport

SERIAL = "ntxfake"
PROMPT_IDS = [1, 17, 923, 44, 1512]
MAX_TOKENS = 6


class RecordingNotifier:
    def __init__(self):
        self.messages: list[str] = []
        self.enabled = True
        self.watchdog_interval = None

    def notify(self, message: str) -> bool:
        self.messages.append(message)
        return True

    def ready(self, status: str) -> None:
        self.notify(f"READY=1\nSTATUS={status}")

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")

    def stopping(self, status: str = "stopping") -> None:
        self.notify(f"STOPPING=1\nSTATUS={status}")

    def watchdog(self) -> None:
        pass


@pytest.fixture(scope="module")
def drive(tmp_path_factory):
    """A six-layer synthetic model staged onto a 64 MiB image the fake controller serves."""
    from ntransformerd.tools import synth
    d = tmp_path_factory.mktemp("nvmed")
    shape = synth.Shape(n_layers=6, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, rope_base=10000.0,
                        llama31_rope=False, vocab=2048)
    model = str(d / "six.gguf")
    synth.synthesize(model, shape=shape, ftype="q8_0", seed=3)
    other = str(d / "other.gguf")
    synth.synthesize(other, shape=shape, ftype="q8_0", seed=4)
    img = d / "drive.img"
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    staging.stage(str(img), model, lba_size=512)
    image = np.fromfile(img, np.uint8)
    ctrl = {"c": None}

    def transport():
        ctrl["c"] = FakeNvmeController(image, serial=SERIAL, mdts=5)   # the same medium each bring-up
        return FakeNvmeTransport(ctrl["c"])
    return {"model": model, "other": other, "transport": transport, "ctrl": ctrl, "dir": d}


def _budgets(model_path):
    """vram/pinned budgets that leave no layer resident, one pinned and the rest on storage."""
    from ntransformerd.engine import tiers
    from ntransformerd.engine.runtime.engine import EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel
    m = GGUFModel(model_path)
    layer = max(m.layer_bytes(i) for i in range(m.config.n_layers)) + (1 << 16)
    fixed = sum(t.nbytes for n, t in m.tensors.items() if not n.startswith("blk."))
    kv, _ = tiers.kv_and_workspace(m, EngineConfig(max_batch=2, max_ctx=128), "cpu")
    vram, ram = fixed + kv + 2 * layer + (1 << 20), 3 * layer + (1 << 16)
    plan = tiers.model_plan(m, EngineConfig(max_batch=2, max_ctx=128, vram_budget=vram, pinned_budget=ram), backend="cpu")
    storage = plan.layers(tiers.STORAGE)
    assert len(storage) >= 4, plan.explain()
    return vram, ram, sum(m.layer_bytes(i) for i in storage)


def _config(tmp, name, **kw):
    from ntransformerd.config import DaemonConfig
    base = dict(socket=str(tmp / f"{name}.sock"), socket_group="", backend="cpu-ref", max_batch=2, max_ctx=128,
                drain_timeout=1.0, nvme_retries=2)
    base.update(kw)
    return DaemonConfig(**base)


class Running:
    def __init__(self, config, drive=None, tmp=None):
        from ntransformerd.server.daemon import Daemon
        self.notifier = RecordingNotifier()
        self.daemon = Daemon(config=config, notifier=self.notifier,
                             transport_factory=drive["transport"] if drive else None,
                             run_dir=str(tmp) if tmp else None, state_dir=str(tmp) if tmp else None)
        self.daemon.start()

    def client(self):
        from ntx_client import Client
        return Client(self.daemon.config.socket, timeout=120)

    def wait(self, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.daemon.stopping.is_set():
            if any(m.startswith("READY=1") for m in self.notifier.messages):
                return
            time.sleep(0.05)
        raise AssertionError(f"not ready: {self.notifier.messages[-5:]}")

    def stop(self):
        self.daemon.request_shutdown()
        self.daemon.shutdown()


def _ids(client):
    return client.complete(prompt_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).ids


def _storage_tier(status):
    return next(t for t in status.tiers if t.name == "storage")


@pytest.fixture(scope="module")
def file_ids(drive, tmp_path_factory):
    vram, ram, _ = _budgets(drive["model"])
    tmp = tmp_path_factory.mktemp("f")
    r = Running(_config(tmp, "file", model=drive["model"], vram_budget=vram, pinned_budget=ram))
    try:
        r.wait()
        with r.client() as c:
            ids = _ids(c)
            st = _storage_tier(c.status())
            assert st.source.startswith("file ") and st.read_bytes > 0
        return ids
    finally:
        r.stop()


def test_one_plan_fills_the_drive_image_and_loads_the_engine(drive, tmp_path, monkeypatch):
    """The model read from the drive alone: one tier plan per load decides which layers come off
    the drive into memory and is the plan the engine loads (engine.plan_for, then Engine(plan=))."""
    from ntransformerd.engine import tiers as tiers_mod
    plans = []
    real = tiers_mod.model_plan

    def counting(*a, **kw):  # the planner's entry: every plan of a load goes through it
        plans.append(real(*a, **kw))
        return plans[-1]
    vram, ram, _ = _budgets(drive["model"])
    monkeypatch.setattr(tiers_mod, "model_plan", counting)
    r = Running(_config(tmp_path, "once", storage=f"nvme:{SERIAL}", vram_budget=vram, pinned_budget=ram), drive,
                tmp_path)
    try:
        r.wait()
        engine = r.daemon.scheduler.engine
        assert len(plans) == 1 and engine.plan is plans[0] and engine.plan.layers("storage"), plans
    finally:
        r.stop()


@pytest.mark.parametrize("model_set", [True, False], ids=["model-set", "model-from-drive"])
def test_nvme_storage_gives_the_file_ids_and_counts_its_reads(drive, file_ids, tmp_path, model_set):
    vram, ram, storage_bytes = _budgets(drive["model"])
    cfg = _config(tmp_path, "nv", model=drive["model"] if model_set else "", storage=f"nvme:{SERIAL}",
                  vram_budget=vram, pinned_budget=ram)
    r = Running(cfg, drive, tmp_path)
    try:
        r.wait()
        with r.client() as c:
            assert _ids(c) == file_ids
            s = c.status()
            st = _storage_tier(s)
            assert st.source == f"nvme {SERIAL} at fake"
            assert st.read_bytes >= storage_bytes * s.steps > 0, (st.read_bytes, storage_bytes, s.steps)
            assert st.commands > 0 and st.commands_in_flight == 0 and st.read_errors == 0
            if not model_set:
                assert c.model().name.startswith("synthetic")
        said = "\n".join(r.notifier.messages)
        assert "nvme: bringing up fake" in said and "serial ntxfake ready" in said
    finally:
        r.stop()
    ctrl = drive["ctrl"]["c"]
    assert not ctrl.cc & 1 and ctrl.t.regions == [] and not ctrl.faults   # disabled, all unmapped


def test_drive_error_mid_stream_fails_with_unavailable_then_serves_again(drive, file_ids, tmp_path):
    from ntx_client import NtxError
    vram, ram, _ = _budgets(drive["model"])
    r = Running(_config(tmp_path, "err", model=drive["model"], storage=f"nvme:{SERIAL}", vram_budget=vram,
                        pinned_budget=ram), drive, tmp_path)
    try:
        r.wait()
        with r.client() as c:
            assert _ids(c) == file_ids
            drive["ctrl"]["c"].error_for = lambda cmd: STATUS_UNRECOVERED_READ_ERROR if cmd.opc == 0x02 else None
            with pytest.raises(NtxError) as exc:
                _ids(c)
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE, exc.value
            assert "unrecovered read error" in str(exc.value)
            health = c.health()
            assert health == "NOT_SERVING", health
            # the next bring-up meets a healthy controller (the fake is new per bring-up)
            c.wait_ready(timeout=60)
            assert _ids(c) == file_ids
        said = "\n".join(r.notifier.messages)
        assert "drive error" in said and said.count("serial ntxfake ready") == 2
    finally:
        r.stop()


def test_staged_copy_of_another_model_is_refused_with_exit_2(drive, tmp_path):
    r = Running(_config(tmp_path, "ref", model=drive["other"], storage=f"nvme:{SERIAL}"), drive, tmp_path)
    try:
        assert r.daemon.stopping.wait(60)
        assert r.daemon.exit_code == 2
        said = "\n".join(r.notifier.messages)
        assert "STATUS=refused: nvme ntxfake at fake holds a staged copy of six.gguf" in said, said
        assert not any(m.startswith("READY=1") for m in r.notifier.messages)
    finally:
        r.stop()


def test_failed_load_model_keeps_the_old_model_serving(drive, file_ids, tmp_path):
    from ntx_client import AdminClient, NtxError
    vram, ram, _ = _budgets(drive["model"])
    r = Running(_config(tmp_path, "lm", model=drive["model"], vram_budget=vram, pinned_budget=ram))
    try:
        r.wait()
        bad = tmp_path / "corrupt.gguf"
        data = bytearray(open(drive["model"], "rb").read(1 << 16))
        data[8:16] = (10 ** 12).to_bytes(8, "little")   # an absurd tensor count
        bad.write_bytes(bytes(data))
        with r.client() as c, AdminClient(r.daemon.config.admin_socket, timeout=120) as admin:
            name = c.model().name
            for path, code in ((str(tmp_path / "typo.gguf"), grpc.StatusCode.INVALID_ARGUMENT),
                               (str(bad), grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(NtxError) as exc:
                    admin.load_model(path)
                assert exc.value.code == code, exc.value
                assert c.health() == "SERVING" and c.model().name == name
                assert _ids(c) == file_ids
            info = admin.load_model(drive["other"])          # a good one does replace it
            assert info.path == drive["other"] and c.model().path == drive["other"]
            assert c.health() == "SERVING" and _ids(c) != file_ids
    finally:
        r.stop()


def test_load_model_of_another_model_than_the_staged_one_keeps_serving(drive, file_ids, tmp_path):
    from ntx_client import AdminClient, NtxError
    vram, ram, _ = _budgets(drive["model"])
    r = Running(_config(tmp_path, "lmn", storage=f"nvme:{SERIAL}", vram_budget=vram, pinned_budget=ram),
                drive, tmp_path)
    try:
        r.wait()
        with r.client() as c, AdminClient(r.daemon.config.admin_socket, timeout=120) as admin:
            with pytest.raises(NtxError, match="holds a staged copy of six.gguf") as exc:
                admin.load_model(drive["other"])
            assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert c.health() == "SERVING" and _ids(c) == file_ids
            admin.load_model(drive["model"])               # the staged model by its file: fine
            assert _ids(c) == file_ids
    finally:
        r.stop()


def test_a_drive_that_never_comes_up_exits_1_after_the_bounded_retries(tmp_path, caplog):
    from ntx_system.ctrlr import CtrlrError
    attempts = []

    def broken():
        attempts.append(1)
        raise CtrlrError("ENABLE_WAIT_FOR_READY_1: CSTS.RDY=1 after CC.EN=1 did not happen within CAP.TO")
    r = Running(_config(tmp_path, "dead", storage=f"nvme:{SERIAL}", nvme_retries=3), {"transport": broken},
                tmp_path)
    try:
        assert r.daemon.stopping.wait(60)
        assert r.daemon.exit_code == 1 and len(attempts) == 3
        # a growing pause between the attempts: 1 s, then 2 s
        assert re.search(r"attempt 1/3 failed: .*; again in 1 s", caplog.text), caplog.text
        assert re.search(r"attempt 2/3 failed: .*; again in 2 s", caplog.text), caplog.text
        said = "\n".join(r.notifier.messages)
        assert "attempt 1/3 failed" in said and "did not come up after 3 attempts" in said
        assert "STATUS=failed: nvme ntxfake" in said
    finally:
        r.stop()
