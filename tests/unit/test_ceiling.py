"""The version ceiling a shard keeps in its data directory."""

import json

import pytest

from diloco.errors import InvalidArgument
from diloco.syncer.ceiling import CEILING_STRIDE, VersionCeiling, ceiling_name


def test_the_ceiling_is_written_only_when_a_version_passes_it_and_read_back(tmp_path):
    path = tmp_path / ceiling_name(0)
    ceiling = VersionCeiling(path)
    assert ceiling.of(0) is None and not path.exists()
    ceiling.advance(0, 0)
    assert json.loads(path.read_text()) == {"0": CEILING_STRIDE}
    written = path.stat().st_mtime_ns
    for version in range(1, CEILING_STRIDE + 1):  # within the stride: no write
        ceiling.advance(0, version)
    assert path.stat().st_mtime_ns == written
    ceiling.advance(0, CEILING_STRIDE + 1)
    ceiling.advance(3, 7)
    ceiling.advance(0, 5)  # never lowered
    assert json.loads(path.read_text()) == {"0": 2 * CEILING_STRIDE + 1, "3": 7 + CEILING_STRIDE}
    again = VersionCeiling(path)
    assert (again.of(0), again.of(3), again.of(1)) == (2 * CEILING_STRIDE + 1, 7 + CEILING_STRIDE, None)
    VersionCeiling(None).advance(0, 10**9)  # no data directory: nothing kept


@pytest.mark.parametrize("text", ["{", "[1, 2]", '{"0": "x"}'])
def test_a_damaged_ceiling_file_is_a_clear_error(tmp_path, text):
    path = tmp_path / ceiling_name(0)
    path.write_text(text)
    with pytest.raises(InvalidArgument, match="is not a version ceiling file"):
        VersionCeiling(path)
