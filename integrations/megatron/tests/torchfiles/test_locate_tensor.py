"""``locate_tensor``: a DCP item's tensor found by the restricted unpickler alone, as ``load_refs`` finds it."""

import io

import pytest
import torch

from tenplex.errors import CorruptShardError, ManifestError, UnsafePickleError
from tenplex_megatron.torchfiles.ptfile import load_refs, locate_tensor


def _blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("tensor", [torch.randn(700, 300), torch.arange(10, dtype=torch.bfloat16),
                                    torch.randn(40, 50)[10:30], torch.tensor(3.5), torch.zeros(0, 4)],
                         ids=["matrix", "bf16", "row-slice", "scalar", "empty"])
def test_the_same_place_as_load_refs_inside_a_larger_file(tmp_path, tensor):
    pad = b"x" * 4099  # the item starts mid-file, as in a .distcp
    blob = _blob(tensor)
    (tmp_path / "f.distcp").write_bytes(pad + blob + b"tail")
    path = str(tmp_path / "f.distcp")
    ref, n = locate_tensor(path, len(pad), len(blob), "item")
    assert ref == load_refs(path, len(pad), len(blob))[0]
    assert 0 < n < 16384
    got, _ = ref.read()
    assert torch.equal(got, tensor)


def test_a_non_row_major_tensor_or_a_cut_blob_is_refused(tmp_path):
    blob = _blob(torch.randn(64, 32).t())  # strides (1, 32)
    (tmp_path / "t.distcp").write_bytes(blob)
    with pytest.raises(ManifestError, match="not row-major"):
        locate_tensor(str(tmp_path / "t.distcp"), 0, len(blob), "item")
    blob = _blob(torch.randn(1024, 64))
    (tmp_path / "c.distcp").write_bytes(blob)
    with pytest.raises(CorruptShardError):  # the zip directory is at the blob's end
        locate_tensor(str(tmp_path / "c.distcp"), 0, len(blob) // 2, "item")
    with pytest.raises(ManifestError, match="outside the file"):
        locate_tensor(str(tmp_path / "c.distcp"), 8, len(blob), "item")


def test_anything_but_one_tensor_is_refused(tmp_path):
    blob = _blob({"w": torch.zeros(3)})
    (tmp_path / "d.distcp").write_bytes(blob)
    with pytest.raises(UnsafePickleError, match="not a tensor"):
        locate_tensor(str(tmp_path / "d.distcp"), 0, len(blob), "item")


def test_a_compressed_tensor_record_is_refused(tmp_path):
    """A deflated storage record is valid zip (torch.load inflates it), but its bytes in place are the
    compressed stream: both readers refuse it rather than return the stream as tensor data."""
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(_blob(torch.zeros(1000))))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out:
        for info in src.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            out.writestr(info.filename, src.read(info.filename), compress_type=method)
        out.writestr(info.filename.rsplit("/", 1)[0] + "/pad", b"\1" * 8000)  # the file stays long enough
    blob = buf.getvalue()
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), torch.zeros(1000))
    path = tmp_path / "z.distcp"
    path.write_bytes(blob)
    with pytest.raises(CorruptShardError, match="record data/0 is compressed"):
        locate_tensor(str(path), 0, len(blob), "item")
    with pytest.raises(CorruptShardError, match="record data/0 is compressed"):
        load_refs(str(path), 0, len(blob))
