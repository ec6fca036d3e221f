"""Regenerates the committed Python stubs in kvmesh/v1/ from protos/kvmesh/v1/*.proto.

The stubs are committed (so installing kvmesh needs no protoc); tests/test_protos.py checks that
regenerating them gives no diff. Run `make protos` after editing a .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "kvmesh" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes kvmesh/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py under ``out_dir``."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in proto_files()],
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


def main() -> int:
    generate(ROOT)
    init = ROOT / "kvmesh" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs of protos/kvmesh/v1 (run `make protos`)."""\n')
    print(f"generated stubs for {len(proto_files())} protos in {ROOT / 'kvmesh' / 'v1'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
