"""``python -m gtp verify`` and ``checkpoint.verify_on_load`` on a checkpoint the training
workers wrote (tiny model, dp2, 2 iterations), and on copies of it that each test damages itself:
one flipped byte inside a tensor's stored bytes, a data file cut inside a record, bytes appended
to a data file, a missing ``.metadata``. A resume from the flipped copy is refused, naming the
file and the tensor, before training and before any weight of the model changed."""

from __future__ import annotations

import io
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ITER = 2
TENSOR = "decoder.layers.mlp.linear_fc1.weight"
CHUNK = (TENSOR, (0, 0, 0))  # layer 0's


@pytest.fixture(scope="module")
def saved(train_jobs, tmp_path_factory):
    """The run every test reads or copies: trained in one world as torchrun's workers train it
    (tests/helpers/inworld.py); the refused resume goes through train.py."""
    run = tmp_path_factory.mktemp("verify") / "run"
    train_jobs([(run, [f"train.train_iters={ITER}", f"checkpoint.save_interval={ITER}"])])
    return run


def _records(iter_path: Path) -> dict:
    """(fqn, chunk offsets) -> (data file, offset, length) of every stored record (the
    unpickled .metadata)."""
    from ckpt.format.safe_metadata import read_metadata

    return {(index.fqn, tuple(index.offset or ())): (iter_path / info.relative_path,
                                                      info.offset, info.length)
            for index, info in read_metadata(iter_path).storage_data.items()}


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved / "checkpoints", root)
    return root, root / f"iter_{ITER:07d}"


def flip_payload_byte(iter_path: Path, chunk: tuple) -> Path:
    """Flip one bit of the middle byte of ``chunk``'s stored tensor bytes (its zip entry
    ``data/0``, located with zipfile, not with the code under test); returns the data file."""
    file, offset, length = _records(iter_path)[chunk]
    raw = bytearray(file.read_bytes())
    archive = zipfile.ZipFile(io.BytesIO(bytes(raw[offset:offset + length])))
    entry = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    with archive.open(entry) as f:
        start = f._fileobj.tell()  # where zipfile starts reading the entry's bytes
    raw[offset + start + entry.file_size // 2] ^= 0x01
    file.write_bytes(bytes(raw))
    return file


def verify(*argv) -> tuple[int, str]:
    from ckpt.cli import main

    out = io.StringIO()
    return main(["verify", *map(str, argv)], out=out), out.getvalue()


def test_a_fresh_checkpoint_verifies(saved):
    rc, out = verify(saved / "checkpoints")
    assert rc == 0, out
    assert out.startswith(f"OK {saved / 'checkpoints' / f'iter_{ITER:07d}'}: "), out
    assert "DAMAGED" not in out
    rc, out = verify(saved / "checkpoints" / f"iter_{ITER:07d}")
    assert rc == 0 and out.startswith("OK "), out


def test_a_flipped_data_byte_names_the_file_and_tensor(saved, tmp_path):
    root, path = _copy(saved, tmp_path)
    file = flip_payload_byte(path, CHUNK)
    for ckpt in (root, path):
        rc, out = verify(ckpt)
        assert rc == 1, out
        lines = [line for line in out.splitlines() if line.startswith("DAMAGED")]
        assert lines == [f"DAMAGED {file}: tensor '{TENSOR}', the chunk at (0, 0, 0): entry "
                         f"archive/data/0 (57600 bytes) does not match its CRC-32 "
                         + lines[0].split("CRC-32 ", 1)[1]], out
        assert "(57600 bytes)" in lines[0]  # 2 layers x 200 x 72 fp32 / 2 layers per chunk


def test_a_truncated_file_names_the_file_and_the_record_it_cuts(saved, tmp_path):
    _, path = _copy(saved, tmp_path)
    file, offset, length = _records(path)[CHUNK]
    os.truncate(file, offset + length // 2)
    rc, out = verify(path)
    assert rc == 1, out
    assert (f"DAMAGED {file}: tensor '{TENSOR}', the chunk at (0, 0, 0): the file has "
            f"{offset + length // 2} bytes, but .metadata places this record at bytes {offset} "
            f"to {offset + length}: the file is truncated") in out.splitlines(), out


def test_bytes_after_the_last_record_and_a_missing_metadata(saved, tmp_path):
    root, path = _copy(saved, tmp_path)
    file = _records(path)[CHUNK][0]
    size = file.stat().st_size
    with open(file, "ab") as f:
        f.write(b"\0" * 10)
    rc, out = verify(path)
    assert rc == 1 and (f"DAMAGED {file}: 10 bytes after its last record (byte {size}): not "
                        f"written by this checkpoint's save") in out.splitlines(), out
    (path / ".metadata").unlink()
    rc, out = verify(root)
    assert rc == 1, out
    assert f"DAMAGED {path / '.metadata'}: missing" in out.splitlines(), out
    assert f"DAMAGED {root / 'latest_checkpointed_iteration.txt'}: names iteration {ITER}, but " \
           f"{path} lacks .metadata" in out.splitlines(), out
    rc, out = verify(tmp_path / "nothing")
    assert rc == 2


def test_a_resume_from_a_flipped_byte_is_refused_before_training(saved, tmp_path, train_run):
    root, path = _copy(saved, tmp_path)
    file = flip_payload_byte(path, CHUNK)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    proc = train_run(tmp_path / "resumed", "train.train_iters=4", f"checkpoint.load={root}",
                     rc=None)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert (f"{path} is damaged: {file}: tensor '{TENSOR}', the chunk at (0, 0, 0): entry "
            f"archive/data/0 (57600 bytes) does not match its CRC-32") in proc.stdout, \
        proc.stdout[-3000:]
    assert "checkpoint.verify_on_load" in proc.stdout
    assert not re.search(r"iteration +\d+/\d+ \|", proc.stdout), proc.stdout[-3000:]  # trained none
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def _load_into_sentinel(cfg_path, root):
    """World 1: a model filled with a sentinel loads ``root`` verified, then unverified; returns
    [(error text, names of the parameters that no longer hold only the sentinel)] of each."""
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from ckpt import io as checkpoint
    from recipes.run import worker
    from recipes.config.validate import validate

    cfg = OmegaConf.load(cfg_path)
    parallel_dims = validate(cfg, 1)
    _, model, optimizer, scheduler = worker.setup(cfg, parallel_dims)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-999.0)
    results = []
    for verify_on_load in (True, False):
        error = None
        try:
            checkpoint.load_checkpoint(root, model, optimizer, scheduler,
                                       checkpoint.layout_record(parallel_dims),
                                       verify=verify_on_load)
        except checkpoint.CheckpointError as exc:
            error = str(exc)
        results.append((error, [n for n, p in model.named_parameters()
                                if not (p == -999.0).all()]))
    parallel_state.destroy_model_parallel()
    return results


@pytest.mark.multiprocess
def test_the_refused_load_leaves_every_weight_as_it_was(saved, tmp_path):
    """Verified, the damaged checkpoint changes no weight; unverified, the reader's CRC check
    of the whole tensor it reads still fails the load, naming the file and the tensor."""
    from omegaconf import OmegaConf

    from multiproc import run_distributed

    root, path = _copy(saved, tmp_path)
    file = flip_payload_byte(path, CHUNK)
    cfg = OmegaConf.load(saved / "resolved_config.yaml")
    cfg.parallelism.nproc_per_node = 1
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(OmegaConf.to_yaml(cfg))
    [(error, changed), (error_unverified, _)], = run_distributed(
        _load_into_sentinel, 1, str(cfg_path), str(root), timeout=300)
    assert changed == [], changed
    assert error and f"{file}: tensor '{TENSOR}'" in error, error
    error = error_unverified
    assert error and (f"DataFileError: {file}: the stored tensor's bytes do not match the "
                      f"CRC-32 of its record") in error and f"tensor '{TENSOR}'" in error, error


def test_inspect_shows_the_optimizer_step(saved):
    from ckpt.cli import main

    out = io.StringIO()
    assert main(["inspect", str(saved / "checkpoints")], out=out) == 0
    assert f"optimizer step: {ITER} (expected {ITER}: iteration {ITER} - 0 skipped)" \
        in out.getvalue().splitlines(), out.getvalue()
    assert "warning:" not in out.getvalue()


def test_the_step_warning_for_each_optimizer_kind():
    """Common states as megatron writes them: the plain optimizer's ``common_step`` (fp32 and
    bf16's nested state), the distributed optimizer's param groups, a chained optimizer."""
    import torch

    from ckpt.cli import describe_step

    def common(optimizer, iteration=12, skipped=None):
        train_state = {} if skipped is None else {"skipped_iterations": skipped}
        return {"iteration": iteration, "optimizer": optimizer, "train_state": train_state}

    plain = {"state": {"common_step": torch.tensor(12.0)}, "param_groups": []}
    bf16 = {"optimizer": {"state": {"common_step": torch.tensor(10.0)}}}
    dist = {"param_state_sharding_type": "fully_reshardable",
            "optimizer": {"param_groups": [{"step": 90}, {"step": 90}]}}
    split = {"param_state_sharding_type": "fully_reshardable",
             "optimizer": {"param_groups": [{"step": 12}, {"step": 11}]}}
    assert describe_step(common(plain)) == [
        "optimizer step: 12 (expected 12: iteration 12, no skipped iterations recorded)"]
    assert describe_step(common(bf16, skipped=2)) == [
        "optimizer step: 10 (expected 10: iteration 12 - 2 skipped)"]
    lines = describe_step(common(dist))
    assert lines[0] == "optimizer step: 90 (expected 12: iteration 12, no skipped iterations " \
                       "recorded)"
    assert lines[1].startswith("warning: the optimizer step 90 is not the iteration minus the "
                               "skipped iterations (12)")
    lines = describe_step(common({0: split, 1: dist}))
    assert lines[0].startswith("optimizer step: differs between param groups: 11, 12, 90")
    assert lines[1].startswith("warning:")
    assert describe_step(common({})) == []
