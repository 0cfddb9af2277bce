"""The committed stubs in diloco/v1 must be exactly what scripts/gen_protos.sh produces."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted((ROOT / "protos" / "diloco" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         *map(str, protos)],
        check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(ROOT) for p in (ROOT / "diloco" / "v1").iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
    )
    assert generated == committed, "generated file set differs; run scripts/gen_protos.sh"
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"stale generated stubs {stale}; run scripts/gen_protos.sh and commit"
