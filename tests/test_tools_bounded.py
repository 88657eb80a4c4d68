"""The offline tools hold about one tensor at a time, not the checkpoint (issue 55 item 5).

In this process, on the committed tiny checkpoints of ``tests/golden/compat/``: every read of
``gtp convert`` and ``gtp export`` is counted where it happens
(``ckpt.stock.reading.load_stored``: the keys of one request, and the bytes of earlier requests
still held when it is made), and the writer of ``gtp convert`` / ``gtp import``
(``ckpt.format.dcp_writer``) is checked to free each chunk before it makes the next. The
stock reader's requests (a stock checkpoint: one GTP weight's stored group per request) are
checked in tests/test_gtp_cli.py on the stock checkpoint built there. Measured peaks:
benchmarks/tools_memory.py.
"""

from __future__ import annotations

import io
import weakref
from pathlib import Path

import pytest
import torch

from ckpt.stock import reading

GOLDEN = Path(__file__).resolve().parent / "golden" / "compat"


class Reads:
    """Wraps ``reading.load_stored``: per request, its keys, its bytes and the bytes of the
    tensors of earlier requests still alive with their storage."""

    def __init__(self, monkeypatch):
        self.requests: list[tuple[list, int, int]] = []
        self._alive: list = []
        inner = reading.load_stored

        def load_stored(path, metadata, keys):
            held = sum(t().untyped_storage().nbytes() for t in self._alive if t() is not None)
            out = inner(path, metadata, keys)
            got = [v for v in out.values() if isinstance(v, torch.Tensor)]
            self._alive += [weakref.ref(t) for t in got]
            self.requests.append((list(keys), sum(t.nbytes for t in got), held))
            return out

        monkeypatch.setattr(reading, "load_stored", load_stored)

    @property
    def largest(self) -> int:
        return max(b for _, b, _ in self.requests)


def _stored_bytes(path) -> dict:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    return {k: v.dtype.itemsize * int(torch.Size(v.global_shape).numel()) for k, v in meta.items()}


def _cli(*argv) -> tuple[int, str]:
    from ckpt.cli import main

    out = io.StringIO()
    return main([str(a) for a in argv], out=out), out.getvalue()


@pytest.mark.parametrize("name", ["fp32_g2a16", "fp32_distopt_tp2"])
def test_convert_reads_and_holds_one_tensor_at_a_time(name, tmp_path, monkeypatch):
    src = GOLDEN / name
    sizes = _stored_bytes(src / "iter_0000001")
    reads = Reads(monkeypatch)
    assert _cli("convert", src, tmp_path / "out")[0] == 0
    assert sorted(k for keys, _, _ in reads.requests for k in keys) == sorted(sizes)
    assert [keys for keys, _, _ in reads.requests if len(keys) != 1] == []
    # When a tensor is read, every tensor read before it has been written and freed.
    assert [(keys, held) for keys, _, held in reads.requests if held] == []
    assert reads.largest == max(sizes.values()) < sum(sizes.values()) / 4
    rc, text = _cli("compare", src, tmp_path / "out")
    assert (rc, text.splitlines()[-1].split(":")[0]) == (0, "EQUAL"), text


def _with_run_config(src: Path, root: Path) -> Path:
    """A copy of the golden checkpoint ``src`` whose common state records the run config an
    export reads (the goldens were saved without one), written by ``ckpt.format.dcp_writer``."""
    import yaml
    from omegaconf import OmegaConf

    from ckpt.format import dcp_writer
    from compat_checkpoint import case_cfg

    analysis, tensors = reading.read_logical(src)
    cfg = OmegaConf.to_container(OmegaConf.create(yaml.safe_load(case_cfg(src.name))))
    common = dict(analysis.common)
    common["train_state"] = {**(common.get("train_state") or {}),
                             "config": {"model": cfg["model"], "data": {"tokenizer": "byte"}}}
    chunks = [(k, (0,) * t.dim(), tuple(t.shape), tuple(t.shape), t.dtype, lambda t=t: t.clone())
              for k, t in tensors.items()]
    (root / "iter_0000001").mkdir(parents=True)
    dcp_writer.write(root / "iter_0000001", chunks, common)
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")
    return root


def test_export_reads_the_model_tensors_only_one_per_request(tmp_path, monkeypatch):
    src = _with_run_config(GOLDEN / "fp32_g2a16", tmp_path / "ckpt")
    sizes = _stored_bytes(src / "iter_0000001")
    model = {k for k in sizes if not k.startswith("optimizer")}
    reads = Reads(monkeypatch)
    rc, text = _cli("export", src, tmp_path / "hf")
    assert rc == 0, text
    assert [keys for keys, _, _ in reads.requests if len(keys) != 1] == []
    assert sorted(k for keys, _, _ in reads.requests for k in keys) == sorted(model)
    assert sum(b for _, b, _ in reads.requests) == sum(sizes[k] for k in model)
    assert model and len(model) < len(sizes)


def test_the_writer_frees_each_chunk_before_it_makes_the_next(tmp_path):
    from megatron.core import dist_checkpointing

    from ckpt.format import dcp_writer
    from ckpt.stock.reading import ensure_dist

    made, held = [], []

    def producer(i):
        def make():
            held.append(sum(t().untyped_storage().nbytes() for t in made if t() is not None))
            t = torch.full((64, 32), float(i))
            made.append(weakref.ref(t))
            return t
        return make

    chunks = [(f"w{i}", (0, 0), (64, 32), (64, 32), torch.float32, producer(i)) for i in range(5)]
    dcp_writer.write(tmp_path, chunks, {"iteration": 3}, [("extra", (0,), (1,), {"a": 1})])
    assert held == [0] * 5
    cleanup = ensure_dist()
    try:
        meta = dist_checkpointing.load_tensors_metadata(str(tmp_path))
        back = reading.load_stored(tmp_path, meta, [f"w{i}" for i in range(5)])
        common = dist_checkpointing.load_common_state_dict(str(tmp_path))
    finally:
        cleanup()
    for i in range(5):
        assert torch.equal(back[f"w{i}"], torch.full((64, 32), float(i)))
    assert common == {"iteration": 3}
