"""The host copy a background checkpoint writes (dstrain/run/background_save.py) and when saves go to the background."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dstrain.config import CheckpointConfig
from dstrain.errors import UserError
from dstrain.parallel.layout import Layout
from dstrain.run import checkpoint
from dstrain.run.background_save import HostPages, Writer, host_copy


def test_host_copy_is_independent_of_later_in_place_updates_and_keeps_views_shared():
    flat = torch.arange(12.0)  # ZeRO's module weights are views of one flat buffer
    state = {"module": {"a": flat[:4].view(2, 2), "b": flat[4:]}, "shape": torch.Size([2, 2]), "lr": 0.1,
             "groups": [{"step": torch.tensor(3)}], "pair": (flat[0:1], "x")}
    copied = host_copy(state)
    flat.add_(100.0)  # the next optimizer step, in place
    state["groups"][0]["step"] += 1
    assert copied["module"]["a"].tolist() == [[0.0, 1.0], [2.0, 3.0]] and copied["module"]["b"][0].item() == 4.0
    assert copied["groups"][0]["step"].item() == 3 and copied["pair"][0].item() == 0.0
    assert type(copied["shape"]) is torch.Size and copied["lr"] == 0.1 and copied["pair"][1] == "x"
    # one storage copied once, the views rebuilt on it: torch.save writes the same bytes as from the live state
    a, b = copied["module"]["a"], copied["module"]["b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert b.storage_offset() == 4


def test_writer_records_files_and_reports_a_failure(tmp_path):
    writer = Writer(0, checkpoint._file_record)
    job = writer.begin(4, tmp_path)
    writer.put({"w": torch.ones(3)}, tmp_path / "a.pt")
    writer.seal()
    assert job.done.wait(30) and job.error is None
    assert job.records["a.pt"] == checkpoint._file_record(tmp_path / "a.pt")
    assert torch.load(tmp_path / "a.pt")["w"].tolist() == [1.0, 1.0, 1.0]
    failed = writer.begin(8, tmp_path)
    writer.put({"w": torch.ones(3)}, tmp_path / "missing" / "b.pt")  # no such folder: the write fails
    writer.put({"w": torch.ones(3)}, tmp_path / "c.pt")  # skipped: the checkpoint is already lost
    writer.seal()
    assert failed.done.wait(30) and "does not exist" in str(failed.error) and not (tmp_path / "c.pt").exists()


def test_the_next_save_reuses_the_host_buffers_and_writes_its_own_values(tmp_path):
    """A save's host buffers are kept once written (fresh memory's page faults were most of the stall) and the next
    save copies into them: its files hold the new state, not the old one's bytes."""
    writer = Writer(0, checkpoint._file_record)
    weights = torch.zeros(1000)
    used = []
    for step, value in ((4, 1.0), (8, 2.0), (12, 3.0)):
        weights.fill_(value)
        kept = [s for spare in writer.spare.values() for s in spare]  # the last save's buffers
        job = writer.begin(step, tmp_path)
        writer.put({"w": weights, "m": weights[:10]}, tmp_path / f"s{step}.pt")
        used.append([storage for _, _, storage in job.storages])
        assert step == 4 or used[-1] == kept and all(a is b for a, b in zip(used[-1], kept))
        writer.seal()
        assert job.done.wait(30) and job.error is None
        weights.fill_(-1.0)  # the next optimizer steps change the live state
        saved = torch.load(tmp_path / f"s{step}.pt")
        assert saved["w"].tolist() == [value] * 1000 and saved["m"].tolist() == [value] * 10
    assert [len(u) for u in used] == [1, 1, 1]  # one storage copied once per save (the view shares it)


def test_page_locked_buffers_have_their_own_size_and_are_unregistered_before_they_are_let_go(tmp_path):
    """Copies off a GPU go to page-locked host buffers of exactly their size (PyTorch's pinned allocator rounds up
    to a power of two: 28.0 GiB for 17.3 GB on gpu-1b). A buffer the next save does not reuse is unregistered
    while the writer still holds it: memory freed while registered stays locked, and its address range cannot be
    registered again. cudaHostRegister itself is exercised on a GPU (tests/gpu/test_background_save_gpu.py)."""
    calls = []
    pages = HostPages(register=lambda ptr, n: calls.append(("register", ptr, n)) or True,
                      unregister=lambda ptr: calls.append(("unregister", ptr)))
    writer = Writer(0, checkpoint._file_record, pages)
    job = writer.begin(4, tmp_path)
    big, small = writer._alloc(3_000_001, True), writer._alloc(5_000, True)
    plain = writer._alloc(7, False)  # a copy of host memory: never registered
    writer.seal()
    assert job.done.wait(30) and job.error is None
    assert calls == [("register", big.data_ptr(), 3_000_001), ("register", small.data_ptr(), 5_000)]
    assert big.nbytes() == 3_000_001 and plain.data_ptr() not in pages.held
    job = writer.begin(8, tmp_path)
    assert writer._alloc(3_000_001, True) is big  # reused: not registered again
    writer.seal()
    assert job.done.wait(30)
    assert calls[2:] == [("unregister", small.data_ptr())]  # the unused one, once
    assert list(pages.held) == [big.data_ptr()]
    refused = HostPages(register=lambda ptr, n: False, unregister=lambda ptr: pytest.fail("never registered"))
    storage = refused.new(100)  # registration failed: pageable memory, the copy into it synchronous
    assert storage.nbytes() == 100 and not refused.held
    refused.release(storage)


NVME = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}


def test_background_decision():
    layout = Layout(2)
    on, said = checkpoint.background_decision(CheckpointConfig(), {"zero_optimization": {"stage": 2}}, layout,
                                              10**6, None, 2)
    assert on and "written in the background" in said and "host copy per rank" in said
    off, said = checkpoint.background_decision(CheckpointConfig(), NVME, layout, 10**6, None, 2)
    assert not off and "NVMe" in said
    off, said = checkpoint.background_decision(CheckpointConfig(background="false"), {}, layout, 10**6, None, 2)
    assert not off
    huge, said = checkpoint.background_decision(CheckpointConfig(), {}, layout, 10**14, None, 2)
    assert not huge and "would not fit" in said
    with pytest.raises(UserError, match="checkpoint.background=true cannot apply with NVMe offload"):
        checkpoint.check_background(CheckpointConfig(background="true"), NVME)
    with pytest.raises(UserError, match="checkpoint.background"):
        CheckpointConfig(background="sometimes")


def test_every_auto_is_young_daly_from_the_measured_stall(monkeypatch):
    """The first save at step 5 measures the stall; the interval is sqrt(2 x stall x MTBF of the job) in steps."""
    from dstrain.parallel.dist import DistContext

    ckpt = checkpoint.Checkpointer(Path("/nonexistent"), CheckpointConfig(every="auto"), DistContext(0, 0, 1))
    clock = iter(float(i) * 0.5 for i in range(100))  # steps of 0.5 s
    monkeypatch.setattr(checkpoint.time, "perf_counter", lambda: next(clock))
    assert [ckpt.due(s, 1000) for s in range(1, 6)] == [False] * 4 + [True]
    ckpt.stalls.append(0.2)  # what a background save() records
    said = []
    ckpt.choose_interval(4, 6000.0, torch.device("cpu"), said.append)
    assert ckpt.every is None and not said  # its stall is not final before the next step's optimizer update
    ckpt.before_update()
    ckpt.choose_interval(4, 6000.0, torch.device("cpu"), said.append)
    # sqrt(2 x 0.2 s x 6000 h x 3600 / 4 nodes) = 1,470 s = 2,939 steps of 0.5 s
    assert ckpt.every == 2939 and "every 2,939 steps" in said[0] and "fault.mtbf_hours=6000" in said[0]
    assert ckpt.due(2939 * 2, 10**6) and not ckpt.due(2939 * 2 + 1, 10**6) and ckpt.due(10**6, 10**6)
    with pytest.raises(UserError, match="checkpoint.every"):
        CheckpointConfig(every="sometimes")


def test_engine_state_is_copied_before_the_next_update_and_the_rest_at_once(tmp_path, monkeypatch):
    """The engine's host-memory state (until_update) is copied by the copy thread, which the next optimizer step
    waits for; what else a rank saves is copied at the save (the next backward may change it)."""
    from dstrain.run import faults

    writer = Writer(0, checkpoint._file_record)
    weights, residual = torch.zeros(1000), torch.zeros(10)
    monkeypatch.setattr(faults, "_RULES", faults._parse("save:copy:slow:seconds=1:step=4"))
    job = writer.begin(4, tmp_path)
    writer.put({"w": weights, "v": weights[:3]}, tmp_path / "engine.pt", until_update=True)
    writer.put({"r": residual}, tmp_path / "extra.pt")
    assert len(job.later) == 1 and not job.copied.is_set()  # one storage, not copied yet
    writer.seal()
    residual.fill_(7.0)  # the next backward: the extra's copy was taken at the save
    assert writer.wait_copied() > 0.5 and job.copied.is_set() and job.copy_s > 0.5
    weights.fill_(5.0)  # the next optimizer update, after the wait
    assert job.done.wait(30) and job.error is None
    assert torch.load(tmp_path / "engine.pt")["w"].tolist() == [0.0] * 1000
    assert torch.load(tmp_path / "engine.pt")["v"].tolist() == [0.0] * 3
    assert torch.load(tmp_path / "extra.pt")["r"].tolist() == [0.0] * 10
    assert writer.wait_copied() == 0.0  # nothing in flight to wait for


def test_file_records_are_crc32_and_older_sha256_manifests_are_still_checked(tmp_path):
    import hashlib
    import zlib
    path = tmp_path / "shard.pt"
    data = bytes(range(256)) * ((1 << 24) // 256 + 3)  # longer than one read buffer
    path.write_bytes(data)
    record = checkpoint._file_record(path)
    assert record == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    old = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # a manifest from before CRC-32
    assert checkpoint._problems(tmp_path, ["shard.pt"], {"shard.pt": record}) == []
    assert checkpoint._problems(tmp_path, ["shard.pt"], {"shard.pt": old}) == []
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(flipped))
    assert checkpoint._problems(tmp_path, ["shard.pt"], {"shard.pt": record}) == ["shard.pt fails its CRC-32 check"]
    assert checkpoint._problems(tmp_path, ["shard.pt"], {"shard.pt": old}) == ["shard.pt fails its SHA-256 check"]


def test_checkpoint_files_carry_no_zip_crc_and_load_the_same(tmp_path):
    """The manifest's CRC-32 is the check; torch.save's own per-record CRC (0.6 s of CPU a GB) is switched off for
    the run, and torch.load reads the files as before."""
    before = torch.serialization.get_crc32_options()
    try:
        checkpoint.Checkpointer(tmp_path, CheckpointConfig(), ctx=type("Ctx", (), {"rank": 0})())
        assert torch.serialization.get_crc32_options() is False
        torch.save({"w": torch.arange(5.0)}, tmp_path / "a.pt")
        assert torch.load(tmp_path / "a.pt")["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        torch.serialization.set_crc32_options(before)


def test_exporting_a_pruned_step_says_which_steps_exist(tmp_path, capsys):
    """Issue 85: `python -m dstrain.export run/checkpoints/step_00000010` of a step keep_last had pruned said only
    'no complete checkpoint in ...'; it now says why it may be gone and which steps there are."""
    from dstrain.run.export import main
    for step in (20, 30):
        (tmp_path / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step:08d}" / checkpoint.COMPLETE).write_text("{}")
    gone = tmp_path / "checkpoints" / "step_00000010"
    with pytest.raises(SystemExit) as exit_:
        main([str(gone)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {gone} is not there: checkpoint.keep_last pruned it, or that step was never saved; this run has "
        f"step_00000020, step_00000030: export one of them, or pass the run directory for the newest")
