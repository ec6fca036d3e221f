"""The committed stubs in kvmesh/v1/ are exactly what `make protos` generates."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

from kvmesh import protogen


def test_regenerating_stubs_gives_no_diff(tmp_path):
    # NOTE: in a process of its own: protoc (grpc_tools) crashes a process that loaded NIXL's wheel, which bundles
    # its own abseil (the prefill/decode tests run workers with NIXL in this pytest process)
    code = "import sys; from pathlib import Path; from kvmesh import protogen; protogen.generate(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=300)
    generated = sorted(p.name for p in (tmp_path / "kvmesh" / "v1").iterdir())
    committed_dir = protogen.ROOT / "kvmesh" / "v1"
    committed = sorted(p.name for p in committed_dir.iterdir() if p.name != "__init__.py" and p.suffix in (".py", ".pyi"))
    assert generated == committed
    stale = [n for n in generated if not filecmp.cmp(tmp_path / "kvmesh" / "v1" / n, committed_dir / n, shallow=False)]
    assert stale == [], f"stubs out of date, run `make protos`: {stale}"


def test_enums_follow_buf_style():
    from kvmesh.v1 import common_pb2, kv_service_pb2

    for module in (common_pb2, kv_service_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), zero
    assert common_pb2.DESCRIPTOR.package == "kvmesh.v1"


def test_other_languages_generate_stubs_without_flags(tmp_path):
    """Every .proto names its Go, Java and C# packages, so `protoc --java_out` etc. need no options."""
    import importlib.util

    from kvmesh.v1 import common_pb2, kv_service_pb2, router_pb2, worker_pb2

    for module in (common_pb2, kv_service_pb2, router_pb2, worker_pb2):
        opts = module.DESCRIPTOR.GetOptions()
        assert opts.go_package == "github.com/kvmesh/kvmesh/gen/go/kvmesh/v1;kvmeshv1", module.__name__
        assert (opts.java_package, opts.java_multiple_files, opts.csharp_namespace) == (
            "dev.kvmesh.v1", True, "Kvmesh.V1"), module.__name__
    # NOTE: found, not imported (see the first test: grpc_tools' native parts and NIXL's share no process)
    include = Path(importlib.util.find_spec("grpc_tools").origin).parent / "_proto"
    java, csharp = tmp_path / "java", tmp_path / "csharp"
    java.mkdir()
    csharp.mkdir()
    # NOTE: grpcio-tools' protoc has the Python generators only; this is the full protoc (dev extra).
    protoc = Path(sys.executable).with_name("protoc")
    subprocess.run([str(protoc), f"-I{protogen.PROTO_DIR}", f"-I{include}", f"--java_out={java}",
                    f"--csharp_out={csharp}", *[str(p.relative_to(protogen.PROTO_DIR)) for p in protogen.proto_files()]],
                   check=True, capture_output=True)
    assert (java / "dev" / "kvmesh" / "v1" / "GenerateRequest.java").is_file()
    assert "namespace Kvmesh.V1" in (csharp / "Router.cs").read_text()
