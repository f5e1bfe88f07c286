"""Row-cache keys: stable, and different whenever anything that decides a row's outputs differs."""

import pytest

from coalesce.cache.keys import KEY_BYTES, file_digest, output_fingerprint, row_key
from tests.unit.fakes import embedding_pipeline

BASE = {"model": "minilm", "version": "1", "onnx_sha256": "ab" * 32, "tokenizer_sha256": "cd" * 32,
        "max_sequence_length": 256, "pooling": "mean", "normalize": True, "runtime": "onnxruntime",
        "precision": "fp32", "task": "embedding"}


def test_keys_are_stable_and_depend_on_the_rows_bytes():
    fp = output_fingerprint(BASE)
    assert output_fingerprint(dict(reversed(list(BASE.items())))) == fp  # order of fields does not matter
    assert row_key(fp, b"hello") == row_key(fp, b"hello")
    assert row_key(fp, b"hello") != row_key(fp, b"hello ")
    assert len(row_key(fp, b"")) == KEY_BYTES == 16
    # Pinned, so an accidental change of the key scheme (which would strand a shared cache) fails here.
    assert output_fingerprint({"model": "m"}).hex()[:16] == "548f58d1c36c715b"
    assert row_key(b"\x00" * 32, b"hello").hex() == "d63cf02419882a93dc85e3836b325fc4"


def test_a_texts_key_is_pinned_through_the_tasks_row_bytes():
    pipeline, _ = embedding_pipeline()
    assert pipeline.task.row_bytes("hello") == b"\x00hello"
    assert row_key(b"\x00" * 32, pipeline.task.row_bytes("hello")).hex() == "27ab46876604fe9c26c947dd2d292d8d"


@pytest.mark.parametrize(("field", "other"), [
    ("model", "other"), ("version", "2"), ("onnx_sha256", "ef" * 32), ("tokenizer_sha256", "01" * 32),
    ("max_sequence_length", 128), ("pooling", "cls"), ("normalize", False), ("runtime", "tensorrt"),
    ("precision", "fp16"), ("task", "classify"),
])
def test_every_output_affecting_field_changes_the_key(field, other):
    changed = {**BASE, field: other}
    assert row_key(output_fingerprint(changed), b"same row") != row_key(output_fingerprint(BASE), b"same row")


def test_file_digest(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * (3 << 20) + b"tail")
    first = file_digest(path, chunk_bytes=1 << 20)
    assert first == file_digest(path) and len(first) == 64
    path.write_bytes(b"x" * (3 << 20) + b"tale")
    assert file_digest(path) != first


def test_a_folders_digest_covers_its_files_names_and_content(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    first = file_digest(folder)
    (folder / "model.safetensors").write_bytes(b"weightz")
    second = file_digest(folder)
    (folder / "model.safetensors").rename(folder / "other.safetensors")
    assert len({first, second, file_digest(folder)}) == 3
