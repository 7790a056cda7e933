"""ModelWriter: its states refuse out-of-order writes; what it publishes loads."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from moestream.formats import ModelWriter, Recipe, WriterState, load_manifest

MANIFEST = {
    "model_type": "qwen3_moe",
    "dtype": "bfloat16",
    "recipe": Recipe(),
    "source": {"repo_id": "test", "revision": "0"},
    "created_by": "test",
}


def test_states_refuse_out_of_order_writes(tmp_path: Path) -> None:
    w = ModelWriter(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    with pytest.raises(RuntimeError, match="state TENSORS, not FILES"):
        w.write_config({}, {})
    with pytest.raises(RuntimeError, match="state TENSORS, not MANIFEST"):
        w.publish(tmp_path / "out")
    w.add_dense({"w": mx.ones((4, 4))})
    w.close_tensors()
    with pytest.raises(RuntimeError, match="state FILES, not TENSORS"):
        w.add_dense({"v": mx.ones((4,))})
    w.write_config({"model_type": "qwen3_moe"}, {"bits": 4})
    manifest = w.write_manifest(**MANIFEST)
    assert set(manifest.file_checksums) == {"config.json", "dense.safetensors"}
    with pytest.raises(RuntimeError, match="state MANIFEST, not FILES"):
        w.write_config({}, {})
    w.publish(tmp_path / "out")
    assert w.state is WriterState.PUBLISHED and not (tmp_path / "tmp").exists()
    assert load_manifest(tmp_path / "out") == manifest
